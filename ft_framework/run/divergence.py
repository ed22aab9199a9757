"""The divergence guard: a non-finite loss or gradient norm stops the run.

After every optimizer step the trainer asks :meth:`DivergenceGuard.check` whether this step's
loss (this rank's micro-batches) or the gradient norm is NaN or infinite. Under fp16 an infinite
gradient norm is the loss scaler's business (it skips that step and lowers the scale), so there
only the loss counts. Under sharding every
rank reduces one flag, so all ranks stop at the same step. A diverged run writes results.json with
``"diverged": {"step": ..., "what": ...}`` and ``"failed": true`` and exits with
:data:`~ft_framework.run.failures.EXIT_DIVERGED`, distinct from a crash (1) and a user error (2).
"""

from __future__ import annotations

import math
from typing import Any

import torch

from ft_framework.distributed import collectives

__all__ = ["DivergenceGuard", "describe"]


def _finite(value: Any) -> bool:
    return value is None or math.isfinite(float(value))


def describe(loss_bad: bool, grad_bad: bool, loss: Any = None, grad_norm: Any = None) -> str:
    """``"loss is nan"``, ``"gradient norm is inf"``, ... (values shown when this rank has them)."""
    parts = []
    if loss_bad:
        parts.append(f"loss is {float(loss)}" if loss is not None and not _finite(loss) else "loss is not finite")
    if grad_bad:
        parts.append(f"gradient norm is {float(grad_norm)}" if grad_norm is not None and not _finite(grad_norm)
                     else "gradient norm is not finite")
    return " and ".join(parts)


class DivergenceGuard:
    """Checks one step; all ranks of a sharded run agree through one reduced flag."""

    def __init__(self, strategy):
        self.strategy = strategy
        # fp16 trains with a loss scaler: overflowing gradients are expected and skipped, not divergence.
        self.check_grad_norm = getattr(strategy, "precision", "fp32") != "fp16"

    def _agree(self, flags: list[int]) -> list[int]:
        """Element-wise max of `flags` over ranks (one small collective per step)."""
        if self.strategy.world_size <= 1:
            return flags
        return [int(v) for v in collectives.all_reduce(torch.tensor(flags, dtype=torch.int32), op="max").tolist()]

    def check(self, step: int, loss: Any, grad_norm: Any) -> dict[str, Any] | None:
        """None while training is finite, else ``{"step": step, "what": "loss is nan"}``.
        `loss` is this rank's loss sum since the last log line (finite until this step)."""
        grad_flag = int(self.check_grad_norm and not _finite(grad_norm))
        loss_bad, grad_bad = self._agree([int(not _finite(loss)), grad_flag])
        if not (loss_bad or grad_bad):
            return None
        return {"step": int(step), "what": describe(bool(loss_bad), bool(grad_bad), loss, grad_norm)}
