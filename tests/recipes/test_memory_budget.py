"""An ft-train run whose planned peak exceeds training.memory_budget_gib is refused before anything
loads: one line, exit 2, naming the planned peak and overrides that fit."""

from __future__ import annotations

import contextlib
import io
import json

import yaml
from huggingface_hub import constants as hub_constants

from ft_framework import cli
from ft_framework.config import validate_config
from ft_framework.strategies.memory_fit import plan_run
from ft_framework.strategies.memory_plan import GIB, format_bytes
from ft_framework.task_kinds import build_task_kind

TINY = {"model_type": "bert", "vocab_size": 1000, "hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4,
        "intermediate_size": 256, "max_position_embeddings": 128}


def _config_only_run(tmp_path, device: str) -> dict:
    """A run of a model directory that holds config.json only: no weights and no tokenizer, so a run
    that loaded anything would fail there."""
    model_dir = tmp_path / "model"
    model_dir.mkdir()
    (model_dir / "config.json").write_text(json.dumps(TINY))
    return {"model": {"name_or_path": str(model_dir)},
            "data": {"task": "sst2", "source": "builtin:quickstart", "max_seq_length": 64},
            "optimizer": {"name": "recadam", "hparams": {"lr": 2e-5}}, "schedule": {"warmup_steps": 0},
            "training": {"max_steps": 2, "per_device_batch_size": 8, "device": device},
            "logging": {"output_dir": str(tmp_path / "out"), "progress_bar": False}}


def _train_main(tmp_path, run: dict) -> tuple[int, str]:
    """ft-train's exit code and stderr for `run`, written to a config file as a user would."""
    config = tmp_path / "run.yaml"
    config.write_text(yaml.safe_dump(run))
    err = io.StringIO()
    with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(err):
        code = cli.train_main(["--config", str(config)])
    return code, err.getvalue()


def test_an_over_budget_run_is_refused_in_one_line_before_anything_loads(tmp_path):
    base = _config_only_run(tmp_path, "cpu")
    peaks = {}
    for batch in (4, 8):
        cfg = validate_config({**base, "training": {**base["training"], "per_device_batch_size": batch}})
        peaks[batch] = plan_run(cfg, task=build_task_kind(cfg), world_size=1, on_gpu=False).device_peak
    budget_gib = (peaks[4] + peaks[8]) / 2 / GIB  # batch 4 fits, batch 8 does not
    base["training"]["memory_budget_gib"] = budget_gib
    code, err = _train_main(tmp_path, base)
    lines = err.strip().splitlines()
    assert code == 2 and len(lines) == 1, err
    line = lines[0]
    assert "training.memory_budget_gib" in line and "Traceback" not in line
    assert f"planned peak per rank is {format_bytes(peaks[8])}" in line and "MiB" in line
    assert "training.per_device_batch_size=4 training.gradient_accumulation_steps=2" in line  # what fits
    assert not (tmp_path / "out" / "checkpoints").exists()


def _run_line(tmp_path, name_or_path: str, budget_gib: float, monkeypatch) -> tuple[int, str]:
    # No network and an empty cache: a run that reached the model load would fail there, not on the
    # budget. huggingface_hub reads HF_HOME and HF_HUB_OFFLINE once, when it is imported, and a test
    # that ran before in this process may have imported it: its constants are set too (models/hub.py
    # reads HF_HUB_OFFLINE from the environment when it asks).
    empty_home = tmp_path / "empty_hf_home"
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_HOME", str(empty_home))
    monkeypatch.setattr(hub_constants, "HF_HUB_CACHE", str(empty_home / "hub"))
    monkeypatch.setattr(hub_constants, "HF_HUB_OFFLINE", True)
    run = {"model": {"name_or_path": name_or_path},
           "data": {"task": "sst2", "source": "builtin:quickstart", "max_seq_length": 32},
           "optimizer": {"name": "recadam", "hparams": {"lr": 2e-5}}, "schedule": {"warmup_steps": 0},
           "training": {"max_steps": 2, "per_device_batch_size": 1, "device": "cpu", "memory_budget_gib": budget_gib},
           "logging": {"output_dir": str(tmp_path / "out"), "progress_bar": False}}
    code, err = _train_main(tmp_path, run)
    return code, err.strip()


def test_the_budget_is_checked_before_the_weights_are_looked_for(tmp_path, monkeypatch):
    # bert-base-uncased is neither cached nor reachable here; its shipped architecture is enough to plan
    code, text = _run_line(tmp_path, "bert-base-uncased", 0.25, monkeypatch)
    assert code == 2 and len(text.splitlines()) == 1, text
    assert text.startswith("ft-train: error: training.memory_budget_gib: the planned peak per rank is"), text
    assert "over the budget of 0.25 GiB" in text


def test_a_model_without_any_architecture_is_reported_before_the_budget(tmp_path, monkeypatch):
    # nothing to plan from: the model source is the error, naming how to provide its config.json
    code, text = _run_line(tmp_path, "nobody/no-such-model-xyz", 0.25, monkeypatch)
    assert code == 2 and len(text.splitlines()) == 1, text
    assert "model.name_or_path: 'nobody/no-such-model-xyz' is not in the Hugging Face cache" in text, text


def test_an_auto_device_run_without_a_gpu_is_checked_against_the_cpu_plan(tmp_path):
    """training.device auto on a machine without a GPU runs on the CPU: its budget is the CPU plan's
    (ft-plan's default plan for auto is a GPU run's, which adds the CUDA context and slack)."""
    import pytest
    import torch

    if torch.cuda.is_available():
        pytest.skip("this machine has a GPU: auto runs there")
    run = _config_only_run(tmp_path, "auto")
    cpu_cfg, gpu_cfg = validate_config({**run, "training": {**run["training"], "device": "cpu"}}), validate_config(run)
    cpu = plan_run(cpu_cfg, task=build_task_kind(cpu_cfg), world_size=1, on_gpu=False).device_peak
    gpu = plan_run(gpu_cfg, task=build_task_kind(gpu_cfg), world_size=1, on_gpu=True).device_peak
    assert cpu < gpu
    run["training"]["memory_budget_gib"] = (cpu + gpu) / 2 / GIB  # the CPU plan fits, the GPU plan would not
    code, err = _train_main(tmp_path, run)
    # past the budget check: it stops at the weights, which this directory does not have
    assert code != 0 and "training.memory_budget_gib" not in err, err
    assert "model.safetensors" in err
