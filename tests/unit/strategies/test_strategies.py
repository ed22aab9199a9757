import pytest

from ft_framework.config import StrategyConfig, TrainingConfig
from ft_framework.strategies import SingleDeviceStrategy, build_strategy


def training(**kw):
    return TrainingConfig(max_steps=1, **kw)


def test_single_strategy_on_cpu():
    s = build_strategy(StrategyConfig(name="single"), training(device="cpu"))
    assert isinstance(s, SingleDeviceStrategy) and s.device.type == "cpu" and s.world_size == 1


def test_fp16_needs_cuda():
    with pytest.raises(ValueError, match="fp16 needs a CUDA device"):
        build_strategy(StrategyConfig(name="single"), training(device="cpu", precision="fp16"))


def test_ddp_outside_a_distributed_launch_explains_how_to_launch(monkeypatch):
    monkeypatch.delenv("RANK", raising=False)
    with pytest.raises(RuntimeError, match="torchrun --nproc_per_node"):
        build_strategy(StrategyConfig(name="ddp"), training(device="cpu"))


@pytest.mark.parametrize("name", ["deepspeed", "fsdp"])
def test_sharded_strategies_outside_a_distributed_launch_explain_how_to_launch(name, monkeypatch):
    pytest.importorskip("deepspeed") if name == "deepspeed" else None
    monkeypatch.delenv("RANK", raising=False)
    with pytest.raises(RuntimeError, match="--nproc_per_node N launch/train.py"):
        build_strategy(StrategyConfig(name=name), training(device="cpu"))
