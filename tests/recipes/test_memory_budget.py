"""An ft-train run whose planned peak exceeds training.memory_budget_gib is refused before anything
loads: one line, exit 2, naming the planned peak and overrides that fit."""

from __future__ import annotations

import contextlib
import io
import json

import yaml

from ft_framework import cli
from ft_framework.config import validate_config
from ft_framework.strategies.memory_fit import plan_run
from ft_framework.strategies.memory_plan import GIB, format_bytes

TINY = {"model_type": "bert", "vocab_size": 1000, "hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4,
        "intermediate_size": 256, "max_position_embeddings": 128}


def test_an_over_budget_run_is_refused_in_one_line_before_anything_loads(tmp_path):
    model_dir = tmp_path / "model"
    model_dir.mkdir()
    # config.json only: no weights and no tokenizer, so a run that loaded anything would fail otherwise
    (model_dir / "config.json").write_text(json.dumps(TINY))
    base = {"model": {"name_or_path": str(model_dir)},
            "data": {"task": "sst2", "source": "builtin:quickstart", "max_seq_length": 64},
            "optimizer": {"name": "recadam", "hparams": {"lr": 2e-5}}, "schedule": {"warmup_steps": 0},
            "training": {"max_steps": 2, "per_device_batch_size": 8, "device": "cpu"},
            "logging": {"output_dir": str(tmp_path / "out"), "progress_bar": False}}
    peaks = {}
    for batch in (4, 8):
        cfg = validate_config({**base, "training": {**base["training"], "per_device_batch_size": batch}})
        peaks[batch] = plan_run(cfg, world_size=1, on_gpu=False).device_peak
    budget_gib = (peaks[4] + peaks[8]) / 2 / GIB  # batch 4 fits, batch 8 does not
    base["training"]["memory_budget_gib"] = budget_gib
    config = tmp_path / "run.yaml"
    config.write_text(yaml.safe_dump(base))

    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        code = cli.train_main(["--config", str(config)])
    lines = err.getvalue().strip().splitlines()
    assert code == 2 and len(lines) == 1, err.getvalue()
    line = lines[0]
    assert "training.memory_budget_gib" in line and "Traceback" not in line
    assert f"planned peak per rank is {format_bytes(peaks[8])}" in line and "MiB" in line
    assert "training.per_device_batch_size=4 training.gradient_accumulation_steps=2" in line  # what fits
    assert not (tmp_path / "out" / "checkpoints").exists()
