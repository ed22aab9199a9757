"""Child-Tuning-D end to end (tiny BERT, one process): the Fisher pass runs before the first step
and its numbers reach results.json; a resume takes the mask from the checkpoint (no second pass)
and ends where the uninterrupted run ends."""

import json
import logging

import torch

from ft_framework.checkpointing.layout import read_fields
from ft_framework.config import load_config
from ft_framework.trainer import Trainer
from tiny_run import write_run_config

CHILD = {"name": "adamw", "hparams": {"lr": 1e-3}, "child_tuning": {"reserve_p": 0.2, "fisher_batches": 3}}


def run(config_path, overrides=(), stop_after_step=None):
    return Trainer(load_config(config_path, list(overrides))).fit(stop_after_step=stop_after_step)


def masks(checkpoint):
    return {n: f["child_mask"] for n, f in read_fields(checkpoint, fields=["child_mask"]).items()}


def test_resume_keeps_the_mask_and_runs_no_second_fisher_pass(tiny_bert_dir, tmp_path, caplog):
    common = dict(optimizer=CHILD, training={"max_steps": 4}, checkpoint={"every_steps": 2},
                  evaluation={"num_evals": 1})
    full = run(write_run_config(tmp_path / "full.yaml", tiny_bert_dir, tmp_path / "full", **common))
    record = full["child_tuning"]
    assert record["fisher_batches"] == 3 and record["kept_elements"] >= record["candidate_elements"] * 0.2
    assert record["kept_fraction"] == record["kept_elements"] / record["candidate_elements"]
    full_masks = masks(tmp_path / "full" / "checkpoints" / "step_00000004")
    # The candidates are the encoder blocks' weights; embeddings, pooler and head have no mask.
    assert full_masks and all(".encoder.layer." in n for n in full_masks)
    assert all(m.dtype == torch.bool for m in full_masks.values())

    cut_cfg = write_run_config(tmp_path / "cut.yaml", tiny_bert_dir, tmp_path / "cut", **common)
    assert run(cut_cfg, stop_after_step=2) == {"stopped_at_step": 2}
    with caplog.at_level(logging.INFO, logger="ft_framework.trainer"):
        resumed = run(cut_cfg, ["checkpoint.resume_from=latest"])
    assert "Fisher" not in caplog.text and "resumed from" in caplog.text
    def same_child(r):  # the pass's seconds are the cut run's own
        return {k: v for k, v in r.items() if k != "fisher_seconds"}

    assert same_child(resumed["child_tuning"]) == same_child(record) and resumed["final"] == full["final"]
    for name, mask in masks(tmp_path / "cut" / "checkpoints" / "step_00000004").items():
        assert torch.equal(mask, full_masks[name]), name
    full_w = read_fields(tmp_path / "full" / "checkpoints" / "step_00000004", fields=["master"])
    for name, fields in read_fields(tmp_path / "cut" / "checkpoints" / "step_00000004", fields=["master"]).items():
        assert torch.equal(fields["master"], full_w[name]["master"]), name
    assert json.loads((tmp_path / "cut" / "results.json").read_text())["child_tuning"] == resumed["child_tuning"]
