"""The report of a sweep: Chen et al. 2020's Table 1 layout, the best hyper-parameters per task,
Levene's test between methods, and the expected best score of n random trials; Markdown and CSV.

    report = build_report("runs/sweeps/glue_recadam")
    print(report.markdown())
    report.write("runs/sweeps/glue_recadam/report")   # report.md, report.csv and the tables below

How numbers are made (also stated at the top of report.md):
- A run's score is its reported main metric (results.json: the final or, with
  evaluation.select_best, the best evaluation) on the selection split (dev), or on the held-out
  half when the dev set was split in half (data.split_dev_in_half), in points (x100), or as it is
  for a metric where lower is better (a loss: sweep/scores.py owns the unit and the direction).
- "Best" follows the main metric's direction everywhere: the highest score, or the lowest for a
  lower-is-better metric (completion_loss, perplexity, mse).
- Per method and task, the hyper-parameter setting (the axis values other than the task and the
  seeds) with the best MEAN score on the selection split over seeds is chosen (the paper selects
  t0 and k "on each dev set"); Table 1 gives that setting's median, best (the paper's max), mean and
  std (ddof=1) over seeds, and how many of its runs failed (Mosbach et al.: no better than the
  baseline; results.json's `failed`) and, apart from those, how many diverged (results.json's
  `diverged`: a NaN/inf loss stopped them; they have no score).
- Avg >10k / Avg <10k / Avg: mean over tasks of the per-task statistic, the tasks grouped by the
  training-set size the runs actually had (results.json's `train_examples`: a 600-example local
  SST-2 is < 10k; the nominal GLUE size, TaskSpec.train_size, only for runs that do not record it;
  WNLI is left out of the averages as in the paper). An average covers the tasks the method has
  results for; one over tasks whose main metrics point in opposite directions (an accuracy and a
  loss) has no meaning and is left empty (its counts are still summed).
- Levene's test (median-centred, Brown-Forsythe) compares, per task, the seeds of the chosen
  setting of each pair of methods.
- The learning–forgetting frontier (score against functional forgetting and the benchmark drop per
  evaluation, forgetting at matched accuracy, Spearman between ‖θ − θ*‖ and forgetting, and between
  the benchmark drop and the KL, the LM loss gained and ‖θ − θ*‖): sweep/frontier.py.
- Expected best score of n trials: bootstrap (10,000 draws) of n runs with replacement from ALL
  finished runs of a method on a task (every setting and seed is a random trial), the best by
  selection score counting with its score; the exact expectation is given alongside.
"""

from __future__ import annotations

import csv
import io
import math
from collections import defaultdict
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterable, Sequence

import numpy as np

from ft_framework.data.tasks import GLUE_TASKS
from ft_framework.data.tasks import LARGE_TASK_MIN_TRAIN_SIZE as LARGE_TASK_SIZE
from ft_framework.interpolate import mean_curves
from ft_framework.run.files import REPORT_FILE

from ft_framework.sweep.markdown import fmt, md_table
from ft_framework.sweep.frontier import AUTO_MEASURE, DEFAULT_MATCHED_FRACTION, Frontier, build_frontier
from ft_framework.sweep.records import RunRecord, load_records, read_interpolation, setting_label
from ft_framework.sweep.scores import (best_score, lower_is_better, oriented, score_decimals, score_scale,
                                       score_unit, task_main_metrics)
from ft_framework.sweep.stats import expected_max_curve, levene, sample_std

__all__ = ["TASK_TRAIN_SIZES", "LARGE_TASKS", "SMALL_TASKS", "TASK_ORDER", "TaskCell", "Report", "build_report",
           "interpolation_curves", "interpolation_markdown"]

# The task facts are the TaskSpecs'; the report only chooses an order and which tasks to average.
TASK_TRAIN_SIZES: dict[str, int] = {name: spec.train_size for name, spec in GLUE_TASKS.items()}
# Columns from the largest training set to the smallest, as in Chen et al. 2020, Table 1.
TASK_ORDER = tuple(sorted(GLUE_TASKS, key=lambda name: -GLUE_TASKS[name].train_size))
# Chen et al. 2020 leave WNLI out of their averages; so does the report, to stay comparable.
NOT_AVERAGED = ("wnli",)
LARGE_TASKS = tuple(t for t in TASK_ORDER if GLUE_TASKS[t].is_large and t not in NOT_AVERAGED)
SMALL_TASKS = tuple(t for t in TASK_ORDER if not GLUE_TASKS[t].is_large and t not in NOT_AVERAGED)
AVG_COLUMNS = ("avg_gt10k", "avg_lt10k", "avg")
AVG_TITLES = {"avg_gt10k": "Avg >10k", "avg_lt10k": "Avg <10k", "avg": "Avg"}
CURVE_NS = (1, 2, 3, 5, 10, 20, 50, 100)
# Levene's test needs spread within each group: with 2 seeds |y - median| is the same for both.
LEVENE_MIN_SEEDS = 3


def _size_text(size: int) -> str:
    """600, 2.5k, 67k."""
    if size < 1000:
        return str(size)
    return f"{size / 1000:.1f}k" if size < LARGE_TASK_SIZE else f"{size // 1000}k"


def _size_title(task: str, size: int | None = None) -> str:
    """A column title with the task's training-set size: the size its runs had, when given and
    not the nominal GLUE size ("SST-2 600"), else the nominal one ("SST-2 67k")."""
    spec = GLUE_TASKS.get(task)
    if size is not None and (spec is None or size != spec.train_size):
        return f"{spec.title if spec is not None else task} {_size_text(size)}"
    return _size_title_nominal(task)


def _size_title_nominal(task: str) -> str:
    spec = GLUE_TASKS.get(task)
    return spec.size_title if spec is not None else task


def _titles(tasks: Iterable[str]) -> str:
    """GLUE titles ("SST-2"); a task of your own data keeps its name."""
    return ", ".join(GLUE_TASKS[t].title if t in GLUE_TASKS else t for t in tasks)



@dataclass
class TaskCell:
    """A method on a task: its chosen setting and that setting's scores over seeds."""

    method: str
    task: str
    setting: tuple[tuple[str, str], ...]
    scores: list[float]
    selection_mean: float
    failed: int
    settings_tried: int
    runs: list[RunRecord] = field(default_factory=list)
    diverged: int = 0   # runs of this setting that diverged (not in `scores`)
    metric: str | None = None   # the task's main metric: the scores' unit and direction

    @property
    def n(self) -> int:
        return len(self.scores)

    def stat(self, name: str) -> float:
        s = np.asarray(self.scores, dtype=np.float64)
        if name == "median":
            return float(np.median(s))
        if name == "max":
            return float(np.max(s))
        if name == "best":   # max, or min for a lower-is-better metric
            return float(best_score(self.metric, s))
        if name == "mean":
            return float(np.mean(s))
        if name == "std":
            return sample_std(s)
        if name == "failed":
            return float(self.failed)
        if name == "diverged":
            return float(self.diverged)
        if name == "n":
            return float(self.n)
        raise KeyError(name)


STATISTICS = ("median", "max", "best", "mean", "std", "failed", "diverged", "n")
# Statistics of the scores themselves: an average of them over tasks needs one direction.
SCORE_STATISTICS = ("median", "max", "best", "mean", "std")


def _ordered_tasks(tasks: Iterable[str], sizes: dict[str, int] | None = None) -> list[str]:
    """Largest training set first (the sizes the runs had, else the nominal GLUE ones)."""
    tasks = set(tasks)
    nominal = [t for t in TASK_ORDER if t in tasks] + sorted(t for t in tasks if t not in TASK_ORDER)
    if not sizes:
        return nominal
    size = {t: sizes.get(t, GLUE_TASKS[t].train_size if t in GLUE_TASKS else 0) for t in nominal}
    return sorted(nominal, key=lambda t: -size[t])


@dataclass
class Report:
    """Everything ft-report prints and writes, computed once from the records."""

    source: Path
    records: list[RunRecord]
    methods: list[str]
    tasks: list[str]
    cells: dict[tuple[str, str], TaskCell]
    settings: list[dict[str, Any]]
    levene_rows: list[dict[str, Any]]
    expected_rows: list[dict[str, Any]]
    bootstrap_samples: int = 10_000
    # Each task's training-set size in these runs (results.json's train_examples; else nominal).
    task_sizes: dict[str, int] = field(default_factory=dict)
    frontier: Frontier | None = None
    # Each task's main metric (its scores' unit and direction, sweep/scores.py).
    metrics: dict[str, str] = field(default_factory=dict)

    def _size(self, task: str) -> int | None:
        spec = GLUE_TASKS.get(task)
        return self.task_sizes.get(task, spec.train_size if spec is not None else None)

    @property
    def large_tasks(self) -> tuple[str, ...]:
        """The averaged tasks with more than 10k training examples in these runs."""
        return tuple(t for t in self.tasks if t not in NOT_AVERAGED and (self._size(t) or 0) > LARGE_TASK_SIZE)

    @property
    def small_tasks(self) -> tuple[str, ...]:
        return tuple(t for t in self.tasks if t not in NOT_AVERAGED and t not in self.large_tasks)

    # ---- Table 1 ------------------------------------------------------------------------
    def table1_value(self, method: str, stat: str, column: str) -> float:
        """A cell of Table 1: a task's statistic, or an average column."""
        if column in AVG_COLUMNS:
            large, small = self.large_tasks, self.small_tasks
            group = {"avg_gt10k": large, "avg_lt10k": small, "avg": large + small}[column]
            present = [t for t in self.tasks if t in group and (method, t) in self.cells]
            values = [self.cells[(method, t)].stat(stat) for t in present]
            if not values:
                return math.nan
            if stat in SCORE_STATISTICS and len({lower_is_better(self.metrics.get(t)) for t in present}) > 1:
                return math.nan   # an accuracy averaged with a loss means nothing
            if stat in ("failed", "diverged", "n"):
                return float(sum(values))
            return float(np.mean(values))
        cell = self.cells.get((method, column))
        return cell.stat(stat) if cell is not None else math.nan

    def table1_rows(self) -> list[dict[str, Any]]:
        """One row per (statistic, method): the CSV form of Table 1."""
        columns = [*self.tasks, *AVG_COLUMNS]
        rows = []
        for stat in STATISTICS:
            for method in self.methods:
                row: dict[str, Any] = {"method": method, "statistic": stat}
                for col in columns:
                    row[col] = self.table1_value(method, stat, col)
                rows.append(row)
        return rows

    def _decimals(self, column: str, decimals: int) -> int:
        """`decimals` for a column of points; more where every task of the column is a loss."""
        group = {"avg_gt10k": self.large_tasks, "avg_lt10k": self.small_tasks,
                 "avg": self.large_tasks + self.small_tasks}.get(column, (column,))
        metrics = [self.metrics[t] for t in group if t in self.metrics]
        return score_decimals(metrics[0], decimals) if metrics and all(map(lower_is_better, metrics)) else decimals

    def _table1_markdown(self) -> str:
        columns = [*self.tasks, *AVG_COLUMNS]
        header = ["Method", *[_size_title(t, self.task_sizes.get(t)) for t in self.tasks],
                  *[AVG_TITLES[c] for c in AVG_COLUMNS]]
        rows = []
        # The paper's "Max" is the best seed; with a lower-is-better task that is a min, so "Best".
        best_title = "Best" if any(lower_is_better(m) for m in self.metrics.values()) else "Max"
        for stat, title in (("median", "Median"), ("best", best_title), ("mean", "Mean"), ("std", "Std")):
            for method in self.methods:
                rows.append([f"{method} {title}", *[fmt(self.table1_value(method, stat, c), self._decimals(c, 1))
                                                     for c in columns]])
        # Failed runs are counted among the n evaluated ones; diverged runs come on top of them.
        counts = [("failed", 0)] + ([("diverged", 1)] if any(r.state == "diverged" for r in self.records) else [])
        for stat, add_to_total in counts:
            for method in self.methods:
                cells = []
                for c in columns:
                    count, n = self.table1_value(method, stat, c), self.table1_value(method, "n", c)
                    total = n + count * add_to_total
                    cells.append("–" if math.isnan(n) else f"{int(count)}/{int(total)}")
                rows.append([f"{method} {stat} runs", *cells])
        return md_table(header, rows)

    # ---- Markdown -------------------------------------------------------------------------
    def markdown(self) -> str:
        finished = sum(r.finished for r in self.records)
        counts: dict[str, int] = defaultdict(int)
        for r in self.records:
            counts["finished" if r.finished else r.state] += 1
        metric_lines = sorted({f"{r.task}: {r.main_metric} on {r.score_split}, {score_unit(r.main_metric)}"
                               for r in self.records if r.finished})
        out = [f"# Report: {self.source}", "",
               f"{len(self.records)} runs: " + ", ".join(f"{v} {k}" for k, v in sorted(counts.items())) + ".",
               "Scores are the reported main metric (" + "; ".join(metric_lines) + "); the best is the highest, "
               "or the lowest where lower is better." if metric_lines else "No finished runs yet.", ""]
        if not finished:
            return "\n".join(out)
        out += ["## Table 1: median and max over seeds (Chen et al. 2020 layout)", "",
                "Per method and task, the setting with the best mean selection-split score; its median, max (Best: "
                "the min for a lower-is-better metric), mean and std (ddof=1) over seeds, and its failed runs (no "
                "better than the baseline: the majority class, or a decoder before fine-tuning; Mosbach et al.; "
                "diverged runs, stopped by a NaN/inf loss, are counted apart and have no score). "
                "Avg >10k / <10k / Avg: mean over the tasks present, grouped by the training-set size of "
                f"these runs ({_titles(self.large_tasks) or 'none'} > 10k; {_titles(self.small_tasks) or 'none'} "
                f"< 10k; {_titles(NOT_AVERAGED)} not averaged; left empty over tasks whose metrics point in "
                "opposite directions); failed runs are summed.", "",
                self._table1_markdown(), ""]
        missing = [(m, t) for m in self.methods for t in self.tasks if (m, t) not in self.cells]
        if missing:
            out += ["Missing (no finished run): " + ", ".join(f"{m}/{t}" for m, t in missing)
                    + ". Averages of those methods cover fewer tasks.", ""]
        out += ["## Best hyper-parameters per task (by mean validation score over seeds)", ""]
        rows = []
        for (method, task), cell in sorted(self.cells.items(), key=lambda kv: (self.methods.index(kv[0][0]),
                                                                               self.tasks.index(kv[0][1]))):
            digits = score_decimals(cell.metric, 2)
            rows.append([method, task, setting_label(cell.setting), f"{cell.settings_tried}",
                         fmt(cell.selection_mean, digits), fmt(cell.stat("mean"), digits),
                         fmt(cell.stat("std"), digits), str(cell.n)])
        out += [md_table(["Method", "Task", "Best setting", "Settings", "Mean (selection)", "Mean (score)",
                           "Std", "Seeds"], rows, align_left=3), ""]
        out += ["## Stability: Levene's test for equal variances (Mosbach et al. 2021)", ""]
        if self.levene_rows:
            rows = [[r["task"], r["method_a"], r["method_b"], fmt(r["std_a"], 2), fmt(r["std_b"], 2),
                     f"{r['n_a']}/{r['n_b']}", fmt(r["statistic"], 3), fmt(r["pvalue"], 4)]
                    for r in self.levene_rows]
            out += ["Median-centred (Brown-Forsythe), on the seeds of each method's chosen setting; "
                    "a small p: the spreads differ.", "",
                    md_table(["Task", "Method A", "Method B", "Std A", "Std B", "n A/B", "W", "p"], rows, 3), ""]
        else:
            out += [f"Needs two methods with at least {LEVENE_MIN_SEEDS} finished seeds (of their chosen setting) "
                    "on a task.", ""]
        out += ["## Expected best score vs number of random trials (Zhang et al. 2021, Fig. 4)", "",
                f"Bootstrap over all finished runs of a method on a task ({self.bootstrap_samples:,} draws of n runs with "
                "replacement; the best by selection score counts with its score); mean ± std.", ""]
        ns = sorted({r["n"] for r in self.expected_rows})
        groups: dict[tuple[str, str], dict[int, dict[str, Any]]] = defaultdict(dict)
        for r in self.expected_rows:
            groups[(r["method"], r["task"])][r["n"]] = r
        rows = []
        for (method, task), by_n in groups.items():
            d = score_decimals(self.metrics.get(task), 2)
            rows.append([method, task, str(by_n[1]["trials"]),
                         *[f"{fmt(by_n[n]['mean'], d)} ± {fmt(by_n[n]['std'], d)}" if n in by_n else "–" for n in ns]])
        out += [md_table(["Method", "Task", "Trials", *[f"n={n}" for n in ns]], rows, align_left=2), ""]
        unfinished = [r for r in self.records if not r.finished]
        if unfinished:
            out += ["## Runs without results", "",
                    md_table(["Run", "Method", "Task", "Seed", "Setting", "State"],
                              [[r.run_id, r.method, r.task, str(r.seed), r.setting_label, r.state]
                               for r in unfinished], align_left=6), ""]
        interpolation = interpolation_markdown(self)  # runs with interpolation.json (ft-interpolate)
        if interpolation:
            out += [interpolation, ""]
        frontier = self.frontier.markdown() if self.frontier is not None else ""
        if frontier:
            out += [frontier, ""]
        return "\n".join(out)

    # ---- CSV ------------------------------------------------------------------------------
    def csv_tables(self) -> dict[str, tuple[list[str], list[dict[str, Any]]]]:
        """File name -> (columns, rows) of every CSV the report writes."""
        table1 = ["method", "statistic", *self.tasks, *AVG_COLUMNS]
        runs = [{"run_id": r.run_id, "method": r.method, "task": r.task, "seed": r.seed, "setting": r.setting_label,
                 "state": r.state if not r.finished else "finished", "score": r.score,
                 "selection_score": r.selection_score, "failed": r.failed, "train_examples": r.train_examples,
                 "diverged_at_step": (r.diverged or {}).get("step"), "main_metric": r.main_metric,
                 "score_split": r.score_split} for r in self.records]
        return {
            "report.csv": (table1, self.table1_rows()),
            "settings.csv": (["method", "task", "setting", "best", "n", "selection_mean", "mean", "std", "median",
                              "max", "best_score", "failed", "diverged"], self.settings),
            "levene.csv": (["task", "method_a", "method_b", "n_a", "n_b", "std_a", "std_b", "statistic", "pvalue"],
                           self.levene_rows),
            "expected_max.csv": (["method", "task", "trials", "n", "mean", "std", "exact_mean", "exact_std"],
                                 self.expected_rows),
            "runs.csv": (list(runs[0]) if runs else ["run_id"], runs),
            **self._frontier_tables(),
        }

    def _frontier_tables(self) -> dict[str, tuple[list[str], list[dict[str, Any]]]]:
        if self.frontier is None or not self.frontier.tasks:
            return {}
        tables = {"frontier.csv": (["task", "method", "run_id", "seed", "setting", "kind", "step", "alpha", "score",
                                    "measure", "forgetting", "distance", "non_dominated"],
                                   self.frontier.point_rows())}
        if self.frontier.matched_rows:
            tables["matched_accuracy.csv"] = (["task", "measure", "method", "reference", "fraction", "target",
                                               "points", "reached", "forgetting", "score", "run_id", "alpha"],
                                              self.frontier.matched_rows)
        if self.frontier.correlation_rows:
            tables["forgetting_correlation.csv"] = (["task", "measure", "method", "n", "rho", "pvalue"],
                                                    self.frontier.correlation_rows)
        if self.frontier.benchmark_correlation_rows:
            tables["benchmark_correlation.csv"] = (["task", "predictor", "method", "n", "rho", "pvalue"],
                                                   self.frontier.benchmark_correlation_rows)
        return tables

    @staticmethod
    def csv_text(columns: Sequence[str], rows: Sequence[dict[str, Any]]) -> str:
        buf = io.StringIO()
        writer = csv.DictWriter(buf, fieldnames=list(columns), extrasaction="ignore", lineterminator="\n")
        writer.writeheader()
        for row in rows:
            writer.writerow({k: ("" if v is None or (isinstance(v, float) and math.isnan(v)) else v)
                             for k, v in row.items()})
        return buf.getvalue()

    def write(self, out_dir: str | Path) -> list[Path]:
        """Writes report.md and the CSVs; returns the paths written (the plots: plots.write_plots)."""
        out = Path(out_dir)
        out.mkdir(parents=True, exist_ok=True)
        written = []
        (out / REPORT_FILE).write_text(self.markdown() + "\n")
        written.append(out / REPORT_FILE)
        for name, (columns, rows) in self.csv_tables().items():
            (out / name).write_text(self.csv_text(columns, rows))
            written.append(out / name)
        return written


# ---- the interpolation section (runs with an interpolation.json, from ft-interpolate or the sweep's post-step) ----
def interpolation_curves(report: "Report") -> dict[tuple[str, str], dict[str, Any]]:
    """(method, task) -> the mean curve over the chosen setting's seeds that have interpolation.json."""
    out = {}
    for (method, task), cell in report.cells.items():
        outs = [o for o in map(read_interpolation, cell.runs) if o is not None]
        outs = [o for o in outs if outs and o["alphas"] == outs[0]["alphas"]]
        if outs:
            curve = mean_curves(outs)
            curve["best_alphas"] = [o["best_alpha"] for o in outs]
            out[(method, task)] = curve
    return out


def interpolation_markdown(report: "Report") -> str:
    """The report's section on interpolation toward θ* (empty when no run was interpolated)."""
    curves = interpolation_curves(report)
    if not curves:
        return ""
    lines = ["## Interpolation toward θ* (WiSE-FT): θ_α = θ* + α (θ − θ*)", "",
             "Per method and task, the chosen setting's runs (seeds averaged): the main metric on the selection "
             "split at each α (the report's unit), ‖θ_α − θ*‖₂ at α = 1, and the α best on the selection split (of "
             "the mean curve; per seed in brackets). α = 1 is the fine-tuned model, α = 0 the pretrained one under "
             "the fine-tuned head.", ""]
    by_task: dict[str, list[tuple[str, dict[str, Any]]]] = defaultdict(list)
    for (method, task), curve in curves.items():
        by_task[task].append((method, curve))
    for task in [t for t in report.tasks if t in by_task]:
        entries = sorted(by_task[task], key=lambda mc: report.methods.index(mc[0]))
        alphas = entries[0][1]["alphas"]
        header = ["Method", "n", *[f"α={a:g}" for a in alphas], "‖θ−θ*‖ (α=1)", "best α"]
        rows = []
        for method, curve in entries:
            split, main = curve["selection_split"], curve["main_metric"]
            scores = {r["alpha"]: score_scale(main) * r["metrics"][split][main] for r in curve["rows"]}
            best = max(curve["rows"], key=lambda r: (oriented(main, r["metrics"][split][main]), r["alpha"]))["alpha"]
            per_seed = ", ".join(f"{a:g}" for a in curve["best_alphas"])
            rows.append([method, str(curve["n"]), *[fmt(scores.get(a), score_decimals(main, 1)) for a in alphas],
                         f"{curve['rows'][-1]['distance']:.3f}", f"{best:g} ({per_seed})"])
        lines += [f"### {task}", "", md_table(header, rows), ""]
    return "\n".join(lines)


def _best_cells(records: Sequence[RunRecord]) -> tuple[dict[tuple[str, str], TaskCell], list[dict[str, Any]]]:
    by_setting: dict[tuple[str, str], dict[tuple, list[RunRecord]]] = defaultdict(lambda: defaultdict(list))
    diverged: dict[tuple[str, str], dict[tuple, list[RunRecord]]] = defaultdict(lambda: defaultdict(list))
    for r in records:
        if r.finished:
            by_setting[(r.method, r.task)][r.setting].append(r)
        elif r.state == "diverged":
            diverged[(r.method, r.task)][r.setting].append(r)
    cells, settings = {}, []
    for key, groups in by_setting.items():
        metric = next(iter(groups.values()))[0].main_metric   # one per task (scores.task_main_metrics)
        means = {s: float(np.mean([r.selection_score for r in runs])) for s, runs in groups.items()}
        best = max(groups, key=lambda s: oriented(metric, means[s]))  # ties: the first setting of the grid
        for s, runs in groups.items():
            scores = [r.score for r in runs]
            settings.append({"method": key[0], "task": key[1], "setting": setting_label(s), "best": s == best,
                             "n": len(runs), "selection_mean": means[s], "mean": float(np.mean(scores)),
                             "std": sample_std(scores), "median": float(np.median(scores)),
                             "max": float(np.max(scores)), "best_score": float(best_score(metric, scores)),
                             "failed": sum(bool(r.failed) for r in runs), "diverged": len(diverged[key][s])})
        runs = sorted(groups[best], key=lambda r: (str(r.seed), r.run_id))
        cells[key] = TaskCell(method=key[0], task=key[1], setting=best, scores=[r.score for r in runs],
                              selection_mean=means[best], failed=sum(bool(r.failed) for r in runs),
                              settings_tried=len(groups), runs=runs, diverged=len(diverged[key][best]),
                              metric=metric)
    return cells, settings


def build_report(directory: str | Path, *, bootstrap_samples: int = 10_000, forgetting_measure: str = AUTO_MEASURE,
                 reference_method: str | None = None, matched_fraction: float = DEFAULT_MATCHED_FRACTION) -> Report:
    """Reads a sweep store (or a run directory) and computes every table of the report (the
    frontier's options: sweep/frontier.py)."""
    records = load_records(directory)
    methods: list[str] = []
    for r in records:
        if r.method not in methods:
            methods.append(r.method)
    task_sizes = _task_sizes(records)
    metrics = task_main_metrics((r.task, r.main_metric) for r in records if r.finished)
    tasks = _ordered_tasks((r.task for r in records if r.task), task_sizes)
    cells, settings = _best_cells(records)
    settings.sort(key=lambda s: (methods.index(s["method"]), tasks.index(s["task"]), not s["best"]))

    levene_rows = []
    for task in tasks:
        present = [m for m in methods if (m, task) in cells]
        for i, a in enumerate(present):
            for b in present[i + 1:]:
                ca, cb = cells[(a, task)], cells[(b, task)]
                if ca.n < LEVENE_MIN_SEEDS or cb.n < LEVENE_MIN_SEEDS:
                    continue
                res = levene(ca.scores, cb.scores, center="median")
                levene_rows.append({"task": task, "method_a": a, "method_b": b, "n_a": ca.n, "n_b": cb.n,
                                    "std_a": ca.stat("std"), "std_b": cb.stat("std"),
                                    "statistic": res.statistic, "pvalue": res.pvalue})

    expected_rows = []
    for method in methods:
        for task in tasks:
            runs = [r for r in records if r.finished and r.method == method and r.task == task]
            if not runs:
                continue
            trials = len(runs)
            ns = [n for n in CURVE_NS if n <= max(trials, 1)] or [1]
            if trials not in ns:
                ns.append(trials)
            lower = lower_is_better(metrics[task])
            for row in expected_max_curve([r.score for r in runs], ns, [r.selection_score for r in runs],
                                          num_samples=bootstrap_samples, lower_is_better=lower):
                expected_rows.append({"method": method, "task": task, "trials": trials, **row})
    frontier = build_frontier(records, methods, tasks, measure=forgetting_measure, reference=reference_method,
                              fraction=matched_fraction)
    return Report(source=Path(directory), records=records, methods=methods, tasks=tasks, cells=cells,
                  settings=settings, levene_rows=levene_rows, expected_rows=expected_rows,
                  bootstrap_samples=bootstrap_samples, task_sizes=task_sizes, frontier=frontier, metrics=metrics)


def _task_sizes(records: Sequence[RunRecord]) -> dict[str, int]:
    """Per task, the largest training set its runs recorded (results.json's train_examples)."""
    sizes: dict[str, int] = {}
    for r in records:
        if r.task and r.train_examples:
            sizes[r.task] = max(sizes.get(r.task, 0), int(r.train_examples))
    return sizes
