"""Optimizer-step benchmark: ms/step and effective GB/s of RecAdam implementations vs Adam baselines.

    python benchmarks/optim_step.py                              # CPU, 1M/10M/50M/100M, 1 and 2 threads
    python benchmarks/optim_step.py --sizes 5e7 --threads 2 --simd avx2
    python benchmarks/optim_step.py --markdown /tmp/optim_step.md
    python benchmarks/optim_step.py --device cuda                # GPU: triton and torch RecAdam vs AdamW(fused=True)
    python benchmarks/optim_step.py --sizes 5e7 --threads 2 --only ours_fp32,ds_adam --paired --lead-in 1

The parameters of one size are ONE flat fp32 tensor (ZeRO-Offload hands the CPU optimizer one flat
partition; ``--chunks K`` splits them into K tensors instead). Gradients are random, fixed per size;
every timed step reuses the same gradient (this is a memory-bandwidth benchmark). Each step is timed
with time.perf_counter around ``opt.step()`` (plus the separate pull for "fused AdamW + pull", plus
a CUDA synchronize on GPU); the table shows the median after warm-up. Every candidate gets a fresh
optimizer (state allocated in its warm-up) and its memory is freed before the next one.

The machine is usually shared: the script measures how many cores OTHER processes kept busy while
each candidate was timed (/proc/stat) and flags rows above 0.2 cores as NOISY. ``--wait-quiet S``
waits (up to S seconds) for a quiet machine before each candidate; ``--rounds R`` repeats each row
R times with the candidates interleaved and drops noisy rounds when a quiet one exists.

Effective GB/s = the bytes the ideal one-pass update must move per parameter / time:
RecAdam 32 B (reads p, g, m, v, theta*; writes p, m, v; all fp32), 30 B with bf16 anchors, Adam 28 B.
Every RecAdam candidate (also the multi-pass ones) is credited 32 B, so its GB/s is comparable.

Candidates (--only takes these names):
  ours_fp32    ft_framework recadam, impl="cpu" (C++ kernel), fp32 anchors
  ours_bf16    ft_framework recadam, impl="cpu", anchor_dtype="bfloat16"
  ours_importance  ours_fp32 with a per-element importance F~ (bf16 optimizer state, issue 51): the
               pull weighted by min(w F~, 1); 34 B moved, 18 B host (opt-in)
  ours_compact ft_framework recadam, impl="cpu", state_dtype="bfloat16" (the compact state: 26 B moved, 10 B
               host; opt-in)
  ours_compact_ds  the same with the parameter as its own master (keep_masters_in_params: the step on
               DeepSpeed's fp32 partitions, no delta: 22 B moved, 10 B host; opt-in)
  ours_torch   ft_framework recadam, impl="torch" (CPU or CUDA)
  ours_triton  ft_framework recadam, impl="triton" (CUDA; one Triton launch per step)
  ours_triton_compact  the same in the compact state (bf16 moments and anchors: 26 B moved; CUDA)
  authors      RecAdam in the style of the authors' release (benchmarks/authors_style_recadam.py)
  adamw_pull   torch.optim.AdamW(fused=True) step + a separate p.lerp_(theta*, pull)
  ds_adam      deepspeed.ops.adam.DeepSpeedCPUAdam (Adam only; JIT-built on first use)
  adamw_fused  torch.optim.AdamW(fused=True) alone (Adam only; default on CUDA, opt-in on CPU)
  ours_adamw   ft_framework adamw, impl="cpu": our kernel doing DeepSpeedCPUAdam's exact work (opt-in)
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import math
import os
import platform
import shlex
import statistics
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

# DeepSpeed picks its accelerator at import: it must be set before anything imports deepspeed.
os.environ.setdefault("DS_ACCELERATOR", "cpu")

import torch  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))
from authors_style_recadam import AuthorsStyleRecAdam, check_against_ours  # noqa: E402
from harness import (  # noqa: E402
    NOISY_CORES, BackgroundLoad, fmt_bg, fmt_size, loadavg, log, machine_line, markdown_table,
    paired_ratio, paired_times, quiet_rounds, round_order, set_threads, wait_for_quiet,
)

from ft_framework.optim import build_optimizer  # noqa: E402
from ft_framework.optim import cpu as cpu_kernel  # noqa: E402
from ft_framework.optim.base import IMPORTANCE  # noqa: E402

# RecAdam hyper-parameters of the authors' GLUE recipe (lr*(w-lambda)*gamma = 0.1 at the start).
HP = dict(lr=2e-5, betas=(0.9, 0.999), eps=1e-6, weight_decay=0.0, anneal_fun="sigmoid",
          anneal_k=0.5, anneal_t0=250.0, anneal_w=1.0, pretrain_cof=5000.0)

BYTES = {"recadam": 32, "recadam_bf16": 30, "adam": 28,
         # the compact state (optim/compact.py): reads g 4, m 2, v 2, delta 4, theta* 2; writes p 4, m 2,
         # v 2, delta 4 (p is written as theta* + delta for the model's forward)
         "recadam_compact": 26,
         # the compact state on DeepSpeed's partitions (the fp32 weight is the master, no delta):
         # reads g 4, p 4, m 2, v 2, theta* 2; writes p 4, m 2, v 2
         "recadam_compact_ds": 22,
         # the fp32 state with the per-element importance F~ (bf16): RecAdam's 32 B plus reading F~ 2
         "recadam_importance": 34}
# Bytes per parameter the optimizer keeps in host memory: its master (the fp32 weight, or delta),
# the moments and theta*; the model's own fp32 weight and gradient are not counted (they exist in
# every candidate; in the compact state the weight is a copy of theta* + delta, not the master).
HOST_BYTES = {"recadam": 16, "recadam_bf16": 14, "adam": 12, "recadam_compact": 10, "recadam_compact_ds": 10,
              "recadam_importance": 18}

# Steps of the slow multi-pass candidates are capped so that their timed steps take about this long.
SLOW_BUDGET_S = 3.0
MIN_SLOW_STEPS = 3
# Every candidate repeats its timed steps until at least this long has been timed.
MIN_TIMED_S = 0.3


# --------------------------------------------------------------------------------------------------
# Data and candidates
# --------------------------------------------------------------------------------------------------
@dataclass
class SizeData:
    numel: int
    device: torch.device
    theta_star: list[torch.Tensor]   # fp32 pretrained values
    start: list[torch.Tensor]        # initial parameters (theta* + small noise)
    grads: list[torch.Tensor]        # the fixed gradient


def make_data(numel: int, chunks: int, device: torch.device, seed: int = 1234) -> SizeData:
    gen = torch.Generator().manual_seed(seed)
    sizes = [numel // chunks + (1 if i < numel % chunks else 0) for i in range(chunks)]
    theta, start, grads = [], [], []
    for s in sizes:
        a = torch.randn(s, generator=gen) * 0.02
        theta.append(a.to(device))
        start.append((a + torch.randn(s, generator=gen) * 1e-3).to(device))
        grads.append((torch.randn(s, generator=gen) * 1e-2).to(device))
    return SizeData(numel, device, theta, start, grads)


def fresh_params(data: SizeData) -> list[torch.nn.Parameter]:
    params = []
    for s, g in zip(data.start, data.grads):
        p = torch.nn.Parameter(s.clone())
        p.grad = g  # shared, never written by the optimizers
        params.append(p)
    return params


def pull_coefficient(step: int) -> float:
    from ft_framework.optim.anneal import anneal_lambda

    lam = anneal_lambda(HP["anneal_fun"], step, HP["anneal_k"], HP["anneal_t0"], HP["anneal_w"])
    return HP["lr"] * (HP["anneal_w"] - lam) * HP["pretrain_cof"]


class Skip(Exception):
    """A candidate that cannot run here; the message says why."""


@dataclass
class Candidate:
    name: str
    label: str
    bytes_per_param: int
    build: Callable[[SizeData], Callable[[], None]]  # returns the step function
    devices: tuple[str, ...] = ("cpu",)
    slow: bool = False
    host_bytes_per_param: int | None = None  # None: what its bytes_per_param's rule keeps (HOST_BYTES)

    @property
    def host_bytes(self) -> int:
        if self.host_bytes_per_param is not None:
            return self.host_bytes_per_param
        return HOST_BYTES["adam"] if self.bytes_per_param == BYTES["adam"] else HOST_BYTES["recadam"]


def _ours(impl: str, anchor_dtype: str = "float32", state_dtype: str = "float32", masters_in_params: bool = False,
          importance: bool = False):
    def build(data: SizeData):
        params = fresh_params(data)
        group = {"params": params, "anchors": data.theta_star}
        opt = build_optimizer("recadam", [group], impl=impl, anchor_dtype=anchor_dtype, state_dtype=state_dtype,
                              **HP)
        if masters_in_params:
            opt.keep_masters_in_params()
        if importance:  # F~ in [0, 2), mean 1 (what optim/importance.py's normalisation gives)
            gen = torch.Generator().manual_seed(5)
            for p in params:
                opt.state[p][IMPORTANCE] = (2 * torch.rand(p.shape, generator=gen)).to(torch.bfloat16)
        if opt.impl != impl:
            raise Skip(f"asked impl={impl!r}, got {opt.impl!r}")
        return opt.step
    return build


def _ours_adamw(data: SizeData):
    params = fresh_params(data)
    opt = build_optimizer("adamw", [{"params": params}], impl="cpu", lr=HP["lr"], betas=HP["betas"],
                          eps=HP["eps"], weight_decay=0.0)
    return opt.step


def _authors(data: SizeData):
    params = fresh_params(data)
    opt = AuthorsStyleRecAdam([{"params": params, "pretrain_params": list(data.theta_star)}], **HP)
    return opt.step


def _adamw_pull(data: SizeData):
    params = fresh_params(data)
    opt = torch.optim.AdamW(params, lr=HP["lr"], betas=HP["betas"], eps=HP["eps"], weight_decay=0.0,
                            fused=True)
    anchors = data.theta_star
    t = [0]

    def step():
        opt.step()
        t[0] += 1
        pull = pull_coefficient(t[0])
        with torch.no_grad():
            for p, a in zip(params, anchors):
                p.lerp_(a, pull)  # p - pull * (p - a)
    return step


def _adamw_fused(data: SizeData):
    params = fresh_params(data)
    opt = torch.optim.AdamW(params, lr=HP["lr"], betas=HP["betas"], eps=HP["eps"], weight_decay=0.0,
                            fused=True)
    return opt.step


_DS_ERROR: list[str] = []


def _ds_adam(data: SizeData):
    if _DS_ERROR:
        raise Skip(_DS_ERROR[0])
    try:
        from deepspeed.ops.adam import DeepSpeedCPUAdam
        params = fresh_params(data)
        t0 = time.perf_counter()
        opt = DeepSpeedCPUAdam(params, lr=HP["lr"], betas=HP["betas"], eps=HP["eps"],
                               weight_decay=0.0, adamw_mode=True)
        if time.perf_counter() - t0 > 5:
            log(f"    (DeepSpeedCPUAdam op built/loaded in {time.perf_counter() - t0:.0f} s)")
    except Exception as exc:  # noqa: BLE001 - any build failure means: skip the column
        _DS_ERROR.append(f"DeepSpeedCPUAdam unavailable: {type(exc).__name__}: {str(exc).splitlines()[0][:300]}")
        raise Skip(_DS_ERROR[0]) from None
    return opt.step


CANDIDATES = [
    Candidate("ours_fp32", "ours cpu fp32-anchor", BYTES["recadam"], _ours("cpu")),
    Candidate("ours_compact", "ours cpu compact state", BYTES["recadam_compact"], _ours("cpu", "bfloat16", "bfloat16"),
              host_bytes_per_param=HOST_BYTES["recadam_compact"]),
    Candidate("ours_compact_ds", "ours cpu compact, DeepSpeed's masters", BYTES["recadam_compact_ds"],
              _ours("cpu", "bfloat16", "bfloat16", masters_in_params=True),
              host_bytes_per_param=HOST_BYTES["recadam_compact_ds"]),
    Candidate("ours_bf16", "ours cpu bf16-anchor", BYTES["recadam_bf16"], _ours("cpu", "bfloat16"),
              host_bytes_per_param=HOST_BYTES["recadam_bf16"]),
    Candidate("ours_importance", "ours cpu fp32 + importance", BYTES["recadam_importance"],
              _ours("cpu", importance=True), host_bytes_per_param=HOST_BYTES["recadam_importance"]),
    Candidate("ours_torch", "ours torch", BYTES["recadam"], _ours("torch"), ("cpu", "cuda"), slow=True),
    Candidate("ours_triton", "ours triton", BYTES["recadam"], _ours("triton"), ("cuda",)),
    Candidate("ours_triton_compact", "ours triton compact state", BYTES["recadam_compact"],
              _ours("triton", "bfloat16", "bfloat16"), ("cuda",)),
    Candidate("authors", "authors-style", BYTES["recadam"], _authors, slow=True),
    Candidate("adamw_pull", "AdamW fused + pull", BYTES["recadam"], _adamw_pull, ("cpu", "cuda")),
    Candidate("ds_adam", "DeepSpeedCPUAdam (Adam)", BYTES["adam"], _ds_adam),
    Candidate("adamw_fused", "AdamW fused (Adam)", BYTES["adam"], _adamw_fused, ("cpu", "cuda")),
    Candidate("ours_adamw", "ours cpu AdamW (Adam)", BYTES["adam"], _ours_adamw),
]
BY_NAME = {c.name: c for c in CANDIDATES}
DEFAULT_CPU = ["ours_fp32", "ours_bf16", "ours_torch", "authors", "adamw_pull", "ds_adam"]
DEFAULT_CUDA = ["ours_triton", "ours_triton_compact", "ours_torch", "adamw_pull", "adamw_fused"]


# --------------------------------------------------------------------------------------------------
# Timing
# --------------------------------------------------------------------------------------------------
@dataclass
class Result:
    size: int
    threads: int
    name: str
    times_s: list[float] = field(default_factory=list)
    skipped: str | None = None
    background: float | None = None  # cores other processes used during the timed steps
    rounds: str = "1/1"              # rounds pooled / rounds run (noisy rounds are dropped)
    paired: bool = False             # times_s[i] of all paired results come from the same cycle

    @property
    def median_ms(self) -> float:
        return 1e3 * statistics.median(self.times_s)

    @property
    def min_ms(self) -> float:
        return 1e3 * min(self.times_s)

    def gbps(self, bytes_per_param: int) -> float:
        return bytes_per_param * self.size / (self.median_ms * 1e-3) / 1e9


def merge_rounds(rounds: list[Result]) -> Result:
    """Pools the timed steps of a candidate's rounds. Rounds during which other processes kept more
    than NOISY_CORES busy are dropped when at least one quiet round exists (harness.quiet_rounds)."""
    if rounds[-1].skipped:
        return rounds[-1]
    use = [rounds[i] for i in quiet_rounds([r.background for r in rounds])]
    out = Result(rounds[0].size, rounds[0].threads, rounds[0].name, paired=all(r.paired for r in use))
    for r in use:
        out.times_s += r.times_s
    bgs = [r.background for r in use if r.background is not None]
    out.background = max(bgs) if bgs else None
    out.rounds = f"{len(use)}/{len(rounds)}"
    return out


def time_candidate(cand: Candidate, data: SizeData, threads: int, steps: int, warmup: int) -> Result:
    res = Result(data.numel, threads, cand.name)
    cuda = data.device.type == "cuda"
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    step = None
    try:
        step = cand.build(data)
        warm_times = []
        for _ in range(max(1, warmup)):
            sync()
            t0 = time.perf_counter()
            step()
            sync()
            warm_times.append(time.perf_counter() - t0)
        n = steps
        if cand.slow:
            per = warm_times[-1]
            n = min(steps, max(MIN_SLOW_STEPS, math.ceil(SLOW_BUDGET_S / max(per, 1e-9))))
        with BackgroundLoad() as bg:
            t_begin = time.perf_counter()
            # At least MIN_TIMED_S is timed (many more than `steps` at small sizes), so small rows
            # get enough samples and a background-load reading.
            while len(res.times_s) < n or time.perf_counter() - t_begin < MIN_TIMED_S:
                sync()
                t0 = time.perf_counter()
                step()
                sync()
                res.times_s.append(time.perf_counter() - t0)
        res.background = bg.cores
    except Skip as exc:
        res.skipped = str(exc)
    finally:
        del step
        gc.collect()
        if cuda:
            torch.cuda.empty_cache()
    return res


def time_paired(cands: list[Candidate], data: SizeData, threads: int, steps: int, warmup: int,
                lead_in: int = 0) -> list[Result]:
    """All candidates alive at once and their steps interleaved (harness.paired_times): every
    candidate sees the same machine state, so their RATIOS are much steadier on a shared machine.
    Needs the memory of all candidates together; at sizes that fit in the caches it measures
    cold-cache steps (the other candidates evict the data in between). lead_in 0: each timed step
    follows another candidate's step (and pays for writing back its dirty lines); lead_in 1: each
    follows an untimed step of its own, as in training."""
    cuda = data.device.type == "cuda"
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    results = [Result(data.numel, threads, c.name, paired=True) for c in cands]
    fns: list = []
    try:
        for c, r in zip(cands, results):
            try:
                fns.append(c.build(data))
            except Skip as exc:
                r.skipped = str(exc)
                fns.append(None)
        live = [i for i, f in enumerate(fns) if f is not None]
        times, background = paired_times([fns[i] for i in live], steps, warmup, MIN_TIMED_S, sync, lead_in)
        for i, t in zip(live, times):
            results[i].times_s = t
            results[i].background = background
    finally:
        fns.clear()
        gc.collect()
        if cuda:
            torch.cuda.empty_cache()
    return results


# --------------------------------------------------------------------------------------------------
# Report
# --------------------------------------------------------------------------------------------------
RATIOS = [
    # (label, numerator, denominator, target text, predicate)
    # Issue 27: the fp32 step at >= 0.97 of DeepSpeedCPUAdam's bandwidth (32 B against its 28 B:
    # a time ratio <= (32/28)/0.97), the bf16-anchor step likewise (30 B), and the compact step at
    # <= 0.67x DeepSpeedCPUAdam's time.
    ("ours fp32 / DeepSpeedCPUAdam", "ours_fp32", "ds_adam", "<= 1.18, 0.97 of its GB/s",
     lambda r: r <= BYTES["recadam"] / BYTES["adam"] / 0.97),
    ("ours bf16 / DeepSpeedCPUAdam", "ours_bf16", "ds_adam", "<= 1.10, 0.97 of its GB/s",
     lambda r: r <= BYTES["recadam_bf16"] / BYTES["adam"] / 0.97),
    ("ours compact / DeepSpeedCPUAdam", "ours_compact", "ds_adam", "<= 0.67", lambda r: r <= 0.67),
    ("ours compact on DS masters / DeepSpeedCPUAdam", "ours_compact_ds", "ds_adam", "<= 0.67", lambda r: r <= 0.67),
    # Issue 51: the importance-weighted step's bandwidth share (34 B against DeepSpeedCPUAdam's 28 B:
    # 1.21 is parity), and what reading F~ costs over the unweighted step.
    ("ours importance / DeepSpeedCPUAdam", "ours_importance", "ds_adam", "info (1.21: equal GB/s)", None),
    ("ours importance / ours fp32", "ours_importance", "ours_fp32", "info", None),
    ("authors-style / ours fp32", "authors", "ours_fp32", ">= 5", lambda r: r >= 5.0),
    ("AdamW fused + pull / ours fp32", "adamw_pull", "ours_fp32", "> 1", lambda r: r > 1.0),
    ("ours torch / ours fp32", "ours_torch", "ours_fp32", "info", None),
    ("ours AdamW / DeepSpeedCPUAdam", "ours_adamw", "ds_adam", "info", None),
]
CUDA_RATIOS = [
    ("ours triton / AdamW fused", "ours_triton", "adamw_fused", "<= 1.2", lambda r: r <= 1.2),
    ("ours triton compact / AdamW fused", "ours_triton_compact", "adamw_fused", "<= 1.0", lambda r: r <= 1.0),
    ("ours torch / AdamW fused", "ours_torch", "adamw_fused", "info", None),
    ("AdamW fused + pull / AdamW fused", "adamw_pull", "adamw_fused", "info", None),
]


def time_ratio(a: Result, b: Result) -> float:
    """a's time / b's time: for paired runs the median of the per-cycle ratios (both measured
    back to back, so machine drift cancels), else the ratio of the medians."""
    return paired_ratio(a.times_s, b.times_s, paired=a.paired and b.paired)


def build_report(results: list[Result], names: list[str], header: list[str], device: str,
                 target_row: tuple[int, int] | None) -> str:
    """The report: header lines, then markdown tables (readable as plain text too)."""
    by_key = {(r.size, r.threads, r.name): r for r in results}
    rows = sorted({(r.size, r.threads) for r in results})
    cols = [BY_NAME[n] for n in names]

    def cell(size, thr, c):
        r = by_key.get((size, thr, c.name))
        if r is None:
            return "n/a"
        if r.skipped:
            return "skipped"
        return f"{r.median_ms:.2f} ms / {r.gbps(c.bytes_per_param):.1f} GB/s"

    thr_label = "threads" if device == "cpu" else "device"

    def row_key(size, thr):
        return [fmt_size(size), thr if device == "cpu" else device]

    md = markdown_table(["params", thr_label] + [f"{c.label} ({c.bytes_per_param} B)" for c in cols],
                        [row_key(size, thr) + [cell(size, thr, c) for c in cols] for size, thr in rows])

    ratio_defs = RATIOS if device == "cpu" else CUDA_RATIOS
    ratio_defs = [d for d in ratio_defs if d[1] in names and d[2] in names]
    rmd = ""
    if ratio_defs:
        ratio_rows = []
        for size, thr in rows:
            cells = []
            for label, num, den, _t, pred in ratio_defs:
                a, b = by_key.get((size, thr, num)), by_key.get((size, thr, den))
                if not a or not b or a.skipped or b.skipped:
                    cells.append("n/a")
                    continue
                ratio = time_ratio(a, b)
                on_target = target_row == (size, thr) and pred is not None
                txt = f"{ratio:.2f}x"
                cells.append(f"**{txt} {'met' if pred(ratio) else 'NOT met'}**" if on_target else txt)
            ratio_rows.append(row_key(size, thr) + cells)
        rmd = markdown_table(["params", thr_label]
                             + [f"{d[0]} ({'target ' if d[4] else ''}{d[3]})" for d in ratio_defs], ratio_rows)

    detail_rows = []
    for size, thr in rows:
        for c in cols:
            r = by_key.get((size, thr, c.name))
            if r is None:
                continue
            if r.skipped:
                detail_rows.append(row_key(size, thr) + [c.label, "-", "-", f"skipped: {r.skipped}", "", "", "", ""])
            else:
                detail_rows.append(row_key(size, thr) + [
                    c.label, r.rounds, len(r.times_s), f"{r.median_ms:.2f}", f"{r.min_ms:.2f}",
                    f"{1e3 * max(r.times_s):.2f}", f"{r.gbps(c.bytes_per_param):.1f}", fmt_bg(r.background)])
    detail = markdown_table(["params", thr_label, "candidate", "rounds used", "steps", "median ms", "min ms",
                             "max ms", "GB/s", "background load"], detail_rows)

    noisy = sorted({(r.size, r.threads) for r in results
                    if r.background is not None and r.background > NOISY_CORES})
    bytes_md = markdown_table(["candidate", "bytes moved per parameter", "host bytes per parameter"],
                              [[c.label, c.bytes_per_param, c.host_bytes] for c in cols])
    parts = ["\n".join(header), "", "ms/step (median) / effective GB/s:", "", md, "",
             "Bytes per parameter (moved: the ideal one-pass update's reads and writes; host: the optimizer's "
             "master, moments and theta*, not the model's weight and gradient):", "", bytes_md]
    if noisy:
        parts += ["", f"NOISY rows (other processes used > {NOISY_CORES:g} cores during some timed steps): "
                  + ", ".join(f"{fmt_size(a)}/{b}" for a, b in noisy)]
    if rmd:
        note = (f" (targets are stated for {fmt_size(target_row[0])} params"
                + (f", {target_row[1]} threads" if device == "cpu" else "") + ": verdict in bold)"
                if target_row else "")
        if any(r.paired for r in results):
            note += "; paired run: median of the per-cycle ratios"
        parts += ["", "Ratios of ms/step" + note + ":", "", rmd]
    parts += ["", "Per candidate (spread of the pooled timed steps; background load = most cores other processes "
              "kept busy while a pooled round was timed, from /proc/stat; rounds with > "
              f"{NOISY_CORES:g} are dropped when a quiet round exists):", "", detail]
    skipped = sorted({r.skipped for r in results if r.skipped})
    if skipped:
        parts += ["", "Skipped: " + "; ".join(skipped)]
    return "\n".join(parts)


# --------------------------------------------------------------------------------------------------
# Main
# --------------------------------------------------------------------------------------------------
def log_result(r: Result, tag: str, t_start: float) -> None:
    cand = BY_NAME[r.name]
    head = f"   {fmt_size(r.size):>5} {r.threads}t {tag}{cand.label:<26}"
    if r.skipped:
        log(f"{head} skipped: {r.skipped}")
    else:
        log(f"{head} {r.median_ms:9.2f} ms (min {r.min_ms:.2f}, {len(r.times_s)} steps) "
            f"{r.gbps(cand.bytes_per_param):6.1f} GB/s  bg {fmt_bg(r.background)}   "
            f"[{time.perf_counter() - t_start:.0f} s]")


def parse_sizes(s: str) -> list[int]:
    return [int(float(x)) for x in s.split(",") if x.strip()]


def parse_ints(s: str) -> list[int]:
    return [int(x) for x in s.split(",") if x.strip()]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    ap.add_argument("--sizes", type=parse_sizes, default=None,
                    help="parameter counts, comma separated (default 1e6,1e7,5e7,1e8 on CPU, 2e8 on CUDA)")
    ap.add_argument("--threads", type=parse_ints, default=[1, 2], help="CPU thread counts (default 1,2)")
    ap.add_argument("--steps", type=int, default=20, help="timed steps per candidate (slow ones: fewer at large sizes)")
    ap.add_argument("--warmup", type=int, default=3, help="untimed steps first (the first allocates state)")
    ap.add_argument("--only", type=lambda s: [x.strip() for x in s.split(",") if x.strip()], default=None,
                    help="candidates to run: " + ",".join(BY_NAME))
    ap.add_argument("--simd", choices=["scalar", "avx2", "avx512"], default=None,
                    help="SIMD level of our C++ kernel (default: the best this CPU runs)")
    ap.add_argument("--chunks", type=int, default=1, help="split the parameters into this many tensors (default 1: one flat partition)")
    ap.add_argument("--markdown", type=Path, default=None, help="also write the report to this file")
    ap.add_argument("--rounds", type=int, default=1,
                    help="repeat each (size, threads) row this many times, candidates interleaved; "
                         "the median is taken over the pooled timed steps (default 1)")
    ap.add_argument("--paired", action="store_true",
                    help="keep all candidates in memory and interleave their steps one by one (steadier "
                         "ratios on a shared machine; needs all their memory at once; use with --only)")
    ap.add_argument("--lead-in", type=int, default=0, metavar="N",
                    help="with --paired: N untimed steps of the same candidate right before each timed "
                         "one (default 0: each step is timed right after another candidate's step)")
    ap.add_argument("--wait-quiet", type=float, default=0.0, metavar="SECONDS",
                    help="before each candidate wait up to this long until other processes use < "
                         "--quiet-cores cores (default 0: do not wait; the load is reported either way)")
    ap.add_argument("--quiet-cores", type=float, default=0.15, help="threshold for --wait-quiet (default 0.15)")
    ap.add_argument("--no-check", action="store_true", help="skip the authors-style == ours numerical check")
    args = ap.parse_args(argv)

    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        print("CUDA is not available on this machine (torch "
              f"{torch.__version__}): the GPU comparison (torch RecAdam vs AdamW(fused=True)) is skipped.")
        return 0
    sizes = args.sizes or ([10**6, 10**7, 5 * 10**7, 10**8] if device.type == "cpu" else [2 * 10**8])
    names = args.only or (DEFAULT_CPU if device.type == "cpu" else DEFAULT_CUDA)
    unknown = [n for n in names if n not in BY_NAME]
    if unknown:
        ap.error(f"unknown candidate(s) {unknown}; valid: {', '.join(BY_NAME)}")
    wrong_dev = [n for n in names if device.type not in BY_NAME[n].devices]
    if wrong_dev:
        ap.error(f"candidate(s) {wrong_dev} do not run on {device.type}")
    if args.lead_in and not args.paired:
        ap.error("--lead-in needs --paired (unpaired runs time each candidate's steps back to back already)")
    threads = args.threads if device.type == "cpu" else [torch.get_num_threads()]

    if args.simd:
        cpu_kernel.set_simd_level(args.simd)
    simd = cpu_kernel.simd_level() if cpu_kernel.kernel_available() else "kernel not built"

    # Header: machine and software.
    try:
        import deepspeed
        ds_version = deepspeed.__version__
    except Exception as exc:  # noqa: BLE001
        ds_version = f"not importable ({type(exc).__name__})"
    header = [
        f"command: {shlex.join(['python'] + sys.argv) if argv is None else shlex.join(argv)}",
        machine_line(),
        f"software: torch {torch.__version__}, deepspeed {ds_version}, python {platform.python_version()}",
        f"our kernel SIMD level: {simd} (supported: "
        + (", ".join(cpu_kernel.supported_simd_levels()) if cpu_kernel.kernel_available() else "-") + ")",
        f"device: {device}" + (f" ({torch.cuda.get_device_name()})" if device.type == "cuda" else ""),
        f"load average at start: {loadavg()}",
        f"steps: {args.steps} timed after {args.warmup} warm-up (more until {MIN_TIMED_S:g} s are "
        f"timed; slow candidates: capped to ~{SLOW_BUDGET_S:g} s of timed steps, at least {MIN_SLOW_STEPS}), x {args.rounds} interleaved round(s), fresh optimizer "
        f"each round; " + (f"PAIRED: candidates alive together, steps interleaved one by one (lead-in {args.lead_in}); "
           if args.paired else "")
        + f"parameters in {args.chunks} tensor(s)",
        f"RecAdam hyper-parameters: {HP}",
    ]
    for line in header:
        log(line)

    if "authors" in names and not args.no_check:
        chk = check_against_ours()
        worst = max(r["param"] for r in chk.values())
        line = ("authors-style vs ours (8 steps, max relative element difference of the parameters): "
                + ", ".join(f"impl={k} {v['param']:.1e}" for k, v in chk.items())
                + (" -> same numbers (<= 1e-5)" if worst <= 1e-5 else " -> DIFFERENT (> 1e-5)"))
        header.append(line)
        log(line)

    results: list[Result] = []
    t_start = time.perf_counter()
    thread_notes: list[str] = []
    for size in sizes:
        log(f"== {fmt_size(size)} parameters: generating data ...")
        data = make_data(size, args.chunks, device)
        for thr in threads:
            if device.type == "cpu":
                note = set_threads(thr)
                log(f"-- {thr} thread(s): {note}")
            merged: dict[str, list[Result]] = {}
            for rnd in range(args.rounds):
                # Interleave: every candidate once per round, order reversed every other round, so
                # slow drifts of the machine's memory bandwidth hit all candidates alike.
                order = round_order(names, rnd)
                tag = f"r{rnd + 1} " if args.rounds > 1 else ""
                if args.paired:
                    if args.wait_quiet > 0:
                        wait_for_quiet(args.quiet_cores, args.wait_quiet)
                    todo = [BY_NAME[n] for n in names if not (n in merged and merged[n][-1].skipped)]
                    round_results = time_paired(todo, data, thr, args.steps, args.warmup, args.lead_in)
                else:
                    round_results = []
                    for name in order:
                        if name in merged and merged[name][-1].skipped:
                            continue
                        if args.wait_quiet > 0:
                            wait_for_quiet(args.quiet_cores, args.wait_quiet)
                        round_results.append(time_candidate(BY_NAME[name], data, thr, args.steps, args.warmup))
                        log_result(round_results[-1], tag, t_start)
                if args.paired:
                    for r in round_results:
                        log_result(r, tag + "paired ", t_start)
                for r in round_results:
                    merged.setdefault(r.name, []).append(r)
            results += [merge_rounds(merged[n]) for n in names if n in merged]
            if device.type == "cpu" and "ds_adam" in names:
                # DeepSpeed's op is loaded now: re-check that its OpenMP follows torch's setting.
                thread_notes.append(f"{thr} thread(s), after DeepSpeedCPUAdam ran: {set_threads(thr)}")
        del data
        gc.collect()

    if thread_notes:
        header.append("threads: torch.set_num_threads(n) also sets omp_set_num_threads(n); checked with threadpoolctl:")
        header += ["  " + n for n in dict.fromkeys(thread_notes)]
    header.append(f"load average at end: {loadavg()}; total run time {time.perf_counter() - t_start:.0f} s")
    target_row = (5 * 10**7, 2) if device.type == "cpu" else (2 * 10**8, threads[0])
    if target_row and target_row not in {(r.size, r.threads) for r in results}:
        target_row = None
    report = build_report(results, names, header, device.type, target_row)
    print(report)
    if args.markdown:
        args.markdown.parent.mkdir(parents=True, exist_ok=True)
        args.markdown.write_text(report + "\n")
        log(f"wrote {args.markdown}")
    return 0


if __name__ == "__main__":
    with contextlib.suppress(BrokenPipeError):
        sys.exit(main())
