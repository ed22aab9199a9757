"""Step-time ratio of our CPU RecAdam (fp32 and bf16 anchors) to DeepSpeedCPUAdam's Adam, with the
candidates' steps interleaved one by one (A, B, C, A, B, C, ...).

On a shared virtual machine the memory bandwidth drifts by 20-30 % over minutes; timing the
candidates one after another (benchmarks/optim_step.py) then mixes that drift into their ratio.
Interleaving puts every candidate under the same conditions at each moment, so the ratio of their
medians is stable even when the absolute times are not.

    python benchmarks/step_ratio.py [--size 5e7] [--threads 2] [--steps 60] [--warmup 80]
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

os.environ.setdefault("DS_ACCELERATOR", "cpu")

import torch  # noqa: E402

from ft_framework.optim import build_optimizer  # noqa: E402
from ft_framework.optim import cpu as cpu_kernel  # noqa: E402

# The benchmark's RecAdam: lambda(t) is tiny for t << t0, the regime the denormal flush is for.
HPARAMS = dict(lr=2e-5, anneal_fun="sigmoid", anneal_k=0.5, anneal_t0=250, pretrain_cof=5000.0)
BYTES = {"ours fp32-anchor": 32, "ours bf16-anchor": 30, "DeepSpeedCPUAdam": 28}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--size", type=float, default=50e6)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--steps", type=int, default=60, help="timed steps per candidate")
    parser.add_argument("--warmup", type=int, default=80, help="untimed steps first (state allocation, "
                        "and lambda(t) moves into the regime of early training)")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    n = int(args.size)
    gen = torch.Generator().manual_seed(0)
    grad = torch.randn(n, generator=gen) * 1e-2
    steps = {}
    for name, anchor_dtype in (("ours fp32-anchor", "float32"), ("ours bf16-anchor", "bfloat16")):
        p = torch.nn.Parameter(torch.randn(n, generator=gen) * 0.02)
        p.grad = grad
        opt = build_optimizer("recadam", [{"params": [p], "anchors": [p.detach() + 1e-3]}], impl="cpu",
                              anchor_dtype=anchor_dtype, **HPARAMS)
        steps[name] = opt.step
    from deepspeed.ops.adam import DeepSpeedCPUAdam

    q = torch.nn.Parameter(torch.randn(n, generator=gen) * 0.02)
    q.grad = grad
    ds = DeepSpeedCPUAdam([q], lr=HPARAMS["lr"], adamw_mode=True, weight_decay=0.0)
    steps["DeepSpeedCPUAdam"] = ds.step

    times = {name: [] for name in steps}
    for i in range(args.warmup + args.steps):
        for name, step in steps.items():
            t0 = time.perf_counter()
            step()
            if i >= args.warmup:
                times[name].append(time.perf_counter() - t0)
    med = {name: statistics.median(ts) * 1e3 for name, ts in times.items()}
    base = med["DeepSpeedCPUAdam"]
    print(f"{n / 1e6:g} M parameters in one tensor, {args.threads} thread(s), SIMD {cpu_kernel.simd_level()}, "
          f"{args.steps} interleaved steps each after {args.warmup} warm-up, torch {torch.__version__}")
    print("| candidate | bytes/param | median ms | GB/s | ratio to DeepSpeedCPUAdam |")
    print("|---|---|---|---|---|")
    for name, ms in med.items():
        print(f"| {name} | {BYTES[name]} | {ms:.2f} | {BYTES[name] * n / ms / 1e6:.1f} | {ms / base:.3f}x |")


if __name__ == "__main__":
    main()
