"""The chunked next-token loss (training.chunked_loss, models/lm_head_requests.py) against the whole
logits' loss on a decoder with Llama-3's vocabulary (128,256 tokens) and a small random body, at
2048 tokens: each variant's forward and backward in a fresh process, one after another (never two at
once), reporting the peak of live tensor bytes, the process's peak resident set (VmHWM) and tokens/s.

    python benchmarks/chunked_loss.py                       # both variants, the default sizes
    python benchmarks/chunked_loss.py --labels 0.5          # half the positions are label tokens

Every position is a label token unless --labels says less (prompts and padding: the chunked loss
skips their positions, the whole logits' loss computes them anyway). The tokens/s figures are
noisy on a shared machine (the table says the load); the memory figures are not.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import harness  # noqa: E402

VOCAB = 128_256


def _measure(chunked: bool, seq: int, hidden: int, layers: int, label_share: float, steps: int) -> dict:
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    from ft_framework.models.lm_head_requests import REQUEST_KEY, NextTokenLoss, install_head_requests
    from ft_framework.strategies.memory_trace import live_bytes
    from ft_framework.task_kinds.causal_lm import next_token_losses

    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=VOCAB, hidden_size=hidden, intermediate_size=hidden * 2, num_hidden_layers=layers,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=seq,
                         tie_word_embeddings=True)
    model = LlamaForCausalLM(config)
    install_head_requests(model)
    ids = torch.randint(0, VOCAB, (1, seq))
    labels = ids.clone()
    labels[:, :int(seq * (1 - label_share))] = -100
    inputs = {"input_ids": ids, "use_cache": False}
    seconds = []
    with live_bytes() as counter:
        base = counter.current
        for _ in range(steps + 1):  # the first is a warm-up
            started = time.perf_counter()
            if chunked:
                loss = model(**inputs, **{REQUEST_KEY: NextTokenLoss(labels)}).logits
            else:
                loss = next_token_losses(model(**inputs).logits, labels)[0]
            loss.backward()
            model.zero_grad(set_to_none=True)
            seconds.append(time.perf_counter() - started)
            del loss
        peak = counter.peak - base
    hwm = harness._proc_field("/proc/self/status", "VmHWM")
    return {"chunked": chunked, "live_peak_above_weights": peak, "vm_hwm_kib": int(hwm.split()[0]),
            "tokens_per_s": seq / (sum(seconds[1:]) / steps)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seq", type=int, default=2048)
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--labels", type=float, default=1.0, help="the share of positions that are label tokens")
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--one", choices=["whole", "chunked"], help=argparse.SUPPRESS)  # a variant's own process
    args = parser.parse_args()
    if args.one:
        print(json.dumps(_measure(args.one == "chunked", args.seq, args.hidden, args.layers, args.labels, args.steps)))
        return
    rows = []
    for variant in ("whole", "chunked"):
        out = subprocess.run([sys.executable, __file__, "--one", variant, "--seq", str(args.seq), "--hidden",
                              str(args.hidden), "--layers", str(args.layers), "--labels", str(args.labels),
                              "--steps", str(args.steps)], check=True, capture_output=True, text=True).stdout
        result = json.loads(out.strip().splitlines()[-1])
        rows.append([variant, f"{result['live_peak_above_weights'] / 2**30:.2f} GiB",
                     f"{result['vm_hwm_kib'] / 2**20:.2f} GiB", f"{result['tokens_per_s']:.0f}"])
    print(harness.machine_line() + f"; load average {harness.loadavg()} (other work shares the cores)")
    print(f"Llama body {args.layers} x {args.hidden}, vocabulary {VOCAB}, 1 x {args.seq} tokens, "
          f"{args.labels:.0%} label tokens, fp32, forward + backward, mean of {args.steps} steps after one warm-up")
    print(harness.markdown_table(["loss", "live tensors above the weights (peak)", "process peak RSS (VmHWM)",
                                  "tokens/s"], rows))


if __name__ == "__main__":
    main()
