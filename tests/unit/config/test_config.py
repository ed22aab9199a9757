"""The config schema: defaults, overrides, task overrides, and errors that say what to change."""

from __future__ import annotations

import json
import warnings
from pathlib import Path

import pytest
import yaml

from ft_framework.config import (
    ConfigError,
    RunConfig,
    apply_overrides,
    load_config,
    parse_override,
    validate_config,
)


def minimal() -> dict:
    """The smallest valid config: the required sections only."""
    return {
        "model": {"name_or_path": "some/model"},
        "data": {"task": "rte"},
        "optimizer": {"hparams": {"lr": 2e-5}},
        "schedule": {"warmup_ratio": 0.1},
        "training": {"max_steps": 100},
    }


def write(tmp_path: Path, data: dict | str, name: str = "run.yaml") -> Path:
    path = tmp_path / name
    path.write_text(data if isinstance(data, str) else yaml.safe_dump(data))
    return path


def error_of(data: dict, overrides=()) -> str:
    with pytest.raises(ConfigError) as info:
        validate_config(apply_overrides(data, overrides), pinned=list(overrides))
    return str(info.value)


# --- defaults and round trip ----------------------------------------------------------------------


def test_minimal_config_gets_defaults():
    cfg = validate_config(minimal())
    assert cfg.model.init == "pretrained" and cfg.model.mixout == 0.0
    assert cfg.optimizer.name == "recadam" and cfg.optimizer.impl == "auto"
    assert cfg.strategy.name == "single" and cfg.strategy.deepspeed is None
    assert cfg.training.data_seed == cfg.training.seed == 42  # data_seed defaults to seed
    assert cfg.data.source == "hub" and cfg.data.hub_id == "nyu-mll/glue"


def test_weight_decay_defaults_to_the_optimizers_own():
    data = minimal()
    data["optimizer"] = {"name": "adamw"}
    assert validate_config(data).optimizer.weight_decay == pytest.approx(0.01)  # torch AdamW default
    data["optimizer"]["weight_decay"] = 0.0
    assert validate_config(data).optimizer.weight_decay == 0.0


def test_to_dict_is_json_and_validates_back_to_the_same_config():
    data = minimal()
    data["optimizer"]["hparams"].update(betas=[0.9, 0.98], anneal_k=float("inf"))
    data["strategy"] = {"name": "deepspeed"}
    cfg = validate_config(data)
    dumped = cfg.to_dict()
    json.dumps(dumped)
    assert RunConfig.model_validate(dumped) == cfg
    assert dumped["strategy"]["deepspeed"]["zero_stage"] == 2  # defaults of the active section filled


def test_data_seed_is_independent_of_seed():
    data = minimal()
    data["training"].update(seed=1, data_seed=7)
    cfg = validate_config(data)
    assert (cfg.training.seed, cfg.training.data_seed) == (1, 7)


# --- overrides ------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "text, path, value",
    [
        ("training.max_steps=10", ["training", "max_steps"], 10),
        ("optimizer.hparams.lr=2e-5", ["optimizer", "hparams", "lr"], 2e-5),  # YAML 1.1 reads a str
        ("optimizer.hparams.betas=[0.9,0.98]", ["optimizer", "hparams", "betas"], [0.9, 0.98]),
        ("evaluation.select_best=true", ["evaluation", "select_best"], True),
        ("checkpoint.resume_from=null", ["checkpoint", "resume_from"], None),
        ("checkpoint.resume_from=", ["checkpoint", "resume_from"], None),
        ("logging.output_dir=runs/x=1", ["logging", "output_dir"], "runs/x=1"),
        ("optimizer.hparams.anneal_k=.inf", ["optimizer", "hparams", "anneal_k"], float("inf")),
    ],
)
def test_parse_override_types(text, path, value):
    assert parse_override(text) == (path, value)


@pytest.mark.parametrize("text", ["training.max_steps", "=3", "training..max_steps=3"])
def test_malformed_override_is_an_error(text):
    with pytest.raises(ConfigError, match="section.key=value"):
        parse_override(text)


def test_load_config_applies_typed_overrides(tmp_path):
    path = write(tmp_path, minimal())
    cfg = load_config(path, ["training.max_steps=10", "optimizer.hparams.betas=[0.9,0.98]",
                             "optimizer.hparams.lr=3e-5", "model.init=random"])
    assert cfg.training.max_steps == 10
    assert cfg.optimizer.hparams["betas"] == (0.9, 0.98)
    assert cfg.optimizer.hparams["lr"] == pytest.approx(3e-5)
    assert cfg.model.init == "random"


def test_floats_like_2e_5_in_yaml_files_are_floats(tmp_path):
    data = minimal()
    del data["optimizer"]  # given below, once: a key given twice is an error (test_config_untrusted.py)
    text = yaml.safe_dump(data) + "optimizer:\n  hparams:\n    lr: 2e-5\n    anneal_t0: 100\n"
    cfg = load_config(write(tmp_path, text))
    assert cfg.optimizer.hparams["lr"] == pytest.approx(2e-5)
    assert cfg.optimizer.hparams["anneal_t0"] == 100.0  # coerced to the default's type


def test_override_through_a_value_is_an_error():
    with pytest.raises(ConfigError, match="'training.max_steps' is a value"):
        apply_overrides(minimal(), ["training.max_steps.x=1"])


# --- unknown keys and values ----------------------------------------------------------------------


@pytest.mark.parametrize(
    "override, bad_path, valid",
    [
        ("trainig.max_steps=3", "trainig", ["model", "training", "task_overrides"]),
        ("training.max_stepz=3", "training.max_stepz", ["max_steps", "num_epochs", "data_seed"]),
        ("strategy.deepspeed.zero_stag=3", "strategy.deepspeed.zero_stag", ["zero_stage", "offload_param"]),
        ("optimizer.hparam.lr=1", "optimizer.hparam", ["hparams", "layerwise_lr_decay"]),
        ("task_overrides.rte.schedule.warmup=3", "task_overrides.rte.schedule.warmup",
         ["warmup_steps", "warmup_ratio"]),
    ],
)
def test_unknown_key_names_the_path_and_lists_valid_keys(override, bad_path, valid):
    message = error_of(minimal(), [override])
    assert repr(bad_path) in message
    for key in valid:
        assert key in message


def test_unknown_key_suggests_the_closest():
    assert "did you mean 'max_steps'" in error_of(minimal(), ["training.max_step=3"])


@pytest.mark.parametrize(
    "override, valid",
    [
        ("training.precision=fp64", ["'fp32'", "'bf16'", "'fp16'"]),
        ("model.init=rand", ["'pretrained'", "'random'"]),
        ("strategy.name=horovod", ["'single'", "'ddp'", "'deepspeed'", "'fsdp'"]),
        ("schedule.name=cosine_annealing", ["'linear'", "'cosine'", "'warmup_stable_decay'"]),
        ("optimizer.impl=cuda", ["'auto'", "'torch'", "'cpu'"]),
        ("data.task=squad", ["'cola'", "'wnli'"]),
        ("training.device=tpu", ["'auto'", "'cpu'", "'cuda'"]),
        ("optimizer.anchor_dtype=float16", ["'float32'", "'bfloat16'"]),
    ],
)
def test_bad_enum_value_lists_valid_values(override, valid):
    message = error_of(minimal(), [override])
    assert override.split("=")[0] in message
    assert repr(override.split("=")[1]) in message  # what was given
    for value in valid:
        assert value in message


def test_unknown_optimizer_lists_available():
    message = error_of(minimal(), ["optimizer.name=sgd"])
    assert "optimizer.name" in message
    for name in ("recadam", "adamw", "bertadam", "prior_wd"):
        assert name in message


def test_unknown_hparam_lists_the_optimizers_hparams():
    message = error_of(minimal(), ["optimizer.name=adamw", "optimizer.hparams.pretrain_cof=5000"])
    assert "'pretrain_cof'" in message and "'adamw'" in message
    assert "lr, betas, eps" in message


def test_hparam_values_are_checked():
    assert "anneal_fun" in error_of(minimal(), ["optimizer.hparams.anneal_fun=cosine"])
    assert "sigmoid, linear, constant" in error_of(minimal(), ["optimizer.hparams.anneal_fun=cosine"])
    assert "must be a number" in error_of(minimal(), ["optimizer.hparams.lr=fast"])
    assert "list of 2" in error_of(minimal(), ["optimizer.hparams.betas=[0.9]"])
    assert "true or false" in error_of(minimal(), ["optimizer.hparams.correct_bias=1"])
    # the linear anneal needs t0 > 0 (the optimizer's own rule, checked early)
    assert "anneal_t0" in error_of(minimal(), ["optimizer.hparams.anneal_fun=linear",
                                               "optimizer.hparams.anneal_t0=0"])


def test_grouping_hparams_point_to_their_section_field():
    message = error_of(minimal(), ["optimizer.hparams.weight_decay=0.1"])
    assert "optimizer.weight_decay" in message


def test_missing_required_section_is_named():
    data = minimal()
    del data["training"]
    assert "training: required key is missing" in error_of(data)


def test_range_errors_show_the_value():
    message = error_of(minimal(), ["model.mixout=1.0"])
    assert "model.mixout" in message and "1.0" in message


# --- exactly-one and cross-field rules ------------------------------------------------------------


@pytest.mark.parametrize(
    "overrides, message",
    [
        (["schedule.warmup_steps=10"], "exactly one of warmup_steps and warmup_ratio; both"),
        (["schedule.warmup_ratio=null"], "exactly one of warmup_steps and warmup_ratio; neither"),
        (["training.num_epochs=3"], "exactly one of max_steps and num_epochs; both"),
        (["training.max_steps=null"], "exactly one of max_steps and num_epochs; neither"),
        (["evaluation.num_evals=3", "evaluation.every_steps=10"], "at most one of num_evals and every_steps"),
        (["strategy.name=deepspeed", "strategy.deepspeed.config={}", "strategy.deepspeed.config_file=ds.json"],
         "at most one of config (inline) and config_file"),
        (["strategy.name=deepspeed", "strategy.deepspeed.offload_param=true"], "offload_param needs zero_stage: 3"),
        (["strategy.deepspeed.zero_stage=3"], "only read when strategy.name is 'deepspeed'"),
        (["strategy.name=fsdp", "strategy.fsdp.mixed_precision=true"], "needs training.precision bf16"),
        (["model.init=random", "model.reinit_top_layers=2"], "reinit_top_layers has no effect"),
        (["strategy.name=deepspeed", "strategy.deepspeed.zero_stage=4"], "strategy.deepspeed.zero_stage"),
        (["strategy.name=deepspeed", "strategy.deepspeed.zero_stage=0", "training.precision=bf16"],
         "zero_stage 0 with training.precision bf16 runs DeepSpeed's FP16_UnfusedOptimizer"),
        (["strategy.name=deepspeed", "strategy.deepspeed.zero_stage=0", "training.precision=fp16"],
         "valid: zero_stage 1-3 in bf16/fp16, zero_stage 0 in fp32, or strategy.name ddp"),
    ],
)
def test_cross_field_rules(overrides, message):
    assert message in error_of(minimal(), overrides)


def test_replacing_warmup_kind_in_an_override():
    cfg = validate_config(apply_overrides(minimal(), ["schedule.warmup_ratio=null", "schedule.warmup_steps=5"]))
    assert cfg.schedule.warmup_steps == 5 and cfg.schedule.warmup_for(1000) == 5
    assert validate_config(minimal()).schedule.warmup_for(1000) == 100


def test_warmup_ratio_rounds_to_the_nearest_step():
    schedule = validate_config(minimal()).schedule  # warmup_ratio 0.1
    # 1.3 -> 1 and 1.7 -> 2 (rounding up would give 2 and 2); halves go to even, as Python's round.
    assert [schedule.warmup_for(n) for n in (13, 17, 15, 25, 3)] == [1, 2, 2, 2, 0]


def test_fsdp_and_deepspeed_sections_validate():
    data = apply_overrides(minimal(), ["strategy.name=deepspeed", "strategy.deepspeed.zero_stage=3",
                                       "strategy.deepspeed.offload_param=true",
                                       "strategy.deepspeed.offload_optimizer=true"])
    ds = validate_config(data).strategy.deepspeed
    assert (ds.zero_stage, ds.offload_param, ds.offload_optimizer) == (3, True, True)
    data = apply_overrides(minimal(), ["strategy.name=fsdp", "strategy.fsdp.cpu_offload=true",
                                       "strategy.fsdp.mixed_precision=true", "training.precision=bf16"])
    assert validate_config(data).strategy.fsdp.cpu_offload


def test_deepspeed_config_file_must_exist(tmp_path):
    data = apply_overrides(minimal(), ["strategy.name=deepspeed", "strategy.deepspeed.config_file=nope.json"])
    with pytest.raises(ConfigError, match="nope.json"):
        load_config(write(tmp_path, data))
    assert load_config(write(tmp_path, data), check_paths=False).strategy.deepspeed.config_file == "nope.json"


def test_recadam_pull_overshoot_warns():
    from ft_framework.optim.validation import PullOvershootWarning

    # The optimizer's own rule: lr * (w - lambda(1)) * gamma, not lr * w * gamma.
    with pytest.warns(PullOvershootWarning, match="removes 2.5 x"):
        validate_config(apply_overrides(minimal(), ["optimizer.hparams.lr=1e-3"]))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        validate_config(apply_overrides(minimal(), ["optimizer.hparams.lr=2e-5"]))  # 0.05: fine
        # anneal_fun constant has lambda = w: there is no pull, so no false positive.
        validate_config(apply_overrides(minimal(), ["optimizer.hparams.lr=1e-3",
                                                    "optimizer.hparams.anneal_fun=constant"]))


def test_negative_lr_is_a_config_error():
    with pytest.raises(ConfigError, match="lr must be >= 0"):
        validate_config(apply_overrides(minimal(), ["optimizer.hparams.lr=-1e-5"]))


# --- data sources ---------------------------------------------------------------------------------


def test_builtin_quickstart_resolves_to_the_shipped_directory():
    cfg = validate_config(apply_overrides(minimal(), ["data.source=builtin:quickstart", "data.task=sst2"]))
    assert (Path(cfg.data.resolved_source()) / "SST-2" / "train.tsv").is_file()
    assert validate_config(minimal()).data.resolved_source() == "hub"


def test_unknown_builtin_and_missing_directory(tmp_path):
    assert "builtin:quickstart" in error_of(minimal(), ["data.source=builtin:tiny"])
    path = write(tmp_path, apply_overrides(minimal(), [f"data.source={tmp_path / 'nope'}"]))
    with pytest.raises(ConfigError, match="data.source"):
        load_config(path)
    glue = tmp_path / "glue"
    glue.mkdir()
    assert load_config(write(tmp_path, apply_overrides(minimal(), [f"data.source={glue}"]))).data.source == str(glue)


# --- task overrides -------------------------------------------------------------------------------


def with_task_overrides() -> dict:
    data = minimal()
    data["optimizer"] = {"hparams": {"lr": 1e-5}}
    data["task_overrides"] = {
        "rte": {"optimizer.hparams.lr": 3e-5, "training": {"max_steps": 800}},  # dotted and nested
        "mnli": {"optimizer": {"hparams": {"lr": 5e-5}}, "schedule.warmup_ratio": None,
                 "schedule.warmup_steps": 1000},
    }
    return data


def test_task_override_of_the_active_task_is_merged():
    cfg = validate_config(with_task_overrides())
    assert cfg.optimizer.hparams["lr"] == pytest.approx(3e-5)
    assert cfg.training.max_steps == 800
    assert cfg.task_overrides == {}  # merged: the result re-validates to itself
    assert RunConfig.model_validate(cfg.to_dict()) == cfg


def test_task_override_follows_the_task_chosen_on_the_command_line():
    overrides = ["data.task=mnli"]
    cfg = validate_config(apply_overrides(with_task_overrides(), overrides), pinned=overrides)
    assert cfg.optimizer.hparams["lr"] == pytest.approx(5e-5)
    assert (cfg.schedule.warmup_steps, cfg.schedule.warmup_ratio) == (1000, None)
    assert cfg.training.max_steps == 100  # rte's value is not applied


def test_task_without_override_keeps_the_base_values():
    overrides = ["data.task=cola"]
    cfg = validate_config(apply_overrides(with_task_overrides(), overrides), pinned=overrides)
    assert cfg.optimizer.hparams["lr"] == pytest.approx(1e-5)


def test_command_line_wins_over_task_override(tmp_path):
    path = write(tmp_path, with_task_overrides())
    cfg = load_config(path, ["optimizer.hparams.lr=7e-6"])
    assert cfg.optimizer.hparams["lr"] == pytest.approx(7e-6)
    assert cfg.training.max_steps == 800  # the rest of rte's values still apply
    cfg = load_config(path, ["task_overrides.rte.training.max_steps=5"])
    assert cfg.training.max_steps == 5


def test_model_validate_merges_task_overrides_too():
    cfg = RunConfig.model_validate(with_task_overrides())
    assert cfg.training.max_steps == 800 and cfg.task_overrides == {}


def test_inactive_task_override_is_validated_as_well():
    data = with_task_overrides()
    data["task_overrides"]["mnli"]["optimizer"]["hparams"]["lr"] = "fast"
    message = error_of(data)
    assert "data.task=mnli" in message and "'lr' must be a number" in message


def test_task_override_errors():
    data = with_task_overrides()
    data["task_overrides"]["squad"] = {"training.max_steps": 1}
    message = error_of(data)
    assert "'squad'" in message and "rte" in message and "wnli" in message
    data = with_task_overrides()
    data["task_overrides"]["rte"]["data.task"] = "mnli"
    assert "cannot set task_overrides or data.task" in error_of(data)
    data = with_task_overrides()
    data["task_overrides"]["rte"]["optimizer.hparams.lrr"] = 1.0
    assert "unknown hyper-parameter 'lrr'" in error_of(data)


def test_config_error_is_a_value_error(tmp_path):
    assert issubclass(ConfigError, ValueError)
    with pytest.raises(ConfigError, match="not found"):
        load_config(tmp_path / "missing.yaml")
    with pytest.raises(ConfigError, match="mapping"):
        load_config(write(tmp_path, "- a\n- b\n"))


def test_set_path_takes_dotted_or_split_paths_and_refuses_to_go_through_a_value():
    from ft_framework.config import set_path

    data = {"training": {"seed": 1}}
    set_path(data, "optimizer.hparams.lr", 3e-5)
    set_path(data, ["training", "seed"], 2)
    assert data == {"training": {"seed": 2}, "optimizer": {"hparams": {"lr": 3e-5}}}
    with pytest.raises(ConfigError, match="cannot set 'training.seed.x': 'training.seed' is a value, not a section"):
        set_path(data, "training.seed.x", 1)
