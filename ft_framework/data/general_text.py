"""A user's file of general text: data.replay's (read and tokenized once through the token cache into
a ReplayMix, data/replay.py) and optimizer.importance's source (text_table: the rows its Fisher pass
reads, task_kinds/causal_lm.py).

The file is a user's data file, read as data: a ``.txt`` file (UTF-8) holds one document per
non-empty line, as the ``datasets`` text loader and the forgetting probe's file read lines; any
file readers.py reads (``.jsonl``, ``.csv``, ``.tsv``, ``.parquet``) holds rows of SFT's text shape,
a ``text`` field (other fields ignored). Each document is tokenized as a text row is (the tokenizer's
special tokens, an EOS at its end), cut to data.max_seq_length, and every token but its first is a
label: the plain LM loss of pretraining.

    mix = load_replay("general.txt", 0.2, tokenizer, 512, task_rows_per_step=32, seed=2, cache_dir=...)
"""

from __future__ import annotations

import hashlib
from pathlib import Path
from typing import Any, Callable, Iterator

from ft_framework.errors import UserError
from ft_framework.user_files import open_binary, text_stream

from ft_framework.data.readers import Table, read_table
from ft_framework.data.replay import ReplayMix, replay_rows_per_step
from ft_framework.data.sft import load_text_rows
from ft_framework.data.sft_rows import TEXT, row_shape
from ft_framework.data.token_cache import content_hash

__all__ = ["REPLAY_KEY", "TXT_SUFFIX", "load_replay", "text_table"]

REPLAY_KEY = "data.replay.file"
TXT_SUFFIX = ".txt"
# The token cache's split name of replay rows (a key of its own beside train and validation).
_SPLIT = "replay"
_READ_BLOCK = 1 << 20


def load_replay(file: str | Path, fraction: float, tokenizer: Any, max_seq_length: int, *, task_rows_per_step: int,
                seed: int, cache_dir: Path, is_main: bool = True, barrier: Callable[[], None] = lambda: None,
                progress: bool = False) -> ReplayMix:
    """The replay rows of `file` for a run of `task_rows_per_step` task rows per optimizer step (on all
    ranks), drawn with `seed`; tokenized by `is_main` while the others wait at `barrier`."""
    path = Path(file).expanduser()
    if path.is_dir() or not path.exists():
        raise UserError(f"{REPLAY_KEY}: {path} is not a file; give a .txt file (one document per line) or a file of "
                        "rows with a text field (.jsonl, .csv, .tsv, .parquet)")
    name = f"{REPLAY_KEY}: {path}"
    rows, stats = load_text_rows(name, content_hash([path]), lambda: text_table(path, name), tokenizer,
                                 max_seq_length, split=_SPLIT, cache_dir=cache_dir, is_main=is_main, barrier=barrier,
                                 progress=progress)
    source = {"file": str(path), "sha256": _sha256(path), "fraction": fraction, "rows_in_file": len(rows),
              "truncated": stats["truncated"], "tokens": stats["tokens"]}
    return ReplayMix(rows, rows_per_step=replay_rows_per_step(task_rows_per_step, fraction), seed=seed, source=source)


def text_table(path: Path, name: str) -> Table:
    """The general-text file `path` (the config key `name` names it: data.replay.file,
    optimizer.importance.source) as text rows; a file without one is refused in one line."""
    records = _lines(path) if path.suffix.lower() == TXT_SUFFIX else _text_rows(read_table(path, _SPLIT), name)
    return Table(None, str(path), _not_empty(records, name))


def _lines(path: Path) -> Iterator[tuple[str, dict[str, Any]]]:
    try:
        with text_stream(path) as f:
            for line_no, line in enumerate(f, start=1):
                text = line.rstrip("\r\n")
                if text.strip():
                    yield f"{path}:{line_no}", {"text": text}
    except UnicodeDecodeError as exc:
        raise UserError(f"{path}: not UTF-8 text ({exc.reason}); save the file as UTF-8") from None


def _text_rows(table: Table, name: str) -> Iterator[tuple[str, dict[str, Any]]]:
    if table.columns is not None and "text" not in table.columns:
        raise UserError(f"{name}: its columns {table.columns} hold no `text`; it is read as general text, one "
                        "document in each row's text field")
    for where, values in table.records:
        if row_shape(where, values) != TEXT:
            raise UserError(f"{where}: {name} reads general text, a `text` field only (all of it is read); "
                            "this row has prompt/completion or messages")
        yield where, values


def _not_empty(records: Iterator[tuple[str, dict[str, Any]]], name: str) -> Iterator[tuple[str, dict[str, Any]]]:
    empty = True
    for record in records:
        empty = False
        yield record
    if empty:
        raise UserError(f"{name} holds no text; give at least one non-empty document")


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open_binary(path) as f:
        while block := f.read(_READ_BLOCK):
            digest.update(block)
    return digest.hexdigest()
