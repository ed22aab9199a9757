"""SFT rows (sft_rows.py) into tokens, a loss mask and the truncation window, a chunk of rows at a
time through batch calls of the (fast, Rust) tokenizer.

Tokens are TRL's SFTTrainer's (trl 1.16) for the same rows and tokenizer, when nothing is cut:

- ``text``: the text with the tokenizer's EOS token appended (unless it already ends with it),
  tokenized with the tokenizer's special tokens (a BOS where the tokenizer adds one); every token is
  a target.
- ``prompt`` + ``completion``: the completion gets the EOS token the same way; the prompt and the
  prompt + completion are tokenized apart, and the completion starts where the two token lists first
  differ (a token that merges across the boundary belongs to the completion). Targets: the
  completion's tokens.
- ``messages``: rendered by the chat template (data.chat_template, else the tokenizer's own) and
  tokenized without adding special tokens (the template writes them). Targets: the assistant's turns.
  A template with ``{% generation %}`` markers says itself which characters are the assistant's (as
  TRL's training templates do); for one without markers, an assistant turn is what the conversation
  up to and including it adds to the conversation before it rendered with the generation prompt:
  its content and its end-of-turn tokens (ChatML: ``content<|im_end|>\\n``). A token is a target
  when it overlaps an assistant turn's characters (transformers' rule for assistant masks).
- conversational ``prompt`` + ``completion`` (lists of messages, as TRL's SFTTrainer tokenizes them):
  the prompt rendered with the generation prompt and the prompt + completion rendered, both tokenized
  without added special tokens; the completion starts where the two first differ, and its tokens are
  the targets (no EOS appended: the template ends the turn).

A row's ``tools`` go to the chat template's ``tools`` argument. A ``developer`` message is rendered as
``system`` by a template that never names the developer role (said once in the log). A template that
never reads ``tools`` (or ``tool_calls``) would drop them silently: a row holding them is refused.

``train_on_prompt`` makes every token of a prompt/completion or messages row a target.

Truncation to ``max_seq_length`` L (a row longer than L), with C the row's last completion (the
completion, or the last assistant turn and what follows it) and P what comes before it: C keeps its
start and P its end. C gets the room P leaves, but at least half of L (all of C when shorter); P
fills the rest from its end. A text row keeps its first L tokens. A row's first token is never a
target (nothing predicts it); a row with no target left is dropped and counted, never trained on as
all-masked.
"""

from __future__ import annotations

import itertools
import logging
import re
from dataclasses import dataclass
from typing import Any, Sequence

import numpy as np

from ft_framework.errors import UserError, shortened

from ft_framework.data.sft_rows import CHAT_PROMPT_COMPLETION, MESSAGES, PROMPT_COMPLETION, TEXT, SFTRow

__all__ = ["RowTokenizer", "TOKENIZATION_VERSION", "TokenizedRows", "chat_template_text", "check_chat_template",
           "has_generation_markers", "truncation_window"]

logger = logging.getLogger(__name__)

# The version of the rules above, part of every token cache key: change it with any rule that changes
# tokens, targets or windows, so that no entry made by the old rules is read.
TOKENIZATION_VERSION = 1

# transformers' and TRL's test for a template that marks the assistant's characters itself.
_GENERATION_MARKER = re.compile(r"\{%-?\s*generation\s*-?%\}")


def has_generation_markers(template: str) -> bool:
    """Whether ``template`` marks the assistant's output with ``{% generation %}`` blocks."""
    return _GENERATION_MARKER.search(template) is not None


def check_chat_template(template: str, source: str) -> None:
    """Compiles `template` as transformers renders chat templates (its Jinja environment, the
    ``{% generation %}`` tag included; transformers keeps the compiled template, so this is the one
    compilation). An empty template or a syntax error is a UserError naming `source` and the line:
    ``{source} line N: <Jinja's message>``. Errors that only rendering meets (an undefined filter, a
    raise_exception) stay the row's (RowTokenizer)."""
    from jinja2 import TemplateSyntaxError  # a dependency of transformers' chat templates
    from transformers.utils.chat_template_utils import _compile_jinja_template

    if not template.strip():
        raise UserError(f"{source} is empty; a chat template renders each conversation (give a Jinja template)")
    try:
        _compile_jinja_template(template)
    except TemplateSyntaxError as exc:
        raise UserError(f"{source} line {exc.lineno}: {shortened(exc.message or type(exc).__name__)}") from None


def chat_template_text(tokenizer: Any, chat_template: str | None) -> str | None:
    """The chat template that renders conversations: ``chat_template`` (a file's text) when given,
    else the tokenizer's own (its ``default`` one where it has several); None when there is none."""
    if chat_template is not None:
        return chat_template
    own = getattr(tokenizer, "chat_template", None)
    if isinstance(own, dict):
        return own.get("default")
    return own


@dataclass
class TokenizedRows:
    """A chunk of rows, tokenized, cut to the window and with the dropped rows left out: flat int32
    tokens and uint8 targets (1: a loss on this token), each kept row's length, the tokens before its
    last completion and the completion's tokens; and what was counted."""

    input_ids: np.ndarray
    target_mask: np.ndarray
    lengths: np.ndarray
    prompt_lengths: np.ndarray
    completion_lengths: np.ndarray
    rows: int
    truncated: int
    dropped: int


def truncation_window(lengths: np.ndarray, completion_starts: np.ndarray,
                      max_seq_length: int) -> tuple[np.ndarray, np.ndarray]:
    """(first, end) token of each row's kept window (see the module doc): rows no longer than L keep
    all; otherwise the last completion keeps its start and the tokens before it their end, the
    completion taking the room they leave but at least half of L."""
    lengths = np.asarray(lengths, dtype=np.int64)
    starts = np.asarray(completion_starts, dtype=np.int64)
    completion = lengths - starts
    kept_completion = np.minimum(completion, np.maximum(max_seq_length - starts, max_seq_length // 2))
    first = np.maximum(0, starts - (max_seq_length - kept_completion))
    end = starts + kept_completion
    fits = lengths <= max_seq_length
    return np.where(fits, 0, first), np.where(fits, lengths, end)


class RowTokenizer:
    """Tokenizes chunks of rows of one shape for one tokenizer and one set of token settings."""

    def __init__(self, tokenizer: Any, *, max_seq_length: int, train_on_prompt: bool, chat_template: str | None):
        if max_seq_length < 1:
            raise ValueError(f"max_seq_length must be >= 1, got {max_seq_length}")
        self.tokenizer = tokenizer
        self.max_seq_length = max_seq_length
        self.train_on_prompt = train_on_prompt
        self.template = chat_template_text(tokenizer, chat_template)
        # data.chat_template is compiled where its file is read; the tokenizer's own template when a
        # conversation first needs it (rows of the other shapes never render one).
        self._unchecked_template = chat_template is None and self.template is not None
        self._template_name = "the tokenizer's chat template" if chat_template is None else "data.chat_template"
        # Templates that know no developer role (most but the gpt-oss / OpenAI-style ones) get it as system.
        self._developer_as_system = self.template is not None and "developer" not in self.template
        self._developer_said = False

    # ---- one chunk ---------------------------------------------------------------------------------
    def tokenize(self, rows: Sequence[SFTRow]) -> TokenizedRows:
        """The chunk's rows (all of one shape), tokenized and cut."""
        if not rows:
            empty = np.zeros(0, dtype=np.int64)
            return TokenizedRows(np.zeros(0, np.int32), np.zeros(0, np.uint8), empty, empty.astype(np.int32),
                                 empty.astype(np.int32), 0, 0, 0)
        shape = rows[0].shape
        if shape == TEXT:
            ids = self._encode([self._with_eos(row.text, row.where) for row in rows])
            starts = np.zeros(len(ids), dtype=np.int64)
            masks = None
        elif shape == PROMPT_COMPLETION:
            ids, starts = self._prompt_completion(rows)
            masks = None
        elif shape == MESSAGES:
            ids, masks = self._messages(rows)
            starts = None
        elif shape == CHAT_PROMPT_COMPLETION:
            ids, starts = self._chat_prompt_completion(rows)
            masks = None
        else:
            raise ValueError(f"unknown row shape {shape!r}")
        return self._finish(ids, starts, masks, every_token=shape == TEXT or self.train_on_prompt)

    def _encode(self, texts: list[str]) -> list[list[int]]:
        """The tokens of each text, the tokenizer's special tokens added (as TRL tokenizes a string)."""
        out = self.tokenizer(texts, return_attention_mask=False, return_token_type_ids=False, verbose=False)
        return out["input_ids"]

    def _with_eos(self, text: str, where: str) -> str:
        eos = self.tokenizer.eos_token
        if eos is None:
            raise UserError(f"{where}: the tokenizer has no EOS token; text and prompt/completion rows end with it so "
                            "that the model learns to stop (give a tokenizer with an eos_token)")
        return text if text.endswith(eos) else text + eos

    def _prompt_completion(self, rows: Sequence[SFTRow]) -> tuple[list[list[int]], np.ndarray]:
        prompts = self._encode([row.prompt for row in rows])
        full = self._encode([row.prompt + self._with_eos(row.completion, row.where) for row in rows])
        starts = np.fromiter((_common_prefix(p, f) for p, f in zip(prompts, full)), dtype=np.int64, count=len(rows))
        return full, starts

    # ---- conversations -----------------------------------------------------------------------------
    def _need_template(self, rows: Sequence[SFTRow]) -> None:
        if self.template is None:
            raise UserError(f"{rows[0].where}: rows of the messages shape need a chat template, and the tokenizer has "
                            "none; set data.chat_template to a Jinja template file")
        if self._unchecked_template:
            check_chat_template(self.template, "the tokenizer's own chat template (data.chat_template replaces it)")
            self._unchecked_template = False
        for row in rows:
            self._check_tools(row)

    def _check_tools(self, row: SFTRow) -> None:
        """A template that never reads a row's tools or an assistant's tool calls would drop them."""
        calls = any("tool_calls" in message for message in row.messages + row.completion_messages)
        for used, name in ((row.tools is not None, "tools"), (calls, "tool_calls")):
            if used and name not in self.template:
                raise UserError(f"{row.where}: the row holds `{name}`, which {self._template_name} never renders (it "
                                f"does not read `{name}`); give a template that renders tools (data.chat_template)")

    def _conversation(self, messages: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
        """The messages as the template gets them: developer as system where it knows no developer."""
        if not self._developer_as_system or not any(m["role"] == "developer" for m in messages):
            return list(messages)
        if not self._developer_said:
            logger.info("%s has no developer role: developer messages are rendered as system messages",
                        self._template_name)
            self._developer_said = True
        return [dict(m, role="system") if m["role"] == "developer" else m for m in messages]

    def _chat_prompt_completion(self, rows: Sequence[SFTRow]) -> tuple[list[list[int]], np.ndarray]:
        """TRL's conversational prompt/completion: the completion starts where the tokens of the prompt
        (with the generation prompt) and of the whole conversation first differ."""
        self._need_template(rows)
        prompts = [self._render(row.messages, row, tokenize=False, add_generation_prompt=True) for row in rows]
        whole = [self._render(row.messages + row.completion_messages, row, tokenize=False) for row in rows]
        encode = dict(add_special_tokens=False, return_attention_mask=False, return_token_type_ids=False,
                      verbose=False)
        prompt_ids = self.tokenizer(prompts, **encode)["input_ids"]
        full = self.tokenizer(whole, **encode)["input_ids"]
        starts = np.fromiter((_common_prefix(p, f) for p, f in zip(prompt_ids, full)), dtype=np.int64, count=len(rows))
        return full, starts

    def _messages(self, rows: Sequence[SFTRow]) -> tuple[list[list[int]], list[np.ndarray]]:
        self._need_template(rows)
        if has_generation_markers(self.template):
            return self._marked_messages(rows)
        texts, spans = zip(*(self._turn_spans(row) for row in rows))
        encoded = self.tokenizer(list(texts), add_special_tokens=False, return_offsets_mapping=True,
                                 return_attention_mask=False, return_token_type_ids=False, verbose=False)
        masks = [_overlap_mask(np.asarray(offsets, dtype=np.int64).reshape(-1, 2), row_spans)
                 for offsets, row_spans in zip(encoded["offset_mapping"], spans)]
        return encoded["input_ids"], masks

    def _render(self, messages: Sequence[dict[str, Any]], row: SFTRow, **kwargs: Any) -> Any:
        from jinja2 import TemplateError  # a dependency of transformers' chat templates

        try:
            return self.tokenizer.apply_chat_template(self._conversation(messages), chat_template=self.template,
                                                      tools=_tools(row), **kwargs)
        except (TemplateError, ValueError, TypeError, KeyError) as exc:
            raise UserError(f"{row.where}: the chat template cannot render this conversation "
                            f"({type(exc).__name__}: {shortened(str(exc))})") from None

    def _marked_messages(self, rows: Sequence[SFTRow]) -> tuple[list[list[int]], list[np.ndarray]]:
        """The template's own assistant masks (its generation blocks), as TRL takes them."""
        # verbose=False: a row longer than the model's context is cut afterwards, not an error to warn of
        kwargs = dict(tokenize=True, return_dict=True, return_assistant_tokens_mask=True,
                      tokenizer_kwargs={"verbose": False})
        if any(row.tools is not None for row in rows):  # tools are one argument per call: a row at a time
            outs = [self._render(row.messages, row, **kwargs) for row in rows]
            return ([out["input_ids"] for out in outs],
                    [np.asarray(out["assistant_masks"], dtype=np.uint8) for out in outs])
        try:
            out = self.tokenizer.apply_chat_template([self._conversation(row.messages) for row in rows],
                                                     chat_template=self.template, **kwargs)
        except Exception:  # which row: render them one by one, the failing one raises a UserError
            for row in rows:
                self._render(row.messages, row, **kwargs)
            raise
        return out["input_ids"], [np.asarray(mask, dtype=np.uint8) for mask in out["assistant_masks"]]

    def _turn_spans(self, row: SFTRow) -> tuple[str, list[tuple[int, int]]]:
        """The rendered conversation and the characters of each assistant turn: what the conversation up
        to the turn adds to the one before it with the generation prompt."""
        messages = row.messages
        whole = self._render(messages, row, tokenize=False)
        spans = []
        for i, message in enumerate(messages):
            if message["role"] != "assistant":
                continue
            if i == 0:
                raise UserError(f"{row.where}: the conversation opens with an assistant message; without "
                                "{% generation %} markers in the chat template its turn is told apart from what "
                                "precedes it, so start with a system or user message (or mark the template)")
            head = self._render(messages[:i], row, tokenize=False, add_generation_prompt=True)
            upto = whole if i == len(messages) - 1 else self._render(messages[: i + 1], row, tokenize=False)
            if not (upto.startswith(head) and whole.startswith(upto)):
                raise UserError(f"{row.where}: the chat template renders the conversation before messages[{i}] "
                                "differently from the start of the whole one, so the assistant's turn cannot be told "
                                "apart; use a template that keeps earlier turns as they are, or one with "
                                "{% generation %} markers (data.chat_template)")
            spans.append((len(head), len(upto)))
        return whole, spans

    # ---- loss mask, window, drops ------------------------------------------------------------------
    def _finish(self, ids: list[list[int]], starts: np.ndarray | None, masks: list[np.ndarray] | None,
                every_token: bool) -> TokenizedRows:
        count = len(ids)
        lengths = np.fromiter(map(len, ids), dtype=np.int64, count=count)
        flat = np.fromiter(itertools.chain.from_iterable(ids), dtype=np.int32, count=int(lengths.sum()))
        offsets = np.concatenate([[0], np.cumsum(lengths)])
        row_of = np.repeat(np.arange(count), lengths)
        position = np.arange(len(flat), dtype=np.int64) - offsets[row_of]
        if masks is not None:  # a conversation: the last assistant turn is its last completion
            assistant = np.concatenate(masks).astype(bool) if masks else np.zeros(0, dtype=bool)
            starts, completion_lengths = _last_runs(masks, lengths)
            raw_targets = assistant
        else:  # text (starts 0) or prompt/completion: the completion runs to the end
            completion_lengths = lengths - starts
            raw_targets = position >= starts[row_of]
        if every_token:
            raw_targets = np.ones(len(flat), dtype=bool)
        first, end = truncation_window(lengths, starts, self.max_seq_length)
        in_window = (position >= first[row_of]) & (position < end[row_of])
        targets = raw_targets & in_window & (position > first[row_of])
        alive = np.bincount(row_of, weights=targets, minlength=count) > 0
        keep = in_window & alive[row_of]
        return TokenizedRows(
            input_ids=flat[keep], target_mask=targets[keep].astype(np.uint8), lengths=(end - first)[alive],
            prompt_lengths=(starts - first)[alive].astype(np.int32),
            completion_lengths=np.minimum(completion_lengths, end - starts)[alive].astype(np.int32),
            rows=count, truncated=int(np.count_nonzero(alive & (lengths > self.max_seq_length))),
            dropped=int(np.count_nonzero(~alive)))


def _tools(row: SFTRow) -> list[dict[str, Any]] | None:
    return None if row.tools is None else list(row.tools)


def _common_prefix(ids: list[int], other: list[int]) -> int:
    """How many leading tokens two lists share (the prompt's tokens, usually all of them)."""
    if other[: len(ids)] == ids:
        return len(ids)
    return next(i for i, (a, b) in enumerate(zip(ids, other)) if a != b)


def _overlap_mask(offsets: np.ndarray, spans: list[tuple[int, int]]) -> np.ndarray:
    """1 for each token (its character offsets) that overlaps one of the sorted, disjoint spans."""
    if not spans or not len(offsets):
        return np.zeros(len(offsets), dtype=np.uint8)
    span_starts = np.array([s for s, _ in spans], dtype=np.int64)
    span_ends = np.array([e for _, e in spans], dtype=np.int64)
    nearest = np.searchsorted(span_ends, offsets[:, 0], side="right")  # the first span ending after the token starts
    inside = nearest < len(spans)
    overlaps = np.zeros(len(offsets), dtype=bool)
    overlaps[inside] = offsets[inside, 1] > span_starts[nearest[inside]]
    return overlaps.astype(np.uint8)


def _last_runs(masks: list[np.ndarray], lengths: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(first token, length) of each mask's last run of ones: a conversation's last assistant turn.
    A mask without ones gives (its length, 0): nothing to complete."""
    starts = lengths.copy()
    runs = np.zeros(len(masks), dtype=np.int64)
    for i, mask in enumerate(masks):
        ones = np.flatnonzero(mask)
        if ones.size:
            breaks = np.flatnonzero(np.diff(ones) != 1)
            first = ones[breaks[-1] + 1] if breaks.size else ones[0]
            starts[i], runs[i] = first, ones[-1] - first + 1
    return starts, runs
