"""A decoder's SFT run without the memory of the whole logits or of dense packing masks, end to end on
a tiny Llama: the chunked loss (training.chunked_loss, the default) equals the whole logits' run
(losses, gradient norms, completion loss and exact match, forgetting measures) in one process, and a
packed run whose batches carry position_ids and no mask (sdpa: transformers finds the rows' bounds
in them) equals the unpacked run, step for step, as does eager attention's dense-mask fallback,
which the log names. (flex_attention has no backward on this CPU in torch 2.13; flash attention
needs CUDA.) Each step here takes the whole training set, so packing changes no step's rows."""

from __future__ import annotations

import json
import logging
from pathlib import Path

import pytest

from tiny_llm import build_tiny_llm_dir, write_sft_rows, write_sft_run_config
from ft_framework.config import load_config
from ft_framework.config.errors import ConfigError
from ft_framework.trainer import Trainer


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    root = tmp_path_factory.mktemp("sft_memory_lean")
    return {"model": build_tiny_llm_dir(root / "llama", "llama"), "files": write_sft_rows(root / "data")}


def train_records(run_dir: Path) -> list[dict]:
    return [r for r in map(json.loads, (run_dir / "metrics.jsonl").read_text().splitlines()) if r["type"] == "train"]


def run(setup, tmp_path, name, overrides=(), **sections):
    config = write_sft_run_config(tmp_path / f"{name}.yaml", setup["model"], tmp_path / name, setup["files"],
                                  **sections)
    return Trainer(load_config(config, list(overrides))).fit(), train_records(tmp_path / name)


def test_the_chunked_loss_run_equals_the_whole_logits_run(setup, tmp_path):
    sections = dict(data={"main_metric": "exact_match"}, training={"max_steps": 4},
                    optimizer={"name": "adamw", "hparams": {"lr": 1e-2}}, evaluation={"num_evals": 2})
    whole, whole_steps = run(setup, tmp_path, "whole", ["training.chunked_loss=false"], **sections)
    chunked, chunked_steps = run(setup, tmp_path, "chunked", **sections)
    for key in ("loss", "grad_norm"):
        assert [r[key] for r in chunked_steps] == pytest.approx([r[key] for r in whole_steps], rel=1e-5), key
    for when in ("baseline", "final"):
        assert chunked[when]["metrics"]["validation"] == pytest.approx(whole[when]["metrics"]["validation"], rel=1e-5)
    assert chunked["final"]["forgetting"] == pytest.approx(whole["final"]["forgetting"], rel=1e-4, abs=1e-7)
    assert chunked["final"]["samples"] == whole["final"]["samples"]


FULL_BATCH = dict(training={"max_steps": 3, "per_device_batch_size": 48},
                  evaluation={"num_evals": 1, "forgetting": {"enabled": False}, "generation": {"samples": 0}})


@pytest.mark.parametrize("attention", ["sdpa", "eager"])
def test_a_packed_run_equals_the_unpacked_run(setup, tmp_path, attention, caplog):
    overrides = [f"model.attn_implementation={attention}"]
    unpacked, unpacked_steps = run(setup, tmp_path, "rows", overrides, **FULL_BATCH)
    with caplog.at_level(logging.INFO, logger="ft_framework.task_kinds.causal_lm"):
        packed, packed_steps = run(setup, tmp_path, "packed", overrides + ["data.packing=true"], **FULL_BATCH)
    assert 0 < packed["sft"]["train"]["packed_sequences"] < packed["sft"]["train"]["rows"]
    assert [r["loss"] for r in packed_steps] == pytest.approx([r["loss"] for r in unpacked_steps], rel=1e-5)
    assert [r["grad_norm"] for r in packed_steps] == pytest.approx([r["grad_norm"] for r in unpacked_steps], rel=1e-4)
    assert ("packed batches carry a dense (B, 1, T, T) mask" in caplog.text) == (attention == "eager")


def test_the_attention_kernel_and_the_loss_switch_are_config_keys(setup, tmp_path):
    config = write_sft_run_config(tmp_path / "c.yaml", setup["model"], tmp_path / "c", setup["files"])
    cfg = load_config(config, ["model.attn_implementation=flex_attention", "training.chunked_loss=false"])
    assert cfg.model.attn_implementation == "flex_attention" and cfg.training.chunked_loss is False
    assert load_config(config).training.chunked_loss is True and load_config(config).model.attn_implementation is None
    with pytest.raises(ConfigError) as refused:
        load_config(config, ["model.attn_implementation=flash"])
    assert "model.attn_implementation" in str(refused.value) and "flash_attention_2" in str(refused.value)
