"""GLUE loading: the original TSV files of a local directory, or the Hugging Face hub.

Integer labels always follow the ``nyu-mll/glue`` hub label ids, so a task loaded from the hub and the
same task loaded from the original GLUE TSV files give identical labels.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from ft_framework.errors import MissingPath, UserError

from ft_framework.data.examples import RawSplit, encode_label
from ft_framework.data.readers import read_tsv_rows
from ft_framework.data.tasks import TaskSpec

__all__ = ["glue_splits"]

logger = logging.getLogger(__name__)


# --------------------------------------------------------------------------------------------------
# Original GLUE TSV layouts
# --------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class _TsvLayout:
    """Where the texts and the label live in a task's TSV files.

    Columns are header names, or 0-based indices when the file has no header (CoLA).
    """

    text_columns: tuple[str | int, ...]
    label_column: str | int
    has_header: bool = True
    # The original QQP train file has a few truncated rows; the reference processors skip them.
    skip_short_rows: bool = False


_TSV_LAYOUTS: dict[str, _TsvLayout] = {
    # CoLA: source, label, original label mark, sentence -- no header.
    "cola": _TsvLayout((3,), 1, has_header=False),
    "sst2": _TsvLayout(("sentence",), "label"),
    "mrpc": _TsvLayout(("#1 String", "#2 String"), "Quality"),
    "qqp": _TsvLayout(("question1", "question2"), "is_duplicate", skip_short_rows=True),
    "stsb": _TsvLayout(("sentence1", "sentence2"), "score"),
    "mnli": _TsvLayout(("sentence1", "sentence2"), "gold_label"),
    "qnli": _TsvLayout(("question", "sentence"), "label"),
    "rte": _TsvLayout(("sentence1", "sentence2"), "label"),
    "wnli": _TsvLayout(("sentence1", "sentence2"), "label"),
}

_EVAL_FILES = {
    "validation": "dev.tsv",
    "validation_matched": "dev_matched.tsv",
    "validation_mismatched": "dev_mismatched.tsv",
}


def _column_index(header: list[str], column: str | int, path: Path) -> int:
    """Index of a named header column, with an error naming the file when it is missing."""
    if isinstance(column, int):
        return column
    try:
        return header.index(column)
    except ValueError:
        raise UserError(f"{path}: missing column {column!r}; header has {header}") from None


def _read_glue_tsv(path: str | Path, spec: TaskSpec) -> RawSplit:
    """Parse one original-layout GLUE TSV file of task ``spec``."""
    path = Path(path)
    if not path.is_file():
        raise MissingPath(f"GLUE {spec.name} file not found: {path}")
    layout = _TSV_LAYOUTS[spec.name]
    rows = read_tsv_rows(path)
    header = None
    if layout.has_header:
        first = next(rows, None)
        if first is None:
            raise UserError(f"{path}: empty file, expected a header line")
        header = first[1]
    text_idx = [_column_index(header, c, path) for c in layout.text_columns]
    label_idx = _column_index(header, layout.label_column, path)
    needed = max(text_idx + [label_idx]) + 1

    texts: list[list[str]] = [[] for _ in text_idx]
    labels: list[int | float] = []
    skipped = 0
    for line_no, row in rows:
        if len(row) < needed:
            if layout.skip_short_rows:
                skipped += 1
                continue
            raise UserError(f"{path}:{line_no}: row has {len(row)} columns, expected at least {needed}")
        # Extra trailing columns are ignored: values are taken by header position.
        for col, i in zip(texts, text_idx):
            col.append(row[i])
        labels.append(encode_label(spec, row[label_idx], f"{path}:{line_no}", layout.label_column))
    if skipped:
        logger.warning("%s: skipped %d malformed rows", path, skipped)
    if not labels:
        what = "only a header line" if layout.has_header else "no rows"
        raise UserError(f"{path}: no examples (the file holds {what}); a run needs at least one to train on "
                        "and one to evaluate")
    # float32 scores, like the hub's STS-B feature, so both sources give bit-identical labels.
    dtype = np.float32 if spec.is_regression else np.int64
    return RawSplit(texts, np.asarray(labels, dtype=dtype))


def _resolve_task_dir(source: str | Path, spec: TaskSpec) -> Path:
    """Accept either the GLUE root (containing ``<title>/``, e.g. ``SST-2/``) or the task directory itself."""
    root = Path(source).expanduser()
    if (root / spec.title).is_dir():
        return root / spec.title
    if (root / "train.tsv").is_file():
        return root
    raise MissingPath(
        f"no GLUE data for task {spec.name!r} under {root}: expected {root / spec.title / 'train.tsv'} "
        f"(or point source at the {spec.title} directory itself)"
    )


def _load_local(source: str | Path, spec: TaskSpec) -> dict[str, RawSplit]:
    task_dir = _resolve_task_dir(source, spec)
    splits = {"train": _read_glue_tsv(task_dir / "train.tsv", spec)}
    for split in spec.eval_splits:
        splits[split] = _read_glue_tsv(task_dir / _EVAL_FILES[split], spec)
    return splits


def _load_hub(hub_id: str, spec: TaskSpec) -> dict[str, RawSplit]:
    import datasets  # imported lazily: only the hub path needs it

    dsd = datasets.load_dataset(hub_id, spec.name)
    return {split: _from_hub_split(dsd, split, spec, hub_id) for split in ("train",) + spec.eval_splits}


def _from_hub_split(dsd: Any, split: str, spec: TaskSpec, hub_id: str) -> RawSplit:
    """Convert one split of a hub ``DatasetDict`` into a RawSplit, checking columns and labels."""
    if split not in dsd:
        raise ValueError(f"{hub_id}/{spec.name}: missing split {split!r}; available: {list(dsd)}")
    ds = dsd[split]
    for column in spec.text_keys + (spec.label_key,):
        if column not in ds.column_names:
            raise ValueError(
                f"{hub_id}/{spec.name}[{split}]: missing column {column!r}; has {ds.column_names}"
            )
    dtype = np.float32 if spec.is_regression else np.int64
    labels = np.asarray(ds[spec.label_key], dtype=dtype)
    if not spec.is_regression and len(labels) and (labels.min() < 0 or labels.max() >= spec.num_labels):
        raise ValueError(
            f"{hub_id}/{spec.name}[{split}]: label ids outside 0..{spec.num_labels - 1} "
            "(unlabelled test split?)"
        )
    return RawSplit([list(ds[key]) for key in spec.text_keys], labels)


def glue_splits(spec: TaskSpec, source: str = "hub", hub_id: str = "nyu-mll/glue") -> dict[str, RawSplit]:
    """The raw train and eval splits of GLUE task ``spec`` from the hub or a local directory."""
    return _load_hub(hub_id, spec) if source == "hub" else _load_local(source, spec)
