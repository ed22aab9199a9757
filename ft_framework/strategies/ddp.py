"""Plain data parallelism (torch DistributedDataParallel): replicated parameters, one process per
device, started by torchrun (RANK / WORLD_SIZE / MASTER_ADDR in the environment)."""

from __future__ import annotations

import os

import torch
import torch.distributed as dist
from torch import nn

from .single import SingleDeviceStrategy


class DDPStrategy(SingleDeviceStrategy):
    name = "ddp"

    def __init__(self, precision: str = "fp32", device: str = "auto"):
        if "RANK" not in os.environ or "WORLD_SIZE" not in os.environ:
            raise RuntimeError("strategy ddp needs a distributed launch: "
                               "torchrun --nproc_per_node N launch/train.py --config ...")
        super().__init__(precision, device)
        if not dist.is_initialized():
            backend = "nccl" if self.device.type == "cuda" else "gloo"
            dist.init_process_group(backend=backend)
        # Cached: the trainer still asks for them after close() has destroyed the process group.
        self._rank, self._world_size = dist.get_rank(), dist.get_world_size()
        if self.device.type == "cuda":
            local_rank = int(os.environ.get("LOCAL_RANK", 0))
            torch.cuda.set_device(local_rank)
            self.device = torch.device("cuda", local_rank)

    @property
    def rank(self) -> int:
        return self._rank

    @property
    def world_size(self) -> int:
        return self._world_size

    def barrier(self) -> None:
        dist.barrier()

    def gather_objects(self, obj):
        out = [None] * self.world_size
        dist.all_gather_object(out, obj)
        return out

    def broadcast_object(self, obj):
        box = [obj]
        dist.broadcast_object_list(box, src=0)
        return box[0]

    def setup(self, model: nn.Module, build_optimizer):
        model = model.to(self.device)
        ids = [self.device.index] if self.device.type == "cuda" else None
        self.model = nn.parallel.DistributedDataParallel(model, device_ids=ids)
        self.optimizer = build_optimizer(model)
        return self.model, self.optimizer

    def unwrapped_model(self) -> nn.Module:
        return self.model.module

    def load_checkpoint(self, directory):
        super().load_checkpoint(directory)
        self.barrier()

    def close(self) -> None:
        if dist.is_initialized():
            dist.destroy_process_group()
