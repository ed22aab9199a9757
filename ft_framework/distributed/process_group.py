"""What every multi-process strategy (DDP, DeepSpeed, FSDP) shares: joining the process group a
launcher (torchrun, the deepspeed launcher, srun: distributed/slurm_env.py) describes in the environment, and the collectives the
trainer uses for evaluation and checkpoints (made through ft_framework.distributed.collectives)."""

from __future__ import annotations

import os

import torch
import torch.distributed as dist

from ft_framework.distributed import collectives
from ft_framework.distributed.rendezvous import join_process_group
from ft_framework.distributed.slurm_env import adopt_slurm_launch


class ProcessGroupMixin:
    """Mix into a Strategy subclass (before it) and call `_join_process_group` in __init__."""

    def _join_process_group(self, strategy_name: str, launcher: str, init=None) -> None:
        adopt_slurm_launch()  # a task of srun (no torchrun): RANK and the rest from SLURM's variables
        if "RANK" not in os.environ or "WORLD_SIZE" not in os.environ:
            raise RuntimeError(f"strategy {strategy_name} needs a distributed launch (also for one process): "
                               f"{launcher}")
        if self.device.type == "cuda":
            # Before the process group exists: nccl binds each rank's communicator to the current
            # device, and a rank that has not chosen one talks from cuda:0 (every rank on one GPU).
            local_rank = int(os.environ.get("LOCAL_RANK", 0))
            torch.cuda.set_device(local_rank)
            self.device = torch.device("cuda", local_rank)
        if not dist.is_initialized():
            backend = "nccl" if self.device.type == "cuda" else "gloo"
            self._init_process_group(backend)
            if init is not None:
                init(backend)  # a library's own set-up (deepspeed.init_distributed) adopts the group
        # Cached: the trainer still asks for them after close() has destroyed the process group.
        self._rank, self._world_size = dist.get_rank(), dist.get_world_size()

    def _init_process_group(self, backend: str) -> None:
        # device_id binds the nccl communicator to this rank's GPU right away (eager init). The
        # rendezvous is bounded (FT_RENDEZVOUS_TIMEOUT_S) and fails in one line (rendezvous.py).
        kwargs = {"device_id": self.device} if backend == "nccl" else {}
        join_process_group(backend, **kwargs)

    @property
    def rank(self) -> int:
        return self._rank

    @property
    def world_size(self) -> int:
        return self._world_size

    def barrier(self) -> None:
        collectives.barrier()

    def gather_objects(self, obj):
        return collectives.all_gather_object(obj)

    def close(self) -> None:
        if dist.is_initialized():
            dist.destroy_process_group()
