"""The one interface the trainer talks to; each backend (single device, DDP, DeepSpeed, FSDP)
implements it, so the training loop never branches on the backend."""

from __future__ import annotations

import contextlib
from abc import ABC, abstractmethod
from pathlib import Path
from typing import Any, Iterable, Mapping

import torch
from torch import nn

from ft_framework.checkpointing import load_sharded, save_sharded
from ft_framework.errors import UserError
from ft_framework.models.loading import share_mixout_targets
from ft_framework.optim.base import anchored_parameter_names
from ft_framework.strategies.checkpointable import StrategyCheckpoint


def anchors_for(optimizer: torch.optim.Optimizer, anchors: Mapping[str, torch.Tensor],
                known: Iterable[str]) -> set[str]:
    """The names to anchor: those of `optimizer`'s anchored groups (decided by build_param_groups,
    carried by each group). Every one must have theta* in `anchors`, and `anchors` must not name a
    parameter outside `known` (the model's parameter names)."""
    unknown = sorted(set(anchors) - set(known))
    if unknown:
        raise ValueError(f"anchors for parameters the model does not have: {unknown[:5]}; "
                         "pass the pretrained state of this model")
    wanted = anchored_parameter_names(optimizer)
    if anchors and not wanted:
        raise ValueError("the optimizer has no anchored param group, so theta* has nowhere to go; build the groups "
                         "with build_param_groups(model, pretrained_state, ..., attach_anchors=False)")
    missing = sorted(wanted - set(anchors))
    if missing:
        raise ValueError(f"no theta* given for anchored parameters {missing[:5]} ({len(missing)} in all); pass the "
                         "pretrained state the param groups were built from")
    return wanted


def place_anchors(model: nn.Module, optimizer: torch.optim.Optimizer, anchors: Mapping[str, torch.Tensor]) -> None:
    """theta* into `optimizer`'s state after the model was wrapped (Strategy.place_anchors; also
    used as is after ``accelerator.prepare``): each parameter of the optimizer's anchored groups
    gets its anchor, sharded like the parameter for DTensors."""
    named = dict(model.named_parameters())
    wanted = anchors_for(optimizer, anchors, named)
    for name, p in named.items():  # in the model's order: the state's order fixes the order of sums over it
        if name in wanted:
            optimizer.set_anchor(p, anchors[name], copy=False)
    mixout_reads_anchors(model, optimizer)


def mixout_reads_anchors(model: nn.Module, optimizer: torch.optim.Optimizer) -> None:
    """Mixout mixes toward θ* too: each Mixout module whose weight has an anchor in `optimizer`
    reads it from now on (the current one: a checkpoint load may replace the tensor), so θ* is
    kept once (sharded under FSDP2, fp32 under a 16-bit model) instead of again in each module."""

    def reader(p: torch.Tensor):
        if "anchor" not in optimizer.state.get(p, {}):
            return None
        return lambda: optimizer.state[p]["anchor"]

    share_mixout_targets(model, reader)


class Strategy(ABC):
    """Owns device placement, the wrapped model and optimizer, backward/step, and checkpoints."""

    name: str = "base"

    def __init__(self, precision: str = "fp32", device: str = "auto"):
        self.precision = precision
        self.device = self._pick_device(device)
        self.model: nn.Module | None = None
        self.optimizer: torch.optim.Optimizer | None = None
        self.scaler: Any = None  # the fp16 loss scaler of the strategies that need one
        if precision == "fp16" and self.device.type != "cuda":
            raise UserError("training.precision fp16 needs a CUDA device (with a loss scaler); "
                            "use bf16 or fp32 on CPU")

    # ---- process topology ------------------------------------------------------------------
    @property
    def rank(self) -> int:
        return 0

    @property
    def world_size(self) -> int:
        return 1

    @property
    def is_main_process(self) -> bool:
        return self.rank == 0

    @property
    def optimizer_state_is_partitioned(self) -> bool:
        """True when each rank's optimizer holds a disjoint part of the state, anchors included
        (ZeRO, FSDP): sums over it (the forgetting distance) need an all-reduce."""
        return False

    def barrier(self) -> None:
        pass

    def gather_objects(self, obj: Any) -> list[Any]:
        """Every rank's `obj`, in rank order (a one-element list without distribution)."""
        return [obj]

    # ---- setup -------------------------------------------------------------------------------
    @staticmethod
    def _pick_device(device: str) -> torch.device:
        if device == "auto":
            return torch.device("cuda" if torch.cuda.is_available() else "cpu")
        if device == "cuda" and not torch.cuda.is_available():
            raise UserError("training.device is 'cuda' but no CUDA device is available; use 'auto' or 'cpu'")
        return torch.device(device)

    @abstractmethod
    def setup(self, model: nn.Module, build_optimizer,
              anchors: Mapping[str, torch.Tensor] | None = None) -> tuple[nn.Module, torch.optim.Optimizer]:
        """Places/wraps the model, builds the optimizer with `build_optimizer(model)` (param groups
        without anchors), then places theta* with `place_anchors(anchors)` when given.

        `anchors` maps parameter names to the full pretrained values (fp32); the strategy takes the
        tensors over, so the caller should drop its reference afterwards (under ZeRO/FSDP each
        rank then keeps only its own part of theta*)."""

    def place_anchors(self, anchors: Mapping[str, torch.Tensor]) -> None:
        """Puts theta* into the optimizer state, once, after wrapping: each parameter of the
        optimizer's anchored groups gets its anchor (sharded like the parameter for DTensors).
        Names of parameters the optimizer does not hold (frozen ones) are skipped, as
        build_param_groups skips them."""
        place_anchors(self.unwrapped_model(), self.optimizer, anchors)

    # ---- the step ------------------------------------------------------------------------------
    def autocast(self):
        if self.precision == "fp32":
            return contextlib.nullcontext()
        dtype = torch.bfloat16 if self.precision == "bf16" else torch.float16
        return torch.autocast(device_type=self.device.type, dtype=dtype)

    def forward(self, batch: dict[str, torch.Tensor], last_micro_batch: bool = True):
        """One micro-batch's forward. `last_micro_batch`: whether its backward ends the
        accumulation (DDP decides at forward time whether that backward all-reduces)."""
        with self.autocast():
            return self.model(**batch)

    @abstractmethod
    def backward(self, loss: torch.Tensor, last_micro_batch: bool = True) -> None:
        """Back-propagates one micro-batch's loss (already divided by the accumulation count: the
        trainer owns that count). `last_micro_batch` says whether the next clip_and_step follows;
        strategies that reduce gradients at the end of the accumulation use it."""

    @abstractmethod
    def clip_and_step(self, max_grad_norm: float | None) -> float:
        """Clips gradients (when max_grad_norm is set), steps the optimizer, zeroes gradients;
        returns the gradient norm before clipping."""

    def step_unclipped(self) -> None:
        """clip_and_step without clipping, whatever the config says: the optimizer's step receives
        this accumulation's reduced gradients as they are (Child-Tuning's Fisher pass reads them
        there), and they are zeroed after."""
        self.clip_and_step(None)

    def unwrapped_model(self) -> nn.Module:
        return self.model

    def forgetting_distance(self) -> float | None:
        """||theta - theta*||_2 over the anchored parameters, summed over shards when sharded."""
        if not hasattr(self.optimizer, "forgetting_distance"):
            return None
        return self.optimizer.forgetting_distance(all_reduce=self.optimizer_state_is_partitioned)

    def train_metrics(self) -> dict[str, Any]:
        """Counters of the strategy's own that go into each train record of metrics.jsonl."""
        return {}

    def current_lambdas(self) -> list[float | None] | None:
        return self.optimizer.current_lambdas() if hasattr(self.optimizer, "current_lambdas") else None

    # ---- checkpoints (atomic directory writes are the trainer's job) --------------------------
    # One layout for every strategy (ft_framework/checkpointing): per parameter name, the fp32
    # master, every optimizer-state tensor (moments, anchor) and the step, each rank writing the
    # fragments it holds with their offsets. What a strategy holds is said by one object.
    def checkpointable(self) -> StrategyCheckpoint:
        """This strategy's side of the checkpoint layout (replicated whole tensors here)."""
        return StrategyCheckpoint(self)

    def save_checkpoint(self, directory: Path, tokenizer: Any = None) -> None:
        """Writes model and optimizer state into `directory`: every rank its own fragments, in
        parallel (collective). `tokenizer` is saved with the model's config so that the
        checkpoint exports offline (ft-export)."""
        save_sharded(directory, self.checkpointable(), tokenizer=tokenizer)

    def load_checkpoint(self, directory: Path) -> None:
        """Restores model and optimizer state from a checkpoint saved under any strategy and number
        of ranks, each rank reading only the saved fragments that overlap its own (collective)."""
        load_sharded(directory, self.checkpointable())

    def close(self) -> None:
        pass
