"""A task's examples from any source: untokenized splits (:class:`RawSplit`), label encoding,
the shared finishing steps (example limits, the dev set split in half, tokenization) into
:class:`TaskData`, and collation into padded batches.

The GLUE loader (glue.py) and the loader of a user's own files (own_data.py) each produce
RawSplits; everything after that is the same for both.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Mapping, Sequence

import numpy as np
import torch
from torch.utils.data import Dataset

from ft_framework.errors import UserError, quoted

from ft_framework.data.tasks import TaskSpec

__all__ = ["RawSplit", "encode_label", "TokenizedDataset", "tokenize", "Collator", "make_collator", "TaskData",
           "build_task_data"]


@dataclass
class RawSplit:
    """Untokenized examples of one split: one list of texts per text key, plus encoded labels."""

    texts: list[list[str]]
    labels: np.ndarray

    def __len__(self) -> int:
        return len(self.labels)

    def subset(self, indices: Sequence[int] | np.ndarray) -> "RawSplit":
        """Examples at ``indices``, in that order."""
        indices = np.asarray(indices, dtype=np.int64)
        return RawSplit([[col[i] for i in indices] for col in self.texts], self.labels[indices])


def encode_label(spec: TaskSpec, value: Any, where: str, column: str | int) -> int | float:
    """A raw label (a file's string, or a JSON/datasets integer or number) as the task's label id, or
    a finite float score for regression."""
    if spec.is_regression:
        score = None if isinstance(value, bool) else _finite_float(value)
        if score is None:
            raise UserError(f"{where}: label column {column!r} has value {quoted(value)}, expected a float score")
        return score
    key = str(value) if isinstance(value, int) and not isinstance(value, bool) else value
    try:
        return spec.label_list.index(key)
    except ValueError:
        raise UserError(
            f"{where}: unknown label {quoted(value)} in column {column!r}; expected one of {list(spec.label_list)}"
        ) from None


def _finite_float(value: Any) -> float | None:
    try:
        number = float(value)
    except (TypeError, ValueError):
        return None
    return number if math.isfinite(number) else None


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


def tokenize(
    raw: RawSplit, tokenizer: Any, max_seq_length: int, chunk_size: int = 4096
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


class Collator:
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


def make_collator(tokenizer: Any, pad_to_multiple_of: int | None = None) -> Collator:
    """Return a collate function: list of examples -> dict of padded tensors (long/float labels)."""
    return Collator(tokenizer, pad_to_multiple_of=pad_to_multiple_of)


# --------------------------------------------------------------------------------------------------
# Finishing a task's data
# --------------------------------------------------------------------------------------------------


@dataclass
class TaskData:
    """A loaded, tokenized task (GLUE or a user's own data).

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


def _split_in_half(raw: RawSplit, seed: int) -> tuple[RawSplit, RawSplit]:
    """Seeded random permutation; first half (rounded up) for selection, the rest held out."""
    perm = np.random.default_rng(seed).permutation(len(raw))
    cut = (len(raw) + 1) // 2
    return raw.subset(perm[:cut]), raw.subset(perm[cut:])


def _take_first(raw: RawSplit, limit: int | None) -> RawSplit:
    if limit is None or limit >= len(raw):
        return raw
    if limit < 0:
        raise ValueError(f"example limit must be >= 0, got {limit}")
    return raw.subset(np.arange(limit))


def build_task_data(spec: TaskSpec, raw: Mapping[str, RawSplit], *, tokenizer: Any, max_seq_length: int = 128,
                    split_dev_in_half: bool = False, split_seed: int = 0, max_train_examples: int | None = None,
                    max_eval_examples: int | None = None) -> TaskData:
    """Tokenized TaskData from the raw ``train`` split and the task's eval splits.

    ``max_train_examples`` / ``max_eval_examples`` keep the first N examples of the train split / of
    each eval split (before any split in half).
    """
    train_raw = _take_first(raw["train"], max_train_examples)
    eval_raw: dict[str, RawSplit] = {}
    for split in spec.eval_splits:
        dev = _take_first(raw[split], max_eval_examples)
        if split_dev_in_half:
            eval_raw[split], eval_raw[_test_split_name(split)] = _split_in_half(dev, split_seed)
        else:
            eval_raw[split] = dev

    return TaskData(
        task=spec,
        train=tokenize(train_raw, tokenizer, max_seq_length),
        eval={name: tokenize(r, tokenizer, max_seq_length) for name, r in eval_raw.items()},
        train_labels=train_raw.labels,
        eval_labels={name: r.labels for name, r in eval_raw.items()},
    )
