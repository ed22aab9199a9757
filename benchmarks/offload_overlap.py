"""The offloaded optimizer step overlapped with backward, against the serial offloaded step, on
this CPU as a stand-in for GPU + CPU: forward and backward run with one thread on core 0 (the
"GPU"), the optimizer step with one thread on core 1 (the host), so the overlap is what a GPU run
would get when the host step is about as long as backward.

    python benchmarks/offload_overlap.py [--shape 16x1024:12 --shape 128x256:16] [--rule recadam]
        [--max-grad-norm 0] [--bucket-mb 4] [--steps 20]

Each model is a stack of square Linear layers, LAYERSxWIDTH, run at BATCH rows (a transformer's
step/backward ratio is set by parameters per token, which the batch sets here). The two default
shapes are the documented one (16 x 1024^2, 32 tensors of 4 MiB and 4 KiB) and one of many small
tensors (128 x 256^2, 256 tensors, where a per-tensor cost shows). For each shape three
candidates are timed paired, one iteration each per cycle (benchmarks/harness.py): forward +
backward alone (no step), the serial offloaded iteration (backward, then the step) and the
overlapped one (strategy.offload_optimizer {overlap: true}). Each timed iteration follows an
untimed one of its own kind (--lead-in 1), as in a training run: timed right after a serial
iteration, whose step leaves 200 MB of fresh writes behind on the training core, the next
forward was 1-1.3 ms slower, and the rotation put the overlapped iteration there in two cycles
of three (--lead-in 0 shows it). One table, one row per shape: median
times, the step alone, the CPU step's share of each iteration (serial: (iteration - forward and
backward) / iteration, which is the step's own share; overlapped: the same formula, the step's
exposed share), the overlapped / serial ratio (median of paired ratios; the target is <= 0.7) and
the rollbacks. With --max-grad-norm > 0 clipping is in play (the default 0 keeps every
speculative step).

glibc's malloc is pinned to reuse freed blocks (M_MMAP_THRESHOLD 1 GiB, as a GPU's caching
allocator reuses its blocks): with its default, a dynamic threshold, whether each step's 4 MiB
gradients are fresh memory mappings depends on the process's allocation history, and fresh
mappings cost page faults and cross-core TLB flushes that doubled backward in some runs and not
in others (--malloc-default keeps glibc's default to see it).
"""

from __future__ import annotations

import argparse
import ctypes
import os
import statistics
import sys
import time
from pathlib import Path

import torch
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parent))
from harness import (  # noqa: E402
    fmt_bg, log, machine_line, markdown_table, paired_ratio, paired_times, set_threads, wait_for_quiet,
)

from ft_framework.optim import build_optimizer  # noqa: E402
from ft_framework.optim.groups import build_param_groups  # noqa: E402
from ft_framework.optim import cpu as cpu_kernel  # noqa: E402
from ft_framework.strategies import OffloadedSingleDeviceStrategy  # noqa: E402
from ft_framework.strategies.offload import DEFAULT_BUCKET_MB  # noqa: E402

# LAYERSxWIDTH:BATCH. The documented shape (docs/benchmarks.md), then many small tensors.
DEFAULT_SHAPES = ("16x1024:12", "128x256:16")
M_MMAP_THRESHOLD = -3  # glibc's mallopt parameter (malloc.h)


def parse_shape(text: str) -> tuple[int, int, int]:
    """'LAYERSxWIDTH:BATCH' as (layers, width, batch)."""
    try:
        model, batch = text.split(":")
        layers, width = model.lower().split("x")
        values = int(layers), int(width), int(batch)
    except ValueError:
        raise argparse.ArgumentTypeError(f"--shape {text!r}: expected LAYERSxWIDTH:BATCH, e.g. 16x1024:12") from None
    if min(values) < 1:
        raise argparse.ArgumentTypeError(f"--shape {text!r}: layers, width and batch must be >= 1")
    return values


def pin_malloc() -> str:
    """Pins glibc's mmap threshold (see the module doc); returns what was done, for the header."""
    try:
        libc = ctypes.CDLL("libc.so.6")
        ok = libc.mallopt(M_MMAP_THRESHOLD, 2**30) == 1
    except (OSError, AttributeError):
        ok = False
    return "glibc M_MMAP_THRESHOLD pinned to 1 GiB" if ok else "malloc not pinned (no glibc mallopt)"


class Stack(nn.Module):
    def __init__(self, width: int, layers: int):
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(width, width) for _ in range(layers))

    def forward(self, x):
        for layer in self.layers:
            x = torch.tanh(layer(x))
        return x


def make(args, shape: tuple[int, int, int], overlap: bool | None):
    """(run one iteration, strategy) for a fresh model: overlap None = forward/backward only."""
    layers, width, batch = shape
    torch.manual_seed(0)
    model = Stack(width, layers)
    anchors = {n: p.detach().clone() for n, p in model.named_parameters()}
    strategy = OffloadedSingleDeviceStrategy("fp32", "cpu", overlap=bool(overlap), worker_threads=1,
                                             bucket_mb=args.bucket_mb)
    strategy.forward = lambda batch: strategy.model(batch["x"])  # the stack takes one tensor
    strategy.setup(model, lambda m: build_optimizer(
        args.rule, build_param_groups(m, anchors, lr=1e-4, no_decay_bias_and_norm=False, attach_anchors=False),
        impl="cpu"), anchors=anchors)
    if strategy.worker_thread is not None:
        os.sched_setaffinity(strategy.worker_thread.native_id, {args.worker_core})
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(batch, width, generator=gen)
    max_norm = args.max_grad_norm or None

    def iteration():
        loss = strategy.forward({"x": x}).square().mean()
        strategy.backward(loss)
        if overlap is None:
            strategy.model.zero_grad(set_to_none=True)
        else:
            strategy.clip_and_step(max_norm)

    return iteration, strategy


def measure(args, shape: tuple[int, int, int]) -> list[str]:
    """One table row: the three candidates of `shape` timed paired, and the step alone."""
    layers, width, batch = shape
    fwd_bwd, _ = make(args, shape, None)
    serial, serial_strategy = make(args, shape, False)
    overlapped, overlap_strategy = make(args, shape, True)

    # The step alone, on the main thread (one kernel thread), with its rollback to keep the state.
    masters = [m for _, m in serial_strategy._named_masters()]
    grads = [torch.randn_like(m) * 1e-3 for m in masters]
    opt = serial_strategy.optimizer

    step_seconds = []

    def step_only():  # the serial path's step (finite gradients known), timed; then undone
        start = time.perf_counter()
        used = opt.step_tensors(masters, grads, num_threads=1, known_finite=True)
        step_seconds.append(time.perf_counter() - start)
        opt.rollback_tensors(masters, grads, used, num_threads=1)

    wait_for_quiet(0.2, args.quiet_wait)
    times, bg = paired_times([fwd_bwd, serial, overlapped], steps=args.steps, warmup=args.warmup,
                             lead_in=args.lead_in)
    paired_times([step_only], steps=max(5, args.steps // 4), warmup=1)
    fb, ser, ovl = (statistics.median(t) for t in times)
    step = statistics.median(step_seconds[1:])  # the first call is paired_times' warm-up
    ratio = paired_ratio(times[2], times[1])
    rollbacks = overlap_strategy.rollbacks
    for s in (serial_strategy, overlap_strategy):
        s.close()
    return [f"{layers} x {width}² ({len(masters)} tensors, {sum(m.numel() for m in masters) / 1e6:.1f} M)",
            str(batch), f"{fb * 1e3:.1f}", f"{ser * 1e3:.1f}", f"{ovl * 1e3:.1f}", f"{step * 1e3:.1f}",
            f"{(ser - fb) / ser:.0%} / {max(0.0, ovl - fb) / ovl:.0%}", f"**{ratio:.3f}**",
            f"{rollbacks} / {len(times[2]) * (1 + args.lead_in) + args.warmup}", fmt_bg(bg)]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shape", type=parse_shape, action="append",
                    help=f"LAYERSxWIDTH:BATCH, repeatable (default: {' and '.join(DEFAULT_SHAPES)})")
    ap.add_argument("--rule", default="recadam")
    ap.add_argument("--max-grad-norm", type=float, default=0.0)
    ap.add_argument("--bucket-mb", type=float, default=DEFAULT_BUCKET_MB,
                    help="MiB of gradients per hand-off to the worker (strategy.offload_optimizer.bucket_mb)")
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--lead-in", type=int, default=1,
                    help="untimed iterations of the same kind before each timed one (0: after the previous candidate)")
    ap.add_argument("--main-core", type=int, default=0)
    ap.add_argument("--worker-core", type=int, default=1)
    ap.add_argument("--malloc-default", action="store_true", help="keep glibc's dynamic mmap threshold")
    ap.add_argument("--quiet-wait", type=float, default=30.0, help="seconds to wait for a quiet machine")
    args = ap.parse_args()
    shapes = args.shape or [parse_shape(s) for s in DEFAULT_SHAPES]

    os.sched_setaffinity(0, {args.main_core})  # this (training) thread; the workers are pinned apart
    malloc = "glibc malloc default" if args.malloc_default else pin_malloc()
    threads = set_threads(1)
    print(machine_line())
    print(f"threads: {threads}; kernel SIMD level {cpu_kernel.simd_level()}; {malloc}")
    print(f"rule {args.rule}, max_grad_norm {args.max_grad_norm or 'none'}, bucket {args.bucket_mb} MiB, "
          f"{args.steps} paired cycles, lead-in {args.lead_in}; forward/backward on core {args.main_core}, the CPU worker on core "
          f"{args.worker_core}\n")
    rows = []
    for shape in shapes:
        rows.append(measure(args, shape))
        log(f"  {rows[-1][0]}: overlapped / serial {rows[-1][7].strip('*')}")
    print(markdown_table(
        ["model", "batch", "fwd+bwd ms", "serial ms", "overlapped ms", "step alone ms",
         "CPU step's share, serial / overlapped (exposed)", "overlapped / serial (target <= 0.7)",
         "rollbacks / iterations", "background cores"], rows))


if __name__ == "__main__":
    main()
