"""optimizer.child_tuning: its ranges, the combinations it refuses (one line each, naming what is
valid), and a resume of a checkpoint written before the key existed."""

import pytest

from ft_framework.config import ConfigError, apply_overrides, validate_config


def minimal() -> dict:
    return {"model": {"name_or_path": "some/model"}, "data": {"task": "rte"},
            "optimizer": {"name": "adamw", "hparams": {"lr": 2e-5}, "child_tuning": {"reserve_p": 0.3}},
            "schedule": {"warmup_ratio": 0.1}, "training": {"max_steps": 100}}


def error_of(overrides) -> str:
    with pytest.raises(ConfigError) as info:
        validate_config(apply_overrides(minimal(), overrides), pinned=list(overrides))
    return str(info.value)


def test_defaults_and_off():
    cfg = validate_config(minimal())
    assert (cfg.optimizer.child_tuning.reserve_p, cfg.optimizer.child_tuning.fisher_batches) == (0.3, None)
    assert validate_config(apply_overrides(minimal(), ["optimizer.child_tuning=null"])).optimizer.child_tuning is None


@pytest.mark.parametrize("override,said", [
    ("optimizer.child_tuning.reserve_p=0", "greater than 0"),
    ("optimizer.child_tuning.reserve_p=1.5", "less than or equal to 1"),
    ("optimizer.child_tuning.fisher_batches=0", "greater than 0"),
    ("optimizer.child_tuning.keep=0.3", "fisher_batches"),
])
def test_bad_values_are_errors(override, said):
    assert said in error_of([override])


@pytest.mark.parametrize("overrides,said", [
    (["strategy.name=deepspeed", "strategy.deepspeed.zero_stage=3"], "zero_stage 3"),
    (["strategy.offload_optimizer.overlap=false"], "strategy.offload_optimizer"),
])
def test_refused_combinations_name_what_is_valid(overrides, said):
    message = error_of(overrides)
    assert said in message and "valid: single, ddp, fsdp and deepspeed zero_stage 0-2" in message
