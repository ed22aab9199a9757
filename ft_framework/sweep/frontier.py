"""The learning–forgetting frontier of a sweep: the task score against functional forgetting, one
point per evaluation of every finished run (and per α of its interpolation toward θ*, WiSE-FT),
the non-dominated points, forgetting at matched accuracy, and whether ‖θ − θ*‖ predicts it.

    frontier = build_frontier(records, methods, tasks)
    print(frontier.markdown())

How numbers are made (also stated in report.md's section):
- A point's score is the run's main metric on its score split at that evaluation, in the report's
  unit and direction (sweep/scores.py: x100, or a loss as it is, where lower is better); its
  forgetting is a functional measure of the run's forgetting probe (models/forgetting.py for an
  encoder, models/lm_forgetting.py for a decoder).
- The axes: by default every measure of what the model outputs that every point has
  (`mlm_forgetting` for an encoder with an MLM head; `kl_from_pretrained` and `lm_loss_gained` for a
  decoder), else `cka_drift_last`; and, where points scored lm-eval benchmarks (evaluation.benchmarks),
  `benchmark_forgetting`, the mean drop of their scores from θ*'s (models/lm_benchmarks.py), over the
  points that have it; or the one measure asked for. Each axis has its own non-dominated points and
  matched-accuracy table.
- A point is non-dominated when no other point of the task has a score at least as good and a
  forgetting at most as low, with one of the two strictly better. Interpolated points (θ_α) take
  part: each is a model a user could deploy.
- Forgetting at matched accuracy: the target is the score whose ratio to the reference method's best
  score (its best evaluation, any setting and seed, on any axis) is `fraction` (0.99): fraction ×
  best where higher is better, best / fraction where lower is better; per method, the least
  forgetting among its evaluation points that reach the target (as good or better), and again with
  its interpolated points ("+ WiSE-FT").
- Spearman's rank correlation between ‖θ − θ*‖₂ and each functional forgetting measure the points
  recorded (one row per measure), over the evaluation points of the task (and per method with at
  least 3 points). Interpolated points are left out: along one run's α-line both grow by
  construction. And Spearman's ρ between the benchmark drop and each of the KL from θ*, the LM loss
  gained and ‖θ − θ*‖₂ over the evaluation points that scored benchmarks (RL's Razor: does the KL
  predict the forgetting where the distance does not?).
  With at most 8 points the p-value is exact (every ordering), else scipy's t
  approximation.
- θ_1 of an interpolation is the run's reported model, already one of its evaluation points: it is
  not counted twice.
"""

from __future__ import annotations

import math
from collections import defaultdict
from dataclasses import dataclass, field
from typing import Any, Sequence

import numpy as np
from scipy import stats

from ft_framework.errors import UserError
from ft_framework.models.forgetting import CKA_DRIFT_LAST, FORGETTING_MEASURES, MLM_FORGETTING
from ft_framework.models.lm_benchmarks import BENCHMARK_FORGETTING
from ft_framework.models.lm_forgetting import KL_FROM_PRETRAINED, LM_FORGETTING_MEASURES, LM_LOSS_GAINED

from ft_framework.sweep.markdown import fmt, md_table
from ft_framework.sweep.records import RunRecord, read_interpolation, read_metrics
from ft_framework.sweep.scores import lower_is_better, oriented, score_scale, score_unit, task_main_metrics

__all__ = ["AUTO_MEASURE", "BENCHMARK_PREDICTORS", "DEFAULT_MATCHED_FRACTION", "DEFAULT_REFERENCE_METHOD",
           "FALLBACK_MEASURE", "KNOWN_MEASURES", "MEASURE_CHOICES", "MEASURE_NAMES", "MIN_CORRELATION_POINTS",
           "OUTPUT_MEASURES", "Frontier", "FrontierAxis", "FrontierPoint", "build_frontier", "matched_target",
           "measure_label", "non_dominated", "reaches"]

AUTO_MEASURE = "auto"
# Every functional forgetting measure a run records, as their owners name them: an encoder's
# (models/forgetting.py), then a decoder's (models/lm_forgetting.py); the CKA drifts are both's.
KNOWN_MEASURES = tuple(dict.fromkeys((*FORGETTING_MEASURES, *LM_FORGETTING_MEASURES)))
# The benchmarks' forgetting (models/lm_benchmarks.py: the mean drop of the lm-eval scores from θ*'s),
# an axis wherever points have it: evaluations that scored evaluation.benchmarks (each one with
# every_eval, else the last) and θ_α points of an interpolation that scored them.
MEASURE_NAMES = (*KNOWN_MEASURES, BENCHMARK_FORGETTING)
# What the benchmark drop is set against (RL's Razor: does the KL from θ* predict it where ‖θ − θ*‖
# does not?): the probe's output measures, then the distance ("forgetting_distance", as the records name it).
DISTANCE = "forgetting_distance"
BENCHMARK_PREDICTORS = (KL_FROM_PRETRAINED, LM_LOSS_GAINED, DISTANCE)
BENCHMARK_PREDICTOR_TITLES = {KL_FROM_PRETRAINED: "KL from θ* (kl_from_pretrained)",
                              LM_LOSS_GAINED: "LM loss gained (lm_loss_gained)", DISTANCE: "‖θ − θ*‖₂"}
# The default axes: the measures of what the model outputs, each where every point has it. The
# representation drift (CKA) is the axis only when none of them is there (an encoder without an MLM head).
OUTPUT_MEASURES = (MLM_FORGETTING, KL_FROM_PRETRAINED, LM_LOSS_GAINED)
FALLBACK_MEASURE = CKA_DRIFT_LAST
MEASURE_CHOICES = (AUTO_MEASURE, *MEASURE_NAMES)
DEFAULT_REFERENCE_METHOD = "vanilla"
DEFAULT_MATCHED_FRACTION = 0.99
# Spearman's rho of fewer points says nothing (2 points: always ±1).
MIN_CORRELATION_POINTS = 3
EVAL, INTERPOLATED = "eval", "interpolated"
# Up to this many points the p-value is exact (all n! orderings); scipy's t approximation reads
# p = 0 for a perfect rank order of 4 points, whose exact two-sided p is 2/24.
EXACT_P_MAX_POINTS = 8


@dataclass
class FrontierPoint:
    """One model on one axis: a run at one evaluation (kind "eval") or one θ_α of its interpolation."""

    task: str
    method: str
    run_id: str
    seed: Any
    setting: str
    kind: str
    step: int | None
    alpha: float | None
    score: float                 # the report's unit (sweep/scores.py)
    forgetting: float            # the axis's measure
    distance: float | None       # ‖θ − θ*‖₂
    non_dominated: bool = False

    def row(self, measure: str) -> dict[str, Any]:
        return {"task": self.task, "method": self.method, "run_id": self.run_id, "seed": self.seed,
                "setting": self.setting, "kind": self.kind, "step": self.step, "alpha": self.alpha,
                "score": self.score, "measure": measure, "forgetting": self.forgetting, "distance": self.distance,
                "non_dominated": self.non_dominated}


def non_dominated(points: Sequence[tuple[float, float]], *, lower_is_better: bool = False) -> list[bool]:
    """For (score, forgetting) pairs: True where no other pair has a score at least as good and a
    forgetting <=, one of them strictly (a lower forgetting is better; a higher score, or a lower
    one with `lower_is_better`). Sort-based, O(n log n)."""
    sign = -1.0 if lower_is_better else 1.0
    order = sorted(range(len(points)), key=lambda i: (-sign * points[i][0], points[i][1]))
    flags = [False] * len(points)
    best_forgetting = math.inf   # the least forgetting among points of a strictly better score
    i = 0
    while i < len(order):
        j = i
        score = points[order[i]][0]
        while j < len(order) and points[order[j]][0] == score:
            j += 1
        tier = order[i:j]
        least = points[tier[0]][1]   # the tier is sorted by forgetting
        for k in tier:
            flags[k] = points[k][1] == least and least < best_forgetting
        best_forgetting = min(best_forgetting, least)
        i = j
    return flags


def matched_target(metric: str | None, best: float, fraction: float) -> float:
    """The score whose ratio to `best` is `fraction`: fraction × best, or best / fraction where
    lower is better (a completion loss of 2.0 at 0.99: 2.0202)."""
    return best / fraction if lower_is_better(metric) else fraction * best


def reaches(metric: str | None, score: float, target: float) -> bool:
    """Whether `score` is at least as good as `target`."""
    return score <= target if lower_is_better(metric) else score >= target


def measure_label(measure: str) -> str:
    """How a figure's axis names a forgetting measure."""
    if measure == BENCHMARK_FORGETTING:
        return f"benchmark drop from θ* ({measure}, mean over tasks; lower is better)"
    return f"functional forgetting ({measure}; lower is better)"


def _score_text(metric: str | None, value: float | None) -> str:
    if value is None:
        return "–"
    return f"{value:.4f}" if lower_is_better(metric) else f"{value:.2f}"


@dataclass
class FrontierAxis:
    """The frontier on one forgetting measure: its points per task and its matched-accuracy rows."""

    measure: str
    points: dict[str, list[FrontierPoint]]
    matched_rows: list[dict[str, Any]] = field(default_factory=list)


@dataclass
class Frontier:
    """Everything of the frontier section, per axis and task."""

    axes: list[FrontierAxis]
    reference: str | None
    fraction: float
    metrics: dict[str, str]      # task -> its main metric (the score's unit and direction)
    correlation_rows: list[dict[str, Any]]
    left_out: int = 0            # finished runs without forgetting metrics
    notes: list[str] = field(default_factory=list)
    # Spearman's ρ of the benchmark drop against each of BENCHMARK_PREDICTORS (runs that scored benchmarks)
    benchmark_correlation_rows: list[dict[str, Any]] = field(default_factory=list)

    @property
    def measures(self) -> list[str]:
        return [axis.measure for axis in self.axes]

    @property
    def measure(self) -> str:
        """The first axis's measure."""
        return self.axes[0].measure if self.axes else FALLBACK_MEASURE

    @property
    def points(self) -> dict[str, list[FrontierPoint]]:
        """The first axis's points per task."""
        return self.axes[0].points if self.axes else {}

    @property
    def matched_rows(self) -> list[dict[str, Any]]:
        return [row for axis in self.axes for row in axis.matched_rows]

    @property
    def tasks(self) -> list[str]:
        return [t for t in self.metrics if any(axis.points.get(t) for axis in self.axes)]

    def point_rows(self) -> list[dict[str, Any]]:
        return [p.row(axis.measure) for axis in self.axes for t in self.tasks for p in axis.points.get(t, [])]

    def markdown(self) -> str:
        if not self.tasks:
            if not self.left_out:
                return ""
            return "\n".join(["## Learning–forgetting frontier", "",
                              f"No run has functional forgetting metrics ({self.left_out} finished runs without "
                              "them: older runs, or evaluation.forgetting.enabled false).", ""])
        units = "; ".join(f"{t}: {self.metrics[t]}, {score_unit(self.metrics[t])}" for t in self.tasks)
        out = ["## Learning–forgetting frontier", "",
               f"Score (the main metric on the score split; {units}) against functional forgetting "
               f"({', '.join(self.measures)}: each a model's drift from θ* on the probe text"
               + (f", {BENCHMARK_FORGETTING} the mean drop of its lm-eval benchmark scores (evaluation.benchmarks) "
                  "from θ*'s" if BENCHMARK_FORGETTING in self.measures else "")
               + "; lower is better): "
               "one point per evaluation of every finished run and per α of its interpolation toward θ* "
               "(WiSE-FT). A point is non-dominated when no other point has a score at least as good (higher; "
               "lower for a lower-is-better metric) and a forgetting at most as low, one of them strictly. "
               "Figure: plots/frontier_<task>.png, one panel per measure; every point: frontier.csv.", ""]
        if self.left_out:
            out += [f"Left out: {self.left_out} finished runs without forgetting metrics (older runs, or "
                    "evaluation.forgetting.enabled false).", ""]
        out += self.notes + ([""] if self.notes else [])
        for axis in self.axes:
            for task in self.tasks:
                metric = self.metrics[task]
                front = sorted((p for p in axis.points.get(task, []) if p.non_dominated),
                               key=lambda p: -oriented(metric, p.score))
                rows = [[p.method, p.run_id, str(p.seed), p.kind if p.alpha is None else f"α={p.alpha:g}",
                         "–" if p.step is None else str(p.step), _score_text(metric, p.score), f"{p.forgetting:.4g}"]
                        for p in front]
                out += [f"### {task}: non-dominated points on {axis.measure}", "",
                        md_table(["Method", "Run", "Seed", "Model", "Step", f"Score ({metric})", axis.measure],
                                 rows, 5), ""]
        if self.matched_rows:
            out += ["### Forgetting at matched accuracy", "",
                    f"Target: the score whose ratio to the best score of `{self.reference}` (its best evaluation, any "
                    f"setting and seed) is {self.fraction:g}: {self.fraction:g} × that best where higher is better, "
                    f"that best / {self.fraction:g} where lower is better. Per method, the least forgetting among its "
                    "evaluation points that reach the target (as good or better); \"+ WiSE-FT\" also counts its "
                    "interpolated points.", ""]
            for axis in self.axes:
                if not axis.matched_rows:
                    continue
                rows = [[r["task"], r["method"], _score_text(self.metrics[r["task"]], r["target"]),
                         f"{r['reached']}/{r['points']}",
                         "not reached" if r["forgetting"] is None else f"{r['forgetting']:.4g}",
                         _score_text(self.metrics[r["task"]], r["score"]), r.get("run_id") or "–"]
                        for r in axis.matched_rows]
                out += [f"#### {axis.measure}", "",
                        md_table(["Task", "Method", "Target", "Points reaching", f"Least {axis.measure}", "Its score",
                                  "Run"], rows, 2), ""]
        if self.correlation_rows:
            out += ["### Does ‖θ − θ*‖ predict functional forgetting?", "",
                    "Spearman's rank correlation between ‖θ − θ*‖₂ and each functional forgetting measure the runs "
                    f"recorded, over the evaluation points (all methods, then per method with at least "
                    f"{MIN_CORRELATION_POINTS} points). ρ near 1: the distance ranks models as that measure does, so "
                    "watching it tells you something; near 0 or negative: it does not, and a method that shrinks the "
                    "distance need not forget less.", ""]
            rows = [[r["task"], r["measure"], r["method"], str(r["n"]), fmt(r["rho"], 3), fmt(r["pvalue"], 4)]
                    for r in self.correlation_rows]
            out += [md_table(["Task", "Measure", "Points of", "n", "ρ", "p"], rows, 3), ""]
        if self.benchmark_correlation_rows:
            out += ["### Does the KL from θ* predict the benchmark drop? (RL's Razor)", "",
                    f"Spearman's rank correlation between `{BENCHMARK_FORGETTING}` (the mean drop of the benchmark "
                    "scores from θ*'s) and the KL from θ* on the probe text, the LM loss gained on it and ‖θ − θ*‖₂, "
                    "over the evaluation points that scored the benchmarks (all methods, then per method with at "
                    f"least {MIN_CORRELATION_POINTS} points; the θ_α points are left out as above). Shenfeld et al. "
                    "(2025, \"RL's Razor\") found that the KL from the base model predicts how much a fine-tuned "
                    "model forgets where the distance in weights does not: a ρ of the KL near 1 over all methods, "
                    "and one of ‖θ − θ*‖ below it, is that finding here.", ""]
            rows = [[r["task"], BENCHMARK_PREDICTOR_TITLES[r["predictor"]], r["method"], str(r["n"]), fmt(r["rho"], 3),
                     fmt(r["pvalue"], 4)] for r in self.benchmark_correlation_rows]
            out += [md_table(["Task", f"{BENCHMARK_FORGETTING} against", "Points of", "n", "ρ", "p"], rows, 3), ""]
        return "\n".join(out)


def _measures(rec: dict[str, Any]) -> dict[str, float]:
    """An evaluation record's (or a θ_α row's) forgetting measures: its probe's and, where it scored
    benchmarks, their mean drop."""
    out = dict(rec.get("forgetting") or {})
    if rec.get(BENCHMARK_FORGETTING) is not None:
        out[BENCHMARK_FORGETTING] = rec[BENCHMARK_FORGETTING]
    return out


def _eval_points(run: RunRecord) -> list[dict[str, Any]]:
    """(step, score, forgetting dict, distance) of each evaluation that measured forgetting."""
    out = []
    scale = score_scale(run.main_metric)
    for rec in read_metrics(run):
        measures = _measures(rec)
        if rec.get("type") != "eval" or not measures:
            continue
        value = ((rec.get("metrics") or {}).get(run.score_split) or {}).get(run.main_metric)
        if value is None:
            continue
        out.append({"step": int(rec["step"]), "score": scale * float(value), "forgetting": measures,
                    "distance": rec.get(DISTANCE)})
    return out


def _interpolated_points(run: RunRecord) -> list[dict[str, Any]]:
    data = read_interpolation(run)
    if data is None:
        return []
    out = []
    scale = score_scale(run.main_metric)
    for row in data.get("rows", []):
        if float(row["alpha"]) == 1.0:   # θ_1 is the run's reported model: an evaluation point already
            continue
        value = ((row.get("metrics") or {}).get(run.score_split) or {}).get(run.main_metric)
        measures = _measures(row)
        if value is None or not measures:
            continue
        out.append({"alpha": float(row["alpha"]), "score": scale * float(value), "forgetting": measures,
                    "distance": row.get("distance")})
    return out


def _choose_axes(requested: str, raw: list[dict[str, Any]]) -> list[str]:
    if requested not in MEASURE_CHOICES:
        raise UserError(f"ft-report: --forgetting-measure {requested!r} is not known; valid: "
                        f"{', '.join(MEASURE_CHOICES)}")
    if requested != AUTO_MEASURE:
        return [requested]
    axes = [m for m in OUTPUT_MEASURES if raw and all(m in p["forgetting"] for p in raw)]
    probed = any(set(p["forgetting"]) - {BENCHMARK_FORGETTING} for p in raw)   # some point measured the probe
    if probed or not raw:
        axes = axes or [FALLBACK_MEASURE]
    # The benchmarks' axis where some points scored them (without every_eval: each run's last evaluation).
    if any(BENCHMARK_FORGETTING in p["forgetting"] for p in raw):
        axes.append(BENCHMARK_FORGETTING)
    return axes


def build_frontier(records: Sequence[RunRecord], methods: Sequence[str], tasks: Sequence[str], *,
                   measure: str = AUTO_MEASURE, reference: str | None = None,
                   fraction: float = DEFAULT_MATCHED_FRACTION) -> Frontier:
    """The frontier of the finished runs. `reference=None` means `vanilla` where the sweep has it
    (else no matched-accuracy table, with a note); a reference the sweep lacks is an error."""
    if not 0.0 < fraction <= 1.0:
        raise UserError(f"ft-report: --matched-fraction {fraction:g} must be in (0, 1]")
    if reference is not None and reference not in methods:
        raise UserError(f"ft-report: --reference-method {reference!r} is not a method of this sweep; valid: "
                        f"{', '.join(methods)}")
    finished = [r for r in records if r.finished and r.task]
    metric_of = task_main_metrics((r.task, r.main_metric) for r in finished)
    collected: list[tuple[RunRecord, str, dict[str, Any]]] = []
    left_out = 0
    for run in finished:
        evals = _eval_points(run)
        if not evals:
            left_out += 1
            continue
        collected += [(run, EVAL, p) for p in evals] + [(run, INTERPOLATED, p) for p in _interpolated_points(run)]
    chosen = _choose_axes(measure, [p for _, _, p in collected])
    present = [t for t in tasks if any(run.task == t for run, _, _ in collected)]
    notes: list[str] = []
    axes = []
    for name in chosen:
        missing = sum(name not in p["forgetting"] for _, _, p in collected)
        if missing and name == BENCHMARK_FORGETTING:
            notes.append(f"{missing} points without benchmark scores are left out of the {name} axis (a run "
                         "without evaluation.benchmarks.every_eval scores them at its last evaluation only; an "
                         "interpolation scores them where the run configured them).")
        elif missing:
            notes.append(f"{missing} points without {name} are left out of its axis (e.g. no MLM head for "
                         "mlm_forgetting, or an encoder's points on a decoder's measure).")
        points: dict[str, list[FrontierPoint]] = defaultdict(list)
        for run, kind, p in collected:
            if name not in p["forgetting"]:
                continue
            points[run.task].append(FrontierPoint(
                task=run.task, method=run.method, run_id=run.run_id, seed=run.seed, setting=run.setting_label,
                kind=kind, step=p.get("step"), alpha=p.get("alpha"), score=p["score"],
                forgetting=float(p["forgetting"][name]), distance=p.get("distance")))
        for task, pts in points.items():
            lower = lower_is_better(metric_of[task])
            for point, flag in zip(pts, non_dominated([(q.score, q.forgetting) for q in pts], lower_is_better=lower)):
                point.non_dominated = flag
        axes.append(FrontierAxis(measure=name, points={t: points[t] for t in present if t in points}))

    if reference is None and DEFAULT_REFERENCE_METHOD in methods:
        reference = DEFAULT_REFERENCE_METHOD
    if reference is None and present:
        notes.append(f"No matched-accuracy table: the sweep has no method `{DEFAULT_REFERENCE_METHOD}`; name the "
                     f"full fine-tuning method with ft-report --reference-method (one of {', '.join(methods)}).")
    elif present:
        # One target per task, from every evaluation of the reference (an axis may have fewer points).
        targets = {}
        for task in present:
            ref = [p["score"] for run, kind, p in collected if run.task == task and run.method == reference
                   and kind == EVAL]
            if ref:
                metric = metric_of[task]
                targets[task] = matched_target(metric, max(ref, key=lambda s: oriented(metric, s)), fraction)
        for axis in axes:
            axis.matched_rows = _matched_rows(axis, metric_of, methods, reference, fraction, targets)
    by_task: dict[str, list[tuple[RunRecord, dict[str, Any]]]] = defaultdict(list)
    for run, kind, p in collected:
        if kind == EVAL:
            by_task[run.task].append((run, p))
    evals = {t: by_task[t] for t in present}
    correlation = _correlation_rows(evals, methods, [m for m in chosen if m != BENCHMARK_FORGETTING])
    return Frontier(axes=axes, reference=reference, fraction=fraction,
                    metrics={t: metric_of[t] for t in present}, correlation_rows=correlation, left_out=left_out,
                    notes=notes, benchmark_correlation_rows=_benchmark_correlation_rows(evals, methods))


def _matched_rows(axis: FrontierAxis, metric_of: dict[str, str], methods: Sequence[str], reference: str,
                  fraction: float, targets: dict[str, float]) -> list[dict[str, Any]]:
    rows = []
    for task, pts in axis.points.items():
        metric = metric_of[task]
        if task not in targets:
            continue
        target = targets[task]
        for method in methods:
            own = [p for p in pts if p.method == method]
            if not own:
                continue
            for label, kinds in ((method, (EVAL,)), (f"{method} + WiSE-FT", (EVAL, INTERPOLATED))):
                candidates = [p for p in own if p.kind in kinds]
                if label != method and not any(p.kind == INTERPOLATED for p in own):
                    continue
                reaching = [p for p in candidates if reaches(metric, p.score, target)]
                best = min(reaching, key=lambda p: (p.forgetting, -oriented(metric, p.score))) if reaching else None
                rows.append({"task": task, "measure": axis.measure, "method": label, "reference": reference,
                             "fraction": fraction, "target": target, "points": len(candidates),
                             "reached": len(reaching), "forgetting": None if best is None else best.forgetting,
                             "score": None if best is None else best.score,
                             "run_id": None if best is None else best.run_id,
                             "alpha": None if best is None else best.alpha})
    return rows


def _spearman(x: Sequence[float], y: Sequence[float]) -> tuple[float, float]:
    """Spearman's rho and its two-sided p-value: with at most EXACT_P_MAX_POINTS points, the share of
    all n! pairings whose |rho| is at least the observed one (scipy's exact permutation test of
    |rho|, one-sided), else scipy's t approximation. (scipy's two-sided test of rho doubles the
    smaller tail instead, which differs where ties in both x and y make rho's null asymmetric.)"""
    if len(set(x)) < 2 or len(set(y)) < 2:   # a constant has no ranks to correlate
        return math.nan, math.nan
    result = stats.spearmanr(x, y)
    rho, pvalue = float(result.statistic), float(result.pvalue)
    if len(x) <= EXACT_P_MAX_POINTS:
        # Ranks permute with their values, so the test permutes x's ranks (one sample: n! pairings).
        rank_y = stats.rankdata(y) - (len(y) + 1) / 2.0

        def abs_rho(rank_x: np.ndarray, axis: int = -1) -> np.ndarray:   # Pearson's |r| of the ranks
            centred = rank_x - (len(y) + 1) / 2.0
            return np.abs(np.sum(centred * rank_y, axis=axis)
                          / np.sqrt(np.sum(centred ** 2, axis=axis) * np.sum(rank_y ** 2)))

        exact = stats.permutation_test((stats.rankdata(x),), abs_rho, permutation_type="pairings",
                                       vectorized=True, n_resamples=np.inf, alternative="greater")
        pvalue = float(exact.pvalue)
    return rho, pvalue


def _correlation_rows(evals: dict[str, list[tuple[RunRecord, dict[str, Any]]]], methods: Sequence[str],
                      axes: Sequence[str]) -> list[dict[str, Any]]:
    """Per task and measure (the axes first, then every other measure the points recorded): ρ over
    all evaluation points, then over each method's."""
    rows = []
    for task, points in evals.items():
        recorded = {m for _, p in points for m in p["forgetting"] if m in KNOWN_MEASURES}
        measures = [*axes, *(m for m in KNOWN_MEASURES if m in recorded and m not in axes)]
        for measure in measures:
            usable = [(run, p) for run, p in points if p.get("distance") is not None and measure in p["forgetting"]]
            groups = [("all", usable)] + [(m, [(run, p) for run, p in usable if run.method == m]) for m in methods]
            for label, group in groups:
                if len(group) < MIN_CORRELATION_POINTS or (label != "all" and len(group) == len(usable)):
                    continue
                rho, pvalue = _spearman([float(p["distance"]) for _, p in group],
                                        [float(p["forgetting"][measure]) for _, p in group])
                rows.append({"task": task, "measure": measure, "method": label, "n": len(group), "rho": rho,
                             "pvalue": pvalue})
    return rows


def _benchmark_correlation_rows(evals: dict[str, list[tuple[RunRecord, dict[str, Any]]]],
                                methods: Sequence[str]) -> list[dict[str, Any]]:
    """Per task and predictor (BENCHMARK_PREDICTORS the points recorded): Spearman's ρ between it and
    the benchmark drop, over all evaluation points that scored the benchmarks, then over each method's."""
    rows = []
    for task, points in evals.items():
        for predictor in BENCHMARK_PREDICTORS:
            def value(p: dict[str, Any]) -> float | None:
                found = p.get("distance") if predictor == DISTANCE else p["forgetting"].get(predictor)
                return None if found is None else float(found)

            usable = [(run, p) for run, p in points if BENCHMARK_FORGETTING in p["forgetting"] and value(p) is not None]
            groups = [("all", usable)] + [(m, [(run, p) for run, p in usable if run.method == m]) for m in methods]
            for label, group in groups:
                if len(group) < MIN_CORRELATION_POINTS or (label != "all" and len(group) == len(usable)):
                    continue
                rho, pvalue = _spearman([value(p) for _, p in group],
                                        [float(p["forgetting"][BENCHMARK_FORGETTING]) for _, p in group])
                rows.append({"task": task, "predictor": predictor, "method": label, "n": len(group), "rho": rho,
                             "pvalue": pvalue})
    return rows
