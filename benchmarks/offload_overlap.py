"""The offloaded optimizer step overlapped with backward, against the serial offloaded step, on
this CPU as a stand-in for GPU + CPU: forward and backward run with one thread on core 0 (the
"GPU"), the optimizer step with one thread on core 1 (the host), so the overlap is what a GPU run
would get when the host step is about as long as backward.

    python benchmarks/offload_overlap.py [--width 1024] [--layers 16] [--batch 12] [--rule recadam]
        [--max-grad-norm 0] [--steps 20]

The model is a stack of square Linear layers (a transformer's step/backward ratio is set by
parameters per token, which --batch sets here). Three candidates are timed paired, one iteration
each per cycle (benchmarks/harness.py): forward + backward alone (no step), the serial offloaded
iteration (backward, then the step) and the overlapped one (strategy.offload_optimizer
{overlap: true}). Printed: the machine, median times, the CPU step's exposed share of each
iteration (serial: step / iteration; overlapped: (iteration - forward/backward) / iteration),
the overlapped / serial ratio (the target is <= 0.7), and the rollback count.
With --max-grad-norm > 0 clipping is in play (the default 0 keeps every speculative step).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
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


class Stack(nn.Module):
    def __init__(self, width: int, layers: int):
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(width, width) for _ in range(layers))

    def forward(self, x):
        for layer in self.layers:
            x = torch.tanh(layer(x))
        return x


def make(args, overlap: bool | None):
    """(run one iteration, strategy) for a fresh model: overlap None = forward/backward only."""
    torch.manual_seed(0)
    model = Stack(args.width, args.layers)
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
    x = torch.randn(args.batch, args.width, generator=gen)
    max_norm = args.max_grad_norm or None

    def iteration():
        loss = strategy.forward({"x": x}).square().mean()
        strategy.backward(loss)
        if overlap is None:
            strategy.model.zero_grad(set_to_none=True)
        else:
            strategy.clip_and_step(max_norm)

    return iteration, strategy


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--width", type=int, default=1024)
    ap.add_argument("--layers", type=int, default=16)
    ap.add_argument("--batch", type=int, default=12, help="rows per iteration: sets backward's share")
    ap.add_argument("--rule", default="recadam")
    ap.add_argument("--max-grad-norm", type=float, default=0.0)
    ap.add_argument("--bucket-mb", type=float, default=DEFAULT_BUCKET_MB,
                    help="MiB of gradients per hand-off to the worker (strategy.offload_optimizer.bucket_mb)")
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--main-core", type=int, default=0)
    ap.add_argument("--worker-core", type=int, default=1)
    ap.add_argument("--quiet-wait", type=float, default=30.0, help="seconds to wait for a quiet machine")
    args = ap.parse_args()

    os.sched_setaffinity(0, {args.main_core})  # this (training) thread; the workers are pinned apart
    threads = set_threads(1)
    log(machine_line())
    log(f"threads: {threads}; kernel SIMD level {cpu_kernel.simd_level()}")
    num_params = args.layers * (args.width * args.width + args.width)
    log(f"model: {args.layers} x Linear({args.width}, {args.width}) = {num_params / 1e6:.1f} M parameters, "
        f"batch {args.batch}, rule {args.rule}, max_grad_norm {args.max_grad_norm or 'none'}, "
        f"bucket {args.bucket_mb} MiB")

    fwd_bwd, _ = make(args, None)
    serial, serial_strategy = make(args, False)
    overlapped, overlap_strategy = make(args, True)

    # The step alone, on the main thread (one kernel thread), for the serial share.
    masters = [m for _, m in serial_strategy._named_masters()]
    grads = [torch.randn_like(m) * 1e-3 for m in masters]
    opt = serial_strategy.optimizer

    def step_only():
        used = opt.step_tensors(masters, grads, num_threads=1)
        opt.rollback_tensors(masters, grads, used, num_threads=1)

    wait_for_quiet(0.2, args.quiet_wait)
    times, bg = paired_times([fwd_bwd, serial, overlapped], steps=args.steps, warmup=args.warmup)
    step_times, _ = paired_times([step_only], steps=max(5, args.steps // 4), warmup=1)
    med = [statistics.median(t) for t in times]
    step_med = statistics.median(step_times[0]) / 2  # one step and its rollback, about equal
    ratio = paired_ratio(times[2], times[1])
    rows = [
        ["forward + backward (no step)", f"{med[0] * 1e3:.1f}", "-"],
        ["serial offload (backward, then step)", f"{med[1] * 1e3:.1f}", f"{(med[1] - med[0]) / med[1]:.0%}"],
        ["overlapped offload", f"{med[2] * 1e3:.1f}", f"{max(0.0, med[2] - med[0]) / med[2]:.0%}"],
    ]
    print(markdown_table(["iteration", "median ms", "CPU step's exposed share"], rows))
    print(f"\nstep alone (one kernel thread): {step_med * 1e3:.1f} ms = {step_med / med[1]:.0%} of the serial "
          f"iteration; backward/step ratio {(med[0]) / step_med:.2f}")
    print(f"overlapped / serial iteration time (median of paired ratios): {ratio:.3f} (target <= 0.7)")
    print(f"rollbacks: overlapped {overlap_strategy.rollbacks} over {len(times[2]) + args.warmup} iterations; "
          f"background load {fmt_bg(bg)} cores")
    for s in (serial_strategy, overlap_strategy):
        s.close()


if __name__ == "__main__":
    main()
