"""Plots of a sweep report (PNG, matplotlib's Agg canvas; no display needed):

- learning_curves_<task>.png  training loss and dev score over steps, one line per k (RecAdam's
  objective-shifting rate) next to the methods without annealing (Chen et al. 2020, Fig. 2a)
- forgetting_<task>.png       ||θ - θ*||₂ over steps per k against vanilla (Fig. 2b)
- lambda_<task>.png           λ(t), the annealing coefficient, per k
- scores_boxplot.png          score distribution per method and task (seeds of the chosen setting)
- expected_max.png            expected best score vs number of random trials (Zhang et al. Fig. 4)
- interpolation_<task>.png    each method's mean interpolation curve toward θ* (runs with interpolation.json)
- frontier_<task>.png         score against functional forgetting, every evaluation of every run, one colour
                              per method, the WiSE-FT α lines, the non-dominated points joined; one panel
                              per forgetting measure of the frontier (a decoder's: the KL from θ* and the
                              LM loss gained; and the benchmark drop where runs scored benchmarks)

Scores are in the report's unit and direction (sweep/scores.py): an axis says "x100", or "lower is
better" for a loss.

Lines average the seeds of one setting. For a method with a k axis, the other hyper-parameters stay
at the task's best setting; the other methods show their best setting.
"""

from __future__ import annotations

import math
from collections import defaultdict
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable

import numpy as np

from ft_framework.interpolate import plot_interpolation
from ft_framework.sweep.frontier import EVAL, INTERPOLATED, Frontier, measure_label
from ft_framework.sweep.records import RunRecord, read_metrics
from ft_framework.sweep.report import Report, interpolation_curves
from ft_framework.sweep.scores import score_label, score_scale

if TYPE_CHECKING:
    from matplotlib.figure import Figure

__all__ = ["K_KEY", "write_plots", "curve_groups", "write_interpolation_plots", "write_frontier_plots"]

K_KEY = "optimizer.hparams.anneal_k"


def _metrics(run: "RunRecord", cache: dict[str, list[dict[str, Any]]]) -> list[dict[str, Any]]:
    if run.run_id not in cache:
        cache[run.run_id] = read_metrics(run)
    return cache[run.run_id]


def curve_groups(report: "Report", task: str) -> list[tuple[str, list["RunRecord"], bool]]:
    """(label, runs, annealed-with-k-axis) for each line of a task's curves."""
    groups = []
    for method in report.methods:
        cell = report.cells.get((method, task))
        if cell is None:
            continue
        runs = [r for r in report.records if r.finished and r.method == method and r.task == task]
        if any(K_KEY in r.axes for r in runs):
            others = {k: v for k, v in cell.setting if k != K_KEY}
            by_k: dict[str, list] = defaultdict(list)
            for r in runs:
                setting = dict(r.setting)
                if {k: v for k, v in setting.items() if k != K_KEY} == others:
                    by_k[setting.get(K_KEY, "?")].append(r)
            for k in sorted(by_k, key=_as_float):
                groups.append((f"{method} k={k}", by_k[k], True))
        else:
            groups.append((method, cell.runs, False))
    return groups


def _as_float(text: str) -> float:
    try:
        return float(text)
    except ValueError:
        return math.inf


def _mean_curve(runs: list["RunRecord"], extract: Callable[[dict[str, Any], "RunRecord"], float | None],
                kind: str, cache: dict) -> tuple[np.ndarray, np.ndarray]:
    values: dict[int, list[float]] = defaultdict(list)
    for run in runs:
        for rec in _metrics(run, cache):
            if rec.get("type") != kind:
                continue
            v = extract(rec, run)
            if v is not None and math.isfinite(v):
                values[int(rec["step"])].append(float(v))
    steps = np.array(sorted(values))
    return steps, np.array([np.mean(values[s]) for s in steps])


def _loss(rec: dict[str, Any], run: "RunRecord") -> float | None:
    return rec.get("loss")


def _score(rec: dict[str, Any], run: "RunRecord") -> float | None:
    value = (rec.get("metrics") or {}).get(run.score_split, {}).get(run.main_metric)
    return None if value is None else score_scale(run.main_metric) * value


def _distance(rec: dict[str, Any], run: "RunRecord") -> float | None:
    return rec.get("forgetting_distance")


def _lambda(rec: dict[str, Any], run: "RunRecord") -> float | None:
    values = [v for v in (rec.get("lambda") or []) if v is not None]
    return values[0] if values else None


def _line_plot(ax, groups, extract, kind, cache, ylabel, title) -> int:
    drawn = 0
    for label, runs, annealed in groups:
        steps, values = _mean_curve(runs, extract, kind, cache)
        if len(steps) == 0:
            continue
        style = "-" if annealed else "--"
        ax.plot(steps, values, style, marker="o" if len(steps) < 12 else None, markersize=3, label=label)
        drawn += 1
    ax.set_xlabel("step")
    ax.set_ylabel(ylabel)
    ax.set_title(title)
    if drawn:
        ax.legend(fontsize=7)
    ax.grid(alpha=0.3)
    return drawn


def _save(fig: Figure, path: Path) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    return path


def write_plots(report: "Report", out_dir: str | Path) -> list[Path]:
    """Writes the PNGs that have data; returns their paths."""
    from matplotlib.figure import Figure  # lazy: the CLI starts without matplotlib
    from matplotlib.ticker import MaxNLocator, ScalarFormatter

    out = Path(out_dir)
    written: list[Path] = []
    cache: dict[str, list[dict[str, Any]]] = {}
    for task in report.tasks:
        groups = curve_groups(report, task)
        if not groups:
            continue
        metric = next((r.main_metric for _, runs, _ in groups for r in runs), "score")

        fig = Figure(figsize=(11, 4))
        ax_loss, ax_score = fig.subplots(1, 2)
        n = _line_plot(ax_loss, groups, _loss, "train", cache, "training loss", f"{task}: training loss")
        n += _line_plot(ax_score, groups, _score, "eval", cache, score_label(metric), f"{task}: dev {metric}")
        if n:
            written.append(_save(fig, out / f"learning_curves_{task}.png"))

        fig = Figure(figsize=(6, 4))
        if _line_plot(fig.subplots(), groups, _distance, "train", cache, "‖θ − θ*‖₂",
                      f"{task}: forgetting (distance to the pretrained weights)"):
            written.append(_save(fig, out / f"forgetting_{task}.png"))

        fig = Figure(figsize=(6, 4))
        annealed = [g for g in groups if g[2]] or groups
        if _line_plot(fig.subplots(), annealed, _lambda, "train", cache, "λ(t)", f"{task}: annealing coefficient"):
            written.append(_save(fig, out / f"lambda_{task}.png"))

    tasks = [t for t in report.tasks if any((m, t) in report.cells for m in report.methods)]
    if tasks:
        cols = min(4, len(tasks))
        rows = math.ceil(len(tasks) / cols)
        fig = Figure(figsize=(3.6 * cols, 3.4 * rows))
        axes = np.atleast_1d(fig.subplots(rows, cols)).ravel()
        for ax, task in zip(axes, tasks):
            methods = [m for m in report.methods if (m, task) in report.cells]
            data = [report.cells[(m, task)].scores for m in methods]
            ax.boxplot(data)
            ax.set_xticks(range(1, len(methods) + 1), methods, rotation=20, fontsize=8)
            for i, scores in enumerate(data, 1):
                ax.plot(np.full(len(scores), i, dtype=float), scores, "k.", alpha=0.6)
            ax.set_title(task)
            ax.set_ylabel(score_label(report.metrics.get(task)))
            ax.grid(alpha=0.3)
        for ax in axes[len(tasks):]:
            ax.set_visible(False)
        written.append(_save(fig, out / "scores_boxplot.png"))

        fig = Figure(figsize=(3.6 * cols, 3.4 * rows))
        axes = np.atleast_1d(fig.subplots(rows, cols)).ravel()
        for ax, task in zip(axes, tasks):
            for method in report.methods:
                rows_ = [r for r in report.expected_rows if r["method"] == method and r["task"] == task]
                if not rows_:
                    continue
                ns = np.array([r["n"] for r in rows_])
                mean = np.array([r["mean"] for r in rows_])
                std = np.array([r["std"] for r in rows_])
                ax.plot(ns, mean, marker="o", markersize=3, label=method)
                ax.fill_between(ns, mean - std, mean + std, alpha=0.2)
            largest = max((r["n"] for r in report.expected_rows if r["task"] == task), default=1)
            if largest > 10:
                ax.set_xscale("log")
                ax.xaxis.set_major_formatter(ScalarFormatter())
            else:
                ax.xaxis.set_major_locator(MaxNLocator(integer=True))
            ax.set_xlabel("number of random trials")
            ax.set_ylabel(f"expected best {score_label(report.metrics.get(task))}")
            ax.set_title(task)
            ax.legend(fontsize=7)
            ax.grid(alpha=0.3)
        for ax in axes[len(tasks):]:
            ax.set_visible(False)
        written.append(_save(fig, out / "expected_max.png"))
    written += write_interpolation_plots(report, out)
    if report.frontier is not None:
        written += write_frontier_plots(report.frontier, report.methods, out)
    return written


def write_frontier_plots(frontier: Frontier, methods: list[str], directory: Path) -> list[Path]:
    """plots/frontier_<task>.png: score against functional forgetting (sweep/frontier.py), one panel
    per forgetting measure of the frontier."""
    from matplotlib.figure import Figure  # lazy: the CLI starts without matplotlib

    written = []
    for task in frontier.tasks:
        axes_of_task = [axis for axis in frontier.axes if axis.points.get(task)]
        fig = Figure(figsize=(7 * len(axes_of_task), 5))
        panels = np.atleast_1d(fig.subplots(1, len(axes_of_task))).ravel()
        for ax, axis in zip(panels, axes_of_task):
            _frontier_panel(ax, axis.points[task], axis.measure, frontier.metrics[task], methods, task)
        written.append(_save(fig, Path(directory) / f"frontier_{task}.png"))
    return written


def _frontier_panel(ax, points: list, measure: str, metric: str, methods: list[str], task: str) -> None:
    """One measure's frontier: the points per method, the α lines, the non-dominated staircase."""
    from matplotlib import colormaps  # lazy: the CLI starts without matplotlib

    colours = colormaps["tab10"]
    for method in (m for m in methods if any(p.method == m for p in points)):
        colour = colours(methods.index(method) % 10)   # one colour per method in every panel
        evals = [p for p in points if p.method == method and p.kind == EVAL]
        ax.scatter([p.forgetting for p in evals], [p.score for p in evals], color=colour, s=22, alpha=0.8,
                   label=method)
        lines: dict[str, list] = defaultdict(list)
        for p in points:
            if p.method == method and p.kind == INTERPOLATED:
                lines[p.run_id].append(p)
        for j, line in enumerate(lines.values()):
            line.sort(key=lambda p: p.alpha)
            ax.plot([p.forgetting for p in line], [p.score for p in line], "--", color=colour, alpha=0.6,
                    marker="x", markersize=4, label=f"{method} WiSE-FT (α)" if j == 0 else None)
    front = sorted((p for p in points if p.non_dominated), key=lambda p: p.forgetting)
    ax.plot([p.forgetting for p in front], [p.score for p in front], "-", color="black", linewidth=0.8,
            drawstyle="steps-post", label="non-dominated")
    ax.scatter([p.forgetting for p in front], [p.score for p in front], s=70, facecolors="none",
               edgecolors="black", linewidths=1.2)
    ax.set_xlabel(measure_label(measure))
    ax.set_ylabel(score_label(metric))
    ax.set_title(f"{task}: learning–forgetting frontier ({measure})")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7)


def write_interpolation_plots(report: "Report", directory: Path) -> list[Path]:
    """plots/interpolation_<task>.png: each method's mean curve (score vs α and vs ‖θ_α − θ*‖)."""
    curves = interpolation_curves(report)
    written = []
    for task in report.tasks:
        entries = [(m, curves[(m, task)]) for m in report.methods if (m, task) in curves]
        if entries:
            written.append(plot_interpolation([c for _, c in entries], Path(directory) / f"interpolation_{task}.png",
                                              labels=[m for m, _ in entries]))
    return written
