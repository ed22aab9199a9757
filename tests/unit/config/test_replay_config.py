"""data.replay's config: off by default (a config without it is unchanged), its fraction in (0, 1),
its file checked before anything loads, and refused for an encoder's run; each error one line."""

import pytest
from config_errors import one_line_error
from tiny_llm import build_tiny_llm_dir, write_sft_rows, write_sft_run_config

from ft_framework.config import ConfigError, apply_overrides, load_config, validate_config


def decoder() -> dict:
    return {"model": {"name_or_path": "some/model"},
            "data": {"problem": "causal_lm", "source": "builtin:quickstart_sft",
                     "replay": {"file": "general.txt", "fraction": 0.2}},
            "optimizer": {"name": "adamw", "hparams": {"lr": 2e-5}}, "schedule": {"warmup_ratio": 0.1},
            "training": {"max_steps": 10}}


def test_off_by_default_and_read_when_given():
    config = decoder()
    cfg = validate_config(config)
    assert (cfg.data.replay.file, cfg.data.replay.fraction) == ("general.txt", 0.2)
    del config["data"]["replay"]
    plain = validate_config(config)
    assert plain.data.replay is None and "replay" in plain.to_dict()["data"]
    assert validate_config(apply_overrides(decoder(), ["data.replay=null"])).data.replay is None


@pytest.mark.parametrize("fraction", [0, 1, 1.5, -0.2])
def test_a_fraction_outside_the_open_interval_is_one_line(fraction):
    message = one_line_error(decoder(), [f"data.replay.fraction={fraction}"])
    assert f"data.replay.fraction: {float(fraction)!r} is outside (0, 1)" in message


@pytest.mark.parametrize("overrides,said", [
    (["data.replay.share=0.3"], "share"),
    (["data.replay={file: general.txt}"], "fraction"),
])
def test_unknown_and_missing_keys_are_named(overrides, said):
    assert said in one_line_error(decoder(), overrides)


def test_an_encoder_run_refuses_replay():
    config = {"model": {"name_or_path": "some/model"}, "data": {"task": "rte", "replay": {"file": "g.txt",
                                                                                          "fraction": 0.2}},
              "optimizer": {"name": "adamw", "hparams": {"lr": 2e-5}}, "schedule": {"warmup_ratio": 0.1},
            "training": {"max_steps": 10}}
    message = one_line_error(config)
    assert "data.replay is read only when data.problem is causal_lm" in message


def test_a_missing_replay_file_is_named_before_anything_loads(tmp_path):
    model = build_tiny_llm_dir(tmp_path / "llama")
    files = write_sft_rows(tmp_path / "data", train_rows=4, eval_rows=2)
    config = write_sft_run_config(tmp_path / "run.yaml", model, tmp_path / "run", files,
                                  data={"replay": {"file": str(tmp_path / "absent.txt"), "fraction": 0.2}})
    with pytest.raises(ConfigError) as info:
        load_config(config)
    assert str(info.value).startswith("data.replay.file: ") and "absent.txt" in str(info.value)
    assert "is not a file" in str(info.value) and "\n" not in str(info.value)
    (tmp_path / "absent.txt").write_text("now it is here\n")
    assert load_config(config).data.replay.fraction == 0.2
