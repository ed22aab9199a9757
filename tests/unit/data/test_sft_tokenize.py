"""SFT tokenization (data/sft_tokenize.py, through data/sft.py): truncation keeps the end of the prompt
and the start of the completion, rows without a completion token are dropped and counted, eval items
say where the completion is, and a template or tokenizer that cannot serve is one line.

The byte-level tokenizer of tests/tiny_llm.py has one token per byte, so the counts below are
character counts (its EOS, <|im_end|>, is one token)."""

from __future__ import annotations

import numpy as np
import pytest

from sft_helpers import MARKED_WITH_NEWLINE, build_tiny_tokenizer, write_jsonl

from ft_framework.data.sft import SFTSettings, load_sft_data
from ft_framework.data.sft_tokenize import truncation_window
from ft_framework.errors import UserError

EOS = "<|im_end|>"


def load(tmp_path, rows, tokenizer=None, *, validation=None, progress=False, **settings):
    tokenizer = tokenizer or build_tiny_tokenizer()
    train = write_jsonl(tmp_path / "train.jsonl", rows)
    dev = write_jsonl(tmp_path / "dev.jsonl", validation) if validation is not None else train
    settings.setdefault("max_seq_length", 64)
    return load_sft_data({"train": train, "validation": dev}, tokenizer, SFTSettings(**settings),
                         cache_dir=tmp_path / "cache", progress=progress)


def decoded(tokenizer, ids):
    return tokenizer.decode(ids)


def targets(tokenizer, item):
    return tokenizer.decode([t for t in item["labels"] if t != -100])


@pytest.mark.parametrize("length, start, window", [
    (8, 3, (0, 8)),        # fits
    (15, 0, (0, 10)),      # text: its first L tokens
    (12, 3, (0, 10)),      # short prompt: the completion cut at its end
    (12, 9, (2, 12)),      # long prompt, short completion: the prompt cut at its start, the completion whole
    (18, 9, (4, 14)),      # both long: the completion keeps half of L
    (27, 25, (17, 27)),    # a prompt longer than L: its end and the whole completion
    (10, 10, (0, 10)),     # no completion, fits
    (14, 14, (4, 14)),     # no completion, too long: nothing of it to keep
])
def test_the_truncation_window(length, start, window):
    first, end = truncation_window(np.array([length]), np.array([start]), 10)
    assert (int(first[0]), int(end[0])) == window


def test_a_long_prompt_keeps_its_end_and_the_completion_its_start(tmp_path):
    tokenizer = build_tiny_tokenizer()
    prompt, completion = "abcdefghijklmnopqrstuvwxyz0123", "ABCDEFGHIJ"  # 30 and 10 (+ EOS) tokens
    data = load(tmp_path, [{"prompt": prompt, "completion": completion}], tokenizer, max_seq_length=16)
    item = data.eval["validation"][0]
    # The completion gets half of L (8 of its 11 tokens), the prompt its last 8.
    assert decoded(tokenizer, item["input_ids"]) == prompt[-8:] + completion[:8]
    assert targets(tokenizer, item) == completion[:8]
    assert (item["prompt_length"], item["completion_length"]) == (8, 8)
    assert data.stats["validation"] == {"rows": 1, "truncated": 1, "dropped_no_completion": 0, "tokens": 16,
                                        "completion_tokens": 8}


def test_a_short_prompt_stays_whole_and_the_completion_fills_the_rest(tmp_path):
    tokenizer = build_tiny_tokenizer()
    data = load(tmp_path, [{"prompt": "Q: ", "completion": "x" * 30}], tokenizer, max_seq_length=16)
    item = data.train[0]
    assert decoded(tokenizer, item["input_ids"]) == "Q: " + "x" * 13
    assert len(item["input_ids"]) == 16 and targets(tokenizer, item) == "x" * 13


def test_a_text_row_keeps_its_start(tmp_path):
    tokenizer = build_tiny_tokenizer()
    data = load(tmp_path, [{"text": "0123456789abcdefghij"}], tokenizer, max_seq_length=8)
    item = data.eval["validation"][0]
    assert decoded(tokenizer, item["input_ids"]) == "01234567"
    assert targets(tokenizer, item) == "1234567"  # the first token is never a target
    assert (item["prompt_length"], item["completion_length"]) == (0, 8)


def test_a_conversation_keeps_its_end(tmp_path):
    tokenizer = build_tiny_tokenizer()
    chat = [{"role": "system", "content": "s" * 40}, {"role": "user", "content": "u" * 10},
            {"role": "assistant", "content": "early"}, {"role": "user", "content": "why?"},
            {"role": "assistant", "content": "because"}]
    whole = tokenizer.apply_chat_template(chat, tokenize=True)["input_ids"]
    data = load(tmp_path, [{"messages": chat}], tokenizer, max_seq_length=48)
    item = data.eval["validation"][0]
    assert len(whole) > 48 and item["input_ids"] == whole[-48:]  # the last turn fits whole: the end is kept
    assert targets(tokenizer, item) == f"early{EOS}\nbecause{EOS}\n"
    last_turn = f"because{EOS}\n"
    assert item["completion_length"] == len(tokenizer(last_turn)["input_ids"])
    assert decoded(tokenizer, item["input_ids"][item["prompt_length"]:]) == last_turn


def test_eval_items_say_where_the_completion_is(tmp_path):
    tokenizer = build_tiny_tokenizer()
    chat = [{"role": "user", "content": "2+2?"}, {"role": "assistant", "content": "4"},
            {"role": "user", "content": "thanks"}]
    data = load(tmp_path, [{"prompt": "2+2=", "completion": "4"}], tokenizer,
                validation=[{"messages": chat}])
    train_item = data.train[0]
    assert set(train_item) == {"input_ids", "labels"}
    item = data.eval["validation"][0]
    start, count = item["prompt_length"], item["completion_length"]
    assert decoded(tokenizer, item["input_ids"][:start]) == "<|im_start|>user\n2+2?<|im_end|>\n<|im_start|>assistant\n"
    assert decoded(tokenizer, item["input_ids"][start:start + count]) == f"4{EOS}\n"
    assert decoded(tokenizer, item["input_ids"][start + count:]) == "<|im_start|>user\nthanks<|im_end|>\n"
    dataset = data.eval["validation"]  # the same numbers for every row at once, without building items
    assert (dataset.prompt_lengths.tolist(), dataset.completion_lengths.tolist()) == ([start], [count])


def test_rows_without_a_completion_token_are_dropped_and_counted(tmp_path):
    tokenizer = build_tiny_tokenizer()
    # An empty prompt and completion is the EOS alone: a first token, which nothing predicts.
    rows = [{"prompt": "", "completion": ""}, {"prompt": "Q", "completion": "A"}, {"prompt": "", "completion": ""}]
    data = load(tmp_path, rows, tokenizer)
    assert len(data.train) == 1 and decoded(tokenizer, data.train[0]["input_ids"]) == f"QA{EOS}"
    assert data.stats["train"]["rows"] == 3 and data.stats["train"]["dropped_no_completion"] == 2
    with pytest.raises(UserError, match=r"data\.files\.train: .*train\.jsonl: no row has a completion token left "
                                        r"within max_seq_length 1 \(3 read, 3 dropped\); raise data\.max_seq_length$"):
        load(tmp_path, rows, tokenizer, max_seq_length=1)


def test_train_on_prompt_trains_every_token_but_the_first(tmp_path):
    tokenizer = build_tiny_tokenizer()
    data = load(tmp_path, [{"prompt": "Q: ", "completion": "A"}], tokenizer, train_on_prompt=True)
    item = data.train[0]
    assert item["labels"] == [-100] + item["input_ids"][1:]


def test_the_config_template_replaces_the_tokenizers(tmp_path):
    tokenizer = build_tiny_tokenizer()
    chat = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}]
    own = load(tmp_path, [{"messages": chat}], tokenizer)
    marked = load(tmp_path, [{"messages": chat}], tokenizer, chat_template=MARKED_WITH_NEWLINE)
    assert own.train[0]["input_ids"] == marked.train[0]["input_ids"]
    assert targets(tokenizer, own.train[0]) == f"yo{EOS}\n"
    assert targets(tokenizer, marked.train[0]) == f"\nyo{EOS}\n"  # its markers take the newline too
    tokenizer.chat_template = None
    assert load(tmp_path, [{"messages": chat}], tokenizer, chat_template=MARKED_WITH_NEWLINE).train[0] == \
        marked.train[0]


def test_conversations_need_a_chat_template(tmp_path):
    tokenizer = build_tiny_tokenizer()
    tokenizer.chat_template = None
    chat = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}]
    with pytest.raises(UserError, match=r"train\.jsonl:1: rows of the messages shape need a chat template, and the "
                                        r"tokenizer has none; set data\.chat_template to a Jinja template file$"):
        load(tmp_path, [{"messages": chat}], tokenizer)


def test_a_tokenizer_without_eos_cannot_end_completions(tmp_path):
    tokenizer = build_tiny_tokenizer()
    tokenizer.eos_token = None
    with pytest.raises(UserError, match=r"train\.jsonl:1: the tokenizer has no EOS token"):
        load(tmp_path, [{"prompt": "Q", "completion": "A"}], tokenizer)


def test_a_template_that_rewrites_earlier_turns_is_refused_without_markers(tmp_path):
    """Qwen3's template drops the thinking of earlier turns: the conversation's start renders otherwise
    alone; without markers, the turns cannot be told apart."""
    tokenizer = build_tiny_tokenizer()
    tokenizer.chat_template = ("{% for m in messages %}{{ '<|im_start|>' + m['role'] + '\n' }}{% if loop.last %}"
                               "{{ '[final] ' }}{% endif %}{{ m['content'] + '<|im_end|>\n' }}{% endfor %}"
                               "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}")
    chat = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"},
            {"role": "user", "content": "more"}, {"role": "assistant", "content": "ok"}]
    with pytest.raises(UserError, match=r"train\.jsonl:1: the chat template renders the conversation before "
                                        r"messages\[1\] differently from the start of the whole one"):
        load(tmp_path, [{"messages": chat}], tokenizer)


def test_a_template_that_refuses_a_conversation_names_the_row(tmp_path):
    tokenizer = build_tiny_tokenizer()
    tokenizer.chat_template = ("{% for m in messages %}{% if m['role'] == 'system' %}"
                               "{{ raise_exception('System role not supported') }}{% endif %}"
                               "{{ m['role'] + ': ' + m['content'] + '\n' }}{% endfor %}"
                               "{% if add_generation_prompt %}{{ 'assistant: ' }}{% endif %}")
    good = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}]
    with pytest.raises(UserError, match=r"train\.jsonl:2: the chat template cannot render this conversation "
                                        r"\(TemplateError: System role not supported\)$"):
        load(tmp_path, [{"messages": good}, {"messages": [{"role": "system", "content": "x"}] + good}], tokenizer)
    tokenizer.chat_template = "{% generation %}" + tokenizer.chat_template + "{% endgeneration %}"
    with pytest.raises(UserError, match=r"train\.jsonl:2: the chat template cannot render this conversation"):
        load(tmp_path, [{"messages": good}, {"messages": [{"role": "system", "content": "x"}] + good}], tokenizer)


def test_an_opening_assistant_turn_needs_markers(tmp_path):
    chat = [{"role": "assistant", "content": "Hello!"}, {"role": "user", "content": "hi"},
            {"role": "assistant", "content": "yo"}]
    with pytest.raises(UserError, match=r"train\.jsonl:1: the conversation opens with an assistant message"):
        load(tmp_path, [{"messages": chat}])
    tokenizer = build_tiny_tokenizer()
    data = load(tmp_path, [{"messages": chat}], tokenizer, chat_template=MARKED_WITH_NEWLINE)
    assert targets(tokenizer, data.train[0]) == f"\nHello!{EOS}\n\nyo{EOS}\n"


def test_progress_counts_the_rows_being_tokenized(tmp_path, capsys):
    load(tmp_path, [{"text": f"row {i}"} for i in range(3)])
    assert "tokenizing" not in capsys.readouterr().err
    load(tmp_path, [{"text": f"row {i}"} for i in range(5)], progress=True)
    shown = capsys.readouterr().err
    assert "tokenizing train: " in shown and "5 rows" in shown and "tokenizing validation: " in shown


TOOL_ROW = {"messages": [{"role": "user", "content": "2+2?"},
                         {"role": "assistant", "tool_calls": [{"type": "function", "function": {"name": "add"}}]},
                         {"role": "tool", "content": "4"}, {"role": "assistant", "content": "4"}]}


@pytest.mark.parametrize("row, key", [
    ({**TOOL_ROW, "tools": [{"type": "function", "function": {"name": "add"}}]}, "tools"),
    (TOOL_ROW, "tool_calls"),
    ({"prompt": [{"role": "user", "content": "hi"}], "completion": [{"role": "assistant", "content": "ok"}],
      "tools": [{"type": "function", "function": {"name": "add"}}]}, "tools"),
])
def test_a_template_that_never_renders_tools_is_refused_naming_the_row_and_template(tmp_path, row, key):
    """ChatML (the tiny tokenizer's) reads no tools: it would drop them without a word."""
    with pytest.raises(UserError, match=rf"train\.jsonl:1: the row holds `{key}`, which the tokenizer's chat template "
                                        rf"never renders \(it does not read `{key}`\); give a template that renders "
                                        r"tools \(data\.chat_template\)$"):
        load(tmp_path, [row])


DEVELOPER_KNOWN = ("{% for m in messages %}{{ '<|im_start|>' + ('dev' if m['role'] == 'developer' else m['role']) + "
                   "'\n' + m['content'] + '<|im_end|>\n' }}{% endfor %}"
                   "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}")


@pytest.mark.parametrize("template, rendered", [(None, "system"), (DEVELOPER_KNOWN, "dev")])
def test_a_developer_message_is_system_where_the_template_knows_no_developer(tmp_path, caplog, template, rendered):
    rows = [{"messages": [{"role": "developer", "content": "Be brief."}, {"role": "user", "content": "hi"},
                          {"role": "assistant", "content": "ok"}]}] * 3
    tokenizer = build_tiny_tokenizer()
    if template is not None:
        tokenizer.chat_template = template
    with caplog.at_level("INFO", logger="ft_framework.data.sft_tokenize"):
        data = load(tmp_path, rows, tokenizer)
    assert decoded(tokenizer, data.train[0]["input_ids"]).startswith(f"<|im_start|>{rendered}\nBe brief.")
    said = [r for r in caplog.records if "developer messages are rendered as system" in r.getMessage()]
    assert len(said) == (1 if template is None else 0)
