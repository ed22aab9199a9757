"""Backends behind one interface: build_strategy(cfg) picks one from the config."""

from __future__ import annotations

from ft_framework.strategies.base import Strategy
from ft_framework.strategies.ddp import DDPStrategy
from ft_framework.strategies.deepspeed import DeepSpeedStrategy
from ft_framework.strategies.fsdp import FSDPStrategy
from ft_framework.strategies.offload import OffloadedSingleDeviceStrategy
from ft_framework.strategies.single import SingleDeviceStrategy



def build_strategy(strategy_cfg, training_cfg) -> Strategy:
    """The strategy named by `strategy.name`, set up for `training.precision` and `training.device`."""
    name = strategy_cfg.name
    if name == "single":
        offload = getattr(strategy_cfg, "offload_optimizer", None)
        if offload is not None:
            return OffloadedSingleDeviceStrategy(training_cfg.precision, training_cfg.device,
                                                 overlap=offload.overlap, worker_threads=offload.worker_threads,
                                                 bucket_mb=offload.bucket_mb, accumulate=offload.accumulate,
                                                 copies_in_flight=offload.copies_in_flight)
        return SingleDeviceStrategy(training_cfg.precision, training_cfg.device)
    if name == "ddp":
        return DDPStrategy(training_cfg.precision, training_cfg.device)
    if name == "deepspeed":
        return DeepSpeedStrategy(strategy_cfg.deepspeed, training_cfg)
    if name == "fsdp":
        return FSDPStrategy(strategy_cfg.fsdp, training_cfg)
    raise ValueError(f"unknown strategy {name!r}; valid: single, ddp, deepspeed, fsdp")


__all__ = ["DDPStrategy", "DeepSpeedStrategy", "FSDPStrategy", "OffloadedSingleDeviceStrategy", "Strategy", "SingleDeviceStrategy", "build_strategy"]
