"""Supervised fine-tuning rows as the SFT tools take them (TRL's SFTTrainer, torchtune, axolotl,
LLaMA-Factory), read from any file readers.py reads (JSON lines, CSV / TSV, Parquet files or a Hub-style
directory of them, a `datasets` directory) or from a Hub data set (hub_tables.py), each checked and
named by its place.

A row has one of these shapes, told apart by its keys:

- ``text``: a string, trained on as a whole;
- ``prompt`` and ``completion``: two strings, the completion trained on after the prompt; or two
  lists of messages (TRL's conversational prompt/completion), rendered by the chat template, the
  completion's tokens trained on;
- ``messages``: a conversation, a list of ``{"role": ..., "content": ...}`` (OpenAI style; roles
  ``system``, ``developer``, ``user``, ``assistant`` and ``tool``), with at least one assistant
  message. Where the value is text (a CSV cell always is), it is read as JSON;
- ``conversations``: ShareGPT's conversation, a list of ``{"from": ..., "value": ...}`` (``human``,
  ``gpt``, ``system``; ``observation``, ``function`` and ``tool`` a tool's answer, ``function_call`` the
  assistant's call), read as the ``messages`` it means.

Beside messages, a row may hold ``tools`` (OpenAI's function descriptions, a list or its JSON text),
which the chat template renders; an assistant message may hold ``tool_calls`` (then its content may be
null) and a tool message ``tool_call_id`` and ``name``. A message's content is a string or a list of
parts, of which only text parts ``{"type": "text", "text": ...}`` are read (joined with nothing
between them, as chat templates write parts one after another).

Other keys (an ``id``, a ``source``) are ignored, as a Hub data set's extra columns are. A key whose
value is null counts as absent (a Parquet struct column writes every field of every message). All
rows of a file have one shape.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator

from ft_framework.errors import UserError, quoted

from ft_framework.data.readers import Table, read_table

__all__ = ["CHAT_PROMPT_COMPLETION", "COLUMNS", "MESSAGES", "PROMPT_COMPLETION", "ROLES", "SHAPES", "SHAPE_KEYS",
           "SHAREGPT_ROLES", "SFTRow", "TEXT", "read_sft_rows", "row_shape", "sft_rows"]

TEXT, PROMPT_COMPLETION, MESSAGES = "text", "prompt_completion", "messages"
# TRL's conversational prompt/completion: both lists of messages.
CHAT_PROMPT_COMPLETION = "chat_prompt_completion"
# The shapes a tokenizer meets (a ShareGPT row is read as the messages it means).
SHAPES = (TEXT, PROMPT_COMPLETION, MESSAGES, CHAT_PROMPT_COMPLETION)
_SHAREGPT = "conversations"
# The keys that make each shape; a row holds exactly one of these sets.
_SHAPE_OF_KEYS = {("text",): TEXT, ("prompt", "completion"): PROMPT_COMPLETION, ("messages",): MESSAGES,
                  (_SHAREGPT,): _SHAREGPT}
SHAPE_KEYS: tuple[str, ...] = ("text", "prompt", "completion", "messages", _SHAREGPT)
# The columns a row may use (a Parquet file reads only these).
COLUMNS: tuple[str, ...] = SHAPE_KEYS + ("tools",)
ROLES: tuple[str, ...] = ("system", "developer", "user", "assistant", "tool")
# ShareGPT's speakers (axolotl's and LLaMA-Factory's names besides OpenAI's) -> roles.
SHAREGPT_ROLES: dict[str, str] = {"human": "user", "user": "user", "gpt": "assistant", "assistant": "assistant",
                                  "system": "system", "developer": "developer", "function_call": "assistant",
                                  "observation": "tool", "function": "tool", "tool": "tool"}
ASSISTANT = "assistant"
_MESSAGE_KEYS = ("role", "content", "tool_calls", "tool_call_id", "name")
_SHAREGPT_KEYS = ("from", "value")
_VALID_SHAPES = ("a row holds `text`, or `prompt` and `completion`, or `messages`, or `conversations` "
                 "(ShareGPT)")


@dataclass(frozen=True)
class SFTRow:
    """One checked row: ``where`` names it in its file (``train.jsonl:14``); ``text`` for the text
    shape, ``prompt`` and ``completion`` for that shape, ``messages`` (each {role, content, and
    tool_calls / tool_call_id / name where given}) for a conversation or a conversational prompt,
    ``completion_messages`` for a conversational completion, and ``tools`` the row's tool
    descriptions (None when it has none)."""

    where: str
    shape: str
    text: str = ""
    prompt: str = ""
    completion: str = ""
    messages: tuple[dict[str, Any], ...] = ()
    completion_messages: tuple[dict[str, Any], ...] = ()
    tools: tuple[dict[str, Any], ...] | None = None


def read_sft_rows(path: Path, split: str, limit: int | None = None) -> Iterator[SFTRow]:
    """The rows of ``path`` (``split`` picks a directory's split), streamed in file order, the first
    ``limit`` only when given. Every mistake is a UserError naming the row."""
    return sft_rows(read_table(path, split, columns=COLUMNS), limit)


def sft_rows(table: Table, limit: int | None = None) -> Iterator[SFTRow]:
    """The checked rows of ``table`` (a file's, or a Hub data set split's), the first ``limit`` only."""
    if table.columns is not None:  # a header or a schema names the keys once for the whole file
        row_shape(table.header, {name: "" for name in table.columns})
    first: tuple[str, str] | None = None
    for count, (where, values) in enumerate(table.records):
        if limit is not None and count >= limit:
            return
        shape = row_shape(where, values)
        if first is None:
            first = (shape, where)
        elif shape != first[0]:
            raise UserError(f"{where}: a row of the {_shape_name(shape)} shape, but the file's first row ({first[1]}) "
                            f"is of the {_shape_name(first[0])} shape; all rows of a file have one shape")
        yield _checked_row(where, values, shape)


def _shape_name(shape: str) -> str:
    return "conversations (ShareGPT)" if shape == _SHAREGPT else shape


def row_shape(where: str, values: dict[str, Any]) -> str:
    """The shape the keys of ``values`` make (TEXT, PROMPT_COMPLETION, MESSAGES or ``conversations``),
    or a UserError naming what is missing or mixed."""
    keys = tuple(key for key in SHAPE_KEYS if key in values)
    shape = _SHAPE_OF_KEYS.get(keys)
    if shape is not None:
        return shape
    if not keys:
        raise UserError(f"{where}: no SFT row shape in the keys {quoted(sorted(values))}; {_VALID_SHAPES}")
    if keys == ("prompt",) or keys == ("completion",):
        missing = "completion" if keys == ("prompt",) else "prompt"
        raise UserError(f"{where}: `{keys[0]}` without `{missing}`; {_VALID_SHAPES}")
    raise UserError(f"{where}: the keys {', '.join(keys)} mix two shapes; {_VALID_SHAPES}, one of them")


def _checked_row(where: str, values: dict[str, Any], shape: str) -> SFTRow:
    tools = _tools(values.get("tools"), where)
    if shape == TEXT:
        _no_tools(tools, where, "a text row")
        text = _string(values["text"], where, "text")
        if not text.strip():
            raise UserError(f"{where}: `text` is empty; a text row trains on its text")
        return SFTRow(where, TEXT, text=text)
    if shape == PROMPT_COMPLETION:
        prompt, completion = values["prompt"], values["completion"]
        if isinstance(prompt, list) or isinstance(completion, list):
            return _chat_prompt_completion(where, prompt, completion, tools)
        _no_tools(tools, where, "a prompt/completion row of strings")
        return SFTRow(where, PROMPT_COMPLETION, prompt=_string(prompt, where, "prompt"),
                      completion=_string(completion, where, "completion"))
    if shape == _SHAREGPT:
        messages = _conversation(values[_SHAREGPT], where, _SHAREGPT, sharegpt=True)
    else:
        messages = _conversation(values["messages"], where, "messages", sharegpt=False)
    _needs_assistant(messages, where)
    return SFTRow(where, MESSAGES, messages=messages, tools=tools)


def _chat_prompt_completion(where: str, prompt: Any, completion: Any,
                            tools: tuple[dict[str, Any], ...] | None) -> SFTRow:
    """TRL's conversational prompt/completion: both lists of messages."""
    for key, value in (("prompt", prompt), ("completion", completion)):
        if not isinstance(value, list):
            shown = "null" if value is None else type(value).__name__
            raise UserError(f"{where}: `{key}` holds {shown} while the other is a list of messages; a conversational "
                            "prompt/completion row holds two lists of messages")
    if not completion:
        raise UserError(f"{where}: `completion` is an empty list; a conversational completion holds the messages "
                        "trained on (an assistant message)")
    return SFTRow(where, CHAT_PROMPT_COMPLETION, messages=_messages(prompt, where, "prompt", sharegpt=False),
                  completion_messages=_messages(completion, where, "completion", sharegpt=False), tools=tools)


def _no_tools(tools: tuple[dict[str, Any], ...] | None, where: str, what: str) -> None:
    if tools is not None:
        raise UserError(f"{where}: `tools` beside {what}; tools are rendered by a chat template, for rows of messages "
                        "(`messages`, `conversations`, or a prompt and completion of messages)")


def _string(value: Any, where: str, key: str) -> str:
    if not isinstance(value, str):
        shown = "null" if value is None else f"{type(value).__name__} {quoted(value)}"
        raise UserError(f"{where}: `{key}` holds {shown}, expected a string")
    return value


def _json_text(value: Any, where: str, key: str, example: str) -> Any:
    """A list held as JSON text (a CSV cell, a Parquet string column) read; any other value as it is."""
    if not isinstance(value, str):
        return value
    try:
        return json.loads(value)
    except json.JSONDecodeError as exc:
        raise UserError(f"{where}: `{key}` is text but not JSON ({exc.msg} at column {exc.colno}); give {example}") \
            from None
    except RecursionError:
        raise UserError(f"{where}: `{key}` is JSON nested too deep to read") from None


def _conversation(value: Any, where: str, key: str, *, sharegpt: bool) -> tuple[dict[str, Any], ...]:
    value = _json_text(value, where, key, _example(sharegpt))
    if isinstance(value, list) and not value:
        raise UserError(f"{where}: `{key}` is empty; a conversation needs at least one assistant message")
    return _messages(value, where, key, sharegpt=sharegpt)


def _example(sharegpt: bool) -> str:
    return ('a list of messages: [{"from": "human", "value": "..."}, ...]' if sharegpt else
            'a list of messages: [{"role": "user", "content": "..."}, ...]')


def _messages(value: Any, where: str, key: str, *, sharegpt: bool) -> tuple[dict[str, Any], ...]:
    if not isinstance(value, list):
        shown = "null" if value is None else type(value).__name__
        raise UserError(f"{where}: `{key}` holds {shown}, expected {_example(sharegpt)}")
    read = _sharegpt_message if sharegpt else _message
    return tuple(read(message, f"{where}: {key}[{i}]") for i, message in enumerate(value))


def _needs_assistant(messages: tuple[dict[str, Any], ...], where: str) -> None:
    if not any(message["role"] == ASSISTANT for message in messages):
        raise UserError(f"{where}: the conversation has no assistant message; the loss is on the assistant's turns "
                        f"(roles: {quoted([message['role'] for message in messages])})")


def _present(value: dict[str, Any]) -> dict[str, Any]:
    """The keys of a message that hold something (null: absent, as a Parquet struct writes them)."""
    return {key: item for key, item in value.items() if item is not None}


def _message(value: Any, where: str) -> dict[str, Any]:
    if not isinstance(value, dict):
        raise UserError(f"{where} is a {type(value).__name__}, expected an object with `role` and `content`")
    value = _present(value)
    extra = sorted(key for key in value if key not in _MESSAGE_KEYS)
    if extra:
        raise UserError(f"{where} has the key {quoted(extra[0])}; a message holds {', '.join(_MESSAGE_KEYS)}")
    if "role" not in value:
        raise UserError(f"{where} has no `role`; a message holds `role` and `content`")
    role = value["role"]
    if role not in ROLES:
        raise UserError(f"{where} has an unknown role {quoted(role)}; valid: {', '.join(ROLES)}")
    message: dict[str, Any] = {"role": role}
    if "tool_calls" in value:
        if role != ASSISTANT:
            raise UserError(f"{where}: a {role} message holds `tool_calls`; only an assistant message calls tools")
        message["content"] = "" if value.get("content") is None else _content(value["content"], where)
        message["tool_calls"] = _objects(value["tool_calls"], f"{where}.tool_calls", "a tool call")
    elif "content" not in value:
        raise UserError(f"{where} has no `content`; a message holds `role` and `content` (an assistant message "
                        "calling tools: `tool_calls`)")
    else:
        message["content"] = _content(value["content"], where)
    for key in ("tool_call_id", "name"):
        if key in value:
            if role != "tool":
                raise UserError(f"{where}: a {role} message holds `{key}`; it names the call a tool message answers")
            message[key] = _string(value[key], where, key)
    return message


def _sharegpt_message(value: Any, where: str) -> dict[str, Any]:
    if not isinstance(value, dict):
        raise UserError(f"{where} is a {type(value).__name__}, expected an object with `from` and `value`")
    value = _present(value)
    extra = sorted(key for key in value if key not in _SHAREGPT_KEYS)
    if extra:
        raise UserError(f"{where} has the key {quoted(extra[0])}; a ShareGPT message holds `from` and `value` only")
    for key in _SHAREGPT_KEYS:
        if key not in value:
            raise UserError(f"{where} has no `{key}`; a ShareGPT message holds `from` and `value`")
    speaker = value["from"]
    role = SHAREGPT_ROLES.get(speaker) if isinstance(speaker, str) else None
    if role is None:
        raise UserError(f"{where} is from an unknown speaker {quoted(speaker)}; valid: {', '.join(SHAREGPT_ROLES)}")
    return {"role": role, "content": _content(value["value"], where)}


def _content(value: Any, where: str) -> str:
    """A message's content: a string, or a list of text parts joined."""
    if isinstance(value, str):
        return value
    if not isinstance(value, list):
        shown = "null" if value is None else f"{type(value).__name__} {quoted(value)}"
        raise UserError(f"{where}: the content holds {shown}, expected a string or a list of text parts "
                        '[{"type": "text", "text": "..."}]')
    texts = []
    for j, part in enumerate(value):
        part = _present(part) if isinstance(part, dict) else part
        if not isinstance(part, dict) or part.get("type") != "text":
            kind = part.get("type") if isinstance(part, dict) else type(part).__name__
            raise UserError(f"{where}: content part [{j}] is of type {quoted(kind)}; only text parts are read "
                            '({"type": "text", "text": "..."})')
        texts.append(_string(part.get("text"), f"{where}: content part [{j}]", "text"))
    return "".join(texts)


def _objects(value: Any, where: str, what: str) -> list[dict[str, Any]]:
    if not isinstance(value, list) or not all(isinstance(item, dict) for item in value):
        raise UserError(f"{where} holds {type(value).__name__}, expected a list of objects, each {what}")
    return [_present(item) for item in value]


def _tools(value: Any, where: str) -> tuple[dict[str, Any], ...] | None:
    """A row's tools (a list of OpenAI function descriptions, or its JSON text); None when absent."""
    if value is None:
        return None
    value = _json_text(value, where, "tools", 'a list of tools: [{"type": "function", "function": {...}}]')
    return tuple(_objects(value, f"{where}: `tools`", "a tool's description"))
