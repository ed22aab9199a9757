"""One process, one device (CPU or one GPU)."""

from __future__ import annotations

import torch
from torch import nn

from ft_framework.strategies.base import Strategy


class SingleDeviceStrategy(Strategy):
    name = "single"

    def __init__(self, precision: str = "fp32", device: str = "auto"):
        super().__init__(precision, device)
        # fp16 needs loss scaling; bf16 and fp32 do not.
        self.scaler = torch.amp.GradScaler("cuda") if precision == "fp16" else None

    def setup(self, model: nn.Module, build_optimizer, anchors=None):
        self.model = model.to(self.device)
        self.optimizer = build_optimizer(self.model)
        if anchors:
            self.place_anchors(anchors)
        return self.model, self.optimizer

    def backward(self, loss: torch.Tensor, last_micro_batch: bool = True) -> None:
        (self.scaler.scale(loss) if self.scaler else loss).backward()

    def _grad_params(self):
        return [p for p in self.model.parameters() if p.grad is not None]

    def clip_and_step(self, max_grad_norm: float | None) -> float:
        if self.scaler:
            self.scaler.unscale_(self.optimizer)
        params = self._grad_params()
        limit = max_grad_norm if max_grad_norm else float("inf")
        norm = torch.nn.utils.clip_grad_norm_(params, limit) if params else torch.zeros(())
        if self.scaler:
            self.scaler.step(self.optimizer)
            self.scaler.update()
        else:
            self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        return float(norm)
