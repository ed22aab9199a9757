"""A strategy's side of the sharded checkpoint layout: the ``ShardedCheckpointable`` object that
``Strategy.checkpointable()`` returns and ft_framework.checkpointing saves and loads.

Its defaults are those of replicated whole tensors (single device, DDP): every rank holds every
parameter whole and rank 0 writes it. A strategy that partitions or moves the state subclasses it
and overrides what differs (which fragments this rank holds, what to create before a load, what
to refresh after one, its engine's extra state, what the manifest records about the run).
"""

from __future__ import annotations

from typing import Any

import torch

from ft_framework.checkpointing import Fragment, ParamInfo, param_info, whole_tensor_fragments
from ft_framework.optim.base import AnchoredOptimizer, anchored_parameter_names

__all__ = ["StrategyCheckpoint"]


class StrategyCheckpoint:
    """The checkpoint view of `strategy` (built after its setup)."""

    def __init__(self, strategy: Any):
        self.strategy = strategy

    @property
    def name(self) -> str:
        return self.strategy.name

    @property
    def rank(self) -> int:
        return self.strategy.rank

    @property
    def world_size(self) -> int:
        return self.strategy.world_size

    def model(self) -> torch.nn.Module:
        """The unwrapped model: its persistent buffers and config go into the checkpoint."""
        return self.strategy.unwrapped_model()

    def params(self) -> list[ParamInfo]:
        """ParamInfo (name, full shape, dtype) of every model parameter, the same on every rank."""
        return [param_info(n, p) for n, p in self.model().named_parameters()]

    def fragments(self) -> list[Fragment]:
        """This rank's Fragments: 1-D views into the live master weights and optimizer state with
        their offsets in the flattened parameter. Saving writes those marked `write`; loading
        copies into all of them. Here: whole tensors, written by rank 0."""
        return whole_tensor_fragments(self.model().named_parameters(), self.strategy.optimizer,
                                      self.strategy.is_main_process)

    def anchored_names(self) -> set[str]:
        """Names of the parameters this run anchors, from the optimizer's groups; the same on every
        rank (a load checks the checkpoint's anchors against it before any rank reads anything)."""
        return anchored_parameter_names(self.strategy.optimizer)

    def prepare_load(self) -> None:
        """Creates the lazy optimizer state (step, moments) so every load target exists."""
        optimizer = self.strategy.optimizer
        if not isinstance(optimizer, AnchoredOptimizer):
            raise TypeError(f"{type(optimizer).__name__} has no init_state: checkpoints need an "
                            "ft_framework optimizer (ft_framework.optim)")
        for group in optimizer.param_groups:
            for p in group["params"]:
                if p.requires_grad:
                    optimizer.init_state(p)

    def after_load(self) -> None:
        """Refreshes what derives from the loaded masters (nothing for whole tensors)."""

    def extra_state(self) -> Any:
        """Small engine state that is not per parameter (the loss scaler), or None; restored
        only under the same strategy."""
        scaler = self.strategy.scaler
        return {"scaler": scaler.state_dict()} if scaler is not None else None

    def load_extra_state(self, state: Any) -> None:
        scaler = self.strategy.scaler
        if scaler is not None and state and "scaler" in state:
            scaler.load_state_dict(state["scaler"])

    def info(self) -> dict[str, Any]:
        """What the manifest records about the saving run (informative: loading never needs it)."""
        return {"precision": self.strategy.precision}
