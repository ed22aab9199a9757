"""Seeds end to end: the compact optimizer state (bf16 moments and θ*) against the fp32 state.

    nice -n 19 python benchmarks/compact_seeds.py --seeds 1,2,3 --out /tmp/seeds [key.sub=value ...]

Runs `ft-train --config <config> training.seed=<s>` for each seed twice, as the config is (the fp32
state) and with optimizer.state_dtype=bfloat16 optimizer.anchor_dtype=bfloat16 (the compact state),
one run after another, into <out>/fp32_seed<s> and <out>/compact_seed<s>; other `key.sub=value`
arguments go to every run. training.seed seeds the new head's initialization and the compact state's
stochastic rounding; training.data_seed (unset: the same) the data order and dropout, so one seed
differs from the next in all four. `--reuse` reads the results.json of runs already there instead
of running them again.

Prints, from each run's results.json, the task metric (final and best evaluation), the functional
forgetting of the final evaluation (cka_drift_last, cka_drift_mean), ‖θ−θ*‖ (forgetting_distance)
and the training seconds; then, per metric, the fp32 runs' mean, min–max and sample std, the compact
runs' mean and min–max, and the mean over seeds of |compact − fp32| at the same seed. The verdict:
"within" when |mean(compact) − mean(fp32)| <= std(fp32), the fp32 seed-to-seed standard deviation;
"OUTSIDE" otherwise. Training seconds get no verdict (a shared machine's wall times compare nothing).
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
from pathlib import Path
from typing import Sequence

sys.path.insert(0, str(Path(__file__).resolve().parent))
from harness import machine_line, markdown_table  # noqa: E402

from ft_framework.run.files import RESULTS_FILE  # noqa: E402

LAUNCH_TRAIN = Path(__file__).resolve().parent.parent / "launch" / "train.py"  # the ft-train entry point
VARIANTS = {"fp32": [], "compact": ["optimizer.state_dtype=bfloat16", "optimizer.anchor_dtype=bfloat16"]}
# (column name, where in results.json, whether the seed-spread verdict applies)
METRICS = (
    ("metric final", lambda r: r["final"]["metrics"][r["selection_split"]][r["main_metric"]], True),
    ("metric best", lambda r: r["best"]["metrics"][r["selection_split"]][r["main_metric"]], True),
    ("cka_drift_last", lambda r: r["final"]["forgetting"]["cka_drift_last"], True),
    ("cka_drift_mean", lambda r: r["final"]["forgetting"]["cka_drift_mean"], True),
    ("‖θ−θ*‖", lambda r: r["final"]["forgetting_distance"], True),
    ("train s", lambda r: r["train_seconds"], False),
)


def run_dir(out: Path, variant: str, seed: int) -> Path:
    return out / f"{variant}_seed{seed}"


def train(config: str, directory: Path, seed: int, overrides: list[str]) -> None:
    command = [sys.executable, str(LAUNCH_TRAIN), "--config", config, f"training.seed={seed}",
               f"logging.output_dir={directory}", "logging.progress_bar=false", *overrides]
    print("running: ft-train", " ".join(command[2:]), flush=True)
    directory.parent.mkdir(parents=True, exist_ok=True)
    with open(directory.parent / f"{directory.name}.log", "w") as log:
        code = subprocess.run(command, stdout=log, stderr=subprocess.STDOUT).returncode
    if code != 0:
        sys.exit(f"{directory.name}: ft-train exited {code}; see {directory.parent / (directory.name + '.log')}")


def compare(fp32: Sequence[float], compact: Sequence[float]) -> dict[str, float | bool]:
    """One metric over seeds (compact[i] and fp32[i] share a seed). within: |mean(compact) − mean(fp32)|
    <= the fp32 runs' sample standard deviation."""
    if len(fp32) != len(compact) or len(fp32) < 2:
        raise ValueError(f"need the same number (at least 2) of fp32 and compact values, got {len(fp32)} and "
                         f"{len(compact)}")
    fp32_mean, compact_mean, fp32_std = statistics.fmean(fp32), statistics.fmean(compact), statistics.stdev(fp32)
    gap = abs(compact_mean - fp32_mean)
    return {"fp32_mean": fp32_mean, "compact_mean": compact_mean, "fp32_std": fp32_std, "mean_gap": gap,
            "paired_gap": statistics.fmean(abs(c - f) for c, f in zip(compact, fp32)), "within": gap <= fp32_std}


def fmt(x: float) -> str:
    return f"{x:.4g}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", default="configs/quickstart.yaml")
    parser.add_argument("--seeds", type=lambda text: [int(x) for x in text.split(",")], default=[1, 2, 3],
                        help="comma-separated training.seed values (default 1,2,3)")
    parser.add_argument("--out", type=Path, default=Path("runs/compact_seeds"))
    parser.add_argument("--reuse", action="store_true", help="read finished runs under --out instead of rerunning them")
    parser.add_argument("overrides", nargs="*", help="key.sub=value, passed to every run")
    args = parser.parse_args()
    if len(args.seeds) < 2:
        parser.error("--seeds needs at least two seeds (the verdict uses the fp32 seed-to-seed std)")

    values: dict[str, dict[str, list[float]]] = {v: {name: [] for name, _, _ in METRICS} for v in VARIANTS}
    rows = []
    for seed in args.seeds:
        for variant, extra in VARIANTS.items():
            directory = run_dir(args.out, variant, seed)
            if not (args.reuse and (directory / RESULTS_FILE).is_file()):
                train(args.config, directory, seed, [*args.overrides, *extra])
            results = json.loads((directory / RESULTS_FILE).read_text())
            row = [variant, seed, results["steps"]]
            for name, get, _ in METRICS:
                values[variant][name].append(float(get(results)))
                row.append(fmt(values[variant][name][-1]))
            rows.append(row)

    print(machine_line())
    print(f"config: {args.config}, overrides: {' '.join(args.overrides) or 'none'}, seeds: {args.seeds}\n")
    print(markdown_table(["state", "seed", "steps", *(name for name, _, _ in METRICS)], rows))
    print()
    summary = []
    for name, _, judged in METRICS:
        fp32, compact = values["fp32"][name], values["compact"][name]
        c = compare(fp32, compact)
        verdict = ("within" if c["within"] else "OUTSIDE") if judged else "(no verdict)"
        summary.append([name, fmt(c["fp32_mean"]), f"{fmt(min(fp32))}–{fmt(max(fp32))}", fmt(c["fp32_std"]),
                        fmt(c["compact_mean"]), f"{fmt(min(compact))}–{fmt(max(compact))}",
                        fmt(c["mean_gap"]), fmt(c["paired_gap"]), verdict])
    print(markdown_table(["metric", "fp32 mean", "fp32 min–max", "fp32 std", "compact mean", "compact min–max",
                          "gap of means", "same-seed gap (mean)", "gap of means ≤ fp32 std"], summary))


if __name__ == "__main__":
    main()
