"""Plain data parallelism (torch DistributedDataParallel): replicated parameters, one process per
device, started by torchrun (RANK / WORLD_SIZE / MASTER_ADDR in the environment)."""

from __future__ import annotations

import torch
from torch import nn

from ft_framework.distributed.process_group import ProcessGroupMixin
from ft_framework.strategies.single import SingleDeviceStrategy


class DDPStrategy(ProcessGroupMixin, SingleDeviceStrategy):
    name = "ddp"

    def __init__(self, precision: str = "fp32", device: str = "auto"):
        super().__init__(precision, device)
        self._join_process_group("ddp", "torchrun --nproc_per_node N launch/train.py --config ...")

    def setup(self, model: nn.Module, build_optimizer, anchors=None):
        model = model.to(self.device)
        ids = [self.device.index] if self.device.type == "cuda" else None
        self.model = nn.parallel.DistributedDataParallel(model, device_ids=ids)
        self.optimizer = build_optimizer(model)
        if anchors:
            self.place_anchors(anchors)  # replicated, like the parameters
        return self.model, self.optimizer

    def forward(self, batch: dict[str, torch.Tensor], last_micro_batch: bool = True):
        # DDP prepares its all-reduce at forward time: every micro-batch but the last of an
        # accumulation runs under no_sync, so its gradients add up locally and the step reduces once.
        if last_micro_batch or not torch.is_grad_enabled():
            return super().forward(batch)
        with self.model.no_sync():
            return super().forward(batch)

    def unwrapped_model(self) -> nn.Module:
        return self.model.module
