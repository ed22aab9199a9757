"""Statistics of the report: Levene's test for equal variances (Mosbach et al. 2021 compare the
spread of fine-tuning results with it) and the expected best score of n random trials (Zhang et
al. 2021, Fig. 4; Dodge et al. 2019), by bootstrap and in closed form.

    levene([70.1, 71.5, 52.7], [72.0, 72.3, 71.8]).pvalue
    expected_max_bootstrap(scores, n=5)      # (mean, std) of the best of 5 trials drawn with replacement
    expected_max_exact(scores, n=5)          # the same expectation, exactly
    expected_max_exact(losses, n=5, lower_is_better=True)   # the best is the lowest

The best of several trials follows the metric's direction: the highest selection score, or the
lowest one with `lower_is_better` (a loss); ties go to the better target score.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Sequence

import numpy as np
from scipy import stats

__all__ = ["LeveneResult", "levene", "expected_max_exact", "expected_max_bootstrap", "expected_max_curve",
           "sample_std"]


@dataclass(frozen=True)
class LeveneResult:
    statistic: float
    pvalue: float


# |y - centre| equal inside every group up to rounding (e.g. two values per group, whose distances to
# their median or mean are equal): scipy's W would be one rounding error over another.
_ROUNDING = 1e-12


def levene(*groups: Sequence[float], center: str = "median", proportiontocut: float = 0.05) -> LeveneResult:
    """Levene's test that the groups have equal variances (center="median": Brown-Forsythe, the
    default of scipy.stats.levene and the robust choice for few, skewed samples such as seeds).

    scipy.stats.levene computes it, W = (N - k) / (k - 1) * sum_i n_i (Zbar_i - Zbar)^2 /
    sum_ij (Z_ij - Zbar_i)^2 with Z_ij = |Y_ij - center_i| and p = P(F(k - 1, N - k) > W), except
    where W's denominator is zero, which scipy reads through rounding errors: NaN when fewer than two
    groups, a group has fewer than two values, or every Z is equal; W = inf (p = 0) when the Z are
    equal inside each group but not across them.
    """
    arrays = [np.asarray(g, dtype=np.float64).ravel() for g in groups]
    if len(arrays) < 2 or any(len(a) < 2 for a in arrays):
        return LeveneResult(math.nan, math.nan)
    centres = {"median": np.median, "mean": np.mean,
               "trimmed": lambda a: stats.trim_mean(a, proportiontocut)}
    if center not in centres:
        raise ValueError(f"center must be 'median', 'mean' or 'trimmed', got {center!r}")
    z = [np.abs(a - centres[center](a)) for a in arrays]
    tolerance = _ROUNDING * max(float(zi.max()) for zi in z)
    if all(np.ptp(zi) <= tolerance for zi in z):
        if np.ptp([zi.mean() for zi in z]) <= tolerance:
            return LeveneResult(math.nan, math.nan)
        return LeveneResult(math.inf, 0.0)
    result = stats.levene(*arrays, center=center, proportiontocut=proportiontocut)
    return LeveneResult(float(result.statistic), float(result.pvalue))


def _ranked(scores: Sequence[float], selection: Sequence[float] | None,
            lower_is_better: bool = False) -> tuple[np.ndarray, np.ndarray]:
    """Target scores ordered from the worst trial to the best, and each trial's rank in that order.

    The best of a sample is its highest-ranked trial: the best selection (validation) score, ties
    going to the better target score; better is higher, or lower with `lower_is_better`.
    """
    target = np.asarray(scores, dtype=np.float64).ravel()
    sel = target if selection is None else np.asarray(selection, dtype=np.float64).ravel()
    if len(sel) != len(target):
        raise ValueError(f"{len(sel)} selection scores for {len(target)} scores")
    if len(target) == 0:
        raise ValueError("no scores")
    sign = -1.0 if lower_is_better else 1.0
    order = np.lexsort((sign * target, sign * sel))
    rank = np.empty(len(order), dtype=np.int64)
    rank[order] = np.arange(len(order))
    return target[order], rank


def expected_max_exact(scores: Sequence[float], n: int, selection: Sequence[float] | None = None,
                       lower_is_better: bool = False) -> tuple[float, float]:
    """Mean and std of the best of `n` trials drawn with replacement from the N observed ones.

    The best trial is the one with the highest `selection` score (the lowest with
    `lower_is_better`; default: the score itself) and what counts is its `scores` value (e.g.
    select on validation, report test). With the trials sorted from worst to best,
    P(best is the i-th of N) = (i/N)^n - ((i-1)/N)^n (Dodge et al. 2019).
    """
    if n < 1:
        raise ValueError(f"n must be >= 1, got {n}")
    ordered, _ = _ranked(scores, selection, lower_is_better)
    big_n = len(ordered)
    i = np.arange(1, big_n + 1, dtype=np.float64)
    p = (i / big_n) ** n - ((i - 1) / big_n) ** n
    mean = float(np.sum(p * ordered))
    var = max(0.0, float(np.sum(p * ordered ** 2)) - mean ** 2)
    return mean, math.sqrt(var)


def expected_max_bootstrap(scores: Sequence[float], n: int, selection: Sequence[float] | None = None,
                           num_samples: int = 10_000, seed: int = 0, lower_is_better: bool = False
                           ) -> tuple[float, float]:
    """Mean and std over `num_samples` bootstrap draws of n trials of the best trial's score."""
    if n < 1:
        raise ValueError(f"n must be >= 1, got {n}")
    ordered, rank = _ranked(scores, selection, lower_is_better)
    rng = np.random.default_rng(seed)
    draws = rng.integers(0, len(ordered), size=(num_samples, n))
    best = ordered[rank[draws].max(axis=1)]
    return float(best.mean()), float(best.std())


def expected_max_curve(scores: Sequence[float], ns: Sequence[int], selection: Sequence[float] | None = None,
                       num_samples: int = 10_000, seed: int = 0, lower_is_better: bool = False
                       ) -> list[dict[str, float]]:
    """Rows {n, mean, std (bootstrap), exact_mean, exact_std} for each n in `ns`."""
    rows = []
    for n in ns:
        mean, std = expected_max_bootstrap(scores, n, selection, num_samples=num_samples, seed=seed + n,
                                           lower_is_better=lower_is_better)
        exact_mean, exact_std = expected_max_exact(scores, n, selection, lower_is_better)
        rows.append({"n": int(n), "mean": mean, "std": std, "exact_mean": exact_mean, "exact_std": exact_std})
    return rows


def sample_std(values: Sequence[float]) -> float:
    """Standard deviation with ddof=1 (NaN for fewer than two values)."""
    arr = np.asarray(values, dtype=np.float64)
    return float(np.std(arr, ddof=1)) if len(arr) >= 2 else math.nan
