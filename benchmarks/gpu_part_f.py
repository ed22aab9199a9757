"""Part f of benchmarks/gpu_suite.py (issue 35): the device-lean offload against DeepSpeed's on
ALBERT-xxlarge, bf16, seq 128, one GPU.

Candidates, each in a worker process of its own (clean peak statistics, its own time limit):

- our offload, overlapped and serial, as a run builds them: the bf16 model on the device
  (training.precision bf16: the device-lean offload) with the fused tanh GELU
  (model.fused_activations, on by default);
- DeepSpeed ZeRO-2 with optimizer offload and DeepSpeedCPUAdam, as its users run it: the HF model
  unchanged (its own gelu_new), DeepSpeed's bf16.

Per candidate: peak GPU memory at batch 32 (max_memory_allocated and max_memory_reserved),
samples/s, rollbacks, the plan (strategies/memory_plan.plan_peak, made before the model is built)
against the measurement, and the largest batch under a 16 GB cap
(torch.cuda.set_per_process_memory_fraction; the search stops at the worker's time limit and then
reports a lower bound). When the plan misses the measured peak by more than 10%, the worker runs
one more step under torch.cuda.memory._record_memory_history, saves the snapshot (open it at
pytorch.org/memory_viz) and tables the allocations live at the peak by Python line.

On the CPU (--tiny) the same code runs at toy sizes, without memory numbers or a cap: the dry run.
The suite module is passed in (`suite`), so this file imports nothing of it.
"""

from __future__ import annotations

import os
import pickle
import time
from collections import defaultdict
from pathlib import Path
from typing import Any, Iterable

# name -> (strategy section, optimizer builder name of gpu_suite.optimizer_builders, fused activations, launcher)
F_CANDIDATES: dict[str, tuple[dict[str, Any], str, bool, str]] = {
    "lean offload, overlapped (ours)": ({"name": "single", "offload_optimizer": {"overlap": True}}, "RecAdam (ours)",
                                        True, "torchrun"),
    "lean offload, serial (ours)": ({"name": "single", "offload_optimizer": {"overlap": False}}, "RecAdam (ours)",
                                    True, "torchrun"),
    "DeepSpeed ZeRO-2 offload, DeepSpeedCPUAdam": ({"name": "deepspeed",
                                                    "deepspeed": {"zero_stage": 2, "offload_optimizer": True}},
                                                   "DeepSpeedCPUAdam", False, "deepspeed"),
}
# Seconds per candidate's worker (most important first: ours overlapped, then DeepSpeed, then ours
# serial; benchmarks/gpu_run_next.sh builds DeepSpeedCPUAdam's op before). Part f in all: 220 s.
F_BUDGET_S = {"lean offload, overlapped (ours)": 70, "DeepSpeed ZeRO-2 offload, DeepSpeedCPUAdam": 100,
              "lean offload, serial (ours)": 50}
F_ORDER = ("lean offload, overlapped (ours)", "DeepSpeed ZeRO-2 offload, DeepSpeedCPUAdam", "lean offload, serial (ours)")
PLAN_MISS = 0.10  # a row whose plan misses its measurement by more than this gets a memory snapshot
# Seconds a worker keeps before its limit (its deadline counts from its launch: gpu_suite.DEADLINE_ENV)
# to finish the probe in hand, write its row and let go of the GPU.
DEADLINE_MARGIN_S = 20
# Clipping that does not fire (every row reports its median gradient norm): random weights with
# max_grad_norm 1 clip at every step, and a step after one that clipped does not speculate, so the
# overlapped offload would be timed as a serial one. A fine-tuning run whose norms stay under its
# limit speculates at every step; this limit measures that case, for DeepSpeed (which then
# computes its norm and does not clip either) as for ours.
F_MAX_GRAD_NORM = 1e9
OUT_DIR_ENV = "GPU_SUITE_OUT_DIR"  # where a worker writes its memory snapshot
# Targets of issue 35: our overlapped peak <= 0.6 x DeepSpeed's, samples/s >= DeepSpeed's, the
# largest batch in 16 GB >= 1.5 x DeepSpeed's, every plan row within +-10%.
PEAK_RATIO_TARGET, BATCH_RATIO_TARGET = 0.6, 1.5


def worker_kind(name: str) -> str:
    return f"f{list(F_CANDIDATES).index(name)}"


def candidate_of(kind: str) -> str:
    return list(F_CANDIDATES)[int(kind[1:])]


# ---- the allocations live at the peak, from a memory snapshot's trace ----------------------------
def _site(frames: list[dict[str, Any]]) -> str:
    """The Python line an allocation came from: the first frame outside torch and Python's own
    machinery (a model's or ours), else the first frame."""
    for f in frames:
        name = f.get("filename", "")
        if name.endswith(".py") and "/torch/" not in name and "/site-packages/torch" not in name:
            return f"{name}:{f.get('line')} ({f.get('name')})"
    if frames:
        f = frames[0]
        return f"{f.get('filename')}:{f.get('line')} ({f.get('name')})"
    return "(no stack)"


def top_lines_at_peak(events: Iterable[dict[str, Any]], top: int = 10) -> dict[str, Any]:
    """Replays a device trace (torch.cuda.memory._snapshot()["device_traces"][i]: alloc and free
    events with addr, size and frames) and returns the live bytes at its highest point and the
    `top` Python lines holding most of them then: {"peak_bytes", "lines": [(site, bytes, count)]}."""
    events = list(events)
    live: dict[int, int] = {}
    total = peak = 0
    peak_index = -1
    for i, e in enumerate(events):
        action = e.get("action")
        if action == "alloc":
            live[e["addr"]] = e["size"]
            total += e["size"]
            if total > peak:
                peak, peak_index = total, i
        elif action in ("free_requested", "free_completed") and e["addr"] in live:
            total -= live.pop(e["addr"])
    holders: dict[int, dict[str, Any]] = {}
    for e in events[:peak_index + 1]:
        if e.get("action") == "alloc":
            holders[e["addr"]] = e
        elif e.get("action") in ("free_requested", "free_completed"):
            holders.pop(e["addr"], None)
    by_line: dict[str, list[int]] = defaultdict(lambda: [0, 0])
    for e in holders.values():
        slot = by_line[_site(e.get("frames") or [])]
        slot[0] += e["size"]
        slot[1] += 1
    lines = sorted(((site, b, n) for site, (b, n) in by_line.items()), key=lambda x: -x[1])[:top]
    return {"peak_bytes": peak, "lines": lines}


# ---- the worker ----------------------------------------------------------------------------------
def worker_deadline(suite, default_budget_s: float) -> float:
    """This worker's deadline on its perf_counter clock: the parent's wall-clock deadline
    (suite.DEADLINE_ENV, set at launch, so the launcher's start and the imports count), else
    `default_budget_s` from now."""
    wall = os.environ.get(suite.DEADLINE_ENV)
    left = float(wall) - time.time() if wall else default_budget_s
    return time.perf_counter() + left


def offload_counters(strategy) -> dict[str, Any]:
    """What the offload says about its steps so far: speculated during backward, rolled back,
    skipped, and the copy window's waits in the gradient hook (None for DeepSpeed's)."""
    metrics = strategy.train_metrics() if hasattr(strategy, "speculated_steps") else {}
    waits, wait_s = getattr(strategy, "copy_waits", (None, None))
    return {"speculated_steps": metrics.get("offload_speculated_steps"), "rollbacks": metrics.get("offload_rollbacks"),
            "skipped_steps": metrics.get("offload_skipped_steps"), "copy_waits": waits, "copy_wait_s": wait_s}


def worker_f(suite, args, cuda: bool, device: str, tmp: Path) -> dict[str, Any]:
    """One candidate (args.worker = f0/f1/f2) end to end; its row, written to the rows file
    (suite.emit) after every stage, so a kill keeps what was measured."""
    import copy

    import torch
    from transformers import AlbertConfig

    from ft_framework.models.fused_activations import describe_fused, fuse_activations
    from ft_framework.strategies.memory_plan import plan_peak
    from ft_framework.task_kinds import build_task_kind

    started = time.perf_counter()
    name = candidate_of(args.worker)
    deadline = worker_deadline(suite, F_BUDGET_S[name]) - DEADLINE_MARGIN_S
    section, optimizer_name, fused, _ = F_CANDIDATES[name]
    steps, warmup = args.steps or (2 if args.tiny else 3), args.warmup or 1
    row: dict[str, Any] = {"name": name, "batch": args.batch, "seq": args.seq, "steps": steps, "warmup": warmup,
                           "model": "ALBERT-xxlarge" if not args.tiny else "ALBERT (tiny)", "cuda": cuda,
                           "max_grad_norm": F_MAX_GRAD_NORM, "stage": "started"}

    def emit(stage: str) -> None:
        row["stage"], row["seconds"] = stage, time.perf_counter() - started
        suite.emit(args, "row", row)

    cfg = suite.write_min_config(tmp, section, "bf16", args.batch, device, seq=args.seq,
                                 model={"fused_activations": fused}, max_grad_norm=F_MAX_GRAD_NORM)
    arch = AlbertConfig(**(suite.ALBERT_TINY if args.tiny else suite.ALBERT_XXLARGE))
    try:
        plan = plan_peak(cfg, arch, task=build_task_kind(cfg), world_size=1, on_gpu=cuda)
        row.update(planned_gb=plan.live_bytes / 1e9, planned_peak_gb=plan.device_peak / 1e9)
    except Exception as exc:  # noqa: BLE001 - the plan's failure is a result of its own
        row["plan_error"] = f"{type(exc).__name__}: {str(exc)[:300]}"
    emit("planned")
    pristine: dict[str, Any] = {}

    def build():
        """The strategy around a copy of the model built once (no second random init of ALBERT)."""
        if "model" not in pristine:
            pristine["model"] = suite.build_albert(args.tiny)
        model = copy.deepcopy(pristine["model"])
        row["numel"] = sum(p.numel() for p in model.parameters())
        row["activations"] = describe_fused(fuse_activations(model)) if fused else "unchanged (HF model as loaded)"
        return suite.setup_strategy(cfg, model, optimizer_name, True, args.tiny)

    strategy = build()
    entry, strategy = suite.train_candidate(cfg, optimizer_name, args, batch=args.batch, offload=True, steps=steps,
                                            warmup=warmup, strategy=strategy)
    row.update({k: entry.get(k) for k in ("iter_ms", "samples_per_s", "cpu_step_ms", "impl", "loss", "grad_norm")})
    row["measured_gb"], row["measured_reserved_gb"] = entry.get("peak_gpu_gb"), entry.get("peak_gpu_reserved_gb")
    row.update(offload_counters(strategy), counted_steps=warmup + steps)
    emit("measured")
    planned, measured = row.get("planned_gb"), row.get("measured_gb")
    if cuda and planned and measured and abs(planned / measured - 1) > PLAN_MISS and time.perf_counter() < deadline:
        row["snapshot"] = _snapshot_one_step(suite, args, cfg, optimizer_name, strategy, name)
        emit("snapshot")

    def probed(cap: dict[str, Any]) -> None:
        row["cap"] = cap
        emit("cap")

    def train_one(probing, batch: int) -> None:
        suite.train_candidate(cfg, optimizer_name, args, batch=batch, offload=True, steps=1, warmup=1,
                              strategy=probing)

    cap, searched = suite.largest_batch_under_cap(args, strategy, build, train_one, cuda, deadline, on_probe=probed)
    if searched is not None:
        cap["probes"] = searched
    row["cap"] = cap
    emit("done")
    return row


def _snapshot_one_step(suite, args, cfg, optimizer_name: str, strategy, name: str) -> dict[str, Any]:
    """One more step under the allocator's history; the snapshot file and the top lines at the peak."""
    import torch

    torch.cuda.memory._record_memory_history(max_entries=200_000)
    try:
        suite.train_candidate(cfg, optimizer_name, args, batch=args.batch, offload=True, steps=1, warmup=0,
                              strategy=strategy)
        snapshot = torch.cuda.memory._snapshot()
    finally:
        torch.cuda.memory._record_memory_history(enabled=None)
    out_dir = Path(os.environ.get(OUT_DIR_ENV, "."))
    path = out_dir / f"f_snapshot_{name.split(',')[0].replace(' ', '_')}_{worker_kind(name)}.pickle"
    with open(path, "wb") as f:
        pickle.dump(snapshot, f)  # written for pytorch.org/memory_viz; never read back here
    traces = snapshot.get("device_traces") or [[]]
    return {"file": str(path), **top_lines_at_peak(traces[0])}


# ---- the parent's side ---------------------------------------------------------------------------
def run_part_f(suite, args, progress: dict[str, Any] | None = None) -> dict[str, Any]:
    """Each candidate in its own worker under its own time limit, most important first.
    `progress` (the caller's, read if this process is stopped) holds the finished rows ("rows")
    and the rows file of the worker running now ("running")."""
    import argparse

    os.environ[OUT_DIR_ENV] = str(Path(args.out).resolve().parent)
    progress = {} if progress is None else progress
    rows = progress.setdefault("rows", [])
    for name in F_ORDER:
        budget = F_BUDGET_S[name] * (4 if args.tiny else 1)  # the CPU dry run is slower than a GPU
        limited = argparse.Namespace(**{**vars(args), "timeout": budget})
        progress["running"] = (name, suite.worker_files(args, worker_kind(name))[1])
        result = suite.launch_worker(worker_kind(name), limited, F_CANDIDATES[name][3])
        progress["running"] = None
        if "name" not in result:
            result = {"name": name, **result}
        rows.append(result)
        suite.log(f"f: {name}: {result.get('samples_per_s')} samples/s, peak {result.get('measured_gb')} GB")
    return {"rows": rows}


def partial_f(suite, progress: dict[str, Any]) -> dict[str, Any]:
    """Part f's result when this process is stopped: the finished rows and what the running
    worker had written of its row."""
    rows = list(progress.get("rows", []))
    running = progress.get("running")
    if running:
        name, rows_path = running
        row = suite.rows_result(rows_path)
        rows.append({"name": name, **row, "error": f"stopped at the part's time limit (stage {row.get('stage')})"})
    return {"rows": rows}


def _fmt(x: Any, digits: int = 2) -> str:
    if x is None:
        return ""
    return f"{x:.{digits}f}" if isinstance(x, float) else str(x)


def _vs(planned: float | None, measured: float | None) -> str:
    if not planned or not measured:
        return ""
    rel = planned / measured - 1
    return f"{rel:+.1%} ({'yes' if abs(rel) <= PLAN_MISS else 'NO'})"


def format_f(r: dict[str, Any], table) -> str:
    """Part f's section; `table` is gpu_suite.markdown_table."""
    out = ["## f. The device-lean offload against DeepSpeed ZeRO-2 offload: ALBERT-xxlarge, bf16, seq 128", ""]
    rows = r.get("rows") or []
    if r.get("error") and not rows:
        return "\n".join(out + [f"failed: {r['error']}"])
    first = next((x for x in rows if x.get("batch")), {})
    out += [f"{first.get('model', 'ALBERT-xxlarge')}, batch {first.get('batch')}, seq {first.get('seq')}, bf16, "
            f"max_grad_norm {first.get('max_grad_norm', F_MAX_GRAD_NORM):g} (clipping does not fire: each row's median "
            f"gradient norm is below it), one GPU; {first.get('steps')} timed steps after {first.get('warmup')} warm-up. "
            "Speculated / rolled back: of those steps, how many the overlapped offload stepped during backward and how "
            "many of them it undid; hook waits: how often backward's thread waited in the gradient hook for room in "
            "the copy window (copies_in_flight), and for how long in all. Planned: "
            "strategies/memory_plan.plan_peak before the model is built (live tensors; with the CUDA context and "
            "slack against max_memory_reserved). Largest batch: under a "
            f"{(first.get('cap') or {}).get('cap_gb', 16)} GB cap (set_per_process_memory_fraction).", ""]
    body = []
    for x in rows:
        if x.get("error") and not x.get("iter_ms"):
            body.append([x.get("name"), "failed", "", "", "", "", "", "", "", "", "", str(x["error"])[:300]])
            continue
        cap = x.get("cap") or {}
        largest = cap.get("largest_batch")
        largest_text = "" if largest is None and not cap else (
            f"{largest}" + ("" if cap.get("complete", True) else " (at least: time limit)"))
        speculation = ("" if x.get("rollbacks") is None else
                       f"{_fmt(x.get('speculated_steps'))} / {x['rollbacks']} of {_fmt(x.get('counted_steps'))}")
        waits = "" if x.get("copy_waits") is None else f"{x['copy_waits']} ({x.get('copy_wait_s') or 0.0:.3f} s)"
        body.append([x.get("name"), _fmt(x.get("samples_per_s"), 1), _fmt(x.get("measured_gb")),
                     _fmt(x.get("measured_reserved_gb")), _fmt(x.get("planned_gb")),
                     _vs(x.get("planned_gb"), x.get("measured_gb")),
                     _vs(x.get("planned_peak_gb"), x.get("measured_reserved_gb")),
                     _fmt(x.get("grad_norm"), 3), speculation, waits, largest_text,
                     "; ".join(s for s in (x.get("plan_error"), x.get("activations"), cap.get("error"),
                                           x.get("error")) if s)])
    out.append(table(["candidate", "samples/s", "peak allocated GB", "peak reserved GB", "planned GB",
                      "plan vs allocated", "plan (+context, slack) vs reserved", "grad norm",
                      "speculated / rolled back", "hook waits", "largest batch in cap", "note"], body))
    by_name = {x.get("name"): x for x in rows}
    ours = by_name.get("lean offload, overlapped (ours)") or {}
    ds = by_name.get("DeepSpeed ZeRO-2 offload, DeepSpeedCPUAdam") or {}
    verdicts = []
    if ours.get("measured_gb") and ds.get("measured_gb"):
        ratio = ours["measured_gb"] / ds["measured_gb"]
        verdicts.append(f"peak: ours / DeepSpeed = {ratio:.2f} (target <= {PEAK_RATIO_TARGET}: "
                        f"{'met' if ratio <= PEAK_RATIO_TARGET else 'MISSED'})")
    if ours.get("samples_per_s") and ds.get("samples_per_s"):
        ratio = ours["samples_per_s"] / ds["samples_per_s"]
        verdicts.append(f"samples/s: ours / DeepSpeed = {ratio:.2f} (target >= 1: {'met' if ratio >= 1 else 'MISSED'})")
    ob, db = (ours.get("cap") or {}).get("largest_batch"), (ds.get("cap") or {}).get("largest_batch")
    if ob and db:
        ratio = ob / db
        verdicts.append(f"largest batch: ours / DeepSpeed = {ratio:.2f} (target >= {BATCH_RATIO_TARGET}: "
                        f"{'met' if ratio >= BATCH_RATIO_TARGET else 'MISSED'})")
    if verdicts:
        out += [""] + [f"- {v}" for v in verdicts]
    for x in rows:
        snap = x.get("snapshot")
        if not snap:
            continue
        out += ["", f"**{x['name']}**: the plan misses by more than {PLAN_MISS:.0%}; allocations live at the peak "
                f"of one step ({snap['peak_bytes'] / 1e9:.2f} GB; snapshot `{Path(snap['file']).name}`), by Python line:", ""]
        out.append(table(["line", "GB", "blocks"], [[s, f"{b / 1e9:.3f}", n] for s, b, n in snap["lines"]]))
    return "\n".join(out)
