"""The diagonal Fisher of the model as it is, read where every strategy hands the gradients over: in
the optimizer's step. Child-Tuning's child network (optim/child_tuning.py) and the importance of
the weighted pull toward theta* (optim/importance.py) both read it.

While a ``FisherPass`` is active, the optimizer's ``step()`` and ``step_tensors()`` hand each
(tensor, gradient, param group) to it instead of stepping (no step count moves, nothing is
written), and it adds g^2 (fp32, per element) of every tensor of the groups it selects to a buffer
of its own. So g is the global micro-batch's reduced gradient as the strategy delivers it: whole
under one process and DDP, a flat partition under DeepSpeed ZeRO (its padding has g = 0), a
DTensor shard under FSDP2, the host gradient of a master under the single strategy's offload.

    with FisherPass(optimizer, selects=lambda group: group["anchored"]) as fisher:
        for batch in batches:
            micro_step(batch)          # forward, backward, Strategy.step_unclipped
            fisher.batches += 1
    fisher.fisher                      # id(tensor) -> (tensor, sum over batches of g^2)
"""

from __future__ import annotations

from typing import Any, Callable, Iterable

import torch

from ft_framework.optim.base import local_tensor

__all__ = ["FisherPass", "run_fisher_pass"]


class FisherPass:
    """While active, the optimizer's step adds g^2 (fp32, per element) of each tensor of the param
    groups `selects` accepts to a buffer kept here (not in the optimizer state: its owner turns it
    into what it keeps, and drops it)."""

    def __init__(self, optimizer: torch.optim.Optimizer, selects: Callable[[dict[str, Any]], bool]):
        self.optimizer = optimizer
        self.selects = selects
        self.fisher: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}  # id(p) -> (p, F)
        self.batches = 0  # counted by the caller: ZeRO calls step() once per param group (or sub-group)

    def __enter__(self) -> "FisherPass":
        if getattr(self.optimizer, "gradient_sink", None) is not None:
            raise RuntimeError("a Fisher pass is already reading this optimizer's gradients")
        self.optimizer.gradient_sink = self._accumulate
        return self

    def __exit__(self, *exc) -> None:
        self.optimizer.gradient_sink = None

    @torch.no_grad()
    def _accumulate(self, arrivals: Iterable[tuple[torch.Tensor, torch.Tensor | None, dict[str, Any]]]) -> None:
        for p, grad, group in arrivals:
            if grad is None or not self.selects(group):
                continue
            g = local_tensor(grad).float()
            if id(p) not in self.fisher:
                self.fisher[id(p)] = (p, torch.zeros_like(g, dtype=torch.float32))
            self.fisher[id(p)][1].addcmul_(g, g)


def run_fisher_pass(optimizer: torch.optim.Optimizer, batches: Iterable[Any], micro_step: Callable[[Any], None],
                    selects: Callable[[dict[str, Any]], bool]) -> FisherPass:
    """Runs `micro_step(batch)` (forward, backward, the strategy's unclipped step) for each batch
    with the optimizer's step accumulating the Fisher of the groups `selects` accepts."""
    with FisherPass(optimizer, selects) as fisher_pass:
        for batch in batches:
            micro_step(batch)
            fisher_pass.batches += 1
    return fisher_pass
