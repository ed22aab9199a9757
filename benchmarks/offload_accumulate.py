"""Where the device-lean offload sums micro-batches: in fp32 on the host (accumulate: host, the
default) or in bf16 on the device (accumulate: device). On this CPU the "device" is host memory
too, so the table counts, per setting: the gradient bytes the device holds between micro-batches
(what a GPU would keep), the host bytes of the transport (bf16 landing buffers + fp32 sums), and
the median time of an optimizer step (all micro-batches and the step), paired and alternated, and
the time spent in the transport itself (copies out of the device gradients and fp32 host adds),
which is what the setting changes; the step time on a shared machine is mostly its load.

    python benchmarks/offload_accumulate.py [--hidden 512] [--layers 4] [--accum 4] [--steps 6]
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
from transformers import BertConfig, BertForSequenceClassification

from method_clock import MethodClock

from ft_framework.optim import build_optimizer
from ft_framework.optim.groups import build_param_groups
from ft_framework.strategies import OffloadedSingleDeviceStrategy


def build(args, accumulate: str):
    torch.manual_seed(0)
    cfg = BertConfig(vocab_size=1024, hidden_size=args.hidden, num_hidden_layers=args.layers,
                     num_attention_heads=8, intermediate_size=4 * args.hidden, max_position_embeddings=args.seq,
                     hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)
    model = BertForSequenceClassification(cfg)
    anchors = {n: p.detach().clone() for n, p in model.named_parameters() if not n.startswith("classifier")}
    strategy = OffloadedSingleDeviceStrategy("bf16", "cpu", overlap=args.overlap, accumulate=accumulate)
    strategy.setup(model, lambda m: build_optimizer(
        "recadam", build_param_groups(m, anchors, lr=1e-4, weight_decay=0.01, attach_anchors=False),
        impl="auto", anneal_k=0.5, anneal_t0=5, pretrain_cof=10.0), anchors=anchors)
    return strategy


def one_step(strategy, args, step: int, held: list[int]) -> float:
    gen = torch.Generator().manual_seed(step)
    start = time.perf_counter()
    for micro in range(args.accum):
        batch = {"input_ids": torch.randint(0, 1024, (args.batch, args.seq), generator=gen),
                 "labels": torch.randint(0, 2, (args.batch,), generator=gen)}
        last = micro == args.accum - 1
        strategy.backward(strategy.forward(batch).loss / args.accum, last_micro_batch=last)
        if not last:
            held.append(sum(p.grad.numel() * p.grad.element_size() for p in strategy.model.parameters()
                            if p.grad is not None))
    strategy.clip_and_step(1.0)
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--hidden", type=int, default=512)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--seq", type=int, default=64)
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--accum", type=int, default=4)
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--overlap", action="store_true", help="the overlapped offload (default: serial)")
    args = parser.parse_args()
    settings = ("host", "device")
    strategies = {a: build(args, a) for a in settings}
    clocks = {a: MethodClock(strategies[a]._transport, ("take", "add_pending")) for a in settings}
    transport = {a: [] for a in settings}
    times = {a: [] for a in settings}
    held = {a: [] for a in settings}
    for step in range(args.steps + 1):  # the first step of each is a warm-up
        for a in (settings if step % 2 == 0 else settings[::-1]):
            t = one_step(strategies[a], args, step, held[a])
            spent = clocks[a].take()
            if step:
                times[a].append(t)
                transport[a].append(spent)
    params = sum(p.numel() for p in strategies["host"].model.parameters())
    print(f"{params / 1e6:.1f} M parameters, {args.accum} micro-batches of {args.batch} x {args.seq}, "
          f"{'overlapped' if args.overlap else 'serial'}, {torch.get_num_threads()} threads")
    print("| accumulate | device gradient bytes between micro-batches | host transport bytes | transport time per "
          "step (median) | step time (median) |")
    print("|---|---|---|---|---|")
    for a in settings:
        print(f"| {a} | {max(held[a]) / 2**20:.1f} MiB | {strategies[a]._transport.host_bytes() / 2**20:.1f} MiB "
              f"| {statistics.median(transport[a]) * 1e3:.1f} ms | {statistics.median(times[a]) * 1e3:.0f} ms |")
    for s in strategies.values():
        s.close()


if __name__ == "__main__":
    main()
