"""A user's own data (``data.source: files``, or a Hub data set: ``data.source: hub`` with
``data.hub_id``): each split read into a RawSplit, with every mistake named by file and line (a Hub
row by its split and index) and column.

The file formats are readers.py's; which columns hold the texts and the label, and what labels are
valid, are the task's (tasks.own_data_task).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Mapping

import numpy as np

from ft_framework.errors import MissingPath, UserError, quoted

from ft_framework.data.examples import RawSplit, encode_label
from ft_framework.data.hub_tables import HubSource, open_hub_split
from ft_framework.data.readers import Table, read_table
from ft_framework.data.tasks import TaskSpec

__all__ = ["own_data_splits", "own_hub_splits"]


def own_data_splits(spec: TaskSpec, files: Mapping[str, str | Path]) -> dict[str, RawSplit]:
    """The raw train split and the task's eval splits, from ``files`` (split -> path; relative paths
    from the current directory)."""
    return {split: _read_split(spec, Path(files[split]).expanduser(), split) for split in ("train",) + spec.eval_splits}


def own_hub_splits(spec: TaskSpec, source: HubSource) -> dict[str, RawSplit]:
    """The raw train split and the task's eval splits, from the Hub data set ``source``."""
    needed = spec.text_keys + (spec.label_key,)
    return {split: _split_of(spec, open_hub_split(source, split).table(needed), source.describe(split),
                             f"{split} split") for split in ("train",) + spec.eval_splits}


def _read_split(spec: TaskSpec, path: Path, split: str) -> RawSplit:
    if not path.exists():
        raise MissingPath(f"data.files.{split}: {path} not found (relative paths start at the current directory)")
    table = read_table(path, split, columns=spec.text_keys + (spec.label_key,))
    return _split_of(spec, table, str(path), f"{split} file")


def _split_of(spec: TaskSpec, table: Table, name: str, what: str) -> RawSplit:
    needed = spec.text_keys + (spec.label_key,)
    if table.columns is not None:
        for column in needed:
            if column not in table.columns:
                raise UserError(f"{table.header}: missing column {column!r}; the columns are {quoted(table.columns)}")
    texts: list[list[str]] = [[] for _ in spec.text_keys]
    labels: list[int | float] = []
    for where, values in table.records:
        for column in needed:
            if column not in values:  # a JSON line: each object has its own keys
                raise UserError(f"{where}: missing column {column!r}; the object has {quoted(sorted(values))}")
        for texts_of_column, column in zip(texts, spec.text_keys):
            texts_of_column.append(_text(values[column], where, column))
        labels.append(encode_label(spec, values[spec.label_key], where, spec.label_key))
    if not labels:
        raise UserError(f"{name}: no examples in the {what}; a run needs at least one to train on and one "
                        "to evaluate")
    dtype = np.float32 if spec.is_regression else np.int64
    return RawSplit(texts, np.asarray(labels, dtype=dtype))


def _text(value: Any, where: str, column: str) -> str:
    """A text cell, which must hold some text: an empty example trains on nothing but its label."""
    if value is None or (isinstance(value, str) and not value.strip()):
        raise UserError(f"{where}: column {column!r} is empty; every example needs its text")
    if not isinstance(value, str):
        raise UserError(f"{where}: column {column!r} holds {type(value).__name__} {quoted(value)}, expected text")
    return value
