"""Supervised fine-tuning runs of a tiny decoder end to end: what a run records (the pretrained
model as baseline, greedy samples, the decoder's forgetting measures, the data's counts), a resume
that equals the uninterrupted run (θ*'s probe answers read back, not measured again on moved
weights), packing, LoRA with activation checkpointing, the CLI's table, and the config's one-line
refusals."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from tiny_llm import build_tiny_llm_dir, write_sft_rows, write_sft_run_config
from ft_framework.config import load_config
from ft_framework.errors import UserError
from ft_framework.models.lm_forgetting import LM_FORGETTING_MEASURES
from ft_framework.trainer import Trainer

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    root = tmp_path_factory.mktemp("sft_run")
    return {"model": build_tiny_llm_dir(root / "llama", "llama"), "files": write_sft_rows(root / "data")}


def records(run_dir: Path, kind: str) -> list[dict]:
    return [r for r in map(json.loads, (run_dir / "metrics.jsonl").read_text().splitlines()) if r["type"] == kind]


def fit(config, overrides=()):
    return Trainer(load_config(config, list(overrides))).fit()


def test_a_run_records_its_baseline_samples_forgetting_and_data(setup, tmp_path):
    config = write_sft_run_config(tmp_path / "run.yaml", setup["model"], tmp_path / "run", setup["files"],
                                  data={"main_metric": "exact_match"}, training={"max_steps": 8},
                                  optimizer={"name": "adamw", "hparams": {"lr": 1e-2}})
    results = fit(config)
    assert results["main_metric"] == "exact_match" and results["baseline"]["name"] == "pretrained model"
    before = results["baseline"]["metrics"]["validation"]
    after = results["final"]["metrics"]["validation"]
    assert set(after) == {"exact_match", "completion_loss", "perplexity"}
    assert after["completion_loss"] < before["completion_loss"] - 0.5
    assert after["perplexity"] == pytest.approx(2.718281828 ** after["completion_loss"], rel=1e-9)
    forgetting = results["final"]["forgetting"]
    assert set(LM_FORGETTING_MEASURES) <= set(forgetting)
    assert forgetting["kl_from_pretrained"] > 0
    assert forgetting["lm_loss_gained"] == pytest.approx(forgetting["lm_loss"] - forgetting["lm_loss_pretrained"])
    assert len(results["final"]["samples"]) == 2
    assert {"prompt", "reference", "generated"} == set(results["final"]["samples"][0])
    assert results["final"]["samples"][0]["prompt"].startswith("Reverse: ")
    assert results["sft"]["train"]["rows"] == 48 and results["sft"]["validation"]["dropped_no_completion"] == 0
    assert results["forgetting_probe"]["reference"] == "the run's model before its first step"
    evals = records(tmp_path / "run", "eval")
    assert [e["step"] for e in evals] == [4, 8] and all("samples" in e for e in evals)


def test_a_resumed_run_equals_the_uninterrupted_one(setup, tmp_path):
    config = write_sft_run_config(tmp_path / "run.yaml", setup["model"], tmp_path / "full", setup["files"],
                                  checkpoint={"every_steps": 3, "keep_last": 2}, model={"dropout": 0.1})
    full = fit(config)
    trainer = Trainer(load_config(config, [f"logging.output_dir={tmp_path / 'resumed'}"]))
    assert trainer.fit(stop_after_step=3) == {"stopped_at_step": 3}
    resumed = fit(config, [f"logging.output_dir={tmp_path / 'resumed'}", "checkpoint.resume_from=latest"])
    assert resumed["final"]["metrics"] == full["final"]["metrics"]
    assert resumed["final"]["forgetting"] == full["final"]["forgetting"]
    assert resumed["baseline"] == full["baseline"]
    assert [r["loss"] for r in records(tmp_path / "resumed", "train")] == [r["loss"] for r in records(tmp_path / "full", "train")]


def test_packing_trains_on_fewer_sequences(setup, tmp_path):
    config = write_sft_run_config(tmp_path / "run.yaml", setup["model"], tmp_path / "run", setup["files"],
                                  data={"packing": True}, training={"max_steps": 4, "per_device_batch_size": 2})
    results = fit(config)
    stats = results["sft"]["train"]
    assert 0 < stats["packed_sequences"] < stats["rows"]
    assert results["train_examples"] == stats["packed_sequences"]
    assert results["final"]["metrics"]["validation"]["completion_loss"] < \
        results["baseline"]["metrics"]["validation"]["completion_loss"]


def test_lora_with_activation_checkpointing_fine_tunes_a_decoder(setup, tmp_path):
    pytest.importorskip("peft")
    config = write_sft_run_config(tmp_path / "run.yaml", setup["model"], tmp_path / "run", setup["files"],
                                  model={"lora": {"r": 4, "alpha": 8}}, training={"activation_checkpointing": True},
                                  optimizer={"name": "adamw", "hparams": {"lr": 1e-2}})
    results = fit(config)
    assert results["final"]["metrics"]["validation"]["completion_loss"] < \
        results["baseline"]["metrics"]["validation"]["completion_loss"]
    assert results["final"]["forgetting_distance"] > 0  # the merged adapters' distance from θ*
    assert results["final"]["forgetting"]["kl_from_pretrained"] > 0


def test_the_cli_prints_the_pretrained_model_against_the_run(setup, tmp_path):
    config = write_sft_run_config(tmp_path / "run.yaml", setup["model"], tmp_path / "run", setup["files"],
                                  training={"max_steps": 2})
    out = subprocess.run([sys.executable, str(REPO / "launch" / "train.py"), "--config", str(config)],
                         capture_output=True, text=True, cwd=tmp_path, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    assert "pretrained model" in out.stdout and "completion_loss" in out.stdout
    assert "kl_from_pretrained" in out.stdout
    assert "sample: 'Reverse: " in out.stderr


@pytest.mark.parametrize("override, message", [
    ("model.init=random", "model.init: random"),
    ("model.reinit_top_layers=1", "model.reinit_top_layers"),
    ("data.text_columns=[text]", "data.text_columns describes labelled texts"),
    ("data.task=sst2", "data.task names a GLUE task"),
    ("data.source=hub", "data.source: hub with data.problem: causal_lm needs data.hub_id"),
    ("data.source=somewhere", "data.problem: causal_lm reads your files"),
])
def test_a_decoder_run_refuses_what_it_cannot_do_in_one_line(setup, tmp_path, override, message):
    config = write_sft_run_config(tmp_path / "run.yaml", setup["model"], tmp_path / "run", setup["files"])
    with pytest.raises(UserError) as refused:
        load_config(config, [override])
    assert message in str(refused.value)


def test_sft_keys_are_refused_for_a_classifier():
    from ft_framework.config import validate_config

    base = {"model": {"name_or_path": "m"}, "data": {"task": "sst2", "packing": True},
            "schedule": {"warmup_steps": 0}, "training": {"max_steps": 1}}
    with pytest.raises(UserError, match="data.packing is read only when data.problem is causal_lm"):
        validate_config(base)


def test_a_missing_chat_template_file_is_one_line(setup, tmp_path):
    config = write_sft_run_config(tmp_path / "run.yaml", setup["model"], tmp_path / "run", setup["files"],
                                  data={"chat_template": str(tmp_path / "absent.jinja")})
    with pytest.raises(UserError, match="data.chat_template: .*absent.jinja is not a file"):
        fit(config)


@pytest.mark.parametrize("tamper", ["fifo", "missing", "garbage"])
def test_a_resume_refuses_a_tampered_probe_reference_in_one_line(setup, tmp_path, tamper):
    """θ*'s saved answers are data a user hands us: a named pipe is refused, not waited on."""
    import os
    import signal

    config = write_sft_run_config(tmp_path / "run.yaml", setup["model"], tmp_path / "run", setup["files"],
                                  checkpoint={"every_steps": 2})
    assert Trainer(load_config(config)).fit(stop_after_step=2) == {"stopped_at_step": 2}
    share = tmp_path / "run" / "forgetting_reference" / "rank0.safetensors"
    share.unlink()
    if tamper == "fifo":
        os.mkfifo(share)
    elif tamper == "garbage":
        share.write_bytes(b"\x00" * 64)
    signal.alarm(60)
    try:
        with pytest.raises(UserError) as refused:
            fit(config, ["checkpoint.resume_from=latest"])
    finally:
        signal.alarm(0)
    assert "forgetting" in str(refused.value) or "named pipe" in str(refused.value)
    assert "\n" not in str(refused.value)


def test_exact_match_from_one_forward_is_greedy_decodings(setup, tmp_path):
    """The evaluation scores exact match from the loss's forward (greedy_matches); decoding each
    prompt greedily, token by token with the cache, must give the same verdict row by row."""
    import torch

    from ft_framework.task_kinds.causal_lm import greedy_completions, greedy_matches

    config = write_sft_run_config(tmp_path / "run.yaml", setup["model"], tmp_path / "run", setup["files"],
                                  data={"main_metric": "exact_match"}, training={"max_steps": 30},
                                  optimizer={"name": "adamw", "hparams": {"lr": 1e-2}},
                                  evaluation={"num_evals": 1, "forgetting": {"enabled": False}})
    trainer = Trainer(load_config(config))
    results = trainer.fit()
    model = trainer.strategy.unwrapped_model().eval()
    dataset = trainer.data.eval["validation"]
    verdicts = []
    for i in range(len(dataset)):
        row = dataset[i]
        prompt, length = row["prompt_length"], row["completion_length"]
        with torch.no_grad():
            logits = model(input_ids=torch.tensor([row["input_ids"]])).logits[0]
        decoded = greedy_completions(lambda batch: model(**batch), [row["input_ids"][:prompt]], length, 0,
                                     torch.device("cpu"))[0]
        by_decoding = decoded == row["input_ids"][prompt:prompt + length]
        assert greedy_matches(logits, row["input_ids"], prompt, length) == by_decoding, i
        verdicts.append(by_decoding)
    assert any(verdicts) and not all(verdicts)  # both verdicts occur, so the agreement means something
    assert results["final"]["metrics"]["validation"]["exact_match"] == pytest.approx(sum(verdicts) / len(verdicts))
