"""The memory plan against hand-computed bytes, and ALBERT-xxlarge (built on the meta device from
its published architecture: no download, no memory) under ZeRO-2 + CPU offload on a 16 GB GPU."""

import torch

from ft_framework.config import validate_config
from ft_framework.strategies.memory_plan import GIB, format_memory_plan, plan_memory


def run_cfg(strategy: dict, precision: str = "bf16", anchor_dtype: str = "float32", state_dtype: str = "float32"):
    return validate_config({
        "model": {"name_or_path": "albert/albert-xxlarge-v2"},
        "data": {"task": "rte"},
        "optimizer": {"name": "recadam", "hparams": {"lr": 2e-5}, "anchor_dtype": anchor_dtype,
                      "state_dtype": state_dtype},
        "schedule": {"warmup_steps": 0},
        "training": {"max_steps": 1, "precision": precision},
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
