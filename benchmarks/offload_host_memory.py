"""The device-lean offload with the compact state, measured on the CPU (issue 43): the ft-train
process's peak resident set against its plan, and the host bytes per parameter its strategy holds.

    nice -n 19 python benchmarks/offload_host_memory.py                # Qwen2.5-0.5B's architecture
    nice -n 19 python benchmarks/offload_host_memory.py --model tiny   # the tiny Qwen2 of tests/tiny_llm.py

Each row saves a decoder with random weights (fixed seed) into a scratch directory: Qwen2.5-0.5B's
architecture (the config values of Qwen/Qwen2.5-0.5B: hidden 896, 24 layers, 14 heads, 2 KV heads,
intermediate 4864, vocab 151936, tied embeddings; 494 M parameters) written by save_pretrained from
AutoConfig.for_model("qwen2", ...), with the byte-level tokenizer of tests/tiny_llm.py, and a small
prompt/completion set. Then `ft-train` runs in a fresh process (benchmarks/memory_plan.py's
--process worker: cli.train_main with the allocator policy, then the process's own VmHWM from
/proc) with training.precision bf16, strategy.offload_optimizer and optimizer.state_dtype /
anchor_dtype bfloat16 (the bf16 weight form), RecAdam, a few steps of short sequences. The plan is
ft-plan's for the same config on a CPU (`PeakPlan.process_bytes`: device and host rows and the
runtime, one memory). Target: within ±10%.

Host bytes per parameter: every tensor the strategy keeps in host memory for the step
(OffloadedSingleDeviceStrategy.host_tensors: masters, moments, delta, theta*, landing buffers,
fp32 sums, staging), each storage once, counted when ft-train closes the strategy; per-element
tensors and the 0-d step counts apart. Target: at most 12 (16 with gradient accumulation).

Also the peak of the process's anonymous memory (RssAnon, sampled every 50 ms by this script):
VmHWM counts file-backed pages too, and the checkpoint's fp32 weights, which safetensors maps from
the file, stay mapped (and, read once by theta*'s capture, resident) until set-up has built the
state of every parameter.

Rows: each model with and without gradient accumulation (4 micro-batches), and once with a
checkpoint saved every 2 steps (the save forms theta* + delta in fp32 for the checkpoint's masters:
the plan's row for it). Runs without saves set checkpoint.on_signal: exit (else the plan keeps room
for a save a signal would make).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "benchmarks"))
sys.path.insert(0, str(REPO / "tests"))

from harness import machine_line, markdown_table  # noqa: E402

TARGET = 0.10
SEED = 0
# The config values of Qwen/Qwen2.5-0.5B (its config.json), besides the token ids of our tokenizer.
QWEN25_05B = dict(hidden_size=896, intermediate_size=4864, num_hidden_layers=24, num_attention_heads=14,
                  num_key_value_heads=2, vocab_size=151936, max_position_embeddings=32768, rope_theta=1000000.0,
                  rms_norm_eps=1e-6, tie_word_embeddings=True, hidden_act="silu", use_sliding_window=False,
                  sliding_window=32768, max_window_layers=24, attention_dropout=0.0)
# model -> (batch, seq_len, steps)
MODELS = {"Qwen2.5-0.5B": (2, 64, 4), "tiny": (4, 64, 4)}
# (label, gradient_accumulation_steps, checkpoint every_steps)
VARIANTS = [("accumulation 1", 1, None), ("accumulation 4", 4, None), ("accumulation 1, checkpoint every 2", 1, 2)]


def save_model(directory: Path, model: str) -> None:
    """The row's decoder with random weights, its tokenizer, written with save_pretrained."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    from tiny_llm import build_tiny_llm_dir, build_tiny_tokenizer

    if model == "tiny":
        build_tiny_llm_dir(directory, "qwen2", seed=SEED)
        return
    tokenizer = build_tiny_tokenizer(directory)
    config = AutoConfig.for_model("qwen2", pad_token_id=tokenizer.pad_token_id, eos_token_id=tokenizer.eos_token_id,
                                  bos_token_id=None, **QWEN25_05B)
    torch.manual_seed(SEED)
    AutoModelForCausalLM.from_config(config).save_pretrained(directory)


def run_config(tmp: Path, model: str, accumulation: int, every_steps: int | None) -> dict:
    from tiny_llm import write_sft_rows

    batch, seq_len, steps = MODELS[model]
    files = write_sft_rows(tmp / "data", train_rows=48, eval_rows=8, seed=SEED)
    return {
        "model": {"name_or_path": str(tmp / "model")},
        "data": {"problem": "causal_lm", "source": "files", "files": files, "max_seq_length": seq_len,
                 "token_cache_dir": str(tmp / "token_cache")},
        "optimizer": {"name": "recadam", "hparams": {"lr": 1e-5, "anneal_k": 0.5, "anneal_t0": 5,
                                                      "pretrain_cof": 100.0},
                      "state_dtype": "bfloat16", "anchor_dtype": "bfloat16"},
        "schedule": {"name": "linear", "warmup_steps": 1},
        "training": {"max_steps": steps, "per_device_batch_size": batch, "gradient_accumulation_steps": accumulation,
                     "precision": "bf16", "device": "cpu", "seed": SEED, "max_grad_norm": 1.0},
        "strategy": {"name": "single", "offload_optimizer": {"overlap": False}},
        "evaluation": {"num_evals": 1, "batch_size": batch, "forgetting": {"num_sentences": 8},
                       "generation": {"samples": 1, "max_new_tokens": 4}},
        "checkpoint": {"every_steps": every_steps} if every_steps else {"on_signal": "exit"},
        "logging": {"output_dir": str(tmp / "out"), "progress_bar": False},
    }


def host_worker(config_path: str, out: str) -> None:
    """memory_plan.py's --process worker (ft-train in this process, then VmHWM), with the strategy's
    host tensors counted when ft-train closes it."""
    import memory_plan

    from ft_framework.strategies.offload import OffloadedSingleDeviceStrategy

    counted = {}
    close = OffloadedSingleDeviceStrategy.close

    def counting_close(strategy):
        if not counted:
            per_element, steps = {}, {}
            for _role, _name, t in strategy.host_tensors():
                storage = t.untyped_storage()
                (steps if t.dim() == 0 else per_element)[storage.data_ptr()] = storage.nbytes()
            counted.update(per_element=sum(per_element.values()), step_counts=sum(steps.values()),
                           params=sum(p.numel() for p in strategy.unwrapped_model().parameters()),
                           bf16_weights=strategy.bf16_weights)
        close(strategy)

    OffloadedSingleDeviceStrategy.close = counting_close
    memory_plan.process_worker(config_path, out, policy=True)
    result = json.loads(Path(out).read_text())
    Path(out).write_text(json.dumps({**result, **counted}))


def sample_anonymous_peak(process: subprocess.Popen, every: float = 0.05) -> int:
    """The largest RssAnon (bytes) of `process` seen every `every` seconds until it exits: its
    resident memory without file-backed pages (VmHWM counts those too, e.g. a checkpoint's weights
    that safetensors maps from the file until set-up has consumed them). Sampled: a spike shorter
    than `every` may be missed."""
    import time

    peak = 0
    status = Path(f"/proc/{process.pid}/status")
    while process.poll() is None:
        try:
            for line in status.read_text().splitlines():
                if line.startswith("RssAnon:"):
                    peak = max(peak, int(line.split()[1]) * 1024)
        except (FileNotFoundError, ProcessLookupError):
            break
        time.sleep(every)
    process.wait()
    return peak


def measure(model: str, accumulation: int, every_steps: int | None) -> tuple[dict, dict]:
    """(the ft-train process's {code, seconds, peak_rss, per_element, step_counts, params}, its plan)."""
    import yaml

    from ft_framework.config import validate_config
    from ft_framework.strategies.memory_fit import plan_run
    from ft_framework.task_kinds import build_task_kind

    with tempfile.TemporaryDirectory(dir=os.environ.get("FT_BENCH_TMP")) as tmp:
        tmp = Path(tmp)
        save_model(tmp / "model", model)
        config = run_config(tmp, model, accumulation, every_steps)
        path = tmp / "run.yaml"
        path.write_text(yaml.safe_dump(config))
        cfg = validate_config(config)
        plan = plan_run(cfg, task=build_task_kind(cfg), world_size=1, on_gpu=False)
        out, log = tmp / "process.json", tmp / "worker.log"
        env = {**os.environ, "OMP_NUM_THREADS": "2", "HF_HUB_OFFLINE": "1"}
        with open(log, "w") as sink:
            worker = subprocess.Popen([sys.executable, __file__, "--host-worker", str(path), str(out)], env=env,
                                      cwd=REPO, stdout=sink, stderr=subprocess.STDOUT)
            anon_peak = sample_anonymous_peak(worker)
        if worker.returncode != 0 or not out.exists():
            raise SystemExit(f"the ft-train worker failed on {model}: {log.read_text()[-3000:]}")
        got = {**json.loads(out.read_text()), "anon_peak": anon_peak}
    if got["code"] != 0:
        raise SystemExit(f"ft-train exited {got['code']} on {model}")
    return got, {"process": plan.process_bytes, "host_rows": {r.what: r.cpu_bytes for r in plan.rows},
                 "host_bytes_per_param": plan.host_bytes_per_param}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", choices=list(MODELS), default="Qwen2.5-0.5B")
    parser.add_argument("--only", default="", help="run the variants whose label contains this")
    parser.add_argument("--host-worker", nargs=2, metavar=("CONFIG", "OUT"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.host_worker:
        host_worker(*args.host_worker)
        return
    gib = 1024**3
    table, worst = [], 0.0
    batch, seq_len, steps = MODELS[args.model]
    for label, accumulation, every_steps in VARIANTS:
        if args.only not in label:
            continue
        got, plan = measure(args.model, accumulation, every_steps)
        rss, planned = got["peak_rss"], plan["process"]
        worst = max(worst, abs(planned / rss - 1))
        params = got["params"]
        line = [args.model, f"{params / 1e6:.1f} M" if params >= 1e6 else f"{params:,}", label,
                f"{batch} x {seq_len}, {steps} steps", f"{planned / gib:.3f}", f"{rss / gib:.3f}",
                f"{planned / rss - 1:+.1%}", f"{got['anon_peak'] / gib:.3f}", f"{got['per_element'] / params:.2f}",
                f"{got['step_counts']} B", f"{got['seconds']:.0f}"]
        print(" | ".join(line), file=sys.stderr, flush=True)
        table.append(line)
    print(machine_line())
    print()
    print(markdown_table(["model", "parameters", "variant", "batch x seq", "plan GiB (process)",
                          "ft-train peak RSS GiB (VmHWM)", "plan vs RSS", "peak RssAnon GiB (sampled)",
                          "host B/param (strategy)", "step counts", "ft-train seconds"], table))
    print(f"\nworst plan vs the process's peak RSS: {worst:.1%} (target: within {TARGET:.0%})")


if __name__ == "__main__":
    main()
