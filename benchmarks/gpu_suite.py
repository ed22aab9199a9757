"""The GPU suite in one command: tests/gpu and three benchmarks on ONE GPU, as a markdown report.

    python benchmarks/gpu_suite.py --out gpu_results.md          # everything (< 25 min on an H100)
    python benchmarks/gpu_suite.py --only a,b                    # some parts: tests, a, b, c, d
    python benchmarks/gpu_suite.py --tiny --out /tmp/smoke.md    # the same code at toy sizes on the CPU

Parts:
  tests  `pytest tests/gpu` (every strategy on one GPU with nccl; see tests/gpu/test_gpu.py).
  a      Optimizer step, 200 M fp32 parameters in 100 tensors: our RecAdam (torch multi-tensor impl)
         against torch.optim.AdamW fused and foreach, CUDA-event timing, median of --steps after
         --warmup; the RecAdam / fused ratio against the 1.5x target; plus torch.compile variants
         of our step made without touching the library.
  b      ALBERT-xxlarge (published architecture, random weights), seq 128, bf16, DeepSpeed ZeRO-2 +
         optimizer CPU offload, our RecAdam (C++ kernel) against DeepSpeedCPUAdam: step time,
         samples/s, the CPU optimizer step's share of the step, peak GPU memory; then with the GPU
         capped at --cap-gb (torch.cuda.set_per_process_memory_fraction) and the largest batch that
         fits. Runs under the deepspeed launcher, world size 1.
  c      No offload: ZeRO-2 (deepspeed launcher) and FSDP2 (torchrun), world size 1, bf16:
         samples/s with our RecAdam against torch AdamW fused (the end-to-end cost of RecAdam).
  d      ALBERT-xxlarge, bf16, optimizer offloaded to the CPU: our offload overlapped with backward
         (strategy.offload_optimizer {overlap: true}) against our serial offload and DeepSpeed ZeRO-2
         offload with DeepSpeedCPUAdam: samples/s, peak GPU memory, rollbacks; then the same under
         the --cap-gb GPU memory cap (docs/offload.md).
  e      ALBERT-xxlarge, bf16, overlapped offload and DeepSpeed ZeRO-2 offload: the memory plan
         (ft-plan, made before anything is built) against torch.cuda.max_memory_allocated, target
         within 10% (docs/memory.md).
  f      ALBERT-xxlarge, bf16, seq 128: the device-lean offload (overlapped, serial) against DeepSpeed
         ZeRO-2 offload with DeepSpeedCPUAdam: peak memory, samples/s, rollbacks, largest batch in
         16 GB, the plan per row, a memory snapshot where the plan misses (benchmarks/gpu_part_f.py).

--tiny: toy sizes on the CPU (DS_ACCELERATOR=cpu, gloo; tests run with FT_GPU_TESTS_DEVICE=cpu),
so every line of the suite can be smoke-tested without a GPU. Its numbers mean nothing.
Workers (b, c) are this file re-launched with --worker; they write JSON that the parent formats.
"""

from __future__ import annotations

import argparse
import gc
import json
import math
import os
import platform
import shlex
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from importlib import metadata
from pathlib import Path
from typing import Any, Callable, Sequence

from ft_framework.distributed.rendezvous import free_port

sys.path.insert(0, str(Path(__file__).resolve().parent))
import gpu_part_f  # noqa: E402  part f (issue 35), in a file of its own
from method_clock import MethodClock  # noqa: E402
from row_log import RowLog, latest_by, read_rows  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
PARTS = ("tests", "a", "b", "c", "d", "e", "f")
TARGET_RATIO = 1.5  # RecAdam step <= 1.5 x fused AdamW (issue 9)
TRITON_TARGET_FP32, TRITON_TARGET_COMPACT = 1.2, 1.0  # impl="triton" vs fused AdamW (issue 36)

ALBERT_XXLARGE = dict(vocab_size=30000, embedding_size=128, hidden_size=4096, num_hidden_layers=12,
                      num_attention_heads=64, intermediate_size=16384, hidden_act="gelu_new",
                      max_position_embeddings=512, type_vocab_size=2,
                      hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0, classifier_dropout_prob=0.0)
ALBERT_TINY = dict(ALBERT_XXLARGE, vocab_size=1000, embedding_size=16, hidden_size=64, num_hidden_layers=2,
                   num_attention_heads=4, intermediate_size=128, max_position_embeddings=64)
RECADAM_LR = 1e-5  # in the param groups
RECADAM_HPARAMS = dict(anneal_k=0.1, anneal_t0=1000, pretrain_cof=5000.0)


def log(msg: str) -> None:
    print(f"[gpu_suite {time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


# ==================================================================================================
# Arguments, sizes, formatting (pure: tested on CPU by tests/gpu/test_gpu_suite_cpu.py)
# ==================================================================================================
def parse_only(text: str | None) -> list[str]:
    if not text:
        return list(PARTS)
    parts = [p.strip() for p in text.split(",") if p.strip()]
    bad = [p for p in parts if p not in PARTS]
    if bad:
        raise argparse.ArgumentTypeError(f"unknown part(s) {bad}; valid: {', '.join(PARTS)}")
    return [p for p in PARTS if p in parts]


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", default="gpu_results.md", help="markdown report path (default gpu_results.md)")
    p.add_argument("--only", type=parse_only, default=list(PARTS), metavar="PARTS",
                   help="comma-separated subset of: tests,a,b,c,d,e (default all)")
    p.add_argument("--tiny", action="store_true", help="toy sizes on the CPU (smoke test of the suite)")
    p.add_argument("--steps", type=int, default=None, help="timed steps per candidate (default 20 for a, 8 for b/c)")
    p.add_argument("--warmup", type=int, default=None, help="warm-up steps per candidate (default 5 for a, 3 for b/c)")
    p.add_argument("--a-params", type=float, default=None, help="part a: parameters (default 200e6; tiny 2e6)")
    p.add_argument("--a-tensors", type=int, default=None, help="part a: tensors (default 100; tiny 10)")
    p.add_argument("--no-compile", action="store_true", help="part a: skip the torch.compile variants")
    p.add_argument("--batch", type=int, default=None, help="parts b/c: micro-batch (default 32; tiny 4)")
    p.add_argument("--seq", type=int, default=None, help="parts b/c: sequence length (default 128; tiny 16)")
    p.add_argument("--cap-gb", type=float, default=16.0, help="part b: GPU memory cap in GB (default 16)")
    p.add_argument("--max-batch", type=int, default=None,
                   help="parts b, f: upper end of the batch search (default 1024; tiny 24)")
    p.add_argument("--timeout", type=int, default=900, help="seconds per launched worker / pytest (default 900)")
    p.add_argument("--tests-k", default=None, metavar="EXPR", help="part tests: only the cases pytest -k EXPR selects")
    # internal: this file re-launched as a worker
    p.add_argument("--worker", choices=("b", "b_cap", "c_zero2", "c_fsdp", "d", "d_cap", "e", "f0", "f1", "f2"),
                   help=argparse.SUPPRESS)
    p.add_argument("--worker-out", type=Path, help=argparse.SUPPRESS)
    p.add_argument("--rows-out", type=Path, help=argparse.SUPPRESS)  # the worker's rows as they come
    p.add_argument("--local_rank", type=int, default=None, help=argparse.SUPPRESS)  # deepspeed launcher
    return p


def resolve_defaults(args: argparse.Namespace) -> argparse.Namespace:
    tiny = args.tiny
    # The dry run's batch search (a simulated cap of max_batch // 4 = 6, from batch 4) runs each of
    # its paths once in four probes: 4 fits, 8 runs out of memory, 6 fits after it (on the same
    # strategy, or a DeepSpeed engine rebuilt), 7 runs out: the largest batch is 6, the search complete.
    defaults = dict(a_params=2e6 if tiny else 200e6, a_tensors=10 if tiny else 100, batch=4 if tiny else 32,
                    seq=16 if tiny else 128, max_batch=24 if tiny else 1024)
    for key, value in defaults.items():
        if getattr(args, key) is None:
            setattr(args, key, value)
    return args


def chunk_sizes(total: float, tensors: int) -> list[int]:
    """`tensors` sizes summing to int(total), as equal as possible (the first ones one larger)."""
    total, tensors = int(total), max(1, int(tensors))
    base, extra = divmod(total, tensors)
    return [base + (1 if i < extra else 0) for i in range(tensors)]


def markdown_table(header: Sequence[str], rows: Sequence[Sequence[Any]]) -> str:
    cells = [[str(c) for c in header]] + [[("" if c is None else str(c)).replace("|", "\\|").replace("\n", " ")
                                            for c in row] for row in rows]
    widths = [max(len(r[i]) for r in cells) for i in range(len(header))]
    line = lambda r: "| " + " | ".join(c.ljust(w) for c, w in zip(r, widths)) + " |"  # noqa: E731
    return "\n".join([line(cells[0]), "|" + "|".join("-" * (w + 2) for w in widths) + "|"] + [line(r) for r in cells[1:]])


def fmt(x: Any, digits: int = 2) -> str:
    if x is None:
        return "n/a"
    if isinstance(x, float):
        if math.isnan(x):
            return "n/a"
        return f"{x:.{digits}f}"
    return str(x)


def median(xs: Sequence[float]) -> float:
    return statistics.median(xs) if xs else float("nan")


def largest_fitting_batch(fits: Callable[[int], bool], start: int, limit: int) -> tuple[int | None, list[tuple[int, bool]]]:
    """The largest batch in [1, limit] for which fits(batch) holds, assuming fitting is monotone:
    doubling from `start` until it fails (or halving until one fits), then bisection between the
    last fit and the first failure. Returns (largest or None, [(batch, fitted), ...] in order)."""
    tried: list[tuple[int, bool]] = []

    def probe(b: int) -> bool:
        ok = bool(fits(b))
        tried.append((b, ok))
        return ok

    b = max(1, min(start, limit))
    if probe(b):
        good, bad = b, None
        while bad is None and good < limit:
            nxt = min(good * 2, limit)
            if probe(nxt):
                good = nxt
            else:
                bad = nxt
        if bad is None:
            return good, tried
    else:
        bad, good = b, None
        while good is None and bad > 1:
            nxt = bad // 2
            if probe(nxt):
                good = nxt
            else:
                bad = nxt
        if good is None:
            return None, tried
    while bad - good > 1:
        mid = (good + bad) // 2
        if probe(mid):
            good = mid
        else:
            bad = mid
    return good, tried


def versions() -> dict[str, str]:
    out = {"python": platform.python_version()}
    for dist in ("torch", "transformers", "deepspeed", "ft_framework"):
        try:
            out[dist] = metadata.version(dist)
        except metadata.PackageNotFoundError:
            out[dist] = "not installed"
    try:
        import torch

        out["cuda"] = torch.version.cuda or "none (CPU build)"
        out["gpu"] = torch.cuda.get_device_name() if torch.cuda.is_available() else "none (CPU)"
        if torch.cuda.is_available():
            props = torch.cuda.get_device_properties(0)
            out["gpu_memory_gb"] = f"{props.total_memory / 1e9:.1f}"
    except Exception as exc:  # noqa: BLE001
        out["gpu"] = f"unknown ({exc})"
    return out


def replace_text(path: Path, text: str) -> None:
    """Writes `text` to `path` through a temporary file renamed over it: a reader, or a kill at any
    moment, finds the old file or the new one, never a truncated one."""
    partial = path.with_name(path.name + ".partial")
    partial.write_text(text)
    os.replace(partial, path)


def report_header(v: dict[str, str], command: str, tiny: bool) -> str:
    lines = ["# GPU suite results", ""]
    if tiny:
        lines += ["**--tiny smoke run: toy sizes on the CPU; the numbers mean nothing.**", ""]
    lines += [f"- GPU: {v.get('gpu')}" + (f" ({v['gpu_memory_gb']} GB)" if v.get("gpu_memory_gb") else ""),
              f"- torch {v.get('torch')}, CUDA {v.get('cuda')}, DeepSpeed {v.get('deepspeed')}, "
              f"transformers {v.get('transformers')}, Python {v.get('python')}",
              f"- CPU: {cpu_name()} ({os.cpu_count()} logical cores)",
              f"- date: {time.strftime('%Y-%m-%d %H:%M:%S %Z')}",
              f"- command: `{command}`", ""]
    return "\n".join(lines)


def cpu_name() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown CPU"


# ---- section formatting (pure) ---------------------------------------------------------------
def format_tests(r: dict[str, Any]) -> str:
    out = ["## tests/gpu", "", f"`{r.get('command', '')}` (exit code {r.get('returncode')}, {fmt(r.get('seconds'), 0)} s)", ""]
    out.append(markdown_table(["passed", "failed", "errors", "skipped"],
                              [[r.get("passed", 0), r.get("failed", 0), r.get("errors", 0), r.get("skipped", 0)]]))
    if r.get("summary"):
        out += ["", "```", r["summary"].strip(), "```"]
    return "\n".join(out)


def format_a(r: dict[str, Any]) -> str:
    if r.get("error") and not r.get("candidates") and not r.get("bit_equality"):
        return f"## a. Optimizer step\n\nfailed: {r['error']}"
    out = ["## a. Optimizer step", ""]
    checks = r.get("bit_equality") or []
    if checks:
        out += ["Bit equality after 3 steps against the C++ kernel (scalar level, CPU): theta, m, v (and delta).", ""]
        out.append(markdown_table(["rule", "state", "impl", "bit-equal"],
                                  [[x["rule"], x["state"], x["impl"], x.get("error") or ("yes" if x["equal"] else "NO")]
                                   for x in checks]))
        equal = sum(1 for x in checks if x.get("equal"))
        out += ["", f"{equal} of {len(checks)} bit-equal.", ""]
    out += [f"{r['numel'] / 1e6:.0f} M fp32 parameters in {r['tensors']} tensors on {r['device']}; "
            f"median of {r['steps']} steps after {r['warmup']} warm-up steps ({r['timer']} around opt.step: the "
            f"host's work included); kernel ms: the GPU time of the step's kernels alone "
            f"({r.get('kernel_timer', 'torch.profiler')}, per step).", ""]
    rows = []
    fused = next((c["median_ms"] for c in r["candidates"] if c["name"] == "torch AdamW fused" and c.get("median_ms")), None)
    fused_kernel = next((c["kernel_ms"] for c in r["candidates"] if c["name"] == "torch AdamW fused" and c.get("kernel_ms")), None)
    for c in r["candidates"]:
        ratio = c["median_ms"] / fused if fused and c.get("median_ms") else None
        kernel_ratio = c["kernel_ms"] / fused_kernel if fused_kernel and c.get("kernel_ms") else None
        rows.append([c["name"], fmt(c.get("median_ms"), 3), fmt(c.get("min_ms"), 3),
                     fmt(ratio, 2) + ("x" if ratio else ""), fmt(c.get("kernel_ms"), 3),
                     fmt(kernel_ratio, 2) + ("x" if kernel_ratio else ""), fmt(c.get("kernels_per_step"), 1),
                     c.get("note", "")])
    out.append(markdown_table(["candidate", "step median ms", "step min ms", "vs fused AdamW", "kernel ms",
                               "kernels vs fused", "kernels/step", "note"], rows))
    targeted = [c for c in r["candidates"] if c.get("target")]
    for c in targeted:
        if c.get("median_ms") and fused:
            ratio = c["median_ms"] / fused
            verdict = "meets" if ratio <= c["target"] else "MISSES"
            out += ["", f"{c['name']} / fused AdamW = {ratio:.2f}x: {verdict} the {c['target']}x target."]
    ours = next((c["median_ms"] for c in r["candidates"] if c["name"].startswith("RecAdam (ours") and c.get("median_ms")), None)
    if ours and fused and not targeted:
        ratio = ours / fused
        verdict = "meets" if ratio <= TARGET_RATIO else "MISSES"
        out += ["", f"RecAdam / fused AdamW = {ratio:.2f}x: {verdict} the {TARGET_RATIO}x target."]
    if r.get("error"):
        out += ["", f"stopped: {r['error']}"]
    return "\n".join(out)


def format_b(r: dict[str, Any], capped: dict[str, Any] | None) -> str:
    out = ["## b. ALBERT-xxlarge, ZeRO-2 + optimizer CPU offload, bf16", ""]
    if r.get("error"):
        out.append(f"failed: {r['error']}")
    else:
        out += [f"{r['model']} ({r['numel'] / 1e6:.1f} M parameters, random weights), seq {r['seq']}, "
                f"batch {r['batch']}, world size {r['world_size']} ({r['backend']}), median of {r['steps']} steps "
                f"after {r['warmup']} warm-up.", ""]
        out.append(_train_table(r["candidates"], cpu_share=True))
    if capped is not None:
        out += ["", f"### with the GPU capped at {capped.get('cap_gb')} GB (set_per_process_memory_fraction)", ""]
        if capped.get("error") and not capped.get("candidates"):
            out.append(f"failed: {capped['error']}")
        else:
            if capped.get("note"):
                out += [capped["note"], ""]
            out.append(_train_table(capped.get("candidates", []), cpu_share=True))
            lb = capped.get("largest_batch")
            out += ["", f"Largest batch that fits (RecAdam, seq {capped.get('seq')}): **{fmt(lb)}** "
                        f"(searched up to {capped.get('max_batch')}; probes: "
                        + ", ".join(f"{b}{'' if ok else ' OOM'}" for b, ok in capped.get("probes", [])) + ")"]
            if capped.get("largest_batch_run"):
                out += ["", _train_table([capped["largest_batch_run"]], cpu_share=True)]
    return "\n".join(out)


def format_c(results: dict[str, dict[str, Any]]) -> str:
    out = ["## c. No offload, one GPU: samples/s, RecAdam vs torch AdamW fused", ""]
    rows = []
    for label, r in results.items():
        if r.get("error") and not r.get("candidates"):
            rows.append([label, "failed", "", "", "", "", r["error"][:300]])
            continue
        cands = {c["name"]: c for c in r["candidates"]}
        base = cands.get("torch AdamW fused", {}).get("samples_per_s")
        for c in r["candidates"]:
            rel = (c["samples_per_s"] / base) if base and c.get("samples_per_s") else None
            rows.append([label, c["name"], fmt(c.get("iter_ms"), 1), fmt(c.get("samples_per_s"), 1),
                         fmt(rel, 3), fmt(c.get("peak_gpu_gb"), 2), c.get("note") or c.get("error", "")])
    out.append(markdown_table(["setup", "optimizer", "iteration ms", "samples/s", "vs AdamW fused",
                               "peak GPU GB", "note"], rows))
    meta = next((r for r in results.values() if r.get("model")), None)
    if meta:
        out += ["", f"{meta['model']} ({meta['numel'] / 1e6:.1f} M parameters), seq {meta['seq']}, batch {meta['batch']}, "
                    f"{meta['precision']}, world size 1 ({meta['backend']}); median of {meta['steps']} steps."]
    return "\n".join(out)


def format_d(r: dict[str, Any], capped: dict[str, Any] | None) -> str:
    out = ["## d. ALBERT-xxlarge, optimizer offloaded to the CPU: overlapped vs serial vs ZeRO-2 offload, bf16", ""]
    for title, res in (("", r), (f"### with the GPU capped at {(capped or {}).get('cap_gb')} GB", capped)):
        if res is None:
            continue
        if title:
            out += ["", title, ""]
        if res.get("error") and not res.get("candidates"):
            out.append(f"failed: {res['error']}")
            continue
        if res.get("model"):
            out += [f"{res['model']} ({fmt((res.get('numel') or 0) / 1e6, 1)} M parameters, random weights), seq "
                    f"{res['seq']}, batch {res['batch']}, max_grad_norm 1, median of {res['steps']} steps after "
                    f"{res['warmup']} warm-up." + (f" {res['note']}" if res.get("note") else ""), ""]
        rows = []
        base = next((c.get("samples_per_s") for c in res.get("candidates", [])
                     if c.get("name", "").startswith("RecAdam, serial")), None)
        for c in res.get("candidates", []):
            if c.get("error") and c.get("iter_ms") is None:
                rows.append([c.get("name"), "failed", "", "", "", "", c["error"][:300]])
                continue
            rel = c["samples_per_s"] / base if base and c.get("samples_per_s") else None
            rows.append([c["name"], fmt(c.get("iter_ms"), 1), fmt(c.get("samples_per_s"), 1), fmt(rel, 3),
                         fmt(c.get("peak_gpu_gb"), 2), fmt(c.get("rollbacks")), c.get("note", "")])
        out.append(markdown_table(["candidate", "iteration ms", "samples/s", "vs serial offload", "peak GPU GB",
                                   "rollbacks", "note"], rows))
    return "\n".join(out)


def _train_table(cands: list[dict[str, Any]], cpu_share: bool) -> str:
    rows = []
    for c in cands:
        if c.get("error") and c.get("iter_ms") is None:
            rows.append([c.get("name"), c.get("impl", ""), c.get("batch", ""), "failed", "", "", "", "", c["error"][:300]])
            continue
        rows.append([c["name"], c.get("impl", ""), c.get("batch", ""), fmt(c.get("iter_ms"), 1), fmt(c.get("step_ms"), 1),
                     fmt(c.get("cpu_step_ms"), 1), fmt(100 * c["cpu_share"], 1) + "%" if c.get("cpu_share") is not None else "n/a",
                     fmt(c.get("samples_per_s"), 1), fmt(c.get("peak_gpu_gb"), 2)])
    return markdown_table(["optimizer", "impl", "batch", "iteration ms", "engine.step ms", "CPU opt.step ms",
                           "CPU step share", "samples/s", "peak GPU GB"], rows)


def build_report(header: str, sections: list[str]) -> str:
    return header + "\n" + "\n\n".join(sections) + "\n"


# ==================================================================================================
# Timing helpers
# ==================================================================================================
def sync() -> None:
    import torch

    if torch.cuda.is_available():
        torch.cuda.synchronize()


class Timer:
    """CUDA events on a GPU, perf_counter on the CPU; milliseconds."""

    def __init__(self, cuda: bool):
        self.cuda = cuda

    def time(self, fn: Callable[[], Any]) -> float:
        import torch

        if self.cuda:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            end.synchronize()
            return start.elapsed_time(end)
        t0 = time.perf_counter()
        fn()
        return (time.perf_counter() - t0) * 1e3


def is_oom(exc: BaseException) -> bool:
    """The device (torch.OutOfMemoryError) or the host (MemoryError) ran out of memory."""
    import torch

    return isinstance(exc, (torch.OutOfMemoryError, MemoryError))


# ==================================================================================================
# Part a: the optimizer step
# ==================================================================================================
def part_a(args, on_row: Callable[[dict[str, Any]], None] = lambda result: None) -> dict[str, Any]:
    """The rows in the order that keeps the most of a short window: the bit-equality checks first
    (small tensors, the result that must hold), then the cheap timings, the torch.compile variants
    last (their compilation can take minutes). `on_row(result)` runs after every row, with the
    result so far: the parent writes its report then, so a kill keeps every finished row."""
    import torch

    from ft_framework.optim import build_optimizer

    cuda = torch.cuda.is_available() and not args.tiny
    device = torch.device("cuda" if cuda else "cpu")
    if not cuda:  # the dry run: impl="triton" on CPU tensors through the Triton interpreter
        os.environ["TRITON_INTERPRET"] = "1"
    steps, warmup = args.steps or 20, args.warmup or 5
    sizes = chunk_sizes(args.a_params, args.a_tensors)
    timer = Timer(cuda)
    result: dict[str, Any] = {"numel": sum(sizes), "tensors": len(sizes), "device": str(torch.cuda.get_device_name() if cuda else "cpu"),
                              "steps": steps, "warmup": warmup, "timer": "CUDA events" if cuda else "perf_counter",
                              "kernel_timer": "torch.profiler (CUDA kernels)" if cuda else "none on the CPU",
                              "candidates": [], "bit_equality": []}
    on_row(result)
    for row in check_bits_against_cpu(device, interpret=not cuda):
        result["bit_equality"].append(row)
        on_row(result)
        log(f"a: bits {row}")

    gen = torch.Generator(device=device).manual_seed(0)
    grads = [torch.randn(n, device=device, generator=gen).mul_(1e-3) for n in sizes]

    def fresh_params():
        g = torch.Generator(device=device).manual_seed(1)
        ps = [torch.nn.Parameter(torch.randn(n, device=device, generator=g).mul_(0.02)) for n in sizes]
        for p, gr in zip(ps, grads):
            p.grad = gr  # shared, read-only for every candidate
        return ps

    def recadam(ps, impl: str = "torch", compact: bool = False):
        anchors = [p.detach() + 1e-3 for p in ps]
        groups = [{"params": ps, "anchors": anchors, "lr": RECADAM_LR, "weight_decay": 0.01}]
        state = dict(state_dtype="bfloat16", anchor_dtype="bfloat16") if compact else {}
        return build_optimizer("recadam", groups, impl=impl, **RECADAM_HPARAMS, **state)

    def measure(name: str, make: Callable[[], Callable[[], Any]], note: str = "", target: float | None = None) -> None:
        entry: dict[str, Any] = {"name": name, "note": note, "target": target}
        try:
            step = make()
            t0 = time.perf_counter()
            step()
            sync()
            entry["first_call_s"] = round(time.perf_counter() - t0, 2)
            for _ in range(max(0, warmup - 1)):
                step()
            sync()
            times = [timer.time(step) for _ in range(steps)]
            entry.update(median_ms=median(times), min_ms=min(times))
            entry.update(kernel_time(step, cuda))
            if entry["first_call_s"] > 5:
                entry["note"] = (note + f" first call {entry['first_call_s']} s (compilation)").strip()
        except Exception as exc:  # noqa: BLE001 - reported in the table
            entry["note"] = (note + f" not measured: {type(exc).__name__}: {str(exc)[:200]}").strip()
            log(f"a: {name} failed: {exc}")
        result["candidates"].append(entry)
        on_row(result)
        log(f"a: {name}: {entry.get('median_ms')} ms (kernels {entry.get('kernel_ms')} ms)")
        gc.collect()
        if cuda:
            torch.cuda.empty_cache()

    def plain(make_opt):
        def make():
            opt = make_opt(fresh_params())
            return opt.step
        return make

    # Targets (issue 36): the Triton step <= 1.2x fused AdamW's time in fp32, <= 1.0x in the compact state.
    for compact, target in ((False, TRITON_TARGET_FP32), (True, TRITON_TARGET_COMPACT)):
        state = "compact" if compact else "fp32"
        measure(f"RecAdam (ours, impl=triton), {state}", plain(lambda ps, c=compact: recadam(ps, "triton", c)),
                "one launch per step, the exact program", target)
    measure("torch AdamW fused", plain(lambda ps: torch.optim.AdamW(ps, lr=1e-5, weight_decay=0.01, fused=True)))
    for compact in (False, True):
        state = "compact" if compact else "fp32"
        measure(f"RecAdam (ours, impl=torch), {state}", plain(lambda ps, c=compact: recadam(ps, "torch", c)),
                "torch._foreach_* ops, the exact program")
    measure("torch AdamW foreach", plain(lambda ps: torch.optim.AdamW(ps, lr=1e-5, weight_decay=0.01, foreach=True)))
    if not args.no_compile:  # last: compiling can take longer than the rest together
        result["candidates"].append(compiled_opt_step(recadam, fresh_params, timer, steps))
        on_row(result)
        log(f"a: {result['candidates'][-1]['name']}: {result['candidates'][-1].get('note')}")

        def compiled_kernel():
            from ft_framework.optim.torch_step import foreach_step

            opt = recadam(fresh_params())
            group = opt.param_groups[0]
            c = opt.coefficients(group, 10, True)
            ps = group["params"]
            ms = [torch.zeros_like(p) for p in ps]
            vs = [torch.zeros_like(p) for p in ps]
            anchors = [opt.state[p]["anchor"] for p in ps]
            gs = [p.grad for p in ps]

            def kernel():
                with torch.no_grad():
                    foreach_step(ps, gs, ms, vs, anchors, c)
            return torch.compile(kernel)
        measure("RecAdam math, torch.compile(foreach_step), fixed coefficients", compiled_kernel,
                "upper bound of a compiled path: one step's coefficients baked in (training changes them every step)")
        measure("RecAdam math, torch.compile, coefficients as a tensor", lambda: compiled_tensor_coefficients(recadam(fresh_params())),
                "each step's coefficients copied into a device tensor (lr changes never recompile); inductor's own "
                "rounding (FMA contraction): not the exact program")
    return result


def kernel_time(step: Callable[[], Any], cuda: bool, repeats: int = 3) -> dict[str, Any]:
    """The GPU time of the kernels one `step` launches (torch.profiler's CUDA activity, summed over
    every kernel and copy of `repeats` steps, per step) and how many it launches: the step's time
    less what the host spends around them (Python, checks, the launch itself). None on the CPU."""
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    if not cuda:
        return {"kernel_ms": None, "kernels_per_step": None}
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(repeats):
            step()
        sync()
    events = [e for e in prof.key_averages() if e.device_type == DeviceType.CUDA]
    total_us = sum(getattr(e, "self_device_time_total", None) or getattr(e, "self_cuda_time_total", 0) for e in events)
    return {"kernel_ms": total_us / 1e3 / repeats, "kernels_per_step": sum(e.count for e in events) / repeats}


def compiled_tensor_coefficients(opt) -> Callable[[], Any]:
    """A torch.compile'd RecAdam step whose coefficients live in a device tensor, refreshed every
    step from the rule (so a changing lr or lambda(t) is data, not a recompile): the best a compiled
    foreach path can do without a kernel of its own."""
    import torch

    group = opt.param_groups[0]
    ps = group["params"]
    device = ps[0].device
    for p in ps:
        opt.init_state(p)
    ms = [opt.state[p]["exp_avg"] for p in ps]
    vs = [opt.state[p]["exp_avg_sq"] for p in ps]
    anchors = [opt.state[p]["anchor"] for p in ps]
    gs = [p.grad for p in ps]
    k = torch.zeros(8, device=device)

    def program(k):
        b1, b2, eps, step_size, denom_scale, pre_decay, post_pull = (k[i] for i in range(7))
        for p, g, m, v, a in zip(ps, gs, ms, vs, anchors):
            d = p - a
            m.mul_(b1).add_(g * (1 - b1))
            v.mul_(b2).add_(g * g * (1 - b2))
            e = step_size * m / (v.sqrt() * denom_scale + eps) + pre_decay * p
            e = e + post_pull * (d - e)
            p.sub_(e)

    compiled = torch.compile(program)
    t = [0]

    def step():
        t[0] += 1
        c = opt.coefficients(group, t[0], True)
        values = torch.tensor([c.beta1, c.beta2, c.eps, c.step_size, c.denom_scale, c.pre_decay, c.post_pull, 0.0])
        k.copy_(values, non_blocking=True)
        with torch.no_grad():
            compiled(k)
    return step


BIT_CHECK_RULES = {
    "recadam": dict(lr=1e-3, weight_decay=0.01, anneal_fun="sigmoid", anneal_k=0.1, anneal_t0=10, pretrain_cof=50.0),
    "adamw": dict(lr=1e-3, weight_decay=0.01),
    "bertadam": dict(lr=1e-3, weight_decay=0.01, correct_bias=False),
    "prior_wd": dict(lr=1e-3, weight_decay=0.1),
}


def check_bits_against_cpu(device, interpret: bool):
    """3 steps of every rule, fp32 and compact state, on `device` with impl triton and torch, against
    the C++ kernel's scalar level on the CPU: whether every stored bit (theta, m, v, delta) is equal,
    one row at a time as each check ends (a generator).
    Tensors of 1, 7, 65537 and 3 elements (a chunk boundary inside one). On the dry run the Triton
    program runs in the interpreter."""
    import torch

    from ft_framework.optim import build_optimizer
    from ft_framework.optim import cpu as cpu_kernel

    def run(rule: str, impl: str, compact: bool, dev) -> list[torch.Tensor]:
        gen = torch.Generator().manual_seed(5)
        thetas = [torch.randn(n, generator=gen) * 0.05 for n in (1, 7, 65537)]
        anchored = [torch.nn.Parameter((t + torch.randn(t.shape, generator=gen) * 1e-3).to(dev)) for t in thetas]
        head = [torch.nn.Parameter((torch.randn(3, generator=gen) * 0.05).to(dev))]
        state = dict(state_dtype="bfloat16", anchor_dtype="bfloat16", rounding_seed=99) if compact else {}
        opt = build_optimizer(rule, [{"params": anchored, "anchors": [t.to(dev) for t in thetas]}, {"params": head}],
                              impl=impl, **BIT_CHECK_RULES[rule], **state)
        for _ in range(3):
            for p in anchored + head:
                p.grad = torch.randn(p.shape, generator=gen).to(dev)
            opt.step()
        return [x.detach().cpu() for p in anchored + head
                for x in (p, *(opt.state[p][k] for k in ("exp_avg", "exp_avg_sq", "delta") if k in opt.state[p]))]

    def bits(t):
        return t.view(torch.int16 if t.element_size() == 2 else torch.int32)

    level = cpu_kernel.simd_level()
    cpu_kernel.set_simd_level("scalar")
    try:
        for rule in BIT_CHECK_RULES:
            for compact in (False, True):
                want = run(rule, "cpu", compact, torch.device("cpu"))
                for impl in ("triton", "torch"):
                    row = {"rule": rule, "state": "compact" if compact else "fp32", "impl": impl}
                    try:
                        got = run(rule, impl, compact, device)
                        row["equal"] = all(torch.equal(bits(g), bits(w)) for g, w in zip(got, want))
                    except Exception as exc:  # noqa: BLE001 - reported in the table
                        row["error"] = f"{type(exc).__name__}: {str(exc)[:160]}"
                    yield row
    finally:
        cpu_kernel.set_simd_level(level)


def compiled_opt_step(make_recadam, fresh_params, timer: Timer, steps: int) -> dict[str, Any]:
    """torch.compile of a function calling our opt.step(), the library untouched. Our step hands
    each step's coefficients (bias correction, lambda(t)) to the foreach ops as Python floats, so
    Dynamo may compile a new graph every step; timing that would measure compilation. Three calls
    tell: when the graph count still grows at the third, report it instead of a time."""
    import torch

    entry: dict[str, Any] = {"name": "RecAdam, torch.compile(lambda: opt.step())"}
    try:
        from torch._dynamo.utils import counters

        opt = make_recadam(fresh_params())
        fn = torch.compile(lambda: opt.step())
        graphs, seconds = [], []
        for _ in range(3):
            t0 = time.perf_counter()
            fn()
            sync()
            seconds.append(time.perf_counter() - t0)
            graphs.append(int(counters["stats"].get("unique_graphs", 0)))
        if graphs[2] > graphs[1]:
            entry["note"] = (f"not timed: recompiles every step ({graphs} graphs after 1-3 steps; "
                             f"{seconds[-1]:.1f} s per step): the per-step coefficients are Python floats. "
                             "A compiled step needs them as 0-d tensors (a library change)")
        else:
            times = [timer.time(fn) for _ in range(steps)]
            entry.update(median_ms=median(times), min_ms=min(times),
                         note=f"compiled once ({graphs[-1]} graphs), first call {seconds[0]:.1f} s")
    except Exception as exc:  # noqa: BLE001
        entry["note"] = f"not measured: {type(exc).__name__}: {str(exc)[:200]}"
    return entry


# ==================================================================================================
# Parts b and c: workers under a launcher (world size 1)
# ==================================================================================================
def write_min_config(tmp: Path, strategy: dict[str, Any], precision: str, batch: int, device: str,
                     seq: int | None = None, model: dict[str, Any] | None = None, max_grad_norm: float = 1.0):
    """A RunConfig through the public loader (its model/data sections are not used here)."""
    import yaml

    from ft_framework.config import load_config

    model_dir = tmp / "unused_model"
    model_dir.mkdir(parents=True, exist_ok=True)
    (model_dir / "config.json").write_text("{}")
    cfg = {"model": {"name_or_path": str(model_dir), **(model or {})},
           "data": {"task": "sst2", "source": "builtin:quickstart", **({"max_seq_length": seq} if seq else {})},
           "schedule": {"name": "constant", "warmup_steps": 0},
           "training": {"max_steps": 10, "per_device_batch_size": batch, "precision": precision,
                        "device": device, "max_grad_norm": max_grad_norm},
           "strategy": strategy,
           "logging": {"output_dir": str(tmp / "out"), "progress_bar": False}}
    path = tmp / f"bench_{os.getpid()}.yaml"
    path.write_text(yaml.safe_dump(cfg))
    return load_config(path, [], check_paths=False)


def build_albert(tiny: bool):
    import torch
    from transformers import AlbertConfig, AlbertForSequenceClassification

    torch.manual_seed(0)
    cfg = AlbertConfig(**(ALBERT_TINY if tiny else ALBERT_XXLARGE), num_labels=2)
    return AlbertForSequenceClassification(cfg)


def make_batch(batch: int, seq: int, vocab: int, device) -> dict[str, Any]:
    import torch

    g = torch.Generator().manual_seed(batch * 1000 + seq)
    return {"input_ids": torch.randint(5, vocab, (batch, seq), generator=g).to(device),
            "attention_mask": torch.ones(batch, seq, dtype=torch.long).to(device),
            "labels": torch.randint(0, 2, (batch,), generator=g).to(device)}


def optimizer_builders(name: str, *, offload: bool, tiny: bool):
    """(make_optimizer(model), needs_anchors, note) for candidate `name`, through public APIs."""
    import torch

    from ft_framework.optim import build_optimizer
    from ft_framework.optim.groups import build_param_groups

    if name == "RecAdam (ours)":
        def make(model, anchors):
            # The strategy places theta* after wrapping (setup(..., anchors=)); the groups carry none.
            groups = build_param_groups(model, anchors, lr=RECADAM_LR, weight_decay=0.01,
                                        attach_anchors=False)
            return build_optimizer("recadam", groups, impl="auto", **RECADAM_HPARAMS)
        return make, True, ""
    if name == "DeepSpeedCPUAdam":
        def make(model, anchors):
            from deepspeed.ops.adam import DeepSpeedCPUAdam

            return DeepSpeedCPUAdam(model.parameters(), lr=RECADAM_LR, weight_decay=0.01, adamw_mode=True)
        return make, False, ""
    if name == "torch AdamW fused":
        def make(model, anchors):
            return torch.optim.AdamW(model.parameters(), lr=RECADAM_LR, weight_decay=0.01, fused=True)
        return make, False, ""
    raise ValueError(name)


def setup_strategy(cfg, model, optimizer_name: str, offload: bool, tiny: bool):
    """Our strategy (public factory) around `model` with optimizer `optimizer_name`."""
    from ft_framework.strategies import build_strategy

    strategy = build_strategy(cfg.strategy, cfg.training)
    make, needs_anchors, _ = optimizer_builders(optimizer_name, offload=offload, tiny=tiny)
    anchors = None
    if needs_anchors:
        anchors = {n: p.detach().clone().float() for n, p in model.named_parameters() if not n.startswith("classifier")}
    strategy.setup(model, lambda m: make(m, anchors), anchors=anchors)
    return strategy


def train_candidate(cfg, optimizer_name: str, args, *, batch: int, offload: bool, steps: int, warmup: int,
                    strategy=None) -> tuple[dict[str, Any], Any]:
    """Builds (unless given) and times `steps` iterations (forward, backward, clip_and_step at the
    config's training.max_grad_norm); the median gradient norm is in the entry."""
    import torch

    cuda = torch.cuda.is_available() and not args.tiny
    max_grad_norm = cfg.training.max_grad_norm
    entry: dict[str, Any] = {"name": optimizer_name, "batch": batch}
    if strategy is None:
        model = build_albert(args.tiny)
        entry["numel"] = sum(p.numel() for p in model.parameters())
        strategy = setup_strategy(cfg, model, optimizer_name, offload, args.tiny)
        del model
    entry["impl"] = getattr(strategy.optimizer, "impl", type(strategy.optimizer).__name__)
    # the CPU step under offload (the per-tensor steps and rollbacks too), on whichever thread it runs
    clock = getattr(strategy, "_bench_clock", None) or MethodClock(
        strategy.optimizer, ("step", "step_tensors", "rollback_tensors"))
    strategy._bench_clock = clock
    vocab = (ALBERT_TINY if args.tiny else ALBERT_XXLARGE)["vocab_size"]
    data = make_batch(batch, args.seq, vocab, strategy.device)
    if cuda:
        torch.cuda.reset_peak_memory_stats()
    iters, step_ms, cpu_ms, norms = [], [], [], []
    for i in range(warmup + steps):
        sync()
        t0 = time.perf_counter()
        strategy.model.train()
        loss = strategy.forward(data).loss
        strategy.backward(loss)
        sync()
        t1 = time.perf_counter()
        clock.take()
        norm = strategy.clip_and_step(max_grad_norm)
        sync()
        t2 = time.perf_counter()
        cpu = clock.take() * 1e3
        if i >= warmup:
            iters.append((t2 - t0) * 1e3)
            step_ms.append((t2 - t1) * 1e3)
            cpu_ms.append(cpu)
            norms.append(float(norm))
    it = median(iters)
    entry.update(iter_ms=it, step_ms=median(step_ms), cpu_step_ms=median(cpu_ms) if offload else None,
                 cpu_share=(median(cpu_ms) / it) if offload and it else None,
                 samples_per_s=batch / it * 1e3 if it else None, loss=float(loss.detach().float()),
                 grad_norm=median(norms))
    if cuda:
        entry["peak_gpu_gb"] = torch.cuda.max_memory_allocated() / 1e9
        entry["peak_gpu_reserved_gb"] = torch.cuda.max_memory_reserved() / 1e9
    return entry, strategy


def freeze_imports() -> None:
    """For the dry run (--tiny): every object alive now moves to the collector's permanent
    generation (gc.freeze), so each gc.collect() after it (release(), every out-of-memory probe of
    the batch search) no longer walks the ~400,000 objects that importing torch and transformers
    made: 0.3 s of CPU each on a 2-core EPYC, more than a toy step. What is made after it (models,
    strategies, their garbage) is collected as before. Called before any model is built; a GPU run
    does not call it."""
    gc.freeze()


def release(strategy) -> None:
    import torch

    engine = getattr(strategy, "engine", None)
    if engine is not None and hasattr(engine, "destroy"):
        engine.destroy()  # no except: an engine left alive would hold memory the next measurement counts
    for attr in ("engine", "model", "optimizer", "state_map", "_bench_clock"):
        if hasattr(strategy, attr):
            try:
                setattr(strategy, attr, None)
            except AttributeError:  # a read-only property of the strategy: nothing of its own to drop
                pass
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()



def largest_batch_under_cap(args, strategy, build: Callable[[], Any], train_one: Callable[[Any, int], None],
                            cuda: bool, deadline: float, on_probe: Callable[[dict[str, Any]], None] = lambda cap: None
                            ) -> tuple[dict[str, Any], list[tuple[int, bool]] | None]:
    """The largest batch under --cap-gb (parts f and g), doubling then bisecting
    (largest_fitting_batch); stopped at `deadline` (then a lower bound). `train_one(strategy, batch)`
    runs one step; `build()` makes a strategy anew. On the CPU (no cap) a batch above
    --max-batch / 4 stands in for an out-of-memory error. After an out-of-memory probe our offload
    abandons the half-done step and the same strategy probes on (its model and pinned masters stay);
    a DeepSpeed engine is rebuilt (its buffers may be half-built) in the same process group.
    `on_probe(cap)` after every probe: the caller writes it down. Returns (cap: cap_gb, complete,
    the probes run, largest_batch and any error; the search's own probes, a deadline's refusals
    among them, None if it failed)."""
    import torch

    cap: dict[str, Any] = {"cap_gb": args.cap_gb, "complete": True, "probes": []}
    if cuda:
        torch.cuda.empty_cache()
        total = torch.cuda.get_device_properties(0).total_memory
        torch.cuda.set_per_process_memory_fraction(min(1.0, args.cap_gb * 1e9 / total))
    simulated = None if cuda else max(1, args.max_batch // 4)  # the dry run's stand-in for the cap
    state = {"strategy": strategy}

    def probe(batch: int) -> bool:
        try:
            if simulated is not None and batch > simulated:
                raise torch.OutOfMemoryError(f"simulated: batch {batch} > {simulated}")
            if state["strategy"] is None:
                state["strategy"] = build()
            train_one(state["strategy"], batch)
            return True
        except Exception as exc:  # noqa: BLE001
            if not is_oom(exc):
                raise
            current = state["strategy"]
            if current is not None and hasattr(current, "abandon_step"):
                current.abandon_step()  # our offload: the same strategy probes on
            elif current is not None:  # half-way through a DeepSpeed step: rebuilt for the next probe
                # The engine goes, the process group stays (close() would destroy it): the next
                # DeepSpeedStrategy joins it, as deepspeed.init_distributed's groups still name it.
                release(current)
                state["strategy"] = None
            gc.collect()
            if cuda:
                torch.cuda.synchronize()
                torch.cuda.empty_cache()
            return False

    def fits(batch: int) -> bool:
        if time.perf_counter() > deadline:
            cap["complete"] = False
            return False
        ok = probe(batch)
        cap["probes"].append((batch, ok))
        good = [b for b, fit in cap["probes"] if fit]
        cap["largest_batch"] = max(good) if good else None
        on_probe(cap)
        return ok

    searched = None
    try:
        cap["largest_batch"], searched = largest_fitting_batch(fits, args.batch, args.max_batch)
    except Exception as exc:  # noqa: BLE001 - the row says what failed
        cap["error"] = f"{type(exc).__name__}: {str(exc)[:300]}"
    if state["strategy"] is not None:
        release(state["strategy"])
        state["strategy"].close()
    return cap, searched

def emit(args, key: str, value: Any) -> None:
    """A worker's finished row, on disk at once (--rows-out): `key` names the list of the worker's
    result it belongs to, or "row" for a worker whose result is one row written again as it grows
    (part f); the parent rebuilds the result from these when the worker did not end (rows_result)."""
    if args.rows_out is not None:
        RowLog(args.rows_out).append({"key": key, "value": value})


def rows_result(path: Path) -> dict[str, Any]:
    """A worker's result rebuilt from its rows (emit): lists in order, the last "row" merged."""
    data: dict[str, Any] = {}
    for record in read_rows(path):
        if record.get("key") == "row":
            data.update(record.get("value") or {})
        else:
            data.setdefault(record.get("key"), []).append(record.get("value"))
    return data


def worker(args) -> dict[str, Any]:
    import torch
    import torch.distributed as dist

    cuda = torch.cuda.is_available() and not args.tiny
    device = "cuda" if cuda else "cpu"
    steps, warmup = args.steps or (3 if args.tiny else 8), args.warmup or (1 if args.tiny else 3)
    tmp = Path(tempfile.mkdtemp(prefix="gpu_suite_"))
    if args.tiny:
        from transformers import AlbertForSequenceClassification  # noqa: F401  every worker builds one: frozen too

        freeze_imports()
    if args.worker in ("d", "d_cap"):
        return worker_d(args, cuda, device, steps, warmup, tmp)
    if args.worker == "e":
        return worker_e(args, cuda, device, steps=2, warmup=1, tmp=tmp)
    if args.worker in ("f0", "f1", "f2"):
        return gpu_part_f.worker_f(sys.modules[__name__], args, cuda, device, tmp)
    offload = args.worker in ("b", "b_cap")
    precision = "bf16"
    if args.worker.startswith("c_fsdp"):
        strategy = {"name": "fsdp", "fsdp": {"cpu_offload": False, "mixed_precision": True}}
    else:
        strategy = {"name": "deepspeed", "deepspeed": {"zero_stage": 2, "offload_optimizer": offload}}
    cfg = write_min_config(tmp, strategy, precision, args.batch, device)
    out: dict[str, Any] = {"model": "ALBERT-xxlarge" if not args.tiny else "ALBERT (tiny)", "seq": args.seq,
                           "batch": args.batch, "steps": steps, "warmup": warmup, "precision": precision,
                           "candidates": []}
    names = (["RecAdam (ours)", "DeepSpeedCPUAdam"] if offload else ["RecAdam (ours)", "torch AdamW fused"])
    if args.worker == "b_cap":
        names = ["RecAdam (ours)", "DeepSpeedCPUAdam"]
        out["cap_gb"] = args.cap_gb
        if cuda:
            total = torch.cuda.get_device_properties(0).total_memory
            fraction = min(1.0, args.cap_gb * 1e9 / total)
            torch.cuda.set_per_process_memory_fraction(fraction)
            out["note"] = f"memory fraction {fraction:.3f} of {total / 1e9:.1f} GB"
        else:
            out["note"] = ("CPU smoke run: no GPU memory to cap; the batch search runs against a simulated "
                           f"limit (batch > {args.max_batch // 4} 'runs out of memory')")
    for name in names:
        try:
            entry, strat = train_candidate(cfg, name, args, batch=args.batch, offload=offload, steps=steps, warmup=warmup)
            out["numel"] = entry.get("numel", out.get("numel"))
            out["backend"] = dist.get_backend() if dist.is_initialized() else None
            out["world_size"] = dist.get_world_size() if dist.is_initialized() else 1
            release(strat)
        except Exception as exc:  # noqa: BLE001 - reported in the table
            import traceback

            traceback.print_exc()
            entry = {"name": name, "error": f"{type(exc).__name__}: {str(exc)[:400]}", "iter_ms": None}
            gc.collect()
            if cuda:
                torch.cuda.empty_cache()
        out["candidates"].append(entry)
        emit(args, "candidates", entry)
        log(f"{args.worker}: {name}: {entry.get('iter_ms')} ms/iter")
    if args.worker == "b_cap":
        out.update(batch_search(cfg, args, steps=2, cuda=cuda))
    return out


# Part d's candidates: (strategy section, optimizer builder name).
D_CANDIDATES = {
    "RecAdam, overlapped offload (ours)": ({"name": "single", "offload_optimizer": {"overlap": True}}, "RecAdam (ours)"),
    "RecAdam, serial offload (ours)": ({"name": "single", "offload_optimizer": {"overlap": False}}, "RecAdam (ours)"),
    "DeepSpeedCPUAdam, ZeRO-2 offload": ({"name": "deepspeed", "deepspeed": {"zero_stage": 2, "offload_optimizer": True}},
                                         "DeepSpeedCPUAdam"),
}


def worker_d(args, cuda: bool, device: str, steps: int, warmup: int, tmp: Path) -> dict[str, Any]:
    """Part d (and d_cap, under the --cap-gb memory cap): each candidate in turn, one process."""
    import torch
    import torch.distributed as dist

    out: dict[str, Any] = {"model": "ALBERT-xxlarge" if not args.tiny else "ALBERT (tiny)", "seq": args.seq,
                           "batch": args.batch, "steps": steps, "warmup": warmup, "precision": "bf16",
                           "candidates": []}
    if args.worker == "d_cap":
        out["cap_gb"] = args.cap_gb
        if cuda:
            total = torch.cuda.get_device_properties(0).total_memory
            fraction = min(1.0, args.cap_gb * 1e9 / total)
            torch.cuda.set_per_process_memory_fraction(fraction)
            out["note"] = f"Memory fraction {fraction:.3f} of {total / 1e9:.1f} GB."
        else:
            out["note"] = "CPU smoke run: no GPU memory to cap."
    for name, (strategy_section, optimizer_name) in D_CANDIDATES.items():
        try:
            cfg = write_min_config(tmp, strategy_section, "bf16", args.batch, device)
            entry, strat = train_candidate(cfg, optimizer_name, args, batch=args.batch, offload=True,
                                           steps=steps, warmup=warmup)
            entry["name"] = name
            entry["rollbacks"] = getattr(strat, "rollbacks", None)
            out["numel"] = entry.get("numel", out.get("numel"))
            out["backend"] = dist.get_backend() if dist.is_initialized() else None
            release(strat)  # before close(): a DeepSpeed engine's destroy() still needs the process group
            strat.close()
        except Exception as exc:  # noqa: BLE001 - reported in the table
            entry = {"name": name, "error": failure(exc, cuda), "iter_ms": None}
        out["candidates"].append(entry)
        emit(args, "candidates", entry)
        log(f"{args.worker}: {name}: {entry.get('iter_ms')} ms/iter")
    return out


def failure(exc: BaseException, cuda: bool) -> str:
    """A case's error for its table row, after printing the traceback and freeing what it held."""
    import traceback

    import torch

    traceback.print_exc()
    gc.collect()
    if cuda:
        torch.cuda.empty_cache()
    return f"{type(exc).__name__}: {str(exc)[:400]}"


# Part e's cases: the plan (ft-plan's, strategies/memory_plan.py) against the measured peak.
E_CASES = {
    "overlapped offload (single)": {"name": "single", "offload_optimizer": {"overlap": True}},
    "DeepSpeed ZeRO-2 offload": {"name": "deepspeed", "deepspeed": {"zero_stage": 2, "offload_optimizer": True}},
}
E_TARGET = 0.10  # the plan within +-10% of the measured peak (issue 25)


def worker_e(args, cuda: bool, device: str, steps: int, warmup: int, tmp: Path) -> dict[str, Any]:
    """Part e: for each case, the planned live tensor bytes of the device (before anything is built)
    against torch.cuda.max_memory_allocated of a few real steps (on the CPU, --tiny: the live
    tensor bytes the plan's own counter sees, a plumbing check only)."""
    import torch
    from transformers import AlbertConfig

    from ft_framework.strategies.memory_plan import plan_peak
    from ft_framework.task_kinds import build_task_kind
    from ft_framework.strategies.memory_trace import live_bytes

    out: dict[str, Any] = {"model": "ALBERT-xxlarge" if not args.tiny else "ALBERT (tiny)", "seq": args.seq,
                           "batch": args.batch, "precision": "bf16", "cases": []}
    arch = AlbertConfig(**(ALBERT_TINY if args.tiny else ALBERT_XXLARGE))
    for name, strategy_section in E_CASES.items():
        entry: dict[str, Any] = {"name": name}
        try:
            cfg = write_min_config(tmp, strategy_section, "bf16", args.batch, device, seq=args.seq)
            plan = plan_peak(cfg, arch, task=build_task_kind(cfg), world_size=1, on_gpu=cuda)
            entry.update(planned_gb=plan.live_bytes / 1e9, planned_reserved_gb=plan.device_peak / 1e9)
            if cuda:
                torch.cuda.reset_peak_memory_stats()
                _, strat = train_candidate(cfg, "RecAdam (ours)", args, batch=args.batch, offload=True,
                                           steps=steps, warmup=warmup)
                entry.update(measured_gb=torch.cuda.max_memory_allocated() / 1e9,
                             measured_reserved_gb=torch.cuda.max_memory_reserved() / 1e9)
            else:
                with live_bytes() as counter:
                    _, strat = train_candidate(cfg, "RecAdam (ours)", args, batch=args.batch, offload=True,
                                               steps=steps, warmup=warmup)
                entry["measured_gb"] = counter.peak / 1e9
            release(strat)
            strat.close()
        except Exception as exc:  # noqa: BLE001 - reported in the table
            entry["error"] = failure(exc, cuda)
        out["cases"].append(entry)
        emit(args, "cases", entry)
        log(f"e: {name}: planned {entry.get('planned_gb')} GB, measured {entry.get('measured_gb')} GB")
    return out


def format_e(r: dict[str, Any]) -> str:
    out = ["## e. The memory plan against the measured peak: ALBERT-xxlarge, bf16, optimizer offloaded", ""]
    if r.get("error") and not r.get("cases"):
        return "\n".join(out + [f"failed: {r['error']}"])
    out += [f"{r.get('model')}, seq {r.get('seq')}, batch {r.get('batch')}, {r.get('precision')}, world size 1. "
            "Planned: the live tensor bytes of ft-plan's plan (without the CUDA context and allocator slack), "
            "before anything is built; measured: torch.cuda.max_memory_allocated over 2 steps after 1 warm-up "
            f"(with --tiny, on the CPU: live tensor bytes, a plumbing check). Target: within ±{E_TARGET:.0%}.", ""]
    rows = []
    for c in r.get("cases", []):
        if c.get("error"):
            rows.append([c["name"], fmt(c.get("planned_gb")), "failed", "", "", "", c["error"][:300]])
            continue
        rel = c["planned_gb"] / c["measured_gb"] - 1 if c.get("measured_gb") else None
        verdict = "" if rel is None else ("yes" if abs(rel) <= E_TARGET else "NO")
        rows.append([c["name"], fmt(c.get("planned_gb")), fmt(c.get("measured_gb")),
                     "" if rel is None else f"{rel:+.1%}", verdict, fmt(c.get("planned_reserved_gb")),
                     fmt(c.get("measured_reserved_gb"))])
    out.append(markdown_table(["case", "planned GB", "measured GB", "plan vs measured", "within target",
                               "planned peak with context + slack GB", "max reserved GB"], rows))
    return "\n".join(out)


def batch_search(cfg, args, steps: int, cuda: bool) -> dict[str, Any]:
    """Largest RecAdam batch under the cap; a fresh engine after every OOM (its buffers may be
    half-built). On the CPU (smoke run) OOM is simulated above max_batch // 4."""
    import torch

    state: dict[str, Any] = {"strategy": None}
    simulated_limit = None if cuda else max(1, args.max_batch // 4)

    def fits(batch: int) -> bool:
        try:
            if simulated_limit is not None and batch > simulated_limit:
                raise torch.cuda.OutOfMemoryError(f"simulated: batch {batch} > {simulated_limit}")
            entry, state["strategy"] = train_candidate(cfg, "RecAdam (ours)", args, batch=batch, offload=True,
                                                       steps=steps, warmup=1, strategy=state["strategy"])
            log(f"b_cap: batch {batch} fits ({entry['iter_ms']:.0f} ms/iter)")
            return True
        except Exception as exc:  # noqa: BLE001
            if not is_oom(exc):
                raise
            log(f"b_cap: batch {batch}: out of memory")
            if state["strategy"] is not None:
                release(state["strategy"])
                state["strategy"] = None
            gc.collect()
            if torch.cuda.is_available():
                torch.cuda.empty_cache()
            return False

    result: dict[str, Any] = {"max_batch": args.max_batch}
    try:
        largest, probes = largest_fitting_batch(fits, args.batch, args.max_batch)
        result.update(largest_batch=largest, probes=probes)
        if largest is not None:
            entry, strat = train_candidate(cfg, "RecAdam (ours)", args, batch=largest, offload=True,
                                           steps=args.steps or (3 if args.tiny else 5), warmup=1,
                                           strategy=state["strategy"])
            entry["name"] = "RecAdam (ours), largest batch"
            result["largest_batch_run"] = entry
            release(strat)
    except Exception as exc:  # noqa: BLE001
        import traceback

        traceback.print_exc()
        result["error"] = f"batch search: {type(exc).__name__}: {str(exc)[:400]}"
    return result


RUNNING_WORKERS: set[int] = set()  # process groups of the workers running now


def stop_workers_and_exit(signum, frame) -> None:
    """SIGTERM (a part's time limit, benchmarks/gpu_run_next.sh): each running worker's whole
    process group goes too, so none keeps the GPU while the next part measures."""
    for pid in list(RUNNING_WORKERS):
        try:
            os.killpg(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    raise SystemExit(124)


def worker_env(tiny: bool) -> dict[str, str]:
    """The environment a worker of this suite (or of parts f and g) starts in: output unbuffered,
    the repository importable, and on a --tiny dry run DeepSpeed on the CPU with one thread."""
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(REPO), env.get("PYTHONPATH", "")) if p)
    if tiny:
        env.update(DS_ACCELERATOR="cpu", OMP_NUM_THREADS=env.get("OMP_NUM_THREADS", "1"))
    return env


def run_in_session(cmd: list[str], env: dict[str, str], log_path: Path, timeout: float) -> int | None:
    """Runs `cmd` from the repository, its output streamed to `log_path`, in a session of its own:
    at `timeout` seconds (or at this process's SIGTERM, stop_workers_and_exit) the whole tree goes
    (a launcher's worker and a JIT compiler under it too), so no orphan holds GPU memory while the
    next part measures. Its exit code, or None when its time ran out."""
    with open(log_path, "w", buffering=1) as log_file:
        proc = subprocess.Popen(cmd, env=env, cwd=REPO, stdout=log_file, stderr=subprocess.STDOUT, text=True,
                                start_new_session=True)
        RUNNING_WORKERS.add(proc.pid)
        try:
            return proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
            return None
        finally:
            RUNNING_WORKERS.discard(proc.pid)


# A worker's wall-clock deadline (time.time()), set by the parent at launch: its time limit counts
# from before the launcher and the imports, which the worker cannot see from inside.
DEADLINE_ENV = "GPU_SUITE_WORKER_DEADLINE"


def worker_files(args, kind: str) -> tuple[Path, Path]:
    """Where worker `kind` streams its output and appends its rows: beside the report (--out), so a
    kill of the worker, or of this process, leaves both."""
    out = Path(args.out)
    return out.with_name(f"{out.stem}_{kind}.log"), out.with_name(f"{out.stem}_{kind}.rows.jsonl")


def launch_worker(kind: str, args, launcher: str) -> dict[str, Any]:
    """Runs this file as a --worker under `launcher` (deepspeed / torchrun), world size 1, within
    args.timeout seconds. Its output streams to a log file and its rows to a rows file as they come
    (worker_files); when it ends without its result, the result is rebuilt from its rows."""
    out_json = Path(tempfile.mkdtemp(prefix="gpu_suite_w_")) / f"{kind}.json"
    log_path, rows_path = worker_files(args, kind)
    rows_path.unlink(missing_ok=True)
    script = str(Path(__file__).resolve())
    port = str(free_port())
    if launcher == "deepspeed":
        exe = Path(sys.executable).parent / "deepspeed"
        prefix = [str(exe)] if exe.is_file() else [sys.executable, "-m", "deepspeed.launcher.runner"]
        cmd = [*prefix, "--num_gpus", "1", "--master_port", port, script]
    else:
        cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "1", "--master_port", port, script]
    cmd += ["--worker", kind, "--worker-out", str(out_json), "--rows-out", str(rows_path), "--out", str(args.out),
            "--batch", str(args.batch), "--seq", str(args.seq), "--cap-gb", str(args.cap_gb),
            "--max-batch", str(args.max_batch)]
    for flag, value in (("--steps", args.steps), ("--warmup", args.warmup)):
        if value is not None:
            cmd += [flag, str(value)]
    if args.tiny:
        cmd.append("--tiny")
    env = worker_env(args.tiny)
    env[DEADLINE_ENV] = repr(time.time() + args.timeout)
    log(f"launching {kind} (limit {args.timeout} s, output {log_path}): {shlex.join(cmd)}")
    t0 = time.perf_counter()
    rc = run_in_session(cmd, env, log_path, args.timeout)
    rc, note = (-1, f"timeout after {args.timeout}s: ") if rc is None else (rc, "")
    tail = note + log_path.read_text(errors="replace")[-3000:]
    log(f"{kind}: exit {rc} after {time.perf_counter() - t0:.0f} s")
    if out_json.is_file():
        data = json.loads(out_json.read_text())
        if rc != 0:
            data.setdefault("error", f"worker exit code {rc}: {tail[-600:]}")
        return data
    data = rows_result(rows_path)
    data["error"] = f"worker exit code {rc}, ended before its result (its finished rows are kept); log tail: {tail[-1500:]}"
    data.setdefault("candidates", [])
    return data


# ==================================================================================================
# The tests part
# ==================================================================================================
def part_tests(args, log_path: Path) -> dict[str, Any]:
    """`pytest tests/gpu` (with --tests-k, only those cases), its output streamed to `log_path` as it
    comes and each launch's output beside it (FT_GPU_TESTS_LOG_DIR)."""
    import re

    cmd = [sys.executable, "-m", "pytest", "tests/gpu", "-ra", "-q", "-p", "no:cacheprovider"]
    if args.tests_k:
        cmd += ["-k", args.tests_k]
    env = dict(os.environ, FT_GPU_TESTS_LOG_DIR=str(log_path.parent), PYTHONUNBUFFERED="1")
    if args.tiny:
        env.update(FT_GPU_TESTS_DEVICE="cpu", OMP_NUM_THREADS=env.get("OMP_NUM_THREADS", "1"))
    t0 = time.perf_counter()
    rc = run_in_session(cmd, env, log_path, args.timeout)  # its launches share its session: a limit ends them all
    if rc is None:
        with open(log_path, "a") as log_file:
            log_file.write(f"\nTIMEOUT after {args.timeout}s\n")
        rc = -1
    text = log_path.read_text(errors="replace")
    result = {"command": ("FT_GPU_TESTS_DEVICE=cpu " if args.tiny else "") + shlex.join(cmd[2:]).replace("pytest", "python -m pytest", 1),
              "returncode": rc, "seconds": time.perf_counter() - t0, "log": str(log_path)}
    last = [line for line in text.splitlines() if line.strip()][-1:] or [""]
    for key in ("passed", "failed", "skipped", "errors", "error"):
        m = re.search(rf"(\d+) {key}\b", last[0])
        if m:
            result["errors" if key == "error" else key] = int(m.group(1))
    lines = text.splitlines()
    start = next((i for i, line in enumerate(lines) if "short test summary info" in line), None)
    result["summary"] = "\n".join(lines[start:] if start is not None else lines[-5:])[-4000:]
    return result


# ==================================================================================================
# Main
# ==================================================================================================
def main(argv: list[str] | None = None) -> int:
    args = resolve_defaults(build_parser().parse_args(argv))
    if args.tiny:
        os.environ.setdefault("DS_ACCELERATOR", "cpu")
    if args.worker:
        result = worker(args)
        import torch.distributed as dist

        if not dist.is_initialized() or dist.get_rank() == 0:
            args.worker_out.write_text(json.dumps(result, indent=1, default=str))
        if dist.is_initialized():
            dist.destroy_process_group()
        return 0

    signal.signal(signal.SIGTERM, stop_workers_and_exit)
    command = "python " + shlex.join([os.path.relpath(__file__, REPO)] + list(sys.argv[1:] if argv is None else argv))
    started = time.perf_counter()
    v = versions()
    out_path = Path(args.out)
    out_path.parent.mkdir(parents=True, exist_ok=True)
    sections: dict[str, str] = {}
    raw: dict[str, Any] = {"versions": v, "command": command}
    # The part running now and what it has finished, read if this process is stopped (SIGTERM at a
    # part's time limit: stop_workers_and_exit raises SystemExit here) to write the report it had.
    running: dict[str, Any] = {"part": None, "workers": [], "f": {}}

    def write() -> str:
        footer = f"\n_Total wall time: {time.perf_counter() - started:.0f} s._\n"
        text = build_report(report_header(v, command, args.tiny), list(sections.values())) + footer
        # Each file whole or its previous version: a kill between two writes leaves no truncated file.
        replace_text(out_path, text)
        replace_text(out_path.with_suffix(".json"), json.dumps(raw, indent=1, default=str))
        return text

    def run_worker(kind: str, launcher: str) -> dict[str, Any]:
        running["workers"].append(kind)
        return launch_worker(kind, args, launcher)

    def start(part: str) -> None:
        running.update(part=part, workers=[])
        log(f"{part}: started")

    try:
        if "tests" in args.only:
            start("tests")
            r = part_tests(args, out_path.with_name(out_path.stem + "_tests.log"))
            raw["tests"] = r
            sections["tests"] = format_tests(r)
            write()
        if "a" in args.only:
            start("a")

            def on_row(result: dict[str, Any]) -> None:
                raw["a"] = result
                sections["a"] = format_a(result)
                write()
                log(f"a: {len(result['bit_equality']) + len(result['candidates'])} rows on disk")
            try:
                part_a(args, on_row)
            except Exception as exc:  # noqa: BLE001 - the rows before it stay
                log(f"a: failed: {exc}")
                on_row(dict(raw.get("a") or {"candidates": [], "bit_equality": []},
                            error=f"{type(exc).__name__}: {exc}"))
        if "b" in args.only:
            start("b")
            b = run_worker("b", "deepspeed")
            b_cap = run_worker("b_cap", "deepspeed")
            raw["b"], raw["b_cap"] = b, b_cap
            sections["b"] = format_b(b, b_cap)
            write()
        if "c" in args.only:
            start("c")
            c = {"DeepSpeed ZeRO-2": run_worker("c_zero2", "deepspeed"),
                 "FSDP2 (bf16 mixed precision)": run_worker("c_fsdp", "torchrun")}
            raw["c"] = c
            sections["c"] = format_c(c)
            write()
        if "d" in args.only:
            start("d")
            d = run_worker("d", "deepspeed")
            # A --tiny run has no GPU memory to cap: the capped run would repeat the one above.
            d_cap = None if args.tiny else run_worker("d_cap", "deepspeed")
            raw["d"], raw["d_cap"] = d, d_cap
            sections["d"] = format_d(d, d_cap)
            write()
        if "e" in args.only:
            start("e")
            e = run_worker("e", "deepspeed")
            raw["e"] = e
            sections["e"] = format_e(e)
            write()
        if "f" in args.only:
            start("f")
            f = gpu_part_f.run_part_f(sys.modules[__name__], args, running["f"])
            raw["f"] = f
            sections["f"] = gpu_part_f.format_f(f, markdown_table)
            write()
        running["part"] = None
    except SystemExit:
        write_stopped_part(running, raw, sections, args)
        write()
        log(f"stopped in part {running['part']}: {out_path} holds every row it finished")
        raise
    text = write()
    print(text)
    log(f"wrote {out_path} (and {out_path.with_suffix('.json')})")
    failed_tests = raw.get("tests", {}).get("returncode", 0) not in (0, None)
    return 1 if failed_tests else 0


def write_stopped_part(running: dict[str, Any], raw: dict[str, Any], sections: dict[str, str], args) -> None:
    """The section of the part that was stopped, from what it had written down: part a's rows are
    in already (written as they came); part f's finished rows and the running worker's row;
    another part's workers' rows files, listed row by row."""
    part = running.get("part")
    if part is None or part == "a":
        return
    if part == "f":
        raw["f"] = gpu_part_f.partial_f(sys.modules[__name__], running["f"])
        sections["f"] = gpu_part_f.format_f(raw["f"], markdown_table)
        return
    lines = [f"## {part}: stopped at its time limit", ""]
    if part == "tests":
        log_path = Path(args.out).with_name(Path(args.out).stem + "_tests.log")
        tail = log_path.read_text(errors="replace")[-3000:] if log_path.is_file() else ""
        lines += [f"pytest's output so far: `{log_path}`; it ends:", "", "```", tail.strip(), "```"]
    for kind in running.get("workers", []):
        rows = rows_result(worker_files(args, kind)[1])
        raw.setdefault("stopped", {})[kind] = rows
        lines += [f"worker {kind}: rows finished before the stop:", ""]
        for key, value in rows.items():
            for row in value if isinstance(value, list) else [value]:
                lines.append(f"- {key}: `{json.dumps(row, default=str)[:600]}`")
        lines.append("")
    sections[part] = "\n".join(lines)


if __name__ == "__main__":
    raise SystemExit(main())
