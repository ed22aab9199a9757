"""Fully sharded data parallelism with PyTorch FSDP2 (`torch.distributed.fsdp.fully_shard`),
started by torchrun (RANK / WORLD_SIZE / MASTER_ADDR in the environment); gloo on CPU, nccl on CUDA.

    torchrun --nproc_per_node N launch/train.py --config configs/albert_xxl_recadam_fsdp.yaml

Every parameter becomes a DTensor sharded on dim 0 over all ranks. The optimizer is built on the
sharded parameters (after `fully_shard`), so the full fp32 theta* anchors it is given are sharded
like the parameters (`AnchoredOptimizer.set_anchor`) and its state (exp_avg, exp_avg_sq, anchor)
holds only this rank's shard. In the compact state (optimizer.state_dtype bfloat16) the delta master
and the bf16 anchor are sharded like the parameter too, and each shard's stochastic rounding is keyed
on its elements' indices in the full model (`number_local_pieces`). With `mixed_precision` the
sharded parameters stay fp32 (FSDP casts them to bf16/fp16 only for compute and reduces gradients
in fp32), so theta* stays exact. With `cpu_offload` sharded parameters, gradients and optimizer
state live on the CPU, where the optimizer runs the C++ kernel on the local fp32 shards.

Checkpoints are the layout every strategy shares (ft_framework/checkpointing): every rank writes
its DTensor shards of the master weights, moments and anchors through torch.distributed.checkpoint,
and the checkpoint loads under any strategy and number of ranks; a checkpoint whose anchors are
missing or mis-shaped is refused before anything is loaded.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from ft_framework.checkpointing import dtensor_fragments, dtensor_shard_offset
from ft_framework.distributed import collectives
from ft_framework.models.blocks import transformer_block_lists
from ft_framework.optim.base import AnchoredOptimizer, local_tensor
from ft_framework.strategies.base import Strategy
from ft_framework.strategies.checkpointable import StrategyCheckpoint
from ft_framework.distributed.process_group import ProcessGroupMixin

_MP_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}


def _cfg(obj, key: str, default):
    return getattr(obj, key, default) if obj is not None else default


class _ShardedLossScaler:
    """Dynamic loss scaling for fp16 on sharded gradients: each rank checks its own gradient shards
    for inf/nan and one all-reduce (MAX) makes every rank skip or take the step together.

    torch's GradScaler cannot do this: it looks for inf/nan per device on its own rank only, and
    under CPU offload the sharded gradients are CPU tensors it does not unscale."""

    def __init__(self, init_scale: float = 2.0 ** 16, growth_interval: int = 2000):
        self.scale = float(init_scale)
        self.growth_interval = growth_interval
        self.good_steps = 0

    def scale_loss(self, loss: torch.Tensor) -> torch.Tensor:
        return loss * self.scale

    def unscale_(self, grads: list[torch.Tensor]) -> bool:
        """Unscales the local gradient shards in place; True when any rank found inf/nan."""
        # One flag per device, read once: a per-tensor bool() would wait on the GPU for every tensor.
        by_device: dict[torch.device, list[torch.Tensor]] = {}
        for g in grads:
            if g.numel():
                by_device.setdefault(g.device, []).append(torch.isfinite(g).all().logical_not())
        found = torch.zeros((), dtype=torch.float32)
        for flags in by_device.values():
            found = torch.maximum(found, torch.stack(flags).any().float().cpu())
        found = collectives.all_reduce(found, op="max")
        if float(found):
            return True
        inv = 1.0 / self.scale
        for g in grads:
            g.mul_(inv)
        return False

    def update(self, found_inf: bool) -> None:
        if found_inf:
            self.scale *= 0.5
            self.good_steps = 0
        else:
            self.good_steps += 1
            if self.good_steps >= self.growth_interval:
                self.scale *= 2.0
                self.good_steps = 0

    def state_dict(self) -> dict[str, Any]:
        return {"scale": self.scale, "good_steps": self.good_steps}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.scale, self.good_steps = float(state["scale"]), int(state["good_steps"])


def number_local_pieces(optimizer: torch.optim.Optimizer) -> None:
    """The compact state (optimizer.state_dtype bfloat16) keys v's stochastic rounding on each
    element's index in the full model (optim/compact.py), so that the ranks round as one process
    would: the optimizer learns where each sharded parameter's local piece starts inside it."""
    if not (isinstance(optimizer, AnchoredOptimizer) and optimizer.compact):
        return
    for p in (p for g in optimizer.param_groups for p in g["params"]):
        if hasattr(p, "device_mesh"):
            optimizer.set_shard_offset(p, dtensor_shard_offset(p))


class FSDPStrategy(ProcessGroupMixin, Strategy):
    """FSDP2: sharded parameters, gradients and optimizer state (anchors included)."""

    name = "fsdp"

    def __init__(self, fsdp_cfg=None, training_cfg=None):
        precision = _cfg(training_cfg, "precision", "fp32")
        super().__init__(precision, _cfg(training_cfg, "device", "auto"))
        self.cpu_offload = bool(_cfg(fsdp_cfg, "cpu_offload", False))
        self.mixed_precision = bool(_cfg(fsdp_cfg, "mixed_precision", False))
        if self.mixed_precision and precision not in _MP_DTYPES:
            raise ValueError(f"strategy.fsdp.mixed_precision needs training.precision bf16 or fp16 (got {precision})")
        self._join_process_group("fsdp", "torchrun --nproc_per_node N launch/train.py --config ...")
        from torch.distributed.device_mesh import init_device_mesh

        self.mesh = init_device_mesh(self.device.type, (self._world_size,))
        # fp16 gradients need loss scaling (on CUDA only: the base class refuses fp16 on CPU).
        self.scaler = _ShardedLossScaler() if precision == "fp16" else None
        self.sharded_module_names: list[str] = []

    # ---- topology --------------------------------------------------------------------------
    @property
    def optimizer_state_is_partitioned(self) -> bool:
        return True

    # ---- setup -------------------------------------------------------------------------------
    def setup(self, model: nn.Module, build_optimizer, anchors=None):
        from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, OffloadPolicy, fully_shard

        if self.mixed_precision:
            # The sharded parameters are the fp32 master weights; FSDP casts them for compute.
            model = model.to(torch.float32)
        model = model.to(self.device)
        mp = (MixedPrecisionPolicy(param_dtype=_MP_DTYPES[self.precision], reduce_dtype=torch.float32)
              if self.mixed_precision else MixedPrecisionPolicy())
        offload = CPUOffloadPolicy(pin_memory=self.device.type == "cuda") if self.cpu_offload else OffloadPolicy()
        kwargs = dict(mesh=self.mesh, mp_policy=mp, offload_policy=offload)
        self.sharded_module_names = []
        # Each transformer block is its own FSDP unit (models/blocks.py: the same blocks that
        # activation checkpointing, applied before this, recomputes).
        for list_name, blocks in transformer_block_lists(model):
            for i, block in enumerate(blocks):
                fully_shard(block, **kwargs)
                self.sharded_module_names.append(f"{list_name}.{i}")
        fully_shard(model, **kwargs)
        self.sharded_module_names.append("")
        self.model = model
        # Built on the sharded (DTensor) parameters; place_anchors then shards the full fp32 theta*
        # like each parameter, locally on every rank (set_anchor), keeping only this rank's shard.
        self.optimizer = build_optimizer(model)
        number_local_pieces(self.optimizer)
        if anchors:
            self.place_anchors(anchors)
        return self.model, self.optimizer

    # ---- the step ----------------------------------------------------------------------------
    def backward(self, loss: torch.Tensor, last_micro_batch: bool = True) -> None:
        (self.scaler.scale_loss(loss) if self.scaler else loss).backward()

    def _grad_params(self) -> list[torch.Tensor]:
        return [p for g in self.optimizer.param_groups for p in g["params"] if p.grad is not None]

    def grad_norm_(self, max_grad_norm: float | None, grads: list[torch.Tensor], replicated: list[bool]) -> float:
        """The global L2 norm of the gradients (each rank sums its shards, one all-reduce), and
        clipping like torch.nn.utils.clip_grad_norm_. Works where DTensor's clip_grad_norm_ cannot
        (CPU-offloaded gradients with nccl)."""
        sq = torch.zeros((), dtype=torch.float32)
        for g, rep in zip(grads, replicated):
            if rep and self.rank != 0:
                continue  # a replicated gradient is counted once
            if g.numel():
                sq += torch.linalg.vector_norm(g, 2, dtype=torch.float32).cpu().square()
        total = collectives.all_reduce(sq).sqrt()
        if max_grad_norm:
            coef = torch.clamp(max_grad_norm / (total + 1e-6), max=1.0)
            for g in grads:
                g.mul_(coef.to(device=g.device, dtype=g.dtype))
        return float(total)

    def clip_and_step(self, max_grad_norm: float | None) -> float:
        params = self._grad_params()
        grads = [local_tensor(p.grad) for p in params]
        replicated = [not hasattr(p.grad, "device_mesh") for p in params]
        found_inf = self.scaler.unscale_(grads) if self.scaler else False
        if found_inf:
            norm = float("inf")
        else:
            norm = self.grad_norm_(max_grad_norm, grads, replicated)
            self.optimizer.step()
        if self.scaler:
            self.scaler.update(found_inf)
        self.optimizer.zero_grad(set_to_none=True)
        return norm

    # ---- checkpoints -------------------------------------------------------------------------
    # The base class's save/load (ft_framework/checkpointing) with this rank's DTensor shards: the
    # local piece of a Shard(0) parameter is a contiguous range of the flattened full tensor, so
    # each rank writes its pieces of the master, moments and anchor at their offsets.
    def _sharded_named_parameters(self) -> list:
        """The model's parameters as the sharded DTensors the optimizer holds. After a forward
        without backward (evaluation) FSDP2 keeps the root module's parameters unsharded, and
        named_parameters() would return those: reshard first (local, no communication). This also
        makes the next forward gather the values a load wrote into the shards."""
        from torch.distributed.fsdp import FSDPModule

        for module in self.model.modules():
            if isinstance(module, FSDPModule):
                module.reshard()
        return list(self.model.named_parameters())

    def checkpointable(self) -> "_FSDPCheckpoint":
        return _FSDPCheckpoint(self)

    # ---- export ------------------------------------------------------------------------------
    def full_state_dict(self) -> dict[str, torch.Tensor]:
        """The full (unsharded) model state dict as CPU tensors on every rank, gathered one
        tensor at a time (peak extra device memory: one full tensor). Every rank must call it."""
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

        sharded = get_model_state_dict(self.model, options=StateDictOptions(full_state_dict=False))
        out = {}
        for name, value in sharded.items():
            if hasattr(value, "full_tensor"):
                device = collectives.group_device()
                if local_tensor(value).device != device:  # a CPU-offloaded shard under nccl
                    value = value.to(device)
                value = value.full_tensor()
            out[name] = value.detach().cpu()
        return out


class _FSDPCheckpoint(StrategyCheckpoint):
    """Each rank's shards of the DTensor parameters and their state (and the loss scaler)."""

    def fragments(self) -> list:
        s = self.strategy
        return dtensor_fragments(s._sharded_named_parameters(), s.optimizer, s.is_main_process)

    def info(self) -> dict[str, Any]:
        return {**super().info(), "cpu_offload": self.strategy.cpu_offload,
                "mixed_precision": self.strategy.mixed_precision}
