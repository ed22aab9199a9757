"""The whole-peak memory plan against a real measured run of a tiny BERT, ft-plan's --json and the
--fit search (strategies/memory_plan.py, memory_trace.py, memory_fit.py)."""

from __future__ import annotations

import contextlib
import io
import json
import sys
from pathlib import Path

import pytest
import torch

from ft_framework import cli
from ft_framework.config import validate_config
from ft_framework.strategies.memory_fit import fit_to_budget, largest_micro_batches, parse_size, plan_run
from ft_framework.strategies.memory_trace import live_bytes, trace_micro_batch
from ft_framework.task_kinds import build_task_kind

sys.path.insert(0, str(Path(__file__).resolve().parents[3] / "benchmarks"))
import memory_plan as bench  # noqa: E402  (benchmarks/memory_plan.py: the measured run)

TINY = {"model_type": "bert", "vocab_size": 1000, "hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4,
        "intermediate_size": 256, "max_position_embeddings": 128, "hidden_dropout_prob": 0.1,
        "attention_probs_dropout_prob": 0.1}


@pytest.fixture()
def tiny_dir(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps(TINY))  # the architecture only: no weights
    return tmp_path


def run_cfg(model_dir, **training):
    return validate_config({
        "model": {"name_or_path": str(model_dir)},
        "data": {"task": "rte", "max_seq_length": 64},
        "optimizer": {"name": "recadam", "hparams": {"lr": 2e-5}},
        "schedule": {"warmup_steps": 0},
        "training": {"max_steps": 2, "per_device_batch_size": 8, "device": "cpu", **training},
    })


def test_live_bytes_counts_a_storage_once_and_frees_it():
    with live_bytes() as counter:
        a = torch.empty(1000, dtype=torch.float32)
        view = a[10:]  # shares a's storage
        assert counter.current == 4000
        del a
        assert counter.current == 4000  # the view keeps the storage alive
        del view
        assert counter.current == 0 and counter.peak == 4000


@pytest.mark.parametrize("checkpointing", [False, True])
def test_plan_is_within_10_percent_of_a_measured_run(tiny_dir, checkpointing):
    cfg = run_cfg(tiny_dir, activation_checkpointing=checkpointing)
    plan = plan_run(cfg, task=build_task_kind(cfg), world_size=1, on_gpu=False)
    measured, _ = bench.measured_run(cfg)
    assert plan.live_bytes == pytest.approx(measured["live_peak"], rel=0.10)


def test_checkpointing_traces_fewer_activation_bytes(tiny_dir):
    cfg = run_cfg(tiny_dir)
    from ft_framework.strategies.memory_fit import load_architecture

    arch = load_architecture(cfg.model).config
    kw = dict(batch_size=8, seq_len=64, param_dtype=torch.float32, autocast_dtype=None, keep_grads=False,
              task=build_task_kind(cfg))
    plain = trace_micro_batch(arch, checkpointing=False, **kw)
    ckpt = trace_micro_batch(arch, checkpointing=True, **kw)
    assert ckpt.param_bytes == plain.param_bytes and ckpt.above_params < 0.8 * plain.above_params


def ft_plan(*argv):
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        code = cli.plan_main(list(argv))
    return code, out.getvalue(), err.getvalue()


def write_config(tmp_path, model_dir, **training):
    import yaml

    path = tmp_path / "run.yaml"
    path.write_text(yaml.safe_dump({
        "model": {"name_or_path": str(model_dir)}, "data": {"task": "rte", "max_seq_length": 64},
        "optimizer": {"name": "recadam", "hparams": {"lr": 2e-5}}, "schedule": {"warmup_steps": 0},
        "training": {"max_steps": 2, "per_device_batch_size": 8, "gradient_accumulation_steps": 2, **training}}))
    return path


def test_ft_plan_json_has_each_ranks_peaks_and_rows(tiny_dir, tmp_path):
    code, out, _ = ft_plan("--config", str(write_config(tmp_path, tiny_dir)), "--json", "--ranks", "2",
                           "strategy.name=deepspeed", "strategy.deepspeed={zero_stage: 2, offload_optimizer: true}")
    assert code == 0
    answer = json.loads(out)
    assert answer["ranks"] == 2 and len(answer["per_rank"]) == 2
    rank = answer["per_rank"][0]
    assert rank["on_gpu"] is True  # training.device auto: planned for a GPU
    assert rank["device_peak_bytes"] == sum(r["device_bytes"] for r in rank["rows"])
    assert rank["host_peak_bytes"] == pytest.approx(sum(r["host_bytes"] for r in rank["rows"]), abs=len(rank["rows"]))
    assert rank["host_peak_bytes"] > 0  # the offloaded optimizer state
    whats = [r["what"] for r in rank["rows"]]
    assert "anchors theta*" in whats and any(w.startswith("activations") for w in whats)
    assert any(w.startswith("CUDA context") for w in whats)


def test_fit_keeps_the_global_batch_and_takes_the_largest_micro_batch(tiny_dir):
    cfg = run_cfg(tiny_dir, device="cuda", per_device_batch_size=8, gradient_accumulation_steps=2)
    plans = {b: plan_run((planned := run_cfg(tiny_dir, device="cuda", per_device_batch_size=b)), task=build_task_kind(planned), world_size=1, on_gpu=True)
             for b in (4, 8)}
    budget = (plans[4].device_peak + plans[8].device_peak) / 2  # batch 4 fits, batch 8 does not
    fit = fit_to_budget(cfg, task=build_task_kind(cfg), budget_bytes=budget, world_size=1, on_gpu=True)
    assert fit.overrides == ["training.per_device_batch_size=4", "training.gradient_accumulation_steps=4"]
    assert fit.plan.device_peak <= budget


def test_fit_turns_checkpointing_on_when_batch_one_does_not_fit(tiny_dir):
    cfg = run_cfg(tiny_dir, per_device_batch_size=2)  # a CPU run: activations are a large share
    one = plan_run((planned := run_cfg(tiny_dir, per_device_batch_size=1)), task=build_task_kind(planned), world_size=1, on_gpu=False)
    fit = fit_to_budget(cfg, task=build_task_kind(cfg), budget_bytes=one.device_peak * 0.999, world_size=1, on_gpu=False)
    assert fit is not None and "training.activation_checkpointing=true" in fit.overrides
    assert fit.plan.device_peak <= one.device_peak * 0.999
    assert fit_to_budget(cfg, task=build_task_kind(cfg), budget_bytes=1.0, world_size=1, on_gpu=False) is None


def test_sizes_and_a_bad_size():
    assert parse_size("16GiB") == 16 * 2**30 and parse_size("40 GB") == 40e9 and parse_size("512MiB") == 2**29
    with pytest.raises(Exception, match="is not a size"):
        parse_size("sixteen")


def test_ft_plan_names_a_hub_model_it_cannot_read_in_one_line(tmp_path):
    config = write_config(tmp_path, "nobody/not-a-cached-model")
    code, out, err = ft_plan("--config", str(config))
    assert code == 2 and out == ""
    assert len(err.strip().splitlines()) == 1 and "not in the Hugging Face cache" in err


def test_largest_micro_batch_fits_and_the_next_does_not(tiny_dir):
    cfg = run_cfg(tiny_dir, device="cuda")  # on a GPU the step's temporaries flatten the plan at small batches
    peak = {b: plan_run((planned := run_cfg(tiny_dir, device="cuda", per_device_batch_size=b)), task=build_task_kind(planned), world_size=1,
                        on_gpu=True).device_peak for b in (1, 40, 41)}
    budgets = [peak[1] / 2, (peak[40] + peak[41]) / 2]
    assert largest_micro_batches(cfg, task=build_task_kind(cfg), budgets_bytes=budgets, world_size=1, on_gpu=True) == [0, 40]


def test_ft_plan_says_which_device_it_planned_for(tiny_dir, tmp_path):
    config = str(write_config(tmp_path, tiny_dir))
    _, cpu, _ = ft_plan("--config", config, "training.device=cpu")
    assert "planned for: CPU (training.device: cpu)" in cpu
    code, auto, _ = ft_plan("--config", config)  # training.device: auto
    assert code == 0
    if torch.cuda.is_available():
        assert "planned for: GPU (training.device: auto; this machine has one)" in auto
    else:  # this machine has no GPU: the plan is still a GPU run's, and says where ft-train would run
        assert "planned for: GPU (training.device: auto; this machine has none: ft-train here would run on the CPU" \
            in auto
    assert "CUDA context" in auto and "CUDA context" not in cpu
    code, out, _ = ft_plan("--config", config, "--json", "training.device=cpu")
    assert json.loads(out)["planned_for"] == "cpu"


def test_the_cpu_plan_names_the_process_runtime_and_a_gpu_plan_the_checkpoint_copy(tiny_dir):
    from ft_framework.strategies.memory_plan import HOST_RUNTIME_BYTES

    cpu = plan_run((planned := run_cfg(tiny_dir)), task=build_task_kind(planned), world_size=1, on_gpu=False)
    runtime = [r for r in cpu.runtime if r.what.startswith("process runtime")]
    assert [r.cpu_bytes for r in runtime] == [HOST_RUNTIME_BYTES]
    assert cpu.process_bytes == pytest.approx(cpu.live_bytes + HOST_RUNTIME_BYTES)
    gpu = plan_run((planned := run_cfg(tiny_dir, device="cuda")), task=build_task_kind(planned), world_size=1, on_gpu=True)
    copy = [r for r in gpu.tensors if r.what.startswith("host copy of the device state while DCP saves")]
    device_state = sum(r.device_bytes for r in gpu.tensors[:4] if "gradient" not in r.what)  # parameters, moments, theta*
    assert len(copy) == 1 and copy[0].cpu_bytes == device_state > 0
    assert not any(r.what.startswith("host copy") for r in cpu.tensors)


def test_the_offload_saves_its_host_masters_so_no_host_copy_of_its_device_weights_is_planned(tiny_dir):
    """DCP copies device tensors to host memory while it saves; the offload's checkpoint holds its
    host masters and state (strategies/offload.py), its device weights being copies of them."""
    def copies(strategy):
        cfg = validate_config({
            "model": {"name_or_path": str(tiny_dir)}, "data": {"task": "rte", "max_seq_length": 64},
            "optimizer": {"name": "recadam", "hparams": {"lr": 2e-5}}, "schedule": {"warmup_steps": 0},
            "training": {"max_steps": 2, "per_device_batch_size": 8, "device": "cuda", "precision": "bf16"},
            "strategy": strategy})
        return [r for r in plan_run(cfg, task=build_task_kind(cfg), world_size=1, on_gpu=True).tensors
                if r.what.startswith("host copy of the device state")]

    assert len(copies({"name": "single"})) == 1  # the device holds the weights, moments and theta*
    assert copies({"name": "single", "offload_optimizer": {"overlap": True}}) == []
    assert copies({"name": "single", "offload_optimizer": {"overlap": False}}) == []
