"""Replay of general text (data.replay): which replay rows each optimizer step takes, and which rank
takes which. Pure functions of (rows in the file, fraction, the step's task rows, seed, step, rank,
ranks), so that a resumed, replayed or resharded step takes exactly the same rows, and no rank asks
another.

- How many: a step holds T task rows on all ranks together (per_device_batch_size x ranks x
  gradient_accumulation_steps, as without replay) and R = max(1, round(fraction / (1 - fraction) x T))
  replay rows besides them, so that replay rows are the share R / (T + R) ~ fraction of its rows.
  The task rows are not cut: an epoch, num_epochs and max_steps mean what they mean without replay.
- Which: slot s (0 <= s < R) of step t (the 0-based step being taken) takes row
  floor(N x bits / 2**32) of the N rows, bits the counter-based draw of (data seed, replay stream,
  t, s) (counter_rng.py): with replacement, across steps and within one.
- Where: slot s goes to rank s mod ranks (the union of the ranks' slots is the step's); each rank's
  slots, in order, fill micro-batches of at most per_device_batch_size rows, every rank the same number
  (ceil(ceil(R / ranks) / per_device_batch_size)); a rank's micro-batch without a slot holds one
  padding row with no label token (it counts nothing and keeps the data-parallel ranks in step).

    mix = ReplayMix(rows, rows_per_step=replay_rows_per_step(8, 0.2), seed=2, source={...})
    mix.micro_batches(step=0, rank=0, world_size=1, batch_size=8)   # [[row, row]]
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Sequence

import numpy as np
import torch

from ft_framework.counter_rng import STREAM_REPLAY_ROWS, random_bits
from ft_framework.data.sft_collate import IGNORE_INDEX

__all__ = ["ReplayMix", "rank_micro_batches", "replay_rows_per_step", "step_rows"]


def replay_rows_per_step(task_rows: int, fraction: float) -> int:
    """R: the replay rows of a step of `task_rows` task rows, round(fraction / (1 - fraction) x task_rows)
    (halves up), at least 1."""
    if task_rows < 1 or not 0.0 < fraction < 1.0:
        raise ValueError(f"replay needs task_rows >= 1 and 0 < fraction < 1, got {task_rows} and {fraction}")
    return max(1, math.floor(fraction / (1.0 - fraction) * task_rows + 0.5))


def step_rows(num_rows: int, count: int, seed: int, step: int) -> np.ndarray:
    """The rows (indices into `num_rows`) of the step's `count` slots, in slot order."""
    if not 0 < num_rows < 2**31:
        raise ValueError(f"replay needs 1 to 2**31 - 1 rows, got {num_rows}")
    bits = random_bits(seed, STREAM_REPLAY_ROWS, step, torch.arange(count, dtype=torch.int64))
    return ((bits * num_rows) >> 32).numpy()  # bits < 2**32 and num_rows < 2**31: exact in int64


def rank_micro_batches(rows: Sequence[int], *, rank: int, world_size: int, batch_size: int) -> list[list[int]]:
    """`rank`'s replay micro-batches of a step whose slots hold `rows`: slots rank, rank + world_size, ...,
    in micro-batches of at most `batch_size`; every rank as many micro-batches (a rank's last ones may
    be empty)."""
    if not 0 <= rank < world_size:
        raise ValueError(f"rank {rank} is outside 0..{world_size - 1}")
    mine = [int(row) for row in rows[rank::world_size]]
    count = math.ceil(math.ceil(len(rows) / world_size) / batch_size)
    return [mine[i * batch_size:(i + 1) * batch_size] for i in range(count)]


@dataclass
class ReplayMix:
    """A run's replay rows (`rows`: items {"input_ids", "labels"}, every token but a row's first a
    label) and their draw: `rows_per_step` of them per optimizer step, keyed on `seed` (the data seed).
    `source`: what results.json records of the file (path, sha256, fraction, counts)."""

    rows: Any
    rows_per_step: int
    seed: int
    source: dict[str, Any] = field(default_factory=dict)

    def step_rows(self, step: int) -> np.ndarray:
        """The rows of every slot of `step` (0-based, the step being taken)."""
        return step_rows(len(self.rows), self.rows_per_step, self.seed, step)

    def micro_batches(self, step: int, *, rank: int, world_size: int, batch_size: int) -> list[list[int]]:
        """`rank`'s replay micro-batches of `step` (row indices; an empty one: a padding row)."""
        return rank_micro_batches(self.step_rows(step), rank=rank, world_size=world_size, batch_size=batch_size)

    def items(self, rows: Sequence[int]) -> list[dict[str, Any]]:
        """The items of a micro-batch's rows; for none, one padding row: a row's first token, no label."""
        if not rows:
            return [{"input_ids": self.rows[0]["input_ids"][:1], "labels": [IGNORE_INDEX]}]
        return [self.rows[int(row)] for row in rows]

    def record(self, steps: int) -> dict[str, Any]:
        """results.json's record after `steps` optimizer steps: the file, the fraction, the rows per
        step, the rows used (slots filled, repeats counted) and the distinct rows among them."""
        used = np.concatenate([self.step_rows(step) for step in range(steps)]) if steps else np.zeros(0, np.int64)
        return {**self.source, "rows_per_step": self.rows_per_step, "rows_used": int(len(used)),
                "distinct_rows_used": int(len(np.unique(used)))}
