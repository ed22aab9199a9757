"""The importance of each pretrained element for the weighted pull toward theta*
(``optimizer.importance``; docs/forgetting_methods.md, "EWC"): the diagonal Fisher of theta*,
F_i = (1/B) sum over B batches of general text of g_i^2 (g: the gradient of the batch's mean
next-token loss), captured once before the first step, normalised over the whole model:

    F~ = F / mean(F),   mean over every anchored element of the model (all ranks, no padding)

so that mean(F~) = 1 and a pull coefficient keeps its meaning (RecAdam's gamma, prior_wd's decay,
EWC's lambda): the pull of element i is min(w * F~_i, 1) * (theta_i - theta*_i) (the step program
applies the clamp; optim/base.py's IMPORTANCE).

F~ is optimizer state (``state[p][IMPORTANCE]``, bf16), shaped and sharded like the anchor of every
anchored tensor (a DTensor shard under FSDP2, a flat partition under DeepSpeed ZeRO, a host master
under the offloads): saved, loaded and resharded with it, so a resume never captures it again
(``prepare_importance`` gives the load its targets).

The gradients are read where each strategy hands them to the optimizer (optim/fisher.py), so F is
the global batch's reduced gradient squared, whatever the strategy and number of ranks.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from typing import Any, Callable, Iterable, Mapping

import torch

from ft_framework.distributed import collectives
from ft_framework.errors import UserError
from ft_framework.optim.base import IMPORTANCE, anchored_parameter_names, local_tensor
from ft_framework.optim.fisher import FisherPass, run_fisher_pass

__all__ = ["IMPORTANCE", "IMPORTANCE_DTYPE", "ImportanceResult", "anchored_tensors", "capture_fisher",
           "holds_importance", "place_importance", "prepare_importance"]

# F~'s storage: 2 bytes per anchored element (the memory plan's row).
IMPORTANCE_DTYPE = torch.bfloat16


@dataclass(frozen=True)
class ImportanceResult:
    """What a run records about its importance (results.json "importance")."""

    batches: int
    tokens: int
    seconds: float
    anchored_elements: int
    mean_fisher: float       # mean(F) over the anchored elements, before the normalisation
    max_importance: float    # the largest F~ (bf16), over every rank

    def to_record(self) -> dict[str, Any]:
        return asdict(self)


def anchored_tensors(optimizer: torch.optim.Optimizer) -> list[torch.Tensor]:
    """The optimizer's tensors that hold theta* (whole parameters, DTensors, or ZeRO's flat
    partitions), read from its state: under ZeRO-3 the param groups are empty outside step()."""
    return [p for p, state in optimizer.state.items() if "anchor" in state]


def _anchored_group(group: dict[str, Any]) -> bool:
    return bool(group.get("anchored"))


def capture_fisher(optimizer: torch.optim.Optimizer, batches: Iterable[Any],
                   micro_step: Callable[[Any], None]) -> FisherPass:
    """The Fisher pass over `batches` (each through `micro_step`: forward, backward, the strategy's
    unclipped step) with the optimizer's step adding g^2 of every anchored tensor."""
    if not anchored_tensors(optimizer):
        raise ValueError("optimizer.importance: the optimizer holds no theta*, so there is nothing to weigh; "
                         "place the anchors first (Strategy.setup with anchors)")
    return run_fisher_pass(optimizer, batches, micro_step, _anchored_group)


def prepare_importance(optimizer: torch.optim.Optimizer) -> None:
    """An empty F~ for every anchored tensor, so that a checkpoint load has its targets (the load
    replaces them: a resume never runs a second Fisher pass)."""
    for p in anchored_tensors(optimizer):
        optimizer.state[p][IMPORTANCE] = torch.zeros_like(p, dtype=IMPORTANCE_DTYPE)


def holds_importance(optimizer: torch.optim.Optimizer) -> bool:
    """Whether this rank's F~ holds a non-zero element (after a checkpoint load: whether the
    checkpoint brought one; a captured F~ has mean 1, a checkpoint without one leaves the empty
    targets of prepare_importance at zero)."""
    return any(bool(local_tensor(s[IMPORTANCE]).any()) for s in optimizer.state.values() if IMPORTANCE in s)


@torch.no_grad()
def place_importance(fisher_pass: FisherPass, numel_of: Mapping[str, int], *, partitioned: bool,
                     tokens: int = 0, seconds: float = 0.0) -> ImportanceResult:
    """Puts F~ = F / mean(F) (bf16) into the state of every anchored tensor and drops the Fisher
    buffers. `numel_of`: each parameter's full element count by name (the mean's count N is that
    of the anchored parameters, so ZeRO's padding, whose g is 0, counts in neither sum nor N).
    `partitioned`: each rank holds a disjoint part of the state (ZeRO, FSDP2), so the sum and the
    maximum are all-reduced (collective: every rank calls this); under DDP every rank holds it whole.

    The sum is taken in float64; F~ = bf16(fp32(S) / fp32(S / N)), S = sum over batches of g^2 (the
    1/B of F cancels), rounded to nearest even."""
    optimizer = fisher_pass.optimizer
    count = sum(numel_of[name] for name in anchored_parameter_names(optimizer))
    sums = [f for _, f in fisher_pass.fisher.values()]
    if fisher_pass.batches and not sums:
        raise ValueError("optimizer.importance: the optimizer's step saw no gradient of an anchored parameter during "
                         "the Fisher pass; the strategy must step through the optimizer (Strategy.step_unclipped)")
    total = torch.zeros((), dtype=torch.float64)
    for f in sums:
        total += f.sum(dtype=torch.float64).cpu()
    if partitioned:
        total = collectives.all_reduce(total)
    total_sum = float(total)  # the same on every rank: each one decides alike below
    if not math.isfinite(total_sum):  # a NaN or an infinity anywhere reaches the sum
        raise UserError("optimizer.importance: the Fisher pass met a NaN or infinite gradient on the general text; "
                        "check the model and the text (optimizer.importance.source)")
    if not count or not total_sum > 0.0:
        raise UserError("optimizer.importance: the Fisher of theta* is zero on every anchored element (no gradient "
                        "reached them on the general text), so it cannot be normalised; give more text "
                        "(optimizer.importance.batches, source)")
    mean_sum = torch.tensor(total_sum / count, dtype=torch.float32)
    local_max = torch.zeros((), dtype=torch.float32)
    for p in anchored_tensors(optimizer):
        weight = torch.zeros_like(p, dtype=IMPORTANCE_DTYPE)  # a DTensor for a DTensor p: sharded like it
        entry = fisher_pass.fisher.pop(id(p), None)  # each sum dropped once its F~ is formed
        if entry is not None:
            normalised = entry[1].div(mean_sum.to(entry[1].device)).to(IMPORTANCE_DTYPE)
            local_tensor(weight).copy_(normalised.view_as(local_tensor(weight)))
            if normalised.numel():
                local_max = torch.maximum(local_max, normalised.max().float().cpu())
        optimizer.state[p][IMPORTANCE] = weight
    if partitioned:
        local_max = collectives.all_reduce(local_max, op="max")
    fisher_pass.fisher.clear()
    batches = max(1, fisher_pass.batches)
    return ImportanceResult(batches=fisher_pass.batches, tokens=int(tokens), seconds=round(float(seconds), 3),
                            anchored_elements=count, mean_fisher=total_sum / count / batches,
                            max_importance=float(local_max))

