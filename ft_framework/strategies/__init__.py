"""Backends behind one interface: build_strategy(cfg) picks one from the config."""

from __future__ import annotations

from ft_framework.strategies.base import Strategy
from ft_framework.strategies.single import SingleDeviceStrategy



def build_strategy(strategy_cfg, training_cfg) -> Strategy:
    """The strategy named by `strategy.name`, set up for `training.precision` and `training.device`."""
    name = strategy_cfg.name
    if name == "single":
        return SingleDeviceStrategy(training_cfg.precision, training_cfg.device)
    if name == "ddp":
        from ft_framework.strategies.ddp import DDPStrategy

        return DDPStrategy(training_cfg.precision, training_cfg.device)
    if name == "deepspeed":
        from ft_framework.strategies.deepspeed import DeepSpeedStrategy

        return DeepSpeedStrategy(strategy_cfg.deepspeed, training_cfg)
    if name == "fsdp":
        from ft_framework.strategies.fsdp import FSDPStrategy

        return FSDPStrategy(strategy_cfg.fsdp, training_cfg)
    raise ValueError(f"unknown strategy {name!r}; valid: single, ddp, deepspeed, fsdp")


__all__ = ["Strategy", "SingleDeviceStrategy", "build_strategy"]
