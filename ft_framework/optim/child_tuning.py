"""Child-Tuning-D (Xu et al. 2021, "Raise a Child in Large Language Model"): before the first step
a Fisher pass picks the child network, the top ``reserve_p`` fraction of the candidate elements by
F = sum over the pass's micro-batches of g^2; from then on only the child's gradients reach the
optimizer's rule (g * M, no 1/p rescale: that would be Child-Tuning-F).

The mask M is optimizer state (``state[p][CHILD_MASK]``, bool), sharded like p and theta*: it is
saved, loaded and resharded with the anchor and the moments, so a resume needs no second pass.
Which parameters are candidates is decided once, by optim/groups.py (``child_candidate`` on each
group; ZeRO flattens group by group, so the flag holds for its flat partitions too).

The Fisher reads the gradients where every strategy hands them over, in the optimizer's step:
optim/fisher.py's ``FisherPass`` makes step() accumulate g^2 of the candidate groups instead of
updating (no step count moves), so g is the global micro-batch's reduced gradient, as the strategy
delivers it (whole under one process and DDP, a flat partition under ZeRO, a DTensor shard under FSDP2).

The threshold is exact and global over every rank's candidate elements: tau is the k-th largest
Fisher value, k = ceil(reserve_p * N) (N: the candidate elements of the model), found by bisection
over the float32 bit pattern (non-negative floats order like their bits) with one all-reduced
count per probe; the child is every element with F >= tau, so ties at tau are all kept (the kept
count may exceed k).
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from typing import Any, Callable, Iterable, Mapping

import torch

from ft_framework.distributed import collectives
from ft_framework.optim import fisher
from ft_framework.optim.base import CHILD_MASK, local_tensor
from ft_framework.optim.fisher import FisherPass

__all__ = ["ChildTuningResult", "candidate_elements", "candidate_params", "prepare_masks", "run_fisher_pass",
           "select_child"]

# Bit patterns of non-negative float32: 0 is +0.0, one past +inf is above every finite value.
_ABOVE_INF_BITS = 0x7F800001


@dataclass(frozen=True)
class ChildTuningResult:
    """What a run records about its child network (results.json "child_tuning")."""

    fisher_batches: int
    fisher_seconds: float
    candidate_elements: int
    kept_elements: int
    threshold: float

    @property
    def kept_fraction(self) -> float:
        return self.kept_elements / self.candidate_elements if self.candidate_elements else 0.0

    def to_record(self) -> dict[str, Any]:
        return {**asdict(self), "kept_fraction": self.kept_fraction}


def candidate_params(optimizer: torch.optim.Optimizer) -> list[torch.Tensor]:
    """The optimizer's tensors that Child-Tuning masks: those of its ``child_candidate`` groups
    (flat partitions under ZeRO, DTensors under FSDP2)."""
    return [p for g in optimizer.param_groups if g.get("child_candidate") for p in g["params"]]


def candidate_elements(optimizer: torch.optim.Optimizer, numel_of: Mapping[str, int]) -> int:
    """N: the number of candidate elements in the whole model (`numel_of`: each parameter's full
    element count by name; the groups' ``param_names`` survive ZeRO's flattening)."""
    return sum(numel_of[n] for g in optimizer.param_groups if g.get("child_candidate") for n in g["param_names"])


def _count_at_least(fishers: list[torch.Tensor], bits: int, partitioned: bool) -> int:
    local = torch.zeros((), dtype=torch.int64)
    for f in fishers:
        local += (f.view(torch.int32) >= bits).sum().cpu()
    if partitioned:
        local = collectives.all_reduce(local)
    return int(local)


@torch.no_grad()
def select_child(fisher_pass: FisherPass, reserve_p: float, numel_of: Mapping[str, int], *, partitioned: bool,
                 seconds: float = 0.0) -> ChildTuningResult:
    """Puts the mask F >= tau into the optimizer state of every candidate tensor and drops the
    Fisher buffers. `partitioned`: each rank holds a disjoint part of the state (ZeRO, FSDP2), so
    counts are all-reduced (collective: every rank calls this); under DDP every rank holds it whole.

    Padding of ZeRO's flat partitions has g = 0, so F = 0 there: it counts only at the probe 0,
    which every candidate passes anyway.
    """
    if not 0.0 < reserve_p <= 1.0:
        raise ValueError(f"reserve_p must be in (0, 1], got {reserve_p}")
    optimizer = fisher_pass.optimizer
    total = candidate_elements(optimizer, numel_of)
    k = max(1, math.ceil(reserve_p * total))
    fishers = [f for _, f in fisher_pass.fisher.values()]
    if fisher_pass.batches and not fishers:
        raise ValueError("Child-Tuning: the optimizer's step saw no gradient of a candidate parameter during the "
                         "Fisher pass; the strategy must step through optimizer.step() (Strategy.step_unclipped)")
    if any(not bool(torch.isfinite(f).all()) for f in fishers):
        raise ValueError("Child-Tuning: the Fisher pass produced a non-finite g^2 (a NaN or infinite gradient)")
    lo, hi = 0, _ABOVE_INF_BITS  # invariant: count(F >= lo) >= k > count(F >= hi)
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if _count_at_least(fishers, mid, partitioned) >= k:
            lo = mid
        else:
            hi = mid
    kept = total if lo == 0 else _count_at_least(fishers, lo, partitioned)
    tau = torch.tensor(lo, dtype=torch.int32).view(torch.float32)
    for p in candidate_params(optimizer):
        mask = torch.zeros_like(p, dtype=torch.bool)  # a DTensor for a DTensor p: sharded like it
        entry = fisher_pass.fisher.get(id(p))
        if entry is not None:
            local_tensor(mask).copy_(entry[1] >= tau)
        elif lo == 0:
            mask.fill_(True)
        optimizer.state[p][CHILD_MASK] = mask
    fisher_pass.fisher.clear()
    return ChildTuningResult(fisher_batches=fisher_pass.batches, fisher_seconds=round(float(seconds), 3),
                             candidate_elements=total, kept_elements=kept, threshold=float(tau))


def prepare_masks(optimizer: torch.optim.Optimizer) -> None:
    """Empty masks for every candidate tensor, so that a checkpoint load has its targets (the load
    replaces them: a resume never runs a second Fisher pass)."""
    for p in candidate_params(optimizer):
        optimizer.state[p][CHILD_MASK] = torch.zeros_like(p, dtype=torch.bool)


def _is_candidate_group(group: dict[str, Any]) -> bool:
    return bool(group.get("child_candidate"))


def run_fisher_pass(optimizer: torch.optim.Optimizer, batches: Iterable[Any],
                    micro_step: Callable[[Any], None]) -> FisherPass:
    """Runs `micro_step(batch)` (forward, backward, the strategy's unclipped step) for each batch
    with the optimizer's step accumulating the Fisher of the candidates; returns the pass for
    select_child."""
    if not candidate_params(optimizer):
        raise ValueError("Child-Tuning: the optimizer has no child_candidate param group; build the groups "
                         "with build_param_groups(..., child_tuning=True)")
    return fisher.run_fisher_pass(optimizer, batches, micro_step, _is_candidate_group)
