"""The trainer on one GPU, every strategy, with nccl as the backend (world size 1 under the
deepspeed launcher and torchrun): single (fp32, bf16, fp16), our offload overlapped with backward,
DeepSpeed ZeRO 1, 2, 2 + offload, 3, 3 + offload, FSDP2 and FSDP2 + CPU offload, and the compact
optimizer state (optimizer.state_dtype bfloat16) under each offload that runs it; a few steps of a
tiny BERT saved with save_pretrained. Per case:

- the anchors, gathered in full after the run, equal theta* (the saved pretrained tensors) exactly,
  rounded to bf16 where the compact state keeps them so;
- ||theta - theta*|| at every step equals the same run's fp32 CPU reference within tolerance;
- a run resumed from the step-3 checkpoint equals the uninterrupted run;
- the export loads with from_pretrained, and its distance to theta* is the run's last logged one;
- under offload the step ran the C++ kernel on CPU tensors (impl "cpu"), otherwise the program impl="auto"
  picks for CUDA tensors (Triton where it imports, else torch).

Each launcher is started once for all of its cases (tests/gpu/gpu_worker.py writes what it saw).
Skipped without CUDA; FT_GPU_TESTS_DEVICE=cpu runs it all on the CPU with gloo (smoke test).
"""

from __future__ import annotations

import math

import pytest
import torch

from gpu_common import (CASES, RESUME_AT, STEPS, case_params, file_key, rel_diff, run_device, theta_star,
                        train_records)

ON_CUDA = run_device() == "cuda"


def auto_impl_on_cuda() -> str:
    """The step program impl="auto" picks for CUDA parameters (optim/programs.py decides)."""
    from ft_framework.optim.programs import resolve_impl

    return resolve_impl("auto", [torch.empty(1, device="cuda")])


AUTO_ON_CUDA = auto_impl_on_cuda() if ON_CUDA and torch.cuda.is_available() else None


@pytest.mark.parametrize("case_name", case_params())
def test_anchors_equal_theta_star(case_name, launches):
    case = CASES[case_name]
    rec = launches.result(case_name)
    for phase in ("full", "resumed"):
        a = rec[phase]["anchors"]
        assert a["count"] > 0 and a["count"] == a["expected"], (phase, a, rec[phase]["anchor_errors"])
        assert a["missing"] == [] and a["unexpected"] == [], (phase, a)
        assert a["mismatched"] == [], f"{phase}: anchors differ from theta* (max |diff| {a['max_abs_diff']}): {a['mismatched'][:5]}"
        assert rec[phase]["anchor_state_dtypes"] == [f"torch.{case.anchor_dtype}"], (phase, rec[phase])


@pytest.mark.parametrize("case_name", case_params())
def test_forgetting_distance_matches_cpu_reference(case_name, launches, cpu_reference):
    case = CASES[case_name]
    rec = launches.result(case_name)
    run = train_records(rec["full_dir"])
    ref = train_records(cpu_reference["out_dir"])
    assert [r["step"] for r in run] == [r["step"] for r in ref] == list(range(1, STEPS + 1))
    tol = case.tolerance()
    taken = rec["full"]["optimizer_steps"]
    skipped = STEPS - max(taken) if taken else 0
    if skipped:
        # fp16's loss scaler skipped overflowing steps: the trajectories differ by those steps.
        assert case.precision == "fp16" and skipped <= 2, (taken, case.precision)
        last, last_ref = run[-1]["forgetting_distance"], ref[-1]["forgetting_distance"]
        assert rel_diff(last, last_ref) <= tol + skipped / STEPS, (last, last_ref, skipped)
        return
    print(case_name, "relative deviation from the CPU reference per step:",
          [round(rel_diff(r["forgetting_distance"], q["forgetting_distance"]), 5) for r, q in zip(run, ref)])
    for r, q in zip(run, ref):
        assert r["forgetting_distance"] > 0
        assert rel_diff(r["forgetting_distance"], q["forgetting_distance"]) <= tol, \
            f"step {r['step']}: {r['forgetting_distance']} vs CPU {q['forgetting_distance']} (rel tol {tol})"
        assert r["lambda"] == pytest.approx(q["lambda"], rel=1e-6)
        if case.precision == "fp32":
            assert rel_diff(r["grad_norm"], q["grad_norm"]) <= 5e-3, (r["step"], r["grad_norm"], q["grad_norm"])
            assert rel_diff(r["loss"], q["loss"]) <= 5e-3, (r["step"], r["loss"], q["loss"])


@pytest.mark.parametrize("case_name", case_params())
def test_resume_equals_uninterrupted_run(case_name, launches):
    import json
    from pathlib import Path

    from transformers import AutoModelForSequenceClassification

    case = CASES[case_name]
    rec = launches.result(case_name)
    tol = case.resume_tolerance()
    full = [r for r in train_records(rec["full_dir"]) if r["step"] > RESUME_AT]
    resumed = train_records(rec["resumed_dir"])
    assert [r["step"] for r in resumed] == [r["step"] for r in full] == list(range(RESUME_AT + 1, STEPS + 1))
    for a, b in zip(full, resumed):
        for key in ("loss", "grad_norm", "forgetting_distance"):
            assert rel_diff(b[key], a[key]) <= tol, f"step {a['step']} {key}: resumed {b[key]} vs {a[key]}"
        assert b["lambda"] == a["lambda"] and b["lr"] == pytest.approx(a["lr"], rel=1e-12)
    assert rec["resumed"]["steps"] == rec["full"]["steps"] == STEPS
    assert rec["resumed"]["optimizer_steps"] == rec["full"]["optimizer_steps"]
    res_a = json.loads((Path(rec["full_dir"]) / "results.json").read_text())
    res_b = json.loads((Path(rec["resumed_dir"]) / "results.json").read_text())
    assert res_b["final"]["step"] == res_a["final"]["step"] == STEPS
    assert res_b["final"]["metrics"] == res_a["final"]["metrics"]
    ma = AutoModelForSequenceClassification.from_pretrained(rec["full_export"]).state_dict()
    mb = AutoModelForSequenceClassification.from_pretrained(rec["resumed_export"]).state_dict()
    assert ma.keys() == mb.keys()
    for name in ma:
        torch.testing.assert_close(mb[name], ma[name], rtol=tol, atol=tol * 0.1, msg=lambda m: f"{name}: {m}")


@pytest.mark.parametrize("case_name", case_params())
def test_export_loads_with_from_pretrained(case_name, launches, gpu_model_dir):
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    case = CASES[case_name]
    rec = launches.result(case_name)
    model, info = AutoModelForSequenceClassification.from_pretrained(rec["full_export"], output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"] and not info.get("mismatched_keys"), info
    tokenizer = AutoTokenizer.from_pretrained(rec["full_export"])
    batch = tokenizer(["the service is absolutely sloppy ."], return_tensors="pt")
    batch.pop("token_type_ids", None)
    with torch.no_grad():
        logits = model.eval()(**batch).logits
    assert logits.shape == (1, 2) and torch.isfinite(logits).all()
    assert all(p.dtype == torch.float32 for p in model.parameters())
    # The export holds the run's final fp32 weights: its distance to theta* as the optimizer keeps it
    # (rounded to bf16 by the compact state) is the last logged one.
    anchor_dtype = getattr(torch, case.anchor_dtype)
    saved = {k: v.to(anchor_dtype) for k, v in theta_star(gpu_model_dir).items()}
    sq = 0.0
    for name, p in model.named_parameters():
        key = file_key(saved, name)
        if key is not None:
            sq += float((p.detach().double() - saved[key].double()).square().sum())
    logged = train_records(rec["full_dir"])[-1]["forgetting_distance"]
    assert rel_diff(math.sqrt(sq), logged) <= 1e-4, (math.sqrt(sq), logged)


@pytest.mark.parametrize("case_name", case_params())
def test_step_ran_where_expected(case_name, launches):
    case = CASES[case_name]
    rec = launches.result(case_name)
    for phase in ("full", "resumed"):
        obs = rec[phase]
        devices = set(obs["param_devices"])
        if not ON_CUDA:  # smoke run: everything is on the CPU, where the C++ kernel runs
            assert obs["impl"] == "cpu" and devices == {"cpu"}, (phase, obs)
        elif case.offload:
            assert obs["impl"] == "cpu", (phase, obs["impl"], "the offloaded step must run the C++ kernel")
            assert devices == {"cpu"}, (phase, devices)
            assert set(obs["state_devices"]) == {"cpu"}, (phase, obs["state_devices"])
        else:
            # impl="auto" on CUDA parameters: the program programs.py prefers there (Triton where it imports).
            assert obs["impl"] == AUTO_ON_CUDA, (phase, obs["impl"])
            assert devices and all(d.startswith("cuda") for d in devices), (phase, devices)
            assert all(d.startswith("cuda") for d in obs["state_devices"]), (phase, obs["state_devices"])
        expected_backend = None if case.launcher == "python" else ("nccl" if ON_CUDA else "gloo")
        assert obs["backend"] == expected_backend, (phase, obs["backend"])
