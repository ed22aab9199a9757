"""ZeRO-2 + CPU optimizer offload on N ranks: our RecAdam (C++ kernel on the fp32 CPU partitions,
anchors sharded in optimizer state) against DeepSpeedCPUAdam's Adam in the same engine config.

    DS_ACCELERATOR=cpu deepspeed --num_gpus 2 benchmarks/zero_offload_step.py [--params 50e6] [--steps 10]
    (or: torchrun --nproc_per_node 2 benchmarks/zero_offload_step.py ...)

Prints, on rank 0, the machine, the median time of the optimizer step (engine.step() at the
accumulation boundary: the CPU step, the copy back and the parameter all-gather) and of a whole
iteration (forward + backward + step), the background load while each candidate was timed (cores
kept busy by processes other than this run's ranks, NOISY above 0.2), and the ratio RecAdam / DeepSpeedCPUAdam. The model is
a stack of square Linear layers: enough parameters for the step to matter, little compute per
iteration. The machine-noise tools (quiet-machine wait, background load, table) are
benchmarks/harness.py, shared with optim_step.py.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

os.environ.setdefault("DS_ACCELERATOR", "cpu")

import torch  # noqa: E402
from torch import nn  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))
from harness import (  # noqa: E402
    background_cores, fmt_bg, loadavg, machine_busy_s, machine_line, markdown_table, wait_for_quiet,
)


def make_model(num_params: float, width: int) -> nn.Module:
    layers = max(1, round(num_params / (width * width + width)))
    torch.manual_seed(0)
    return nn.Sequential(*[nn.Linear(width, width) for _ in range(layers)])


def run_candidate(name: str, args, strategy_cls, ds_cfg, training_cfg) -> dict[str, float]:
    import deepspeed
    from deepspeed.ops.adam import DeepSpeedCPUAdam

    from ft_framework.optim import build_optimizer
    from ft_framework.optim.groups import build_param_groups
    from ft_framework.strategies.deepspeed import build_deepspeed_config

    model = make_model(args.params, args.width)
    x = torch.randn(args.batch, args.width)
    if name == "recadam":
        strategy = strategy_cls(ds_cfg, training_cfg)
        anchors = {n: p.detach().clone() for n, p in model.named_parameters()}

        def make_optimizer(m):
            groups = build_param_groups(m, anchors, lr=2e-5, no_decay_bias_and_norm=False, attach_anchors=False)
            return build_optimizer("recadam", groups, impl="auto", anneal_k=0.5, anneal_t0=250,
                                   pretrain_cof=5000.0)

        engine, _ = strategy.setup(model, make_optimizer, anchors=anchors)
        impl = strategy.optimizer.impl if hasattr(strategy.optimizer, "impl") else "?"
    else:
        optimizer = DeepSpeedCPUAdam(model.parameters(), lr=2e-5, adamw_mode=True, weight_decay=0.0)
        engine, _, _, _ = deepspeed.initialize(model=model, optimizer=optimizer,
                                               config=build_deepspeed_config(ds_cfg, training_cfg))
        impl = "DeepSpeedCPUAdam"

    def iteration():
        start = time.perf_counter()
        loss = engine(x).pow(2).mean()
        engine.backward(loss)
        before_step = time.perf_counter()
        engine.step()
        end = time.perf_counter()
        return (end - before_step) * 1e3, (end - start) * 1e3

    for _ in range(args.warmup):
        iteration()
    if args.wait_quiet > 0:
        # Every rank sleeps while sampling (a rank waiting in a barrier instead may spin a core).
        wait_for_quiet(args.quiet_cores, args.wait_quiet)
        torch.distributed.barrier()
    t0, busy0, own0 = time.perf_counter(), machine_busy_s(), time.process_time()
    times = [iteration() for _ in range(args.steps)]
    wall, busy1 = time.perf_counter() - t0, machine_busy_s()
    # "Other processes" excludes every rank of this run: sum the ranks' own CPU time.
    own = torch.tensor([time.process_time() - own0], dtype=torch.float64)
    torch.distributed.all_reduce(own)
    background = None if busy0 is None or busy1 is None else background_cores(busy1 - busy0, own.item(), wall)
    numel = sum(p.numel() for p in model.parameters())
    return {"step_ms": statistics.median(t[0] for t in times), "iter_ms": statistics.median(t[1] for t in times),
            "numel": numel, "impl": impl, "background": background}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--params", type=float, default=50e6, help="model parameters (default 50e6)")
    parser.add_argument("--width", type=int, default=2048)
    parser.add_argument("--batch", type=int, default=2)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--wait-quiet", type=float, default=0.0, metavar="SECONDS",
                        help="before each candidate's timed steps wait up to this long until other processes "
                             "use < --quiet-cores cores (default 0: do not wait; the load is reported either way)")
    parser.add_argument("--quiet-cores", type=float, default=0.15, help="threshold for --wait-quiet (default 0.15)")
    parser.add_argument("--local_rank", type=int, default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()

    import torch.distributed as dist

    from ft_framework.config import DeepSpeedConfig, TrainingConfig
    from ft_framework.strategies.deepspeed import DeepSpeedStrategy

    world = int(os.environ.get("WORLD_SIZE", 1))
    ds_cfg = DeepSpeedConfig(zero_stage=2, offload_optimizer=True)
    training_cfg = TrainingConfig(max_steps=1, per_device_batch_size=args.batch, device="cpu", max_grad_norm=None)
    # DeepSpeedCPUAdam first: it JIT-builds once and initializes the process group for both.
    results = {name: run_candidate(name, args, DeepSpeedStrategy, ds_cfg, training_cfg)
               for name in ("deepspeed_cpu_adam", "recadam")}
    if dist.get_rank() == 0:
        ours, theirs = results["recadam"], results["deepspeed_cpu_adam"]
        print(machine_line())
        print(f"ZeRO-2 + optimizer CPU offload, {world} rank(s), {ours['numel'] / 1e6:.1f} M parameters, "
              f"{torch.get_num_threads()} thread(s) per rank, torch {torch.__version__}; "
              f"load average at end: {loadavg()}")
        print(markdown_table(
            ["optimizer", "impl", "step ms (median)", "iteration ms (median)", "background load"],
            [[name, r["impl"], f"{r['step_ms']:.1f}", f"{r['iter_ms']:.1f}", fmt_bg(r["background"])]
             for name, r in (("DeepSpeedCPUAdam (Adam)", theirs), ("ours: RecAdam", ours))]))
        print(f"ratio RecAdam / DeepSpeedCPUAdam: step {ours['step_ms'] / theirs['step_ms']:.3f}x, "
              f"iteration {ours['iter_ms'] / theirs['iter_ms']:.3f}x (target <= 1.15)")


if __name__ == "__main__":
    main()
