"""loss.kl_to_pretrained's config (LossConfig): off by default (a config without it is unchanged), β
and kl_top_k checked, and refused for an encoder's run naming what is valid; each error one line,
answered by the CLI with exit 2 before torch loads."""

import subprocess
import sys

import pytest
import yaml

from config_errors import one_line_error

from ft_framework.config import apply_overrides, validate_config


def decoder() -> dict:
    return {"model": {"name_or_path": "some/model"},
            "data": {"problem": "causal_lm", "source": "builtin:quickstart_sft"},
            "optimizer": {"name": "adamw", "hparams": {"lr": 2e-5}}, "schedule": {"warmup_ratio": 0.1},
            "training": {"max_steps": 10}, "loss": {"kl_to_pretrained": 0.1}}


def encoder() -> dict:
    return {**decoder(), "data": {"task": "rte"}}


def test_off_by_default_and_read_when_given():
    cfg = validate_config(decoder())
    assert (cfg.loss.kl_to_pretrained, cfg.loss.kl_top_k) == (0.1, 32)
    config = decoder()
    del config["loss"]
    plain = validate_config(config)
    assert (plain.loss.kl_to_pretrained, plain.loss.kl_top_k) == (0.0, 32)
    assert plain.to_dict()["loss"] == {"kl_to_pretrained": 0.0, "kl_top_k": 32}
    assert validate_config(apply_overrides(decoder(), ["loss.kl_top_k=5"])).loss.kl_top_k == 5


@pytest.mark.parametrize("overrides,said", [
    (["loss.kl_top_k=0"], "loss.kl_top_k"),
    (["loss.kl_top_k=-3"], "loss.kl_top_k"),
    (["loss.kl_to_pretrained=-0.1"], "loss.kl_to_pretrained"),
    (["loss.beta=0.1"], "beta"),
])
def test_invalid_values_and_unknown_keys_are_named(overrides, said):
    assert said in one_line_error(decoder(), overrides)


def test_an_encoder_run_refuses_the_anchor_naming_what_is_valid():
    message = one_line_error(encoder())
    assert "loss.kl_to_pretrained" in message and "data.problem: causal_lm" in message
    assert "loss.kl_to_pretrained: 0" in message
    assert validate_config(apply_overrides(encoder(), ["loss.kl_to_pretrained=0"])).loss.kl_to_pretrained == 0.0


def test_the_cli_refuses_it_in_one_line_with_exit_2(tmp_path):
    path = tmp_path / "encoder.yaml"
    path.write_text(yaml.safe_dump(encoder()))
    out = subprocess.run([sys.executable, "-m", "ft_framework.cli", "--config", str(path)],
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 2
    lines = out.stderr.strip().splitlines()
    assert len(lines) == 1 and "loss.kl_to_pretrained" in lines[0], out.stderr
