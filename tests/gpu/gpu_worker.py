"""Runs the GPU test cases of one launcher in ONE launch (starting a launcher costs more than a
case) and writes what it observed to RESULTS_DIR/<case>.json; tests/gpu/test_gpu.py asserts on it.

    python gpu_worker.py RESULTS_DIR MODEL_DIR single_fp32 single_bf16 single_fp16
    deepspeed --num_gpus 1 gpu_worker.py RESULTS_DIR MODEL_DIR zero1 zero2 ...
    python -m torch.distributed.run --nproc_per_node 1 gpu_worker.py RESULTS_DIR MODEL_DIR fsdp fsdp_offload

Per case: run A (uninterrupted, STEPS steps, checkpoint after RESUME_AT, export), then run C
(resumed from A's checkpoint, exported too). After each run, on every rank (the gathers are
collective): the anchors gathered in full and compared with theta* as saved, the optimizer's
implementation and where its tensors live, the process group's backend. A failing case writes its
traceback and the next case runs.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import sys
import time
import traceback
from pathlib import Path

os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")  # deterministic cuBLAS (before CUDA starts)
if os.environ.get("FT_GPU_TESTS_DEVICE", "cuda") == "cpu":
    os.environ.setdefault("DS_ACCELERATOR", "cpu")  # before deepspeed is imported

sys.path.insert(0, str(Path(__file__).resolve().parent))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

from gpu_common import (CASES, RESUME_AT, file_key, run_config, run_device, theta_star,  # noqa: E402
                        write_config)


def local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if hasattr(t, "to_local") else t


def full_dtensor(t: torch.Tensor) -> torch.Tensor:
    """Full value of a (possibly sharded, possibly CPU-offloaded) DTensor, on the CPU (collective).
    Under FSDP2 CPU offload the local shard is a CPU tensor on a CUDA mesh: nccl cannot gather it
    there, so the shard is moved to the mesh's device first."""
    if not hasattr(t, "full_tensor"):
        return t.detach().cpu()
    from torch.distributed.tensor import DTensor

    shard = t.to_local()
    mesh = t.device_mesh
    if shard.device.type != mesh.device_type:
        t = DTensor.from_local(shard.to(mesh.device_type), mesh, t.placements, run_check=False,
                               shape=t.shape, stride=t.stride())
    return t.full_tensor().detach().cpu()


def plain_module(trainer):
    """The model inside the DeepSpeed engine (its parameters carry ZeRO's mappings)."""
    strategy = trainer.strategy
    if hasattr(strategy, "unwrapped_model"):
        return strategy.unwrapped_model()
    return trainer.model.module


def gather_anchors(trainer, strategy_name: str) -> tuple[dict[str, torch.Tensor], list[str]]:
    """{parameter name: full anchor} for every anchored parameter, and errors met on the way."""
    anchors: dict[str, torch.Tensor] = {}
    errors: list[str] = []
    opt = trainer.optimizer
    if strategy_name == "deepspeed":
        from deepspeed.utils import safe_get_full_optimizer_state

        for name, p in plain_module(trainer).named_parameters():
            try:
                value = safe_get_full_optimizer_state(p, "anchor")
            except (KeyError, ValueError) as exc:  # no anchor state (the new head)
                errors.append(f"{name}: {type(exc).__name__}: {exc}")
                continue
            if value is not None:
                anchors[name] = value.detach().cpu().reshape(p.ds_shape if hasattr(p, "ds_shape") else p.shape)
        return anchors, errors
    if strategy_name == "fsdp":
        for name, p in trainer.model.named_parameters():
            state = opt.state.get(p, {})
            if "anchor" in state:
                anchors[name] = full_dtensor(state["anchor"])
        return anchors, errors
    # One process: the checkpoint's fragments name each anchor, also where the optimizer steps
    # host masters rather than the model's (device) parameters (strategy.offload_optimizer).
    shapes = {name: p.shape for name, p in trainer.model.named_parameters()}
    for fragment in trainer.strategy.checkpointable().fragments():
        if fragment.field == "anchor":
            anchors[fragment.name] = fragment.tensor.detach().cpu().reshape(shapes[fragment.name])
    return anchors, errors


def compare_anchors(anchors: dict[str, torch.Tensor], saved: dict[str, torch.Tensor], names: list[str],
                    anchor_dtype: torch.dtype) -> dict:
    """Each anchor against theta* as saved, rounded to the dtype the optimizer keeps it in."""
    expected = {n: file_key(saved, n) for n in names}
    expected = {n: k for n, k in expected.items() if k is not None}
    mismatched, max_diff = [], 0.0
    for n, a in anchors.items():
        if n not in expected:
            continue
        ref = saved[expected[n]].to(anchor_dtype)
        if tuple(a.shape) != tuple(ref.shape):
            mismatched.append(f"{n}: shape {tuple(a.shape)} != {tuple(ref.shape)}")
            continue
        if not torch.equal(a, ref):
            mismatched.append(n)
            max_diff = max(max_diff, float((a.double() - ref.double()).abs().max()))
    return {"count": len(anchors), "expected": len(expected),
            "missing": sorted(set(expected) - set(anchors)),
            "unexpected": sorted(set(anchors) - set(expected)),
            "mismatched": mismatched, "max_abs_diff": max_diff}


def optimizer_placement(opt) -> dict:
    """Devices of the tensors the optimizer steps (state keys: ZeRO-3 empties param_groups outside
    step()) and of its state tensors."""
    params = {str(local(p).device) for p in opt.state.keys() if torch.is_tensor(p)}
    params |= {str(local(p).device) for g in opt.param_groups for p in g["params"]}
    states = {str(local(v).device) for s in opt.state.values() for v in s.values()
              if torch.is_tensor(v) and v.dim() > 0}
    return {"param_devices": sorted(params), "state_devices": sorted(states)}


def observe(trainer, case, saved) -> dict:
    strategy = case.strategy["name"]
    module = plain_module(trainer) if strategy == "deepspeed" else trainer.model
    names = [n for n, _ in module.named_parameters()]
    anchors, errors = gather_anchors(trainer, strategy)
    opt = trainer.optimizer
    anchor_dtype = getattr(torch, case.anchor_dtype)
    obs = {"impl": opt.impl, **optimizer_placement(opt),
           "anchors": compare_anchors(anchors, saved, names, anchor_dtype),
           "anchor_errors": errors[:5],
           # as the optimizer keeps them (DeepSpeed's full-state gather hands back fp32 whatever they are)
           "anchor_state_dtypes": sorted({str(s["anchor"].dtype) for s in opt.state.values() if "anchor" in s}),
           "optimizer_steps": opt.group_steps() if hasattr(opt, "group_steps") else None,
           "backend": dist.get_backend() if dist.is_available() and dist.is_initialized() else None,
           "model_param_devices": sorted({str(local(p).device) for p in module.parameters()})}
    if torch.cuda.is_available():
        obs["peak_gpu_memory_mb"] = round(torch.cuda.max_memory_allocated() / 2**20, 1)
    return obs


def run(cfg_path: Path):
    from ft_framework.config import load_config
    from ft_framework.trainer import Trainer

    trainer = Trainer(load_config(cfg_path, []))
    results = trainer.fit()
    return trainer, results


def release(trainer) -> None:
    del trainer
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def run_case(case, results_dir: Path, model_dir: Path, device: str, saved) -> dict:
    work = results_dir / case.name
    full_out, resumed_out = work / "full", work / "resumed"
    record = {"case": case.name, "device": device, "full_dir": str(full_out), "resumed_dir": str(resumed_out),
              "full_export": str(work / "export_full"), "resumed_export": str(work / "export_resumed")}
    started = time.perf_counter()
    rank0 = int(os.environ.get("RANK", 0)) == 0
    if rank0:
        work.mkdir(parents=True, exist_ok=True)
        write_config(work / "full.yaml", run_config(model_dir, full_out, case, device,
                                                     export_dir=work / "export_full"))
        write_config(work / "resumed.yaml", run_config(
            model_dir, resumed_out, case, device, export_dir=work / "export_resumed",
            resume_from=full_out / "checkpoints" / f"step_{RESUME_AT:08d}"))
    if dist.is_initialized():
        dist.barrier()

    if torch.cuda.is_available():
        torch.cuda.reset_peak_memory_stats()
    trainer, results = run(work / "full.yaml")
    record["full"] = observe(trainer, case, saved)
    record["full"]["steps"] = results.get("steps")
    release(trainer)

    trainer, results = run(work / "resumed.yaml")
    record["resumed"] = observe(trainer, case, saved)
    record["resumed"]["steps"] = results.get("steps")
    release(trainer)
    record["seconds"] = round(time.perf_counter() - started, 2)
    return record


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("results_dir", type=Path)
    parser.add_argument("model_dir", type=Path)
    parser.add_argument("cases", nargs="+", choices=sorted(CASES))
    parser.add_argument("--local_rank", type=int, default=None)  # added by the deepspeed launcher
    args = parser.parse_args(argv)
    device = run_device()
    if device == "cuda":
        if not torch.cuda.is_available():
            raise SystemExit("gpu_worker: no CUDA device (set FT_GPU_TESTS_DEVICE=cpu for the CPU smoke run)")
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
    # Save-then-resume must equal the uninterrupted run: no nondeterministic kernels (warn where
    # an op has no deterministic version instead of failing).
    torch.use_deterministic_algorithms(True, warn_only=True)
    saved = theta_star(args.model_dir)
    args.results_dir.mkdir(parents=True, exist_ok=True)
    rank0 = int(os.environ.get("RANK", 0)) == 0
    failures = 0
    for name in args.cases:
        case = CASES[name]
        try:
            record = run_case(case, args.results_dir, args.model_dir, device, saved)
            record["error"] = None
        except Exception:  # noqa: BLE001 - recorded for the test, then the next case runs
            traceback.print_exc()
            record = {"case": name, "error": traceback.format_exc()[-6000:]}
            failures += 1
        if torch.cuda.is_available():
            record["gpu"] = torch.cuda.get_device_name()
        if rank0:
            tmp = args.results_dir / f"{name}.json.tmp"
            tmp.write_text(json.dumps(record, indent=1))
            tmp.replace(args.results_dir / f"{name}.json")
        print(f"gpu_worker: {name}: {'ok' if record['error'] is None else 'FAILED'}", flush=True)
    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()
    return 1 if failures else 0


if __name__ == "__main__":
    raise SystemExit(main())
