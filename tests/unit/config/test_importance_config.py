"""optimizer.importance and the ewc rule in the config: off by default (a config without it is
unchanged), its values and the combinations it refuses, each in one line naming what is valid; ewc
without it is refused."""

import pytest

from config_errors import one_line_error

from ft_framework.config import ConfigError, apply_overrides, validate_config


def decoder(**optimizer) -> dict:
    return {"model": {"name_or_path": "some/model"},
            "data": {"problem": "causal_lm", "source": "builtin:quickstart_sft"},
            "optimizer": {"name": "recadam", "hparams": {"lr": 2e-5}, "importance": {"source": "probe"}, **optimizer},
            "schedule": {"warmup_ratio": 0.1}, "training": {"max_steps": 10}}


def test_defaults_and_off():
    imp = validate_config(decoder()).optimizer.importance
    assert (imp.source, imp.batches, imp.batch_size, imp.max_tokens) == ("probe", None, 8, 256)
    config = decoder()
    del config["optimizer"]["importance"]
    plain = validate_config(config)
    assert plain.optimizer.importance is None and plain.to_dict()["optimizer"]["importance"] is None
    assert validate_config(apply_overrides(decoder(), ["optimizer.importance=null"])).optimizer.importance is None


@pytest.mark.parametrize("source", ["probe", "general.txt", "data/wiki.JSONL"])
def test_the_valid_sources(source):
    assert validate_config(decoder(importance={"source": source})).optimizer.importance.source == source


@pytest.mark.parametrize("override,said", [
    ("optimizer.importance.source=wiki.csv",
     "valid: probe (the forgetting probe's text), builtin:general_text (shipped text), or a path to a .txt file"),
    ("optimizer.importance.source=fisher", "is neither 'probe' nor a file ending .txt or .jsonl"),
    ("optimizer.importance.batches=0", "greater than 0"),
    ("optimizer.importance.batch_size=0", "greater than 0"),
    ("optimizer.importance.max_tokens=1", "greater than or equal to 2"),
    ("optimizer.importance.kind=fisher", "max_tokens"),
])
def test_bad_values_are_one_line(override, said):
    assert said in one_line_error(decoder(), [override])


@pytest.mark.parametrize("name", ["adamw", "bertadam"])
def test_a_rule_without_a_pull_is_refused_naming_those_with_one(name):
    message = one_line_error(decoder(), [f"optimizer.name={name}", "optimizer.hparams={lr: 2.0e-5}"])
    assert f"optimizer {name!r} has none; valid: ewc, prior_wd, recadam (or optimizer.importance: null)" in message


def test_ewc_needs_the_importance():
    config = decoder(name="ewc", hparams={"lr": 2e-5, "ewc_lambda": 1000.0})
    assert validate_config(config).optimizer.resolved_hparams()["ewc_lambda"] == 1000.0
    message = one_line_error(config, ["optimizer.importance=null"])
    assert "optimizer 'ewc' weighs its pull by the Fisher of theta*: set optimizer.importance" in message
    assert "ewc_lambda must be >= 0" in one_line_error(config, ["optimizer.hparams.ewc_lambda=-1"])


@pytest.mark.parametrize("overrides,said", [
    (["data.problem=classification", "data.source=builtin:quickstart", "data.task=sst2"],
     "it needs data.problem: causal_lm (got classification)"),
    (["model.lora={r: 4}"], "cannot be combined with model.lora"),
])
def test_refused_combinations(overrides, said):
    assert said in one_line_error(decoder(), overrides)


@pytest.mark.parametrize("strategy", [
    ["strategy.name=deepspeed", "strategy.deepspeed.zero_stage=3", "strategy.deepspeed.offload_optimizer=true"],
    ["strategy.name=fsdp", "strategy.fsdp.cpu_offload=true"],
    ["strategy.offload_optimizer.overlap=true"],
])
def test_every_strategy_takes_it(strategy):
    assert validate_config(apply_overrides(decoder(), strategy)).optimizer.importance is not None


def test_a_missing_file_is_one_line_before_anything_loads(tmp_path):
    import yaml

    from ft_framework.config import load_config

    config = decoder(importance={"source": str(tmp_path / "missing.txt")})
    path = tmp_path / "run.yaml"
    path.write_text(yaml.safe_dump(config))
    with pytest.raises(ConfigError) as info:
        load_config(path)
    assert "optimizer.importance.source: " in str(info.value) and "missing.txt" in str(info.value)
    assert "is not a file" in str(info.value) and "\n" not in str(info.value).strip()
    (tmp_path / "missing.txt").write_text("general text\n")
    assert load_config(path).optimizer.importance.source.endswith("missing.txt")
