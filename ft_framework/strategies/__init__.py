"""Backends behind one interface: build_strategy(cfg) picks one from the config."""

from __future__ import annotations

from .base import Strategy
from .single import SingleDeviceStrategy

_SHARDED_LATER = ("deepspeed", "fsdp")


def build_strategy(strategy_cfg, training_cfg) -> Strategy:
    """The strategy named by `strategy.name`, set up for `training.precision` and `training.device`."""
    name = strategy_cfg.name
    if name == "single":
        return SingleDeviceStrategy(training_cfg.precision, training_cfg.device)
    if name == "ddp":
        from .ddp import DDPStrategy

        return DDPStrategy(training_cfg.precision, training_cfg.device)
    if name in _SHARDED_LATER:
        raise NotImplementedError(
            f"strategy {name!r} is not implemented in this version (sharded training is planned); "
            f"run on one device with the overrides `strategy.name=single strategy.{name}=null`, "
            f"or data-parallel with torchrun and `strategy.name=ddp strategy.{name}=null`")
    raise ValueError(f"unknown strategy {name!r}; valid: single, ddp, deepspeed, fsdp")


__all__ = ["Strategy", "SingleDeviceStrategy", "build_strategy"]
