"""GLUE loading (Hugging Face hub or local TSV files), tokenization and collation.

Integer labels always follow the ``nyu-mll/glue`` hub label ids, so a task loaded from the hub and the
same task loaded from the original GLUE TSV files give identical labels.
"""

from __future__ import annotations

import csv
import logging
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Sequence

import numpy as np
import torch
from torch.utils.data import Dataset

from ft_framework.errors import MissingPath, UserError

from ft_framework.data.tasks import TaskSpec, get_task

logger = logging.getLogger(__name__)

# Some GLUE fields (e.g. QQP questions) exceed csv's default 128 KiB field limit.
csv.field_size_limit(min(sys.maxsize, 2**31 - 1))


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


@dataclass
class _RawSplit:
    """Untokenized examples of one split: one list of texts per text key, plus encoded labels."""

    texts: list[list[str]]
    labels: np.ndarray

    def __len__(self) -> int:
        return len(self.labels)

    def subset(self, indices: Sequence[int] | np.ndarray) -> "_RawSplit":
        """Examples at ``indices``, in that order."""
        indices = np.asarray(indices, dtype=np.int64)
        return _RawSplit([[col[i] for i in indices] for col in self.texts], self.labels[indices])


def _encode_label(spec: TaskSpec, value: str, where: str, column: str | int) -> int | float:
    """Map a raw TSV label string to the hub label id (or a float score for regression)."""
    if spec.is_regression:
        try:
            return float(value)
        except ValueError:
            raise UserError(
                f"{where}: label column {column!r} has value {value!r}, expected a float score"
            ) from None
    try:
        return spec.label_list.index(value)
    except ValueError:
        raise UserError(
            f"{where}: unknown label {value!r} in column {column!r}; expected one of {list(spec.label_list)}"
        ) from None


def _column_index(header: list[str], column: str | int, path: Path) -> int:
    """Index of a named header column, with an error naming the file when it is missing."""
    if isinstance(column, int):
        return column
    try:
        return header.index(column)
    except ValueError:
        raise UserError(f"{path}: missing column {column!r}; header has {header}") from None


def _read_glue_tsv(path: str | Path, spec: TaskSpec) -> _RawSplit:
    """Parse one original-layout GLUE TSV file of task ``spec``."""
    path = Path(path)
    if not path.is_file():
        raise MissingPath(f"GLUE {spec.name} file not found: {path}")
    try:
        return _parse_glue_tsv(path, spec)
    except UnicodeDecodeError:
        raise _not_utf8(path) from None


def _not_utf8(path: Path) -> UserError:
    """The error for a file that is not UTF-8, naming the first bad line and byte."""
    with path.open("rb") as f:
        for line_no, line in enumerate(f, start=1):
            try:
                line.decode("utf-8")
            except UnicodeDecodeError as exc:
                return UserError(f"{path}:{line_no}: not UTF-8 text (byte 0x{line[exc.start]:02x} at column "
                                 f"{exc.start + 1}); save the file as UTF-8")
    return UserError(f"{path}: not UTF-8 text; save the file as UTF-8")


def _parse_glue_tsv(path: Path, spec: TaskSpec) -> _RawSplit:
    layout = _TSV_LAYOUTS[spec.name]
    with path.open(encoding="utf-8", newline="") as f:
        # GLUE TSVs contain unbalanced raw quotes, so quote processing must be off.
        rows = csv.reader(f, delimiter="\t", quoting=csv.QUOTE_NONE)
        header = next(rows, None) if layout.has_header else None
        if layout.has_header and header is None:
            raise UserError(f"{path}: empty file, expected a header line")
        text_idx = [_column_index(header, c, path) for c in layout.text_columns]
        label_idx = _column_index(header, layout.label_column, path)
        needed = max(text_idx + [label_idx]) + 1

        texts: list[list[str]] = [[] for _ in text_idx]
        labels: list[int | float] = []
        skipped = 0
        first_line = 2 if layout.has_header else 1
        for line_no, row in enumerate(rows, start=first_line):
            if not row:
                continue
            if len(row) < needed:
                if layout.skip_short_rows:
                    skipped += 1
                    continue
                raise UserError(f"{path}:{line_no}: row has {len(row)} columns, expected at least {needed}")
            # Extra trailing columns are ignored: values are taken by header position.
            for col, i in zip(texts, text_idx):
                col.append(row[i])
            labels.append(_encode_label(spec, row[label_idx], f"{path}:{line_no}", layout.label_column))
    if skipped:
        logger.warning("%s: skipped %d malformed rows", path, skipped)
    if not labels:
        what = "only a header line" if layout.has_header else "no rows"
        raise UserError(f"{path}: no examples (the file holds {what}); a run needs at least one to train on "
                        "and one to evaluate")
    # float32 scores, like the hub's STS-B feature, so both sources give bit-identical labels.
    dtype = np.float32 if spec.is_regression else np.int64
    return _RawSplit(texts, np.asarray(labels, dtype=dtype))


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


def _load_local(source: str | Path, spec: TaskSpec) -> dict[str, _RawSplit]:
    task_dir = _resolve_task_dir(source, spec)
    splits = {"train": _read_glue_tsv(task_dir / "train.tsv", spec)}
    for split in spec.eval_splits:
        splits[split] = _read_glue_tsv(task_dir / _EVAL_FILES[split], spec)
    return splits


def _load_hub(hub_id: str, spec: TaskSpec) -> dict[str, _RawSplit]:
    import datasets  # imported lazily: only the hub path needs it

    dsd = datasets.load_dataset(hub_id, spec.name)
    return {split: _from_hub_split(dsd, split, spec, hub_id) for split in ("train",) + spec.eval_splits}


def _from_hub_split(dsd: Any, split: str, spec: TaskSpec, hub_id: str) -> _RawSplit:
    """Convert one split of a hub ``DatasetDict`` into a _RawSplit, checking columns and labels."""
    if split not in dsd:
        raise ValueError(f"{hub_id}/{spec.name}: missing split {split!r}; available: {list(dsd)}")
    ds = dsd[split]
    for column in spec.text_keys + ("label",):
        if column not in ds.column_names:
            raise ValueError(
                f"{hub_id}/{spec.name}[{split}]: missing column {column!r}; has {ds.column_names}"
            )
    dtype = np.float32 if spec.is_regression else np.int64
    labels = np.asarray(ds["label"], dtype=dtype)
    if not spec.is_regression and len(labels) and (labels.min() < 0 or labels.max() >= spec.num_labels):
        raise ValueError(
            f"{hub_id}/{spec.name}[{split}]: label ids outside 0..{spec.num_labels - 1} "
            "(unlabelled test split?)"
        )
    return _RawSplit([list(ds[key]) for key in spec.text_keys], labels)


# --------------------------------------------------------------------------------------------------
# Tokenized dataset and collation
# --------------------------------------------------------------------------------------------------


class TokenizedDataset(Dataset):
    """Tokenized examples stored as flat int32 arrays plus offsets (compact for MNLI/QQP sizes).

    ``ds[i]`` is a dict of python lists (``input_ids``, ``attention_mask``, ...) plus ``labels``
    (int for classification, float for regression).
    """

    def __init__(self, flat: dict[str, np.ndarray], offsets: dict[str, np.ndarray], labels: np.ndarray):
        for key in flat:
            if len(offsets[key]) != len(labels) + 1:
                raise ValueError(
                    f"feature {key!r} has {len(offsets[key]) - 1} rows but there are {len(labels)} labels"
                )
        self._flat = flat
        self._offsets = offsets
        self.labels = labels
        self._is_float = labels.dtype.kind == "f"

    @classmethod
    def from_sequences(cls, features: dict[str, list[list[int]]], labels: np.ndarray) -> "TokenizedDataset":
        """Build from per-example token lists, e.g. a tokenizer's output."""
        flat, offsets = {}, {}
        for key, seqs in features.items():
            flat[key], lengths = _flatten(seqs)
            offsets[key] = np.concatenate([[0], np.cumsum(lengths)])
        return cls(flat, offsets, labels)

    @property
    def feature_names(self) -> list[str]:
        """Names of the token-level features (without ``labels``)."""
        return list(self._flat)

    def __len__(self) -> int:
        return len(self.labels)

    def __getitem__(self, idx: int) -> dict[str, Any]:
        if idx < 0:
            idx += len(self)
        if not 0 <= idx < len(self):
            raise IndexError(idx)
        example: dict[str, Any] = {
            key: flat[self._offsets[key][idx] : self._offsets[key][idx + 1]].tolist()
            for key, flat in self._flat.items()
        }
        label = self.labels[idx]
        example["labels"] = float(label) if self._is_float else int(label)
        return example


def _flatten(seqs: list[list[int]]) -> tuple[np.ndarray, np.ndarray]:
    """Concatenate token lists into one int32 array; also return each list's length."""
    lengths = np.fromiter((len(s) for s in seqs), dtype=np.int64, count=len(seqs))
    flat = np.fromiter((tok for s in seqs for tok in s), dtype=np.int32, count=int(lengths.sum()))
    return flat, lengths


def _tokenize(
    raw: _RawSplit, tokenizer: Any, max_seq_length: int, chunk_size: int = 4096
) -> TokenizedDataset:
    """Tokenize without padding, chunk by chunk, so only one chunk is held as python lists at a time."""
    flat_parts: dict[str, list[np.ndarray]] = {}
    length_parts: dict[str, list[np.ndarray]] = {}
    for start in range(0, len(raw), chunk_size):
        texts = [col[start : start + chunk_size] for col in raw.texts]
        enc = tokenizer(*texts, truncation=True, max_length=max_seq_length)
        for key, seqs in enc.items():
            flat, lengths = _flatten(seqs)
            flat_parts.setdefault(key, []).append(flat)
            length_parts.setdefault(key, []).append(lengths)
    if not flat_parts:
        # Empty split: keep the standard keys so downstream code sees the usual features.
        return TokenizedDataset.from_sequences({"input_ids": [], "attention_mask": []}, raw.labels)
    flat = {key: np.concatenate(parts) for key, parts in flat_parts.items()}
    offsets = {
        key: np.concatenate([[0], np.cumsum(np.concatenate(parts))]) for key, parts in length_parts.items()
    }
    return TokenizedDataset(flat, offsets, raw.labels)


class GlueCollator:
    """Pad a list of examples dynamically to the longest one and return a dict of tensors.

    A class rather than a closure so DataLoader workers can pickle it.
    """

    def __init__(self, tokenizer: Any, pad_to_multiple_of: int | None = None):
        from transformers import DataCollatorWithPadding

        self._pad = DataCollatorWithPadding(
            tokenizer, padding="longest", pad_to_multiple_of=pad_to_multiple_of
        )

    def __call__(self, examples: list[dict[str, Any]]) -> dict[str, torch.Tensor]:
        features = [{k: v for k, v in ex.items() if k != "labels"} for ex in examples]
        batch = dict(self._pad(features))
        if examples and "labels" in examples[0]:
            labels = [ex["labels"] for ex in examples]
            # Regression (STS-B) needs float targets for MSE; classification needs long for CE.
            dtype = torch.float32 if isinstance(labels[0], float) else torch.long
            batch["labels"] = torch.tensor(labels, dtype=dtype)
        return batch


def make_collator(tokenizer: Any, pad_to_multiple_of: int | None = None) -> GlueCollator:
    """Return a collate function: list of examples -> dict of padded tensors (long/float labels)."""
    return GlueCollator(tokenizer, pad_to_multiple_of=pad_to_multiple_of)


# --------------------------------------------------------------------------------------------------
# Public loader
# --------------------------------------------------------------------------------------------------


@dataclass
class GlueData:
    """A loaded, tokenized GLUE task.

    ``eval`` maps split names to datasets: ``task.eval_splits``, or when the dev set was split in half,
    ``validation*`` (selection half) and the matching ``test*`` (held-out half).
    """

    task: TaskSpec
    train: Dataset
    eval: dict[str, Dataset]
    train_labels: np.ndarray
    eval_labels: dict[str, np.ndarray] = field(default_factory=dict)


def _test_split_name(eval_split: str) -> str:
    """validation -> test, validation_matched -> test_matched, ..."""
    return "test" + eval_split[len("validation") :]


def _split_in_half(raw: _RawSplit, seed: int) -> tuple[_RawSplit, _RawSplit]:
    """Seeded random permutation; first half (rounded up) for selection, the rest held out."""
    perm = np.random.default_rng(seed).permutation(len(raw))
    cut = (len(raw) + 1) // 2
    return raw.subset(perm[:cut]), raw.subset(perm[cut:])


def _take_first(raw: _RawSplit, limit: int | None) -> _RawSplit:
    if limit is None or limit >= len(raw):
        return raw
    if limit < 0:
        raise ValueError(f"example limit must be >= 0, got {limit}")
    return raw.subset(np.arange(limit))


def load_glue(
    task: str,
    *,
    tokenizer: Any,
    max_seq_length: int = 128,
    source: str = "hub",
    hub_id: str = "nyu-mll/glue",
    split_dev_in_half: bool = False,
    split_seed: int = 0,
    max_train_examples: int | None = None,
    max_eval_examples: int | None = None,
) -> GlueData:
    """Load and tokenize a GLUE task.

    ``source="hub"`` uses ``datasets.load_dataset(hub_id, task)``; any other value is a local directory in
    the original GLUE layout (``<dir>/RTE/train.tsv`` ...) or the task directory itself.
    ``max_train_examples`` / ``max_eval_examples`` keep the first N examples of the train file / of each
    dev file (before any split in half).
    """
    spec = get_task(task)
    raw = _load_hub(hub_id, spec) if source == "hub" else _load_local(source, spec)

    train_raw = _take_first(raw["train"], max_train_examples)
    eval_raw: dict[str, _RawSplit] = {}
    for split in spec.eval_splits:
        dev = _take_first(raw[split], max_eval_examples)
        if split_dev_in_half:
            eval_raw[split], eval_raw[_test_split_name(split)] = _split_in_half(dev, split_seed)
        else:
            eval_raw[split] = dev

    return GlueData(
        task=spec,
        train=_tokenize(train_raw, tokenizer, max_seq_length),
        eval={name: _tokenize(r, tokenizer, max_seq_length) for name, r in eval_raw.items()},
        train_labels=train_raw.labels,
        eval_labels={name: r.labels for name, r in eval_raw.items()},
    )
