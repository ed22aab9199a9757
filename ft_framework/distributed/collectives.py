"""Every torch.distributed collective the library makes goes through this module.

Backends take tensors on one kind of device only: nccl communicates CUDA tensors of the process's
own device, gloo CPU tensors. Optimizer state under offload, telemetry sums and loss-scaler flags
live on the CPU, model shards on the GPU, so a collective called directly on "the tensor at hand"
works with gloo on a laptop and stops under nccl on a cluster. Here each collective moves its
tensor to the process group's communication device and gives the result back on the device the
tensor came from. tests/unit/distributed/test_collectives.py walks the package's syntax tree and fails on a
collective called anywhere else.

Setting up and tearing down the process group (init_process_group, destroy_process_group) and
asking about it (get_rank, get_backend) are not collectives and stay with their callers.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

_OPS = {"sum": dist.ReduceOp.SUM, "max": dist.ReduceOp.MAX, "min": dist.ReduceOp.MIN}


def communication_device(backend: str, local_device_index: int | None) -> torch.device:
    """The device a backend communicates tensors on: the local CUDA device (index
    `local_device_index`, i.e. torch.cuda.current_device() after set_device) for nccl, the CPU for
    gloo and mpi. A pure function of its arguments, so it is testable without a GPU."""
    name = str(backend).lower()
    if "nccl" in name:
        if local_device_index is None:
            raise ValueError("backend nccl communicates CUDA tensors but no local CUDA device is set: call "
                             "torch.cuda.set_device(LOCAL_RANK) before the first collective")
        return torch.device("cuda", int(local_device_index))
    if name in ("gloo", "mpi"):
        return torch.device("cpu")
    raise ValueError(f"unknown torch.distributed backend {backend!r}; ft_framework knows nccl, gloo and mpi")


def group_device(group=None) -> torch.device:
    """The communication device of `group` (default: the world) in this process."""
    backend = dist.get_backend(group)
    index = torch.cuda.current_device() if "nccl" in str(backend).lower() and torch.cuda.is_available() else None
    return communication_device(backend, index)


def is_distributed() -> bool:
    return dist.is_available() and dist.is_initialized()


def all_reduce_(tensor: torch.Tensor, op: str = "sum", group=None) -> torch.Tensor:
    """Reduces `tensor` over `group` in place (op: sum, max or min) and returns it. When it lives
    elsewhere than the communication device, a copy travels and the result is copied back."""
    if op not in _OPS:
        raise ValueError(f"unknown reduce op {op!r}; valid: {', '.join(_OPS)}")
    device = group_device(group)
    buf = tensor if tensor.device == device else tensor.to(device)
    dist.all_reduce(buf, op=_OPS[op], group=group)
    if buf is not tensor:
        tensor.copy_(buf)
    return tensor


def all_reduce(tensor: torch.Tensor, op: str = "sum", group=None) -> torch.Tensor:
    """The reduction of `tensor` over `group` as a new tensor on `tensor`'s device (the input is
    left as it is)."""
    return all_reduce_(tensor.clone(), op=op, group=group)


def all_gather_object(obj: Any, group=None) -> list[Any]:
    """Every rank's picklable `obj`, in rank order. (torch serializes through a tensor on the
    current CUDA device for nccl, which is why set_device must come first.)"""
    out: list[Any] = [None] * dist.get_world_size(group)
    dist.all_gather_object(out, obj, group=group)
    return out


def barrier(group=None) -> None:
    """Waits for every rank. Under nccl the barrier names the local device, so it cannot pick a
    wrong one (torch warns and guesses when it is not told)."""
    device = group_device(group)
    if device.type == "cuda":
        dist.barrier(group=group, device_ids=[device.index])
    else:
        dist.barrier(group=group)


def any_rank_flag(value: int) -> int:
    """The largest of the ranks' `value` (0: none set a flag). One small all-reduce: the ranks use
    it at a step boundary to agree that one of them was asked to stop (run/signals.py)."""
    return int(all_reduce(torch.tensor([int(value)], dtype=torch.int64), op="max").item())
