"""Supervised fine-tuning rows as the SFT tools take them (TRL's SFTTrainer, torchtune, axolotl), read
from any file readers.py reads (JSON lines, CSV / TSV, Parquet files or a Hub-style directory of them,
a `datasets` directory), each checked and named by its place in the file.

A row has one of three shapes, told apart by its keys:

- ``text``: a string, trained on as a whole;
- ``prompt`` and ``completion``: two strings, the completion trained on after the prompt;
- ``messages``: a conversation, a list of ``{"role": ..., "content": ...}`` (OpenAI style; roles
  ``system``, ``user``, ``assistant`` and ``tool``), with at least one assistant message. Where the
  value is text (a CSV cell always is), it is read as JSON.

Other keys (an ``id``, a ``source``) are ignored, as a Hub data set's extra columns are. A message
holds ``role`` and ``content`` only (a key whose value is null counts as absent: a Parquet struct
column writes every field of every message). All rows of a file have one shape.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator

from ft_framework.errors import UserError, quoted

from ft_framework.data.readers import read_table

__all__ = ["MESSAGES", "PROMPT_COMPLETION", "ROLES", "SHAPES", "SHAPE_KEYS", "SFTRow", "TEXT", "read_sft_rows",
           "row_shape"]

TEXT, PROMPT_COMPLETION, MESSAGES = "text", "prompt_completion", "messages"
SHAPES = (TEXT, PROMPT_COMPLETION, MESSAGES)
# The keys that make each shape; a row holds exactly one of these sets.
_SHAPE_OF_KEYS = {("text",): TEXT, ("prompt", "completion"): PROMPT_COMPLETION, ("messages",): MESSAGES}
SHAPE_KEYS: tuple[str, ...] = ("text", "prompt", "completion", "messages")
ROLES: tuple[str, ...] = ("system", "user", "assistant", "tool")
ASSISTANT = "assistant"
_MESSAGE_KEYS = ("role", "content")
_VALID_SHAPES = "a row holds `text`, or `prompt` and `completion`, or `messages`"


@dataclass(frozen=True)
class SFTRow:
    """One checked row: ``where`` names it in its file (``train.jsonl:14``); ``text`` for the text
    shape, ``prompt`` and ``completion`` for that shape, ``messages`` (each {role, content}) for a
    conversation."""

    where: str
    shape: str
    text: str = ""
    prompt: str = ""
    completion: str = ""
    messages: tuple[dict[str, str], ...] = ()


def read_sft_rows(path: Path, split: str, limit: int | None = None) -> Iterator[SFTRow]:
    """The rows of ``path`` (``split`` picks a directory's split), streamed in file order, the first
    ``limit`` only when given. Every mistake is a UserError naming the row."""
    table = read_table(path, split, columns=SHAPE_KEYS)
    if table.columns is not None:  # a header or a schema names the keys once for the whole file
        row_shape(table.header, {name: "" for name in table.columns})
    first: tuple[str, str] | None = None
    for count, (where, values) in enumerate(table.records):
        if limit is not None and count >= limit:
            return
        row = _checked_row(where, values)
        if first is None:
            first = (row.shape, where)
        elif row.shape != first[0]:
            raise UserError(f"{where}: a row of the {row.shape} shape, but the file's first row ({first[1]}) is of the "
                            f"{first[0]} shape; all rows of a file have one shape")
        yield row


def row_shape(where: str, values: dict[str, Any]) -> str:
    """The shape the keys of ``values`` make (TEXT, PROMPT_COMPLETION or MESSAGES), or a UserError
    naming what is missing or mixed."""
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


def _checked_row(where: str, values: dict[str, Any]) -> SFTRow:
    shape = row_shape(where, values)
    if shape == TEXT:
        text = _string(values["text"], where, "text")
        if not text.strip():
            raise UserError(f"{where}: `text` is empty; a text row trains on its text")
        return SFTRow(where, TEXT, text=text)
    if shape == PROMPT_COMPLETION:
        return SFTRow(where, PROMPT_COMPLETION, prompt=_string(values["prompt"], where, "prompt"),
                      completion=_string(values["completion"], where, "completion"))
    return SFTRow(where, MESSAGES, messages=_messages(values["messages"], where))


def _string(value: Any, where: str, key: str) -> str:
    if not isinstance(value, str):
        shown = "null" if value is None else f"{type(value).__name__} {quoted(value)}"
        raise UserError(f"{where}: `{key}` holds {shown}, expected a string")
    return value


def _messages(value: Any, where: str) -> tuple[dict[str, str], ...]:
    if isinstance(value, str):  # a CSV cell, or a Parquet string column: the list as JSON
        try:
            value = json.loads(value)
        except json.JSONDecodeError as exc:
            raise UserError(f"{where}: `messages` is text but not JSON ({exc.msg} at column {exc.colno}); give a "
                            'list of messages: [{"role": "user", "content": "..."}, ...]') from None
        except RecursionError:
            raise UserError(f"{where}: `messages` is JSON nested too deep to read") from None
    if not isinstance(value, list):
        shown = "null" if value is None else type(value).__name__
        raise UserError(f"{where}: `messages` holds {shown}, expected a list of messages "
                        '[{"role": "user", "content": "..."}, ...]')
    if not value:
        raise UserError(f"{where}: `messages` is empty; a conversation needs at least one assistant message")
    messages = tuple(_message(message, f"{where}: messages[{i}]") for i, message in enumerate(value))
    if not any(message["role"] == ASSISTANT for message in messages):
        raise UserError(f"{where}: the conversation has no assistant message; the loss is on the assistant's turns "
                        f"(roles: {quoted([message['role'] for message in messages])})")
    return messages


def _message(value: Any, where: str) -> dict[str, str]:
    if not isinstance(value, dict):
        raise UserError(f"{where} is a {type(value).__name__}, expected an object with `role` and `content`")
    extra = sorted(key for key, item in value.items() if key not in _MESSAGE_KEYS and item is not None)
    if extra:
        raise UserError(f"{where} has the key {quoted(extra[0])}; a message holds `role` and `content` only")
    for key in _MESSAGE_KEYS:
        if value.get(key) is None:
            raise UserError(f"{where} has no `{key}`; a message holds `role` and `content`")
    role = value["role"]
    if role not in ROLES:
        raise UserError(f"{where} has an unknown role {quoted(role)}; valid: {', '.join(ROLES)}")
    return {"role": role, "content": _string(value["content"], where, "content")}
