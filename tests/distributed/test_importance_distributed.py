"""optimizer.importance on 2 ranks (gloo, CPU): the Fisher of theta* on the probe's general text,
captured under DDP, FSDP2 (with and without cpu_offload) and DeepSpeed ZeRO 1-3 (ZeRO-3 with and
without the optimizer offloaded; one launch, each backend on ranks of its own forked from one process: rank_launcher.py), equals the
one-process capture (each rank reads its share of the reduced gradient in the optimizer's step; F~
is normalised over every rank's anchored elements): to the fp32 rounding of the gradients' reduce,
then bf16. In bf16 mixed precision (DeepSpeed's ZeRO-1 and ZeRO-2 in bf16, fp32 masters), the
2-rank capture equals one process's bf16 capture to the rounding of bf16 gradients. F~ is optimizer state: each backend's checkpoint holds it, and a resume reshards it
instead of capturing it again (a ZeRO-3 checkpoint resumed under FSDP2 on 2 ranks, a one-process
one under ZeRO-2, an FSDP2 one in one process), ending where the uninterrupted run ends."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from ft_framework.checkpointing.layout import read_fields
from rank_launcher import FIT_WORKER, fit_step, launch
from tiny_llm import build_tiny_llm_dir, write_sft_rows, write_sft_run_config

pytest.importorskip("deepspeed")
pytestmark = pytest.mark.slow
# 7 probe sentences: 3 whole batches of 2 (one sentence a rank on 2 ranks).
OPTIMIZER = {"name": "recadam", "hparams": {"lr": 3e-3, "anneal_k": 0.5, "anneal_t0": 5, "pretrain_cof": 100.0},
             "importance": {"source": "probe", "batch_size": 2}}
TWO_RANK = {
    "ddp": {"name": "ddp"},
    "fsdp": {"name": "fsdp"},
    # the sharded parameters, gradients and optimizer state (F~ with them) in host memory
    "fsdp_offload": {"name": "fsdp", "fsdp": {"cpu_offload": True}},
    "zero1": {"name": "deepspeed", "deepspeed": {"zero_stage": 1}},
    "zero2": {"name": "deepspeed", "deepspeed": {"zero_stage": 2}},
    "zero3": {"name": "deepspeed", "deepspeed": {"zero_stage": 3}},
    # the fp32 partitions and their state (F~ with them) in host memory, stepped there
    "zero3_offload": {"name": "deepspeed", "deepspeed": {"zero_stage": 3, "offload_optimizer": True}},
}
# bf16 weights and gradients, fp32 masters (ZeRO-0 in bf16 is refused: config/deepspeed_stage.py).
BF16_TWO_RANK = {
    "zero1_bf16": {"name": "deepspeed", "deepspeed": {"zero_stage": 1}},
    "zero2_bf16": {"name": "deepspeed", "deepspeed": {"zero_stage": 2}},
}
BF16 = {"precision": "bf16"}
CHECKPOINT = {"every_steps": 3, "keep_last": 2}


def fit(config: Path, overrides=()):
    from ft_framework.config import load_config
    from ft_framework.trainer import Trainer

    trainer = Trainer(load_config(config, list(overrides)))
    results = trainer.fit()
    trainer.strategy.close()
    return results


def importance(run_dir: Path, step: int) -> dict[str, torch.Tensor]:
    fields = read_fields(run_dir / "checkpoints" / f"step_{step:08d}", fields=["importance"])
    return {name: f["importance"] for name, f in fields.items() if "importance" in f}


def train_losses(run_dir: Path) -> dict[int, float]:
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return {r["step"]: r["loss"] for r in records if r["type"] == "train"}


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    root = tmp_path_factory.mktemp("importance")
    files = write_sft_rows(root / "data")
    model = build_tiny_llm_dir(root / "llama", "llama")
    single = write_sft_run_config(root / "single.yaml", model, root / "single", files, optimizer=OPTIMIZER,
                                  checkpoint=CHECKPOINT)
    fit(single)
    fit(write_sft_run_config(root / "single_bf16.yaml", model, root / "single_bf16", files, optimizer=OPTIMIZER,
                             training=BF16, checkpoint=CHECKPOINT))
    plan, configs = [], {}
    for name, strategy in TWO_RANK.items():
        configs[name] = write_sft_run_config(root / f"{name}.yaml", model, root / name, files, optimizer=OPTIMIZER,
                                             strategy=strategy, training={"per_device_batch_size": 4},
                                             checkpoint=CHECKPOINT)
        plan.append(fit_step(configs[name]))
    for name, strategy in BF16_TWO_RANK.items():
        configs[name] = write_sft_run_config(root / f"{name}.yaml", model, root / name, files, optimizer=OPTIMIZER,
                                             strategy=strategy, training={"per_device_batch_size": 4, **BF16},
                                             checkpoint=CHECKPOINT)
        plan.append(fit_step(configs[name]))
    # ZeRO-3's flat partitions resharded into FSDP2's DTensor shards, on 2 ranks
    zero3_checkpoint = root / "zero3" / "checkpoints" / "step_00000003"
    plan.append(fit_step(configs["fsdp"], [f"logging.output_dir={root / 'zero3_to_fsdp'}",
                                           f"checkpoint.resume_from={zero3_checkpoint}"]))
    # one process's whole tensors resharded into ZeRO-2's flat partitions
    single_checkpoint = root / "single" / "checkpoints" / "step_00000003"
    plan.append(fit_step(configs["zero2"], [f"logging.output_dir={root / 'single_to_zero2'}",
                                            f"checkpoint.resume_from={single_checkpoint}"]))
    launch(FIT_WORKER, plan, root)
    return root, configs


@pytest.mark.parametrize("strategy", list(TWO_RANK))
def test_two_ranks_capture_the_one_process_importance(runs, strategy):
    root, _ = runs
    want, got = importance(root / "single", 3), importance(root / strategy, 3)
    assert sorted(got) == sorted(want) and len(want) > 5
    same = total = 0
    for name, value in want.items():
        assert got[name].dtype == torch.bfloat16 and got[name].shape == value.shape, name
        # F differs from one process's by the fp32 rounding of the ranks' reduce: at most one bf16 step
        torch.testing.assert_close(got[name].float(), value.float(), rtol=2 ** -7, atol=1e-6, msg=name)
        same += int((got[name] == value).sum())
        total += value.numel()
    assert same > 0.95 * total
    a, b = (json.loads((root / d / "results.json").read_text())["importance"] for d in ("single", strategy))
    assert (b["batches"], b["tokens"], b["anchored_elements"]) == (a["batches"], a["tokens"], a["anchored_elements"]) \
        == (3, a["tokens"], sum(v.numel() for v in want.values()))
    assert b["mean_fisher"] == pytest.approx(a["mean_fisher"], rel=1e-5)
    assert b["max_importance"] == pytest.approx(a["max_importance"], rel=2 ** -7)
    # F~ is kept as it was captured: the last checkpoint holds the same
    assert all(torch.equal(t, importance(root / strategy, 6)[n]) for n, t in got.items())


@pytest.mark.parametrize("strategy", list(BF16_TWO_RANK))
def test_two_ranks_in_bf16_capture_the_one_process_bf16_importance(runs, strategy):
    """A bf16 forward and backward differs from another by more than one rounding: the halves' bf16
    gradients reduced against the whole batch's, each through a different bf16 summation order. Measured
    (tiny Llama, 23,808 anchored elements): one process's bf16 F~ against its fp32 F~ has 99.8 % of the
    elements within 2^-2 relative and 93 % within 2^-4; ZeRO-1 bf16 against one process's bf16 99.5 %
    and 88 %. So the bound: 99 % within 2^-2, half within 2^-4, the mean Fisher within 1 %."""
    root, _ = runs
    want, got = importance(root / "single_bf16", 3), importance(root / strategy, 3)
    assert sorted(got) == sorted(want) and len(want) > 5
    relative = []
    for name, value in want.items():
        assert got[name].dtype == torch.bfloat16 and got[name].shape == value.shape, name
        a, b = got[name].float(), value.float()
        relative.append(((a - b).abs() / b.abs().clamp_min(1e-6)).flatten())
    relative = torch.cat(relative)
    assert float((relative <= 2 ** -2).float().mean()) > 0.99
    assert float((relative <= 2 ** -4).float().mean()) > 0.5
    a, b = (json.loads((root / d / "results.json").read_text())["importance"] for d in ("single_bf16", strategy))
    assert (b["batches"], b["tokens"], b["anchored_elements"]) == (a["batches"], a["tokens"], a["anchored_elements"])
    assert b["mean_fisher"] == pytest.approx(a["mean_fisher"], rel=1e-2)
    assert all(torch.equal(t, importance(root / strategy, 6)[n]) for n, t in got.items())


def test_a_zero3_checkpoint_resumes_under_fsdp_without_a_second_capture(runs):
    root, _ = runs
    resumed, straight = root / "zero3_to_fsdp", root / "zero3"
    got = importance(resumed, 6)
    assert all(torch.equal(got[n], t) for n, t in importance(straight, 3).items())
    assert "importance" in json.loads((resumed / "results.json").read_text())  # the checkpoint's record
    want, losses = train_losses(root / "single"), train_losses(resumed)
    assert sorted(losses) == [4, 5, 6]
    assert [losses[s] for s in (4, 5, 6)] == pytest.approx([want[s] for s in (4, 5, 6)], rel=1e-5)


def test_a_one_process_checkpoint_resumes_under_zero2_without_a_second_capture(runs):
    root, _ = runs
    got, want = importance(root / "single_to_zero2", 6), importance(root / "single", 3)
    assert sorted(got) == sorted(want) and all(torch.equal(got[n], t) for n, t in want.items())
    single, losses = train_losses(root / "single"), train_losses(root / "single_to_zero2")
    assert sorted(losses) == [4, 5, 6]
    assert [losses[s] for s in (4, 5, 6)] == pytest.approx([single[s] for s in (4, 5, 6)], rel=1e-5)


def test_a_two_rank_fsdp_checkpoint_resumes_in_one_process(runs, tmp_path):
    root, configs = runs
    fit(configs["fsdp"], [f"logging.output_dir={tmp_path / 'resumed'}", "strategy.name=single", "strategy.fsdp=null",
                          "training.per_device_batch_size=8",
                          f"checkpoint.resume_from={root / 'fsdp' / 'checkpoints' / 'step_00000003'}"])
    got, want = importance(tmp_path / "resumed", 6), importance(root / "fsdp", 3)
    assert sorted(got) == sorted(want)
    assert all(torch.equal(got[n], t) for n, t in want.items())
    single, losses = train_losses(root / "single"), train_losses(tmp_path / "resumed")
    assert [losses[s] for s in (4, 5, 6)] == pytest.approx([single[s] for s in (4, 5, 6)], rel=1e-5)
