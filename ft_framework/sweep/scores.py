"""A report's number for a task's main metric: its unit and its direction, in one place, so that
records, tables, the frontier and the plots agree.

- Unit: a metric where higher is better (accuracy, F1, MCC, the correlations, exact match: fractions
  or correlations, at most 1) is reported in points, x100, as GLUE tables are; a metric where lower
  is better (metrics.LOWER_IS_BETTER: completion_loss, perplexity, mse: losses and errors, with no
  upper bound) as it is, since x100 would turn a completion loss of 1.23 into 123.
- Direction: metrics.LOWER_IS_BETTER owns it (model selection and the failed-run test read it
  there); here are the report's forms of it: the best of several scores, an oriented score whose
  larger value is always the better one, and the words tables and axes use.
- One main metric per task: a task whose runs report different main metrics (a method that sets
  another data.main_metric) has scores that do not compare, and the report refuses it in one line.

    best_score("completion_loss", [2.1, 1.7])   # 1.7
    score_label("accuracy")                     # "accuracy (x100)"
"""

from __future__ import annotations

from typing import Iterable

from ft_framework.errors import UserError, quoted
from ft_framework.metrics import LOWER_IS_BETTER

__all__ = ["best_score", "lower_is_better", "oriented", "score_decimals", "score_label", "score_scale",
           "score_unit", "task_main_metrics"]


def lower_is_better(metric: str | None) -> bool:
    """Whether a smaller value of `metric` is the better one (metrics.LOWER_IS_BETTER)."""
    return metric in LOWER_IS_BETTER


def score_scale(metric: str | None) -> float:
    """What a value of `metric` is multiplied by in the report: 100 (points), or 1 for a loss."""
    return 1.0 if lower_is_better(metric) else 100.0


def score_unit(metric: str | None) -> str:
    """How the report states `metric`'s unit and direction: "x100", or "as is; lower is better"."""
    return "as is; lower is better" if lower_is_better(metric) else "x100"


def score_label(metric: str | None) -> str:
    """An axis or column title for `metric`'s score: "accuracy (x100)", "completion_loss (lower is better)"."""
    name = metric or "score"
    return f"{name} (lower is better)" if lower_is_better(metric) else f"{name} (x100)"


def score_decimals(metric: str | None, points_decimals: int) -> int:
    """Decimals to show a score of `metric` with, where a table shows points with `points_decimals`:
    two more for a loss (a completion loss of 1.234 and 1.236 differ as 58.1 and 58.3 points do)."""
    return points_decimals + 2 if lower_is_better(metric) else points_decimals


def oriented(metric: str | None, score: float) -> float:
    """`score` with its sign turned so that a larger value is always the better one."""
    return -score if lower_is_better(metric) else score


def best_score(metric: str | None, scores: Iterable[float]) -> float:
    """The best of `scores`: the smallest for a lower-is-better metric, else the largest."""
    values = list(scores)
    return min(values) if lower_is_better(metric) else max(values)


def task_main_metrics(pairs: Iterable[tuple[str | None, str | None]]) -> dict[str, str]:
    """Task -> its runs' main metric, from (task, main metric) pairs of finished runs; a task whose
    runs name two main metrics is refused in one line (their scores do not compare)."""
    out: dict[str, str] = {}
    for task, metric in pairs:
        if not task or not metric:
            continue
        if out.setdefault(task, metric) != metric:
            raise UserError(f"ft-report: the runs of task {quoted(task)} report different main metrics "
                            f"({quoted(out[task])} and {quoted(metric)}), whose scores do not compare; give every "
                            "method the same data.main_metric")
    return out
