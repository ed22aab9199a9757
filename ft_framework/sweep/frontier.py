"""The learning–forgetting frontier of a sweep: the task score against functional forgetting, one
point per evaluation of every finished run (and per α of its interpolation toward θ*, WiSE-FT),
the non-dominated points, forgetting at matched accuracy, and whether ‖θ − θ*‖ predicts it.

    frontier = build_frontier(records, methods, tasks)
    print(frontier.markdown())

How numbers are made (also stated in report.md's section):
- A point's score is the run's main metric on its score split (the report's score, x100) at that
  evaluation; its forgetting is one functional measure of models/forgetting.py: `mlm_forgetting`
  when every point has it, else `cka_drift_last` (or the measure asked for).
- A point is non-dominated when no other point of the task has a score at least as high and a
  forgetting at most as low, with one of the two strictly better. Interpolated points (θ_α) take
  part: each is a model a user could deploy.
- Forgetting at matched accuracy: the target is `fraction` (0.99) of the reference method's best
  score (its best evaluation, any setting and seed); per method, the least forgetting among its
  evaluation points that reach the target, and again with its interpolated points ("+ WiSE-FT").
- Spearman's rank correlation between ‖θ − θ*‖₂ and the functional forgetting, over the
  evaluation points of the task (and per method with at least 3 points). Interpolated points are
  left out: along one run's α-line both grow by construction. With at most 8 points the p-value is
  exact (every ordering), else scipy's t approximation.
- θ_1 of an interpolation is the run's reported model, already one of its evaluation points: it is
  not counted twice.
"""

from __future__ import annotations

import itertools
import math
from collections import defaultdict
from dataclasses import dataclass, field
from typing import Any, Sequence

import numpy as np
from scipy import stats

from ft_framework.errors import UserError
from ft_framework.models.forgetting import CKA_DRIFT_LAST, FORGETTING_MEASURES, MLM_FORGETTING

from ft_framework.sweep.markdown import fmt, md_table
from ft_framework.sweep.records import RunRecord, read_interpolation, read_metrics

__all__ = ["AUTO_MEASURE", "DEFAULT_MATCHED_FRACTION", "DEFAULT_REFERENCE_METHOD", "MEASURE_CHOICES",
           "MIN_CORRELATION_POINTS", "Frontier", "FrontierPoint", "build_frontier", "non_dominated"]

AUTO_MEASURE = "auto"
MEASURE_CHOICES = (AUTO_MEASURE, *FORGETTING_MEASURES)
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
    """One model: a run at one evaluation (kind "eval") or one θ_α of its interpolation."""

    task: str
    method: str
    run_id: str
    seed: Any
    setting: str
    kind: str
    step: int | None
    alpha: float | None
    score: float                 # x100
    forgetting: float
    distance: float | None       # ‖θ − θ*‖₂
    non_dominated: bool = False

    def row(self, measure: str) -> dict[str, Any]:
        return {"task": self.task, "method": self.method, "run_id": self.run_id, "seed": self.seed,
                "setting": self.setting, "kind": self.kind, "step": self.step, "alpha": self.alpha,
                "score": self.score, "measure": measure, "forgetting": self.forgetting, "distance": self.distance,
                "non_dominated": self.non_dominated}


def non_dominated(points: Sequence[tuple[float, float]]) -> list[bool]:
    """For (score, forgetting) pairs: True where no other pair has score >= and forgetting <=, one
    of them strictly (higher score and lower forgetting are better). Sort-based, O(n log n)."""
    order = sorted(range(len(points)), key=lambda i: (-points[i][0], points[i][1]))
    flags = [False] * len(points)
    best_forgetting = math.inf   # the least forgetting among points of strictly higher score
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


@dataclass
class Frontier:
    """Everything of the frontier section, per task."""

    measure: str
    reference: str | None
    fraction: float
    points: dict[str, list[FrontierPoint]]
    matched_rows: list[dict[str, Any]]
    correlation_rows: list[dict[str, Any]]
    left_out: int = 0            # finished runs without forgetting metrics
    notes: list[str] = field(default_factory=list)

    @property
    def tasks(self) -> list[str]:
        return [t for t, pts in self.points.items() if pts]

    def point_rows(self) -> list[dict[str, Any]]:
        return [p.row(self.measure) for t in self.tasks for p in self.points[t]]

    def markdown(self) -> str:
        if not self.tasks:
            if not self.left_out:
                return ""
            return "\n".join(["## Learning–forgetting frontier", "",
                              f"No run has functional forgetting metrics ({self.left_out} finished runs without "
                              "them: older runs, or evaluation.forgetting.enabled false).", ""])
        out = ["## Learning–forgetting frontier", "",
               f"Score (the main metric on the score split, x100) against functional forgetting ({self.measure}, "
               "models' drift from θ* on the probe text; lower is better): one point per evaluation of every "
               "finished run and per α of its interpolation toward θ* (WiSE-FT). A point is non-dominated when "
               "no other point has a score at least as high and a forgetting at most as low, one of them strictly. "
               "Figure: plots/frontier_<task>.png; every point: frontier.csv.", ""]
        if self.left_out:
            out += [f"Left out: {self.left_out} finished runs without forgetting metrics (older runs, or "
                    "evaluation.forgetting.enabled false).", ""]
        out += self.notes + ([""] if self.notes else [])
        for task in self.tasks:
            front = sorted((p for p in self.points[task] if p.non_dominated), key=lambda p: -p.score)
            rows = [[p.method, p.run_id, str(p.seed), p.kind if p.alpha is None else f"α={p.alpha:g}",
                     "–" if p.step is None else str(p.step), f"{p.score:.2f}", f"{p.forgetting:.4g}"]
                    for p in front]
            out += [f"### {task}: non-dominated points", "",
                    md_table(["Method", "Run", "Seed", "Model", "Step", "Score", self.measure], rows, 5), ""]
        if self.matched_rows:
            out += ["### Forgetting at matched accuracy", "",
                    f"Target: {self.fraction:g} × the best score of `{self.reference}` (its best evaluation, any "
                    "setting and seed). Per method, the least forgetting among its evaluation points that reach the "
                    "target; \"+ WiSE-FT\" also counts its interpolated points.", ""]
            rows = [[r["task"], r["method"], f"{r['target']:.2f}", r["reached"] if isinstance(r["reached"], str)
                     else f"{r['reached']}/{r['points']}",
                     "not reached" if r["forgetting"] is None else f"{r['forgetting']:.4g}",
                     "–" if r["score"] is None else f"{r['score']:.2f}", r.get("run_id") or "–"]
                    for r in self.matched_rows]
            out += [md_table(["Task", "Method", "Target", "Points reaching", f"Least {self.measure}", "Its score",
                         "Run"], rows, 2), ""]
        if self.correlation_rows:
            out += ["### Does ‖θ − θ*‖ predict functional forgetting?", "",
                    f"Spearman's rank correlation between ‖θ − θ*‖₂ and {self.measure} over the evaluation points "
                    f"(all methods, then per method with at least {MIN_CORRELATION_POINTS} points). ρ near 1: the "
                    "distance ranks models as their functional forgetting does, so watching it tells you something; "
                    "near 0 or negative: it does not, and a method that shrinks the distance need not forget less.",
                    ""]
            rows = [[r["task"], r["method"], str(r["n"]), fmt(r["rho"], 3), fmt(r["pvalue"], 4)]
                    for r in self.correlation_rows]
            out += [md_table(["Task", "Points of", "n", "ρ", "p"], rows, 2), ""]
        return "\n".join(out)


def _eval_points(run: RunRecord) -> list[dict[str, Any]]:
    """(step, score, forgetting dict, distance) of each evaluation that measured forgetting."""
    out = []
    for rec in read_metrics(run):
        if rec.get("type") != "eval" or not rec.get("forgetting"):
            continue
        value = ((rec.get("metrics") or {}).get(run.score_split) or {}).get(run.main_metric)
        if value is None:
            continue
        out.append({"step": int(rec["step"]), "score": 100.0 * float(value), "forgetting": rec["forgetting"],
                    "distance": rec.get("forgetting_distance")})
    return out


def _interpolated_points(run: RunRecord) -> list[dict[str, Any]]:
    data = read_interpolation(run)
    if data is None:
        return []
    out = []
    for row in data.get("rows", []):
        if float(row["alpha"]) == 1.0:   # θ_1 is the run's reported model: an evaluation point already
            continue
        value = ((row.get("metrics") or {}).get(run.score_split) or {}).get(run.main_metric)
        if value is None or not row.get("forgetting"):
            continue
        out.append({"alpha": float(row["alpha"]), "score": 100.0 * float(value), "forgetting": row["forgetting"],
                    "distance": row.get("distance")})
    return out


def _choose_measure(requested: str, raw: list[dict[str, Any]]) -> str:
    if requested not in MEASURE_CHOICES:
        raise UserError(f"ft-report: --forgetting-measure {requested!r} is not known; valid: "
                        f"{', '.join(MEASURE_CHOICES)}")
    if requested != AUTO_MEASURE:
        return requested
    if raw and all(MLM_FORGETTING in p["forgetting"] for p in raw):
        return MLM_FORGETTING
    return CKA_DRIFT_LAST


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
    collected: list[tuple[RunRecord, str, dict[str, Any]]] = []
    left_out = 0
    for run in finished:
        evals = _eval_points(run)
        if not evals:
            left_out += 1
            continue
        collected += [(run, EVAL, p) for p in evals] + [(run, INTERPOLATED, p) for p in _interpolated_points(run)]
    chosen = _choose_measure(measure, [p for _, _, p in collected])
    notes = []
    missing = sum(chosen not in p["forgetting"] for _, _, p in collected)
    if missing:
        notes.append(f"{missing} points without {chosen} are left out (e.g. no MLM head for mlm_forgetting).")
    points: dict[str, list[FrontierPoint]] = defaultdict(list)
    for run, kind, p in collected:
        if chosen not in p["forgetting"]:
            continue
        points[run.task].append(FrontierPoint(
            task=run.task, method=run.method, run_id=run.run_id, seed=run.seed, setting=run.setting_label,
            kind=kind, step=p.get("step"), alpha=p.get("alpha"), score=p["score"],
            forgetting=float(p["forgetting"][chosen]), distance=p.get("distance")))
    for pts in points.values():
        for point, flag in zip(pts, non_dominated([(q.score, q.forgetting) for q in pts])):
            point.non_dominated = flag
    ordered = {t: points[t] for t in tasks if t in points}

    if reference is None and DEFAULT_REFERENCE_METHOD in methods:
        reference = DEFAULT_REFERENCE_METHOD
    matched: list[dict[str, Any]] = []
    if reference is None and ordered:
        notes.append(f"No matched-accuracy table: the sweep has no method `{DEFAULT_REFERENCE_METHOD}`; name the "
                     f"full fine-tuning method with ft-report --reference-method (one of {', '.join(methods)}).")
    elif ordered:
        matched = _matched_rows(ordered, methods, reference, fraction)
    correlation = _correlation_rows(ordered, methods)
    return Frontier(measure=chosen, reference=reference, fraction=fraction, points=ordered, matched_rows=matched,
                    correlation_rows=correlation, left_out=left_out, notes=notes)


def _matched_rows(points: dict[str, list[FrontierPoint]], methods: Sequence[str], reference: str,
                  fraction: float) -> list[dict[str, Any]]:
    rows = []
    for task, pts in points.items():
        ref = [p.score for p in pts if p.method == reference and p.kind == EVAL]
        if not ref:
            continue
        target = fraction * max(ref)
        for method in methods:
            own = [p for p in pts if p.method == method]
            if not own:
                continue
            for label, kinds in ((method, (EVAL,)), (f"{method} + WiSE-FT", (EVAL, INTERPOLATED))):
                candidates = [p for p in own if p.kind in kinds]
                if label != method and not any(p.kind == INTERPOLATED for p in own):
                    continue
                reaching = [p for p in candidates if p.score >= target]
                best = min(reaching, key=lambda p: (p.forgetting, -p.score)) if reaching else None
                rows.append({"task": task, "method": label, "reference": reference, "fraction": fraction,
                             "target": target, "points": len(candidates), "reached": len(reaching),
                             "forgetting": None if best is None else best.forgetting,
                             "score": None if best is None else best.score,
                             "run_id": None if best is None else best.run_id,
                             "alpha": None if best is None else best.alpha})
    return rows


def _exact_spearman_pvalue(x: Sequence[float], y: Sequence[float], rho: float) -> float:
    """Two-sided permutation p-value of Spearman's rho: the share of the orderings of y whose rho
    is at least as far from 0 as the observed one."""
    rx = stats.rankdata(x) - (len(x) + 1) / 2.0
    orderings = np.array(list(itertools.permutations(stats.rankdata(y))))
    orderings -= orderings.mean(axis=1, keepdims=True)
    # Every ordering has y's ranks, so the same spread: one norm for all.
    r = orderings @ rx / (np.linalg.norm(orderings[0]) * np.linalg.norm(rx))
    return float(np.mean(np.abs(r) >= abs(rho) - 1e-12))


def _correlation_rows(points: dict[str, list[FrontierPoint]], methods: Sequence[str]) -> list[dict[str, Any]]:
    rows = []
    for task, pts in points.items():
        usable = [p for p in pts if p.kind == EVAL and p.distance is not None]
        groups = [("all", usable)] + [(m, [p for p in usable if p.method == m]) for m in methods]
        for label, group in groups:
            if len(group) < MIN_CORRELATION_POINTS or (label != "all" and len(group) == len(usable)):
                continue
            distances = [p.distance for p in group]
            forgetting = [p.forgetting for p in group]
            if len(set(distances)) < 2 or len(set(forgetting)) < 2:   # a constant has no ranks to correlate
                rho, pvalue = math.nan, math.nan
            else:
                result = stats.spearmanr(distances, forgetting)
                rho, pvalue = float(result.statistic), float(result.pvalue)
                if len(group) <= EXACT_P_MAX_POINTS:
                    pvalue = _exact_spearman_pvalue(distances, forgetting, rho)
            rows.append({"task": task, "method": label, "n": len(group), "rho": rho, "pvalue": pvalue})
    return rows
