"""Helpers of the sweep unit tests: a valid inline run config, and a fake "training" command that
writes results.json / metrics.jsonl like the trainer does, in milliseconds instead of seconds.

The fake run's behaviour is picked by environment variables the runner passes through:
FAKE_FAIL_SEEDS="3,4" (exit 1 for those seeds), FAKE_SLEEP_SEEDS="5" (sleep for a minute).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

from ft_framework.run.files import METRICS_FILE, RESULTS_FILE

BASE_RUN = {
    "model": {"name_or_path": "some/model", "init": "pretrained"},
    "data": {"task": "rte", "source": "hub"},
    "optimizer": {"name": "recadam", "hparams": {"lr": 1.0e-4, "anneal_k": 0.5, "anneal_t0": 10}},
    "schedule": {"name": "linear", "warmup_steps": 0},
    "training": {"max_steps": 10, "seed": 1, "device": "cpu"},
    "evaluation": {"num_evals": 2},
    "logging": {"output_dir": "runs/ignored", "progress_bar": True},
    "task_overrides": {"mrpc": {"optimizer.hparams.lr": 2.0e-5}},
}

FAKE_TRAIN = r"""
import json, os, sys, time, yaml
from ft_framework.run.files import METRICS_FILE, RESULTS_FILE
cfg = yaml.safe_load(open(sys.argv[1]))
out, seed, task = cfg["logging"]["output_dir"], cfg["training"]["seed"], cfg["data"]["task"]
print("fake run", seed, task, "threads", os.environ.get("OMP_NUM_THREADS"), "resume" if len(sys.argv) > 2 else "")
def seeds(name):
    return {int(s) for s in os.environ.get(name, "").split(",") if s.strip()}
if seed in seeds("FAKE_SLEEP_SEEDS"):
    time.sleep(60)
if seed in seeds("FAKE_FAIL_SEEDS"):
    print("Traceback: something broke", flush=True)
    sys.exit(1)
k = cfg["optimizer"]["hparams"].get("anneal_k", 0.0)
score = 0.5 + 0.01 * seed + 0.1 * float(k)
with open(os.path.join(out, METRICS_FILE), "a") as f:
    for step in (1, 2):
        f.write(json.dumps({"type": "train", "step": step, "loss": 1.0 / step, "lambda": [0.5 * step, None],
                            "forgetting_distance": 0.1 * step}) + "\n")
    f.write(json.dumps({"type": "eval", "step": 2, "metrics": {"validation": {"accuracy": score}}}) + "\n")
final = {"step": 2, "metrics": {"validation": {"accuracy": score}}}
results = {"task": task, "main_metric": "accuracy", "selection_split": "validation", "steps": 2,
           "final": final, "best": final, "reported": "final",
           "baseline": {"name": "majority class", "metrics": {"validation": {"accuracy": 0.52}}}, "failed": score <= 0.52, "config": cfg}
json.dump(results, open(os.path.join(out, RESULTS_FILE + ".tmp"), "w"))
os.replace(os.path.join(out, RESULTS_FILE + ".tmp"), os.path.join(out, RESULTS_FILE))
"""


def fake_command(config_path, cfg, spec, resume):
    return [sys.executable, "-c", FAKE_TRAIN, str(config_path), *(["resume"] if resume else [])]


def sweep_dict(**extra: Any) -> dict[str, Any]:
    spec = {"base": json.loads(json.dumps(BASE_RUN)), "axes": {"training.seed": [1, 2]},
            "methods": {"recadam": {"axes": {"optimizer.hparams.anneal_k": [0.1, 1.0]}},
                        "vanilla": {"optimizer": {"name": "adamw", "hparams": {"lr": 1.0e-4}}}}}
    spec.update(extra)
    return spec


def write_results(run_dir: Path, *, task: str, score: float, failed: bool, split: str = "validation",
                  main: str = "accuracy", test_score: float | None = None, config: dict | None = None,
                  curves: bool = True) -> None:
    """A results.json (and metrics.jsonl) of the trainer's shape, for report tests."""
    run_dir.mkdir(parents=True, exist_ok=True)
    metrics = {split: {main: score}}
    if test_score is not None:
        metrics["test" + split[len("validation"):]] = {main: test_score}
    final = {"step": 4, "metrics": metrics}
    results = {"task": task, "main_metric": main, "selection_split": split, "steps": 4, "final": final,
               "best": final, "reported": "final", "baseline": {"name": "majority class", "metrics": {split: {main: 0.5}}}, "failed": failed,
               "config": config or {}}
    (run_dir / RESULTS_FILE).write_text(json.dumps(results))
    if curves:
        lines = []
        for step in (1, 2, 3, 4):
            lines.append({"type": "train", "step": step, "loss": 1.0 / step, "lambda": [step / 4, None],
                          "forgetting_distance": 0.1 * step})
            if step % 2 == 0:
                lines.append({"type": "eval", "step": step, "metrics": {split: {main: score * step / 4}}})
        (run_dir / METRICS_FILE).write_text("\n".join(json.dumps(x) for x in lines) + "\n")


def dominated(point: tuple[float, float], others: list[tuple[float, float]]) -> bool:
    """Whether another (score, forgetting) point is at least as low in both and strictly lower in one
    (both lower-is-better, as the frontier tests' completion-loss scores are): the frontier's rule, brute force."""
    (s, f) = point
    return any(s2 <= s and f2 <= f and (s2 < s or f2 < f) for s2, f2 in others)
