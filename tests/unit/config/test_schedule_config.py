"""schedule: transformers' schedules by name, their kwargs checked by the schema; and a command-line
value of an either-or key (max_steps / num_epochs, warmup_steps / warmup_ratio) replacing the file's."""

from __future__ import annotations

import pytest
import yaml

from ft_framework.config import ConfigError, RunConfig, load_config


def _config(tmp_path, **schedule) -> str:
    data = {"model": {"name_or_path": "some/model"}, "data": {"task": "rte"},
            "optimizer": {"hparams": {"lr": 2e-5}}, "schedule": {"warmup_ratio": 0.1, **schedule},
            "training": {"num_epochs": 3}}
    path = tmp_path / "run.yaml"
    path.write_text(yaml.safe_dump(data))
    return str(path)


def _error(path, overrides) -> str:
    with pytest.raises(ConfigError) as info:
        load_config(path, overrides, check_paths=False)
    message = str(info.value)
    assert "\n" not in message.strip().replace("\n  ", " "), message
    return message


@pytest.mark.parametrize("schedule", [
    {"name": "cosine", "kwargs": {"num_cycles": 1.5}},
    {"name": "cosine_with_min_lr", "kwargs": {"min_lr_rate": 0.1}},
    {"name": "warmup_stable_decay", "kwargs": {"num_decay_steps": 100, "decay_type": "1-sqrt"}},
    {"name": "polynomial", "kwargs": {"lr_end": 1e-7, "power": 2}},
    {"name": "constant"}, {"name": "linear"},
])
def test_schedules_and_their_kwargs_load_and_round_trip(tmp_path, schedule):
    cfg = load_config(_config(tmp_path, **schedule), check_paths=False)
    assert cfg.schedule.name == schedule["name"] and cfg.schedule.kwargs == schedule.get("kwargs", {})
    assert RunConfig.model_validate(cfg.to_dict()).to_dict() == cfg.to_dict()


@pytest.mark.parametrize("overrides,message", [
    (["schedule.name=reduce_lr_on_plateau"], "schedule.name: reduce_lr_on_plateau cannot drive ft-train's lr: it "
                                             "lowers lr when an evaluation metric stops improving"),
    (["schedule.name=greedy"], "greedy cannot drive ft-train's lr"),
    (["schedule.name=cosine_annealing"], "'cosine_with_restarts'"),
    (["schedule.kwargs.num_cycles=2"], "schedule: kwargs: linear takes no kwargs (got 'num_cycles')"),
    (["schedule.name=cosine", "schedule.kwargs.min_lr_rate=0.1"],
     "kwargs: cosine takes no key 'min_lr_rate'; valid: num_cycles"),
    (["schedule.name=cosine_with_min_lr"], "needs exactly one of min_lr (an lr) and min_lr_rate"),
    (["schedule.name=warmup_stable_decay"], "warmup_stable_decay needs num_decay_steps"),
    (["schedule.name=polynomial", "schedule.kwargs.lr_end=0.001"],
     "schedule.kwargs: lr_end of polynomial (0.001) must be below the optimizer's lr (2e-05)"),
])
def test_a_wrong_schedule_is_one_line_naming_what_is_valid(tmp_path, overrides, message):
    assert message in _error(_config(tmp_path), overrides)


def test_a_command_line_value_of_an_either_or_key_replaces_the_files(tmp_path):
    path = _config(tmp_path)
    cfg = load_config(path, ["training.max_steps=5", "schedule.warmup_steps=2"], check_paths=False)
    assert (cfg.training.max_steps, cfg.training.num_epochs) == (5, None)
    assert (cfg.schedule.warmup_steps, cfg.schedule.warmup_ratio) == (2, None)
    # both on the command line, or a null, is still the user's to settle
    assert "exactly one of max_steps and num_epochs; both" in _error(path, ["training.max_steps=5",
                                                                            "training.num_epochs=1"])
    assert "exactly one of max_steps and num_epochs; neither" in _error(path, ["training.num_epochs=null"])
    cfg = load_config(path, ["training.num_epochs=null", "training.max_steps=7"], check_paths=False)
    assert (cfg.training.max_steps, cfg.training.num_epochs) == (7, None)


def test_a_checkpoint_recorded_before_schedule_kwargs_resumes():
    """A run checkpointed before schedule.kwargs existed resumes: the key is new and at its default."""
    from ft_framework.config.schema import schema_default
    from ft_framework.run.fingerprint import diff_configs

    schedule = {"name": "linear", "warmup_steps": 3, "warmup_ratio": None}
    old, new = {"config": {"schedule": schedule}}, {"config": {"schedule": {**schedule, "kwargs": {}}}}
    assert diff_configs(old, new, default_of=schema_default) == []
    changed = {"config": {"schedule": {**schedule, "name": "cosine", "kwargs": {"num_cycles": 1}}}}
    assert diff_configs(old, changed, default_of=schema_default) == [
        ("schedule.kwargs.num_cycles", None, 1), ("schedule.name", "linear", "cosine")]
