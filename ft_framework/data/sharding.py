"""Which examples each rank sees: the seeded epoch order, each rank's micro-batches of it, and the
padded slices of an eval set. Pure functions of (sizes, seed, rank, world size), so every rank
computes its own share without communicating, and a resumed run recomputes the same order.

    batches = epoch_batches(len(train), batch_size=32, data_seed=42, epoch=0, rank=0, world_size=2)
    shard = eval_shard(len(dev), rank=0, world_size=2)     # shard.padded: indices to score
    logits = gathered_logits[restore_order([s.indices for s in all_ranks_shards])]
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Sequence

import numpy as np
import torch

__all__ = ["epoch_permutation", "rank_batches", "epoch_batches", "batches_per_epoch", "EvalShard", "eval_shard",
           "restore_order"]

# Mixes the epoch into the seed so each epoch has its own order; a prime keeps (seed, epoch) pairs
# from colliding for any epoch count below it.
_EPOCH_SEED_STRIDE = 1_000_003


def epoch_permutation(num_examples: int, data_seed: int, epoch: int) -> list[int]:
    """The order of the training examples in `epoch`, fixed by (data seed, epoch) alone.

    torch's generator rather than numpy's: saved runs and the resume tests depend on this exact order.
    """
    gen = torch.Generator().manual_seed(data_seed * _EPOCH_SEED_STRIDE + epoch)
    return torch.randperm(num_examples, generator=gen).tolist()


def rank_batches(order: Sequence[int], batch_size: int, rank: int, world_size: int) -> list[list[int]]:
    """`rank`'s micro-batches of an epoch in `order`.

    The order is cut into rounds of batch_size * world_size examples, and round r gives rank k the
    examples k, k + world_size, ... of it (so the union over ranks of a round is the round). A last
    round shorter than world_size wraps around to the start of the epoch, so that every rank gets a
    batch: their gradient all-reduces pair up one to one.
    """
    if not 0 <= rank < world_size:
        raise ValueError(f"rank {rank} is outside 0..{world_size - 1}")
    order = list(order)
    round_size = batch_size * world_size
    batches = []
    for start in range(0, len(order), round_size):
        chunk = order[start:start + round_size]
        if len(chunk) < world_size:
            chunk = chunk + order[:world_size - len(chunk)]
        batches.append(chunk[rank::world_size])
    return batches


def epoch_batches(num_examples: int, *, batch_size: int, data_seed: int, epoch: int, rank: int,
                  world_size: int) -> list[list[int]]:
    """`rank`'s micro-batches of `epoch`: :func:`rank_batches` of :func:`epoch_permutation`."""
    return rank_batches(epoch_permutation(num_examples, data_seed, epoch), batch_size, rank, world_size)


def batches_per_epoch(num_examples: int, batch_size: int, world_size: int) -> int:
    """Micro-batches per rank in one epoch (the length of every rank's :func:`epoch_batches`)."""
    return math.ceil(num_examples / (batch_size * world_size))


@dataclass(frozen=True)
class EvalShard:
    """One rank's share of an eval set of `num_examples`."""

    indices: list[int]   # the examples this rank scores: rank, rank + world_size, ...
    padded: list[int]    # `indices` padded to the same length on every rank (repeats its last one)

    @property
    def num_real(self) -> int:
        """How many leading predictions of `padded` are real; the rest are padding to drop."""
        return len(self.indices)


def eval_shard(num_examples: int, rank: int, world_size: int) -> EvalShard:
    """`rank`'s strided slice of an eval set, padded so every rank runs the same number of batches
    (sharded forwards are collectives): the short ranks repeat an example whose outputs are dropped."""
    if not 0 <= rank < world_size:
        raise ValueError(f"rank {rank} is outside 0..{world_size - 1}")
    indices = list(range(rank, num_examples, world_size))
    per_rank = -(-num_examples // world_size)
    pad = [indices[-1] if indices else 0] * (per_rank - len(indices))
    return EvalShard(indices, indices + pad)


def restore_order(rank_indices: Sequence[Sequence[int]]) -> np.ndarray:
    """The permutation that puts predictions concatenated in rank order (rank 0's real ones, then
    rank 1's, ...) back into example order: ``concatenated[restore_order(...)]``."""
    return np.argsort([i for indices in rank_indices for i in indices])
