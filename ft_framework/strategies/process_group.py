"""What every multi-process strategy (DDP, DeepSpeed, FSDP) shares: joining the process group a
launcher (torchrun, the deepspeed launcher) describes in the environment, and the collectives the
trainer uses for evaluation and checkpoints."""

from __future__ import annotations

import os

import torch
import torch.distributed as dist


class ProcessGroupMixin:
    """Mix into a Strategy subclass (before it) and call `_join_process_group` in __init__."""

    def _join_process_group(self, strategy_name: str, launcher: str, init=None) -> None:
        if "RANK" not in os.environ or "WORLD_SIZE" not in os.environ:
            raise RuntimeError(f"strategy {strategy_name} needs a distributed launch (also for one process): "
                               f"{launcher}")
        if not dist.is_initialized():
            backend = "nccl" if self.device.type == "cuda" else "gloo"
            (init or (lambda b: dist.init_process_group(backend=b)))(backend)
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

    def close(self) -> None:
        if dist.is_initialized():
            dist.destroy_process_group()
