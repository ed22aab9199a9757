"""Part g of the GPU run (issue 43): a 1B decoder LLM on one GPU, our device-lean offload against
DeepSpeed ZeRO-2 and ZeRO-3 offload.

    python benchmarks/gpu_part_g.py --out part_g.md               # a GPU (after benchmarks/gpu_run.sh install)
    python benchmarks/gpu_part_g.py --tiny --out /tmp/part_g.md   # the dry run on the CPU: toy sizes

The model: Llama-3.2-1B's architecture (ft_framework/resources/architectures/llama-3.2-1b.json,
1.24 B parameters, its vocabulary of 128256 tied to the output layer), random weights (seed 0),
bf16, activation checkpointing on every layer, sequences of --seq tokens (default 1024), the
next-token loss in fp32 over every position (task_kinds/causal_lm.next_token_losses).

Candidates, each in a worker process of its own under torchrun (world size 1; clean peaks, its own
time limit), most important first:

- ours: the device-lean offload (strategy.offload_optimizer, serial) with RecAdam and the compact
  state (bf16 moments, theta* in bf16 and theta - theta* in fp32: the bf16 weight form, 12 host
  bytes per parameter), as configs/llama3_8b_sft_recadam.yaml runs an 8B model;
- DeepSpeed ZeRO-2 with the optimizer offloaded, DeepSpeedCPUAdam (fp32 states, no theta*);
- DeepSpeed ZeRO-3 with the optimizer and the parameters offloaded, DeepSpeedCPUAdam.

Per candidate: the plan (ft-plan's library, made before the model is built); the device peak
(torch.cuda.max_memory_allocated and max_memory_reserved) and tokens/s at --batch; the host peak
(the worker's peak resident set, VmHWM, reset with /proc/self/clear_refs once the model is set
up, so it is the training's, and the set-up's before it); the largest batch under a --cap-gb cap
(torch.cuda.set_per_process_memory_fraction; doubling, then bisection; stopped at the worker's
time limit, then a lower bound). Each worker writes its row as it measures it (benchmarks/
row_log.py), so a kill keeps what was measured; the report is rebuilt from the rows.
"""

from __future__ import annotations

import argparse
import gc
import os
import shlex
import signal
import sys
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(Path(__file__).resolve().parent))

from row_log import RowLog, read_rows  # noqa: E402

MODEL = "meta-llama/Llama-3.2-1B"   # the shipped architecture (config.json only)
TINY_MODEL = dict(model_type="llama", vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256, tie_word_embeddings=True)
# name -> (strategy section, optimizer)
G_CANDIDATES: dict[str, tuple[dict[str, Any], str]] = {
    "ours: device-lean offload, RecAdam, compact state": (
        {"name": "single", "offload_optimizer": {"overlap": False}}, "recadam"),
    "DeepSpeed ZeRO-2 offload, DeepSpeedCPUAdam": (
        {"name": "deepspeed", "deepspeed": {"zero_stage": 2, "offload_optimizer": True}}, "DeepSpeedCPUAdam"),
    "DeepSpeed ZeRO-3 offload (optimizer and parameters), DeepSpeedCPUAdam": (
        {"name": "deepspeed", "deepspeed": {"zero_stage": 3, "offload_optimizer": True, "offload_param": True}},
        "DeepSpeedCPUAdam"),
}
# Seconds per worker, from its launch (imports, the random init of 1.24 B parameters and the set-up
# count): part g in all about 200 s on an H100.
G_BUDGET_S = {"ours: device-lean offload, RecAdam, compact state": 65, "DeepSpeed ZeRO-2 offload, DeepSpeedCPUAdam": 65,
              "DeepSpeed ZeRO-3 offload (optimizer and parameters), DeepSpeedCPUAdam": 70}
DEADLINE_MARGIN_S = 12   # a worker stops probing this long before its limit, to write its row and let go
LR = 1e-5
RECADAM_HPARAMS = {"lr": LR, "anneal_k": 0.1, "anneal_t0": 1000, "pretrain_cof": 5000.0}
MAX_GRAD_NORM = 1.0


def log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


# ---- the worker ----------------------------------------------------------------------------------
def run_config(section: dict[str, Any], optimizer: str, batch: int, seq: int, cuda: bool, tmp: Path):
    """The candidate's RunConfig (its plan reads it; its strategy is built from it). The forgetting
    probe and checkpoint saves are off: the plan is the training step's."""
    from ft_framework.config import validate_config

    compact = {"anchor_dtype": "bfloat16", "state_dtype": "bfloat16"} if optimizer == "recadam" else {}
    return validate_config({
        "model": {"name_or_path": MODEL},
        "data": {"problem": "causal_lm", "source": "builtin:quickstart_sft", "max_seq_length": seq},
        "optimizer": {"name": "recadam", "hparams": dict(RECADAM_HPARAMS), **compact},
        "schedule": {"name": "constant", "warmup_steps": 0},
        "evaluation": {"forgetting": {"enabled": False}},
        "checkpoint": {"on_signal": "exit"},
        "training": {"max_steps": 10, "per_device_batch_size": batch, "precision": "bf16",
                     "device": "cuda" if cuda else "cpu", "activation_checkpointing": True,
                     "max_grad_norm": MAX_GRAD_NORM},
        "strategy": section,
        "logging": {"output_dir": str(tmp / "out"), "progress_bar": False}})


def build_model(tiny: bool):
    """The decoder with random weights (seed 0), fp32 on the host, checkpointing on every layer."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    from ft_framework.models.activation_checkpointing import apply_activation_checkpointing
    from ft_framework.strategies.memory_fit import load_architecture
    from ft_framework.config.schema import ModelConfig

    config = AutoConfig.for_model(**TINY_MODEL) if tiny else load_architecture(ModelConfig(name_or_path=MODEL)).config
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config)
    apply_activation_checkpointing(model)
    return model


def setup_strategy(cfg, model, optimizer: str):
    """The candidate's strategy around `model`: ours with theta* (every parameter of a causal LM),
    DeepSpeed's with DeepSpeedCPUAdam as its users run it (AdamW, no theta*)."""
    from ft_framework.optim import build_optimizer
    from ft_framework.optim.groups import build_param_groups
    from ft_framework.strategies import build_strategy

    strategy = build_strategy(cfg.strategy, cfg.training)
    if optimizer == "recadam":
        anchors = {n: p.detach().clone().float() for n, p in model.named_parameters()}
        kwargs = {k: v for k, v in cfg.optimizer.optimizer_kwargs().items() if k not in ("lr", "weight_decay")}

        def make(m):
            groups = build_param_groups(m, anchors, lr=LR, weight_decay=0.0, attach_anchors=False)
            return build_optimizer("recadam", groups, impl="auto", rounding_seed=0, **kwargs)

        strategy.setup(model, make, anchors=anchors)
        return strategy

    def make_cpu_adam(m):
        from deepspeed.ops.adam import DeepSpeedCPUAdam

        return DeepSpeedCPUAdam(m.parameters(), lr=LR, weight_decay=0.0, adamw_mode=True)

    strategy.setup(model, make_cpu_adam, anchors=None)
    return strategy


def make_batch(batch: int, seq: int, vocab: int, device) -> dict[str, Any]:
    import torch

    g = torch.Generator().manual_seed(batch * 1000 + seq)
    ids = torch.randint(0, vocab, (batch, seq), generator=g)
    return {"input_ids": ids.to(device), "attention_mask": torch.ones_like(ids).to(device),
            "position_ids": torch.arange(seq).expand(batch, seq).to(device), "use_cache": False}


def train_steps(strategy, batch: dict[str, Any], steps: int, warmup: int, cuda: bool) -> dict[str, Any]:
    """`warmup` + `steps` iterations (forward, the fp32 next-token loss, backward, clip and step);
    the median iteration of the timed ones."""
    import statistics

    import torch

    from ft_framework.task_kinds.causal_lm import next_token_losses

    if cuda:
        torch.cuda.reset_peak_memory_stats()
    iters, norms = [], []
    for i in range(warmup + steps):
        _sync(cuda)
        t0 = time.perf_counter()
        strategy.model.train()
        logits = strategy.forward(batch).logits
        total, count = next_token_losses(logits, batch["input_ids"])
        del logits
        strategy.backward(total / count)
        norm = strategy.clip_and_step(MAX_GRAD_NORM)
        _sync(cuda)
        if i >= warmup:
            iters.append(time.perf_counter() - t0)
            norms.append(float(norm))
    it = statistics.median(iters)
    tokens = batch["input_ids"].numel()
    out = {"iter_s": it, "tokens_per_s": tokens / it, "loss": float(total / count),
           "grad_norm": statistics.median(norms)}
    if cuda:
        out.update(peak_allocated_gb=torch.cuda.max_memory_allocated() / 1e9,
                   peak_reserved_gb=torch.cuda.max_memory_reserved() / 1e9)
    return out


def _sync(cuda: bool) -> None:
    if cuda:
        import torch

        torch.cuda.synchronize()


def _status_kib(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise RuntimeError(f"{field} not in /proc/self/status")


def _reset_peak_rss() -> bool:
    """VmHWM back to the current resident set (Linux: 5 into /proc/self/clear_refs)."""
    try:
        Path("/proc/self/clear_refs").write_text("5")
        return True
    except OSError:
        return False


def worker(args) -> None:
    import torch

    from ft_framework.strategies.memory_fit import plan_run
    from ft_framework.task_kinds import build_task_kind
    from gpu_suite import freeze_imports, largest_batch_under_cap

    started = time.perf_counter()
    name = list(G_CANDIDATES)[int(args.worker)]
    section, optimizer = G_CANDIDATES[name]
    deadline = time.perf_counter() + float(os.environ.get("GPU_PART_G_LEFT_S", G_BUDGET_S[name])) - DEADLINE_MARGIN_S
    cuda = torch.cuda.is_available() and not args.tiny
    device = torch.device("cuda" if cuda else "cpu")
    rows = RowLog(args.rows_out)
    row: dict[str, Any] = {"name": name, "batch": args.batch, "seq": args.seq, "tiny": args.tiny,
                           "gpu": torch.cuda.get_device_name() if cuda else "none (CPU dry run)", "stage": "started"}

    def emit(stage: str) -> None:
        row["stage"], row["seconds"] = stage, time.perf_counter() - started
        rows.append(row)

    tmp = Path(args.rows_out).parent
    cfg = run_config(section, optimizer, args.batch, args.seq, cuda, tmp)
    # The dry run plans too, so the plan's code runs before a GPU window depends on it; its plan is
    # of the config's architecture (the 1B), not of the toy model the dry run trains.
    plan = plan_run(cfg, task=build_task_kind(cfg), world_size=1, on_gpu=cuda)
    if args.tiny:  # the plan imported the decoder's modules (frozen with the rest, and the plan's few
        freeze_imports()  # objects without storage); before any model is built
    row.update(planned_device_gb=plan.device_peak / 1e9, planned_live_gb=plan.live_bytes / 1e9,
               planned_host_gb=plan.host_peak / 1e9)
    if not args.tiny:
        row["params"] = plan.num_params
    emit("planned")
    rss_start = _status_kib("VmRSS")
    strategy = setup_strategy(cfg, build_model(args.tiny), optimizer)
    gc.collect()
    row.update(setup_peak_rss_gb=_status_kib("VmHWM") * 1024 / 1e9, rss_before_setup_gb=rss_start * 1024 / 1e9)
    if "params" not in row:
        row["params"] = sum(p.numel() for p in strategy.model.parameters())
    row["host_peak_reset"] = _reset_peak_rss()
    vocab = TINY_MODEL["vocab_size"] if args.tiny else 128256
    row.update(train_steps(strategy, make_batch(args.batch, args.seq, vocab, device), args.steps, args.warmup, cuda))
    row["train_peak_rss_gb"] = _status_kib("VmHWM") * 1024 / 1e9
    emit("measured")

    def probed(cap: dict[str, Any]) -> None:
        row["cap"] = cap
        emit("cap")

    def train_one(probing, batch: int) -> None:
        train_steps(probing, make_batch(batch, args.seq, vocab, device), 1, 1, cuda)

    def rebuild():
        return setup_strategy(cfg, build_model(args.tiny), optimizer)

    row["cap"], _ = largest_batch_under_cap(args, strategy, rebuild, train_one, cuda, deadline, on_probe=probed)
    emit("done")


# ---- the parent ----------------------------------------------------------------------------------
def launch(index: int, args, budget: float) -> dict[str, Any]:
    """Worker `index` under torchrun (world size 1) within `budget` seconds; its last row."""
    from ft_framework.distributed.ports import free_port
    from gpu_suite import run_in_session, worker_env

    out = Path(args.out)
    rows_path = out.with_name(f"{out.stem}_g{index}.rows.jsonl")
    log_path = out.with_name(f"{out.stem}_g{index}.log")
    rows_path.unlink(missing_ok=True)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "1", "--master_port", str(free_port()),
           str(Path(__file__).resolve()), "--worker", str(index), "--rows-out", str(rows_path), "--out", args.out,
           "--batch", str(args.batch), "--seq", str(args.seq), "--steps", str(args.steps), "--warmup", str(args.warmup),
           "--cap-gb", str(args.cap_gb), "--max-batch", str(args.max_batch)] + (["--tiny"] if args.tiny else [])
    env = worker_env(args.tiny)
    env["GPU_PART_G_LEFT_S"] = str(budget)
    log(f"g{index}: limit {budget:.0f} s: {shlex.join(cmd)}")
    t0 = time.perf_counter()
    rc = run_in_session(cmd, env, log_path, budget)
    rc, note = (-1, f"stopped at its limit of {budget:.0f} s") if rc is None else (rc, "")
    rows = read_rows(rows_path)
    row = rows[-1] if rows else {"name": list(G_CANDIDATES)[index]}
    if rc != 0:
        tail = log_path.read_text(errors="replace")[-800:]
        row["error"] = note or f"exit {rc} at stage {row.get('stage')}: {tail}"
    log(f"g{index}: exit {rc} after {time.perf_counter() - t0:.0f} s, stage {row.get('stage')}")
    return row


def _fmt(x: Any, digits: int = 2) -> str:
    if x is None:
        return ""
    return f"{x:.{digits}f}" if isinstance(x, float) else str(x)


def format_g(rows: list[dict[str, Any]], header: str) -> str:
    from gpu_suite import markdown_table

    first = rows[0] if rows else {}
    cap_gb = (first.get("cap") or {}).get("cap_gb", 24)
    out = [header, "## g. A 1B decoder: the device-lean offload against DeepSpeed ZeRO-2 and ZeRO-3 offload (issue 43)",
           "", f"Llama-3.2-1B's architecture ({_fmt(first.get('params'))} parameters), random weights, bf16, "
           f"activation checkpointing, batch {first.get('batch')} x {first.get('seq')} tokens, fp32 next-token "
           f"loss over every position, max_grad_norm {MAX_GRAD_NORM}; GPU: {first.get('gpu')}. "
           "Device peak: max_memory_allocated (reserved). Host peak: the worker's VmHWM while it trains "
           "(reset once set up), and during its set-up (the fp32 random init, theta* and the engine's "
           "buffers). Planned: ft-plan's library before the model is built. "
           f"Largest batch: under a {cap_gb} GB cap.", ""]
    body = []
    for x in rows:
        cap = x.get("cap") or {}
        largest = cap.get("largest_batch")
        largest_text = "" if largest is None and not cap else (
            f"{largest}" + ("" if cap.get("complete", True) else " (at least: time limit)"))
        device = ("" if x.get("peak_allocated_gb") is None else
                  f"{x['peak_allocated_gb']:.2f} ({_fmt(x.get('peak_reserved_gb'))})")
        body.append([x.get("name"), _fmt(x.get("tokens_per_s"), 0), device, _fmt(x.get("planned_device_gb")),
                     _fmt(x.get("train_peak_rss_gb")), _fmt(x.get("setup_peak_rss_gb")), _fmt(x.get("planned_host_gb")),
                     largest_text, "; ".join(str(s)[:300] for s in (cap.get("error"), x.get("error")) if s)])
    out.append(markdown_table(["candidate", "tokens/s", "device peak GB", "planned device GB", "host peak GB (train)",
                               "host peak GB (set-up)", "planned host GB", "largest batch in cap", "note"], body))
    return "\n".join(out)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default="gpu_part_g.md", help="the report (rows and logs beside it)")
    parser.add_argument("--tiny", action="store_true", help="the dry run: toy sizes on the CPU")
    parser.add_argument("--batch", type=int, default=None, help="sequences per step (default 4; --tiny 2)")
    parser.add_argument("--seq", type=int, default=None, help="tokens per sequence (default 1024; --tiny 32)")
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--warmup", type=int, default=1)
    parser.add_argument("--cap-gb", type=float, default=24.0)
    parser.add_argument("--max-batch", type=int, default=None, help="the batch search's limit (default 64; --tiny 8)")
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    parser.add_argument("--rows-out", help=argparse.SUPPRESS)
    args = parser.parse_args()
    args.batch = args.batch or (2 if args.tiny else 4)
    args.seq = args.seq or (32 if args.tiny else 1024)
    args.max_batch = args.max_batch or (8 if args.tiny else 64)
    if args.worker is not None:
        worker(args)
        return 0
    from gpu_suite import report_header, stop_workers_and_exit, versions

    signal.signal(signal.SIGTERM, stop_workers_and_exit)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    command = "python benchmarks/gpu_part_g.py " + " ".join(sys.argv[1:])
    header = report_header(versions(), command, args.tiny)
    rows: list[dict[str, Any]] = []
    for index, name in enumerate(G_CANDIDATES):
        rows.append(launch(index, args, G_BUDGET_S[name] * (3 if args.tiny else 1)))
        Path(args.out).write_text(format_g(rows, header) + "\n")  # the report as it grows
    print(format_g(rows, header))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
