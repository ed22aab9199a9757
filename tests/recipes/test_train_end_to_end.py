"""End-to-end runs through the real loading path: loss goes down, logs and results are written,
a resumed run equals an uninterrupted one, the CLI works, and 2-rank DDP equals one process."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tiny_run import write_run_config
from ft_framework.checkpointing.dcp_io import CheckpointReadError
from ft_framework.checkpointing.export import export_pretrained
from ft_framework.cli import export_main
from ft_framework.checkpointing.manager import resolve_latest
from ft_framework.checkpointing.manifest import MANIFEST_FILE
from ft_framework.config import load_config
from ft_framework.config.schema import ForgettingConfig
from ft_framework.models.activation_checkpointing import checkpointed_blocks
from ft_framework.errors import UserError
from ft_framework.run.files import RunPaths, checkpoint_name
from ft_framework.trainer import Trainer

REPO = Path(__file__).resolve().parents[2]


def read_jsonl(path):
    return [json.loads(line) for line in Path(path).read_text().splitlines() if line.strip()]


def run(config_path, overrides=(), stop_after_step=None):
    trainer = Trainer(load_config(config_path, list(overrides)))
    results = trainer.fit(stop_after_step=stop_after_step)
    return trainer, results


def test_training_lowers_the_loss_and_writes_logs_and_results(tiny_bert_dir, tmp_path):
    cfg = write_run_config(tmp_path / "run.yaml", tiny_bert_dir, tmp_path / "out",
                           training={"max_steps": 24}, logging={"tensorboard": True},
                           # 16 examples, 12 epochs: the loop must be able to fit them.
                           data={"max_train_examples": 16},
                           optimizer={"name": "adamw", "hparams": {"lr": 5e-3}})
    trainer, results = run(cfg)
    records = read_jsonl(tmp_path / "out" / "metrics.jsonl")
    train = [r for r in records if r["type"] == "train"]
    evals = [r for r in records if r["type"] == "eval"]
    assert [r["step"] for r in train] == list(range(1, 25))
    first, last = sum(r["loss"] for r in train[:4]) / 4, sum(r["loss"] for r in train[-4:]) / 4
    assert last < first - 0.1, (first, last)
    assert all({"lr", "grad_norm", "lambda", "forgetting_distance"} <= set(r) for r in train)
    # AdamW keeps the anchors for the forgetting distance only; it does not anneal.
    assert train[0]["forgetting_distance"] > 0 and train[0]["lambda"] == [None] * len(trainer.optimizer.param_groups)
    assert [r["step"] for r in evals] == [8, 16, 24]
    saved = json.loads((tmp_path / "out" / "results.json").read_text())
    assert saved["final"]["step"] == 24 and saved["steps"] == 24
    assert set(saved["final"]["metrics"]["validation"]) == {"accuracy"}
    assert saved["baseline"]["metrics"]["validation"]["accuracy"] > 0
    # Mosbach et al.'s failed run: the reported main metric at or below the majority baseline.
    assert saved["main_metric"] == "accuracy" and saved["reported"] == "final"
    run_acc = saved["final"]["metrics"]["validation"]["accuracy"]
    majority_acc = saved["baseline"]["metrics"]["validation"]["accuracy"]
    assert saved["failed"] is (run_acc <= majority_acc), (run_acc, majority_acc, saved["failed"])
    assert saved["config"]["optimizer"]["name"] == "adamw"
    assert any((tmp_path / "out" / "tensorboard").iterdir())
    # Functional forgetting at every evaluation (the tiny BERT has no MLM head: drift only).
    assert all(set(r["forgetting"]) == {"cka_drift_last", "cka_drift_mean"} for r in evals)
    assert saved["final"]["forgetting"]["cka_drift_last"] > 1e-4
    assert saved["forgetting_probe"]["mlm"] is False and saved["forgetting_probe"]["sentences"] == \
        ForgettingConfig().num_sentences


def test_resumed_run_equals_uninterrupted_run(tiny_bert_dir, tmp_path):
    # Dropout on, so the restored RNG state matters too.
    common = dict(training={"max_steps": 10, "per_device_batch_size": 8, "seed": 1, "data_seed": 2,
                            "device": "cpu", "gradient_accumulation_steps": 2})
    full_cfg = write_run_config(tmp_path / "full.yaml", tiny_bert_dir, tmp_path / "full",
                                checkpoint={"every_steps": 3}, **common)
    full, full_results = run(full_cfg, ["model.dropout=0.1"])

    cut_cfg = write_run_config(tmp_path / "cut.yaml", tiny_bert_dir, tmp_path / "cut",
                               checkpoint={"every_steps": 3}, **common)
    stopped = run(cut_cfg, ["model.dropout=0.1"], stop_after_step=7)[1]
    assert stopped == {"stopped_at_step": 7}
    assert (tmp_path / "cut" / "checkpoints" / "latest").read_text() == "step_00000007"
    resumed, resumed_results = run(cut_cfg, ["model.dropout=0.1", "checkpoint.resume_from=latest"])

    for (name, a), (_, b) in zip(full.model.state_dict().items(), resumed.model.state_dict().items()):
        assert torch.equal(a, b), name
    assert resumed_results["final"] == full_results["final"]
    lambdas = [r["lambda"] for r in read_jsonl(tmp_path / "full" / "metrics.jsonl") if r["type"] == "train"]
    assert lambdas[4][0] == 0.5 and 0 < lambdas[0][0] < lambdas[-1][0] < 1  # sigmoid with t0 = 5
    strip = lambda rs: [{k: v for k, v in r.items()} for r in rs]
    assert strip(read_jsonl(tmp_path / "cut" / "metrics.jsonl")) == strip(read_jsonl(tmp_path / "full" / "metrics.jsonl"))


def test_activation_checkpointing_is_applied_and_trains_the_same_weights(tiny_bert_dir, tmp_path):
    """training.activation_checkpointing reaches the model before the strategy wraps it; with
    dropout and Mixout on, the run ends on the same weights and metrics as the run without it."""
    runs = {}
    for checkpointing in (False, True):
        cfg = write_run_config(tmp_path / f"{checkpointing}.yaml", tiny_bert_dir, tmp_path / f"out_{checkpointing}",
                               training={"max_steps": 3, "activation_checkpointing": checkpointing},
                               model={"dropout": 0.1, "mixout": 0.3}, evaluation={"num_evals": 1})
        runs[checkpointing] = run(cfg)
    (plain, plain_results), (checkpointed, checkpointed_results) = runs[False], runs[True]
    assert not checkpointed_blocks(plain.model)
    assert len(checkpointed_blocks(checkpointed.model)) == checkpointed.model.config.num_hidden_layers
    for (name, a), (_, b) in zip(plain.model.state_dict().items(), checkpointed.model.state_dict().items()):
        assert torch.equal(a, b), name
    assert checkpointed_results["final"] == plain_results["final"]


def test_interrupted_save_leaves_previous_checkpoint_latest(tiny_bert_dir, tmp_path):
    cfg = write_run_config(tmp_path / "run.yaml", tiny_bert_dir, tmp_path / "out",
                           checkpoint={"every_steps": 2}, training={"max_steps": 4})
    run(cfg, stop_after_step=2)
    ckpts = tmp_path / "out" / "checkpoints"
    # A crash mid-save leaves a partial directory behind and the pointer untouched.
    partial = ckpts / ".step_00000004.partial"
    partial.mkdir()
    (partial / "model.pt").write_bytes(b"truncated")
    trainer, results = run(cfg, ["checkpoint.resume_from=latest"])
    assert results["steps"] == 4
    with pytest.raises(Exception, match="not a complete checkpoint"):
        run(cfg, [f"checkpoint.resume_from={partial}"])


def test_corrupted_checkpoint_is_a_clear_error(tiny_bert_dir, tmp_path):
    cfg = write_run_config(tmp_path / "run.yaml", tiny_bert_dir, tmp_path / "out",
                           checkpoint={"every_steps": 2}, training={"max_steps": 4})
    run(cfg, stop_after_step=2)
    data = tmp_path / "out" / "checkpoints" / "step_00000002" / "__0_0.distcp"
    # Garbage of the same size: past the manifest's size check, so that reading the data fails.
    garbage = torch.randint(0, 256, (data.stat().st_size,), dtype=torch.uint8,
                            generator=torch.Generator().manual_seed(0))
    data.write_bytes(garbage.numpy().tobytes())
    with pytest.raises(UserError, match="step_00000002 cannot be read") as info:  # a type decides, not a message
        run(cfg, ["checkpoint.resume_from=latest"])
    assert isinstance(info.value.__cause__, CheckpointReadError)


@pytest.mark.slow
def test_cli_runs_and_prints_the_results_table(tiny_bert_dir, tmp_path):
    cfg = write_run_config(tmp_path / "run.yaml", tiny_bert_dir, tmp_path / "out", training={"max_steps": 3})
    out = subprocess.run([sys.executable, str(REPO / "launch" / "train.py"), "--config", str(cfg),
                          "evaluation.num_evals=1"], capture_output=True, text=True, cwd=tmp_path)
    assert out.returncode == 0, out.stderr[-3000:]
    assert "majority class" in out.stdout and "accuracy" in out.stdout
    # the default (auto) without a memory budget: glibc's own policy, said with the setting that chose it
    assert "host allocator: glibc's own (training.host_allocator: auto, without training.memory_budget_gib" \
        in out.stderr
    bad = subprocess.run([sys.executable, str(REPO / "launch" / "train.py"), "--config", str(cfg),
                          "training.max_stepz=3"], capture_output=True, text=True, cwd=tmp_path)
    assert bad.returncode == 2 and "max_stepz" in bad.stderr and "max_steps" in bad.stderr


@pytest.mark.slow
def test_two_rank_ddp_equals_single_process(tiny_bert_dir, tmp_path):
    # 13 probe sentences: rank 1's share is padded, and the padding must not count.
    probe = {"forgetting": {"num_sentences": 13}}
    single_cfg = write_run_config(tmp_path / "single.yaml", tiny_bert_dir, tmp_path / "single",
                                  training={"max_steps": 5, "per_device_batch_size": 8}, evaluation=probe)
    single, _ = run(single_cfg)
    ddp_cfg = write_run_config(tmp_path / "ddp.yaml", tiny_bert_dir, tmp_path / "ddp",
                               training={"max_steps": 5, "per_device_batch_size": 4},
                               strategy={"name": "ddp"}, evaluation=probe)
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    out = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2",
                          "--master_port", "29517", str(REPO / "launch" / "train.py"), "--config", str(ddp_cfg)],
                         capture_output=True, text=True, cwd=tmp_path, env=env, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    a = json.loads((tmp_path / "single" / "results.json").read_text())
    b = json.loads((tmp_path / "ddp" / "results.json").read_text())
    assert a["final"]["metrics"] == b["final"]["metrics"]
    assert b["final"]["forgetting"]["cka_drift_last"] > 0
    assert b["final"]["forgetting"] == pytest.approx(a["final"]["forgetting"], rel=1e-3, abs=1e-7)
    losses_a = [r["loss"] for r in read_jsonl(tmp_path / "single" / "metrics.jsonl") if r["type"] == "train"]
    losses_b = [r["loss"] for r in read_jsonl(tmp_path / "ddp" / "metrics.jsonl") if r["type"] == "train"]
    # DDP logs rank 0's half-batch loss; the gradient (the mean over both halves) drives the same
    # parameters, so the forgetting distance must agree closely.
    dist_a = [r["forgetting_distance"] for r in read_jsonl(tmp_path / "single" / "metrics.jsonl") if r["type"] == "train"]
    dist_b = [r["forgetting_distance"] for r in read_jsonl(tmp_path / "ddp" / "metrics.jsonl") if r["type"] == "train"]
    assert len(losses_a) == len(losses_b) == 5
    assert dist_b == pytest.approx(dist_a, rel=1e-4)


def test_best_on_validation_with_held_out_half_of_dev(tiny_bert_dir, tmp_path):
    cfg = write_run_config(tmp_path / "run.yaml", tiny_bert_dir, tmp_path / "out",
                           training={"max_steps": 6}, evaluation={"num_evals": 3, "select_best": True},
                           data={"split_dev_in_half": True, "max_train_examples": 16},
                           optimizer={"name": "adamw", "hparams": {"lr": 5e-3}},
                           checkpoint={"every_steps": 2, "keep_last": 3, "export_dir": str(tmp_path / "export")})
    _, results = run(cfg)
    evals = [r for r in read_jsonl(tmp_path / "out" / "metrics.jsonl") if r["type"] == "eval"]
    assert all(set(r["metrics"]) == {"validation", "test"} for r in evals)
    best_score = max(r["metrics"]["validation"]["accuracy"] for r in evals)
    first_best = next(r for r in evals if r["metrics"]["validation"]["accuracy"] == best_score)
    assert results["reported"] == "best"
    assert results["best"] == {"step": first_best["step"], "metrics": first_best["metrics"],
                               "forgetting": first_best["forgetting"],
                               "forgetting_distance": first_best["forgetting_distance"]}
    assert set(results["baseline"]["metrics"]) == {"validation", "test"}
    # With select_best the failed flag judges the best evaluation, on the validation half.
    assert results["failed"] is (best_score <= results["baseline"]["metrics"]["validation"]["accuracy"])
    # The best evaluation's checkpoint is kept in the sharded layout (no gathered model file), and
    # it holds the weights of the step-N checkpoint of that evaluation; the export is that model.
    paths = RunPaths(tmp_path / "out")
    best_dir = paths.best_checkpoint
    assert json.loads((best_dir / "COMPLETE").read_text())["step"] == first_best["step"]
    assert (best_dir / MANIFEST_FILE).is_file() and not (tmp_path / "out" / "best").exists()
    assert resolve_latest(paths.latest_checkpoint).name == checkpoint_name(6)  # `latest` is not the best
    same_step = export_pretrained(paths.checkpoints / checkpoint_name(first_best["step"]), tmp_path / "step_export")
    final = export_pretrained(paths.checkpoints / checkpoint_name(6), tmp_path / "final_export")
    from transformers import AutoModelForSequenceClassification

    def weights(directory):
        return AutoModelForSequenceClassification.from_pretrained(directory, dtype=torch.float32).state_dict()

    assert export_main([str(best_dir), str(tmp_path / "cli_export")]) == 0  # ft-export reads it too
    exported, expected, last = weights(tmp_path / "export"), weights(same_step), weights(final)
    by_cli = weights(tmp_path / "cli_export")
    assert set(exported) == set(expected) == set(by_cli)
    for name in expected:
        assert torch.equal(exported[name], expected[name]) and torch.equal(by_cli[name], expected[name]), name
    if first_best["step"] != 6:  # the export is not the final model
        assert any(not torch.equal(exported[n], last[n]) for n in expected)
