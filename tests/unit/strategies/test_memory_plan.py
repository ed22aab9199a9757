"""The memory plan against hand-computed bytes, and ALBERT-xxlarge (built on the meta device from
its published architecture: no download, no memory) under ZeRO-2 + CPU offload on a 16 GB GPU."""

import pytest
import torch

from ft_framework.config import validate_config
from ft_framework.strategies.memory_plan import GIB, format_memory_plan, plan_memory


def run_cfg(strategy: dict, precision: str = "bf16", anchor_dtype: str = "float32", state_dtype: str = "float32",
            accumulation: int = 1):
    return validate_config({
        "model": {"name_or_path": "albert/albert-xxlarge-v2"},
        "data": {"task": "rte"},
        "optimizer": {"name": "recadam", "hparams": {"lr": 2e-5}, "anchor_dtype": anchor_dtype,
                      "state_dtype": state_dtype},
        "schedule": {"warmup_steps": 0},
        "training": {"max_steps": 1, "precision": precision, "gradient_accumulation_steps": accumulation},
        "strategy": strategy,
    })


def rows(cfg, **kw):
    return {r.what: (r.device_bytes, r.cpu_bytes) for r in plan_memory(cfg, **kw)}


def test_zero2_offload_bytes_by_hand():
    cfg = run_cfg({"name": "deepspeed", "deepspeed": {"zero_stage": 2, "offload_optimizer": True}})
    got = rows(cfg, world_size=4, num_params=1000, num_anchored=800)
    assert got["parameters (model copy)"] == (2000, 0)             # bf16, replicated in stage 2
    assert "gradients" not in got                                  # straight to the host partition
    assert got["gradients (fp32 partition for the CPU step)"] == (0, 1000)
    assert got["weights partition in the model's dtype (copied back after the step)"] == (0, 500)
    assert got["fp32 master weights"] == (0, 1000)
    assert got["Adam moments (exp_avg, exp_avg_sq)"] == (0, 2000)
    assert got["anchors theta*"] == (0, 800)                       # total / world, on the CPU


def test_zero3_fsdp_and_single_bytes_by_hand():
    z3 = rows(run_cfg({"name": "deepspeed", "deepspeed": {"zero_stage": 3}}), world_size=2,
              num_params=1000, num_anchored=1000)
    assert z3["parameters (model copy)"] == (1000, 0) and z3["anchors theta*"] == (2000, 0)
    fsdp = rows(run_cfg({"name": "fsdp", "fsdp": {"cpu_offload": True}}, anchor_dtype="bfloat16"),
                world_size=2, num_params=1000, num_anchored=1000)
    assert fsdp["anchors theta*"] == (0, 1000)                     # bf16 anchors: 2 bytes, halved
    single = rows(run_cfg({"name": "single"}, precision="fp32"), world_size=1, num_params=10, num_anchored=8)
    assert single == {"parameters": (40, 0), "gradients": (40, 0),
                      "Adam moments (exp_avg, exp_avg_sq)": (80, 0), "anchors theta*": (32, 0)}


def test_compact_state_bytes_by_hand():
    """optimizer.state_dtype bfloat16: bf16 moments (4 B), the fp32 delta of the anchored (4 B),
    bf16 theta* (2 B); the overlapped offload adds its undo copies (8 B); DeepSpeed keeps no delta."""
    def compact(strategy, world_size=1):
        return rows(run_cfg(strategy, precision="fp32", anchor_dtype="bfloat16", state_dtype="bfloat16"),
                    world_size=world_size, num_params=10, num_anchored=8)

    moments, delta = "Adam moments (exp_avg, exp_avg_sq in bf16)", "delta = theta - theta* (fp32 master of the anchored)"
    for name in ("single", "ddp"):
        got = compact({"name": name})
        assert got[moments] == (40, 0) and got[delta] == (32, 0) and got["anchors theta*"] == (16, 0)
    fsdp = compact({"name": "fsdp", "fsdp": {"cpu_offload": True}}, world_size=2)
    assert fsdp[moments] == (0, 20) and fsdp[delta] == (0, 16) and fsdp["anchors theta*"] == (0, 8)
    serial = compact({"name": "single", "offload_optimizer": {"overlap": False}})
    overlap = compact({"name": "single", "offload_optimizer": {"overlap": True}})
    assert serial[moments] == overlap[moments] == (0, 40) and serial[delta] == (0, 32)
    undo = "undo copies of speculative steps (bf16 m, v and the fp32 master)"
    assert undo not in serial and overlap[undo] == (0, 80)
    # DeepSpeed ZeRO-2 with offload: its fp32 partitions are the masters, so no delta; the state on
    # the host is master 4 + moments 4 + theta* 2 = 10 bytes per parameter (of the rank's share).
    zero = compact({"name": "deepspeed", "deepspeed": {"zero_stage": 2, "offload_optimizer": True}}, world_size=2)
    assert delta not in zero and "Adam moments (exp_avg, exp_avg_sq)" not in zero
    assert zero["fp32 master weights"] == (0, 20) and zero[moments] == (0, 20) and zero["anchors theta*"] == (0, 8)


def test_albert_xxlarge_zero2_offload_fits_a_16gb_gpu():
    from transformers import AlbertConfig, AlbertForSequenceClassification

    # albert-xxlarge-v2's architecture (its config.json); only the shapes matter here.
    arch = AlbertConfig(vocab_size=30000, embedding_size=128, hidden_size=4096, num_hidden_layers=12,
                        num_attention_heads=64, intermediate_size=16384, num_labels=2)
    with torch.device("meta"):
        model = AlbertForSequenceClassification(arch)
    params = sum(p.numel() for p in model.parameters())
    anchored = sum(p.numel() for n, p in model.named_parameters() if not n.startswith("classifier"))
    assert 222e6 < params < 224e6  # ≈ 223 M, shared across the 12 layers
    cfg = run_cfg({"name": "deepspeed", "deepspeed": {"zero_stage": 2, "offload_optimizer": True}})
    plan = plan_memory(cfg, world_size=1, num_params=params, num_anchored=anchored)
    device_gib = sum(r.device_bytes for r in plan) / GIB
    cpu_gib = sum(r.cpu_bytes for r in plan) / GIB
    assert device_gib < 0.5     # bf16 weights: the rest of a 16 GB GPU is for activations and buffers
    assert 4.5 < cpu_gib < 4.7  # fp32 grads, masters, 2 moments, anchors: 5 x 0.83 GiB; bf16 weights 0.41
    text = format_memory_plan(plan, strategy="deepspeed", world_size=1)
    assert "anchors theta*" in text and "total" in text


def test_device_lean_offload_bytes_by_hand():
    """training.precision bf16 with the optimizer offloaded: the bf16 model is the only device copy;
    gradients land in bf16 host buffers; micro-batches accumulate in fp32 on the host by default,
    or in bf16 on the device (strategy.offload_optimizer.accumulate: device)."""
    def lean(offload: dict, accumulation: int = 1):
        cfg = run_cfg({"name": "single", "offload_optimizer": offload}, accumulation=accumulation)
        return rows(cfg, world_size=1, num_params=10, num_anchored=8)

    got = lean({"overlap": True})
    assert got["parameters (bf16 model, the only device copy)"] == (20, 0)
    assert got["gradients (bf16, host landing buffers)"] == (0, 20)
    assert got["fp32 master weights"] == (0, 40) and got["anchors theta*"] == (0, 32)
    assert sum(d for d, _ in got.values()) == 20  # nothing else on the device: no fp32 copy, no gradients
    host_sum = "gradients accumulated in fp32 on the host (between micro-batches)"
    assert host_sum not in got and lean({"overlap": False}, accumulation=4)[host_sum] == (0, 40)
    on_device = lean({"overlap": False, "accumulate": "device"}, accumulation=4)
    assert on_device["gradients accumulated on the device (bf16, between micro-batches)"] == (20, 0)
    # fp32: as before, fp32 device copies of the masters
    fp32 = rows(run_cfg({"name": "single", "offload_optimizer": {"overlap": True}}, precision="fp32"),
                world_size=1, num_params=10, num_anchored=8)
    assert fp32["parameters (fp32 device copies of the masters)"] == (40, 0)


# ------------------------------------------------------------------------------------------------
# ALBERT-xxlarge, bf16, batch 32 x 128 tokens, one GPU: the plan against the H200's measurements
# (docs/benchmarks.md, GPU suite part e: torch.cuda.max_memory_allocated, the HF model unchanged,
# no forgetting probe) and the device-lean offload's planned peak against DeepSpeed's measured one.
# ------------------------------------------------------------------------------------------------
H200_FP32_WEIGHTS_UNDER_AUTOCAST_GB = 20.04   # our overlapped offload as it ran then: fp32 device weights, autocast
H200_ZERO2_OFFLOAD_GB = 14.23                 # DeepSpeed ZeRO-2, optimizer offloaded, bf16 weights


def albert_plan(strategy: dict, *, fused: bool, forgetting: bool = False):
    from ft_framework.strategies.memory_fit import plan_run
    from ft_framework.task_kinds import build_task_kind

    cfg = validate_config({
        "model": {"name_or_path": "albert/albert-xxlarge-v2", "fused_activations": fused},
        "data": {"task": "rte", "max_seq_length": 128},
        "optimizer": {"name": "recadam", "hparams": {"lr": 2e-5}}, "schedule": {"warmup_steps": 0},
        "evaluation": {"forgetting": {"enabled": forgetting}},
        "training": {"max_steps": 1, "precision": "bf16", "per_device_batch_size": 32, "device": "cuda"},
        "strategy": strategy})
    return plan_run(cfg, task=build_task_kind(cfg), world_size=1, on_gpu=True)


@pytest.mark.slow
def test_fp32_weights_under_cuda_autocast_plan_within_5_percent_of_the_h200():
    """The configuration the H200 measured at 20.04 GB (fp32 device weights, CUDA autocast, the
    optimizer on the host) no longer runs under bf16 (the offload is device-lean): it is planned with
    the single strategy's dtype rules, less the optimizer state the single strategy keeps on the
    device. The CPU autocast lists planned it at 13.0 GB (-35%)."""
    plan = albert_plan({"name": "single"}, fused=False)
    optimizer_state = ("Adam moments", "anchors theta*")
    device = sum(r.device_bytes for r in plan.tensors if not r.what.startswith(optimizer_state))
    assert device / 1e9 == pytest.approx(H200_FP32_WEIGHTS_UNDER_AUTOCAST_GB, rel=0.05)


@pytest.mark.slow
def test_zero2_offload_plan_within_10_percent_of_the_h200():
    """-5.7% (13.42 planned, 14.23 measured): within the GPU target (10%), not the re-plan's 5%;
    docs/memory.md says what is not found yet."""
    plan = albert_plan({"name": "deepspeed", "deepspeed": {"zero_stage": 2, "offload_optimizer": True}}, fused=False)
    assert plan.live_bytes / 1e9 == pytest.approx(H200_ZERO2_OFFLOAD_GB, rel=0.10)


@pytest.mark.slow
def test_ft_plan_of_the_lean_overlapped_offload_is_at_most_0_6_of_deepspeeds_measured_peak(tmp_path):
    """ft-plan, defaults (fused activations, the forgetting probe's MLM head), context and slack
    included: at most 0.6 x 14.23 GB."""
    import contextlib
    import io
    import json

    import yaml

    from ft_framework import cli

    config = tmp_path / "albert.yaml"
    config.write_text(yaml.safe_dump({
        "model": {"name_or_path": "albert/albert-xxlarge-v2"}, "data": {"task": "rte", "max_seq_length": 128},
        "optimizer": {"name": "recadam", "hparams": {"lr": 2e-5}}, "schedule": {"warmup_steps": 0},
        "training": {"max_steps": 1, "precision": "bf16", "per_device_batch_size": 32},
        "strategy": {"name": "single", "offload_optimizer": {"overlap": True}}}))
    out = io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(io.StringIO()):
        assert cli.plan_main(["--config", str(config), "--json"]) == 0
    answer = json.loads(out.getvalue())
    assert answer["planned_for"] == "gpu"
    peak = answer["per_rank"][0]["device_peak_bytes"]
    assert peak <= 0.6 * H200_ZERO2_OFFLOAD_GB * 1e9, peak / 1e9
    whats = [r["what"] for r in answer["per_rank"][0]["rows"]]
    assert any(w.startswith("CUDA context") for w in whats) and any(w.startswith("caching allocator") for w in whats)
    assert "MLM head kept for the forgetting probe (fp32)" in whats
