"""Levene's test against its definition in exact arithmetic, and the expected best of n trials:
closed form against brute-force enumeration, bootstrap against the closed form."""

from __future__ import annotations

import itertools
import math
from fractions import Fraction

import numpy as np
import pytest
import scipy.stats

from ft_framework.sweep.stats import (expected_max_bootstrap, expected_max_curve, expected_max_exact, levene,
                                      sample_std)

# Fixed inputs: RTE-like accuracies of three methods (one with a failed run), unequal sizes.
A = [70.4, 71.5, 52.7, 69.3, 72.2, 70.0, 53.1]
B = [72.0, 72.3, 71.8, 73.1, 72.6]
C = [71.1, 69.8, 72.4, 70.9, 71.6, 68.2]


def _levene_by_hand(groups, center, proportiontocut):
    """W in exact rational arithmetic from its definition, and P(F(k - 1, N - k) > W)."""
    def centre(values):
        xs = sorted(values)
        if center == "median":
            mid = len(xs) // 2
            return xs[mid] if len(xs) % 2 else (xs[mid - 1] + xs[mid]) / 2
        cut = int(proportiontocut * len(xs)) if center == "trimmed" else 0
        kept = xs[cut:len(xs) - cut]
        return sum(kept) / len(kept)

    groups = [[Fraction(v) for v in g] for g in groups]
    z = [[abs(v - centre(g)) for v in g] for g in groups]
    k, total = len(z), sum(len(zi) for zi in z)
    means = [sum(zi) / len(zi) for zi in z]
    grand = sum(sum(zi) for zi in z) / total
    between = sum(len(zi) * (m - grand) ** 2 for zi, m in zip(z, means))
    within = sum((v - m) ** 2 for zi, m in zip(z, means) for v in zi)
    w = float(Fraction(total - k, k - 1) * between / within)
    return w, scipy.stats.f.sf(w, k - 1, total - k)


@pytest.mark.parametrize("center", ["median", "mean", "trimmed"])
@pytest.mark.parametrize("groups", [(A, B), (A, B, C), (B, C), ([3.0, 3.0, 3.0], [1.0, 2.0, 4.0])],
                         ids=["AB", "ABC", "BC", "one-constant"])
def test_levene_equals_its_definition(groups, center):
    ours = levene(*groups, center=center, proportiontocut=0.2)
    w, p = _levene_by_hand(groups, center, 0.2)
    assert ours.statistic == pytest.approx(w, rel=1e-12)
    assert ours.pvalue == pytest.approx(p, rel=1e-10)


# The values the former hand-written test gave (sweep/stats.py before issue 52 delegated W and p to
# scipy.stats.levene), center="median" and "mean" alike.
@pytest.mark.parametrize("center", ["median", "mean"])
@pytest.mark.parametrize("groups, statistic, pvalue", [
    (([64.9, 69.8], [69.3, 74.2]), math.nan, math.nan),   # two seeds each, equal spreads up to rounding
    (([69.6, 72.8], [74.5, 71.3]), math.nan, math.nan),
    (([70.1, 71.5], [72.0, 72.3]), math.inf, 0.0),        # two seeds each, different spreads
    (([1.0, 1.0], [2.0, 2.0]), math.nan, math.nan),       # no spread at all
])
def test_levene_where_w_divides_by_zero(groups, center, statistic, pvalue):
    # scipy.stats.levene reads the first two through rounding errors (W = 1.0, p = 0.42; W = 0, p = 1)
    result = levene(*groups, center=center)
    assert result.statistic == pytest.approx(statistic, nan_ok=True)
    assert result.pvalue == pytest.approx(pvalue, nan_ok=True)


@pytest.mark.parametrize("center, statistic, pvalue", [("median", 2.0922651775443306, 0.1786525102033529),
                                                       ("mean", 15.490395444136743, 0.0027939026714930574)])
def test_levene_values_of_the_former_implementation(center, statistic, pvalue):
    result = levene(A, B, center=center)
    assert (result.statistic, result.pvalue) == pytest.approx((statistic, pvalue), rel=1e-12)


def test_levene_separates_a_spread_out_method():
    spread = [60.0, 75.2, 52.1, 80.3, 66.0, 71.4, 58.8]
    assert levene(spread, B).pvalue < 0.01 < 0.05 < levene(B, C).pvalue


def test_levene_degenerate_inputs():
    assert math.isnan(levene(A).statistic)              # one group
    assert math.isnan(levene(A, [1.0]).pvalue)          # a group of one
    assert math.isnan(levene([1.0, 1.0], [2.0, 2.0]).statistic)  # no spread at all


def _brute_force(scores, n, selection=None):
    """Every one of the N^n equally likely draws with replacement; the best by (selection, score)."""
    sel = scores if selection is None else selection
    values = [max(draw, key=lambda i: (sel[i], scores[i])) for draw in
              itertools.product(range(len(scores)), repeat=n)]
    best = np.array([scores[i] for i in values])
    return best.mean(), best.std()


@pytest.mark.parametrize("n", [1, 2, 3, 4])
def test_expected_max_exact_equals_enumeration(n):
    scores = [71.0, 52.7, 73.1, 70.0, 73.1]   # a tie at the top
    mean, std = expected_max_exact(scores, n)
    ref_mean, ref_std = _brute_force(scores, n)
    assert mean == pytest.approx(ref_mean, abs=1e-12) and std == pytest.approx(ref_std, abs=1e-9)
    # Selecting on validation, counting test: the best-validation run need not have the best test score.
    val = [0.71, 0.60, 0.75, 0.75, 0.70]
    test = [70.0, 50.0, 72.0, 74.0, 69.0]
    mean, std = expected_max_exact(test, n, selection=val)
    ref_mean, ref_std = _brute_force(test, n, selection=val)
    assert mean == pytest.approx(ref_mean, abs=1e-12) and std == pytest.approx(ref_std, abs=1e-9)


def test_expected_max_known_values():
    scores = [1.0, 2.0, 3.0, 4.0]
    assert expected_max_exact(scores, 1)[0] == pytest.approx(2.5)
    # P(max = k) = (k/4)^2 - ((k-1)/4)^2 -> E = (1*1 + 2*3 + 3*5 + 4*7) / 16 = 50/16.
    assert expected_max_exact(scores, 2)[0] == pytest.approx(50 / 16)
    assert expected_max_exact(scores, 200)[0] == pytest.approx(4.0)


@pytest.mark.parametrize("n", [1, 3, 10, 40])
def test_bootstrap_agrees_with_the_closed_form(n):
    rng = np.random.default_rng(7)
    scores = np.round(rng.normal(70, 5, size=25), 1)
    mean, std = expected_max_bootstrap(scores, n, num_samples=40_000, seed=3)
    exact_mean, exact_std = expected_max_exact(scores, n)
    # Within 5 standard errors of the bootstrap mean (a fixed seed: deterministic).
    assert abs(mean - exact_mean) < 5 * exact_std / math.sqrt(40_000) + 1e-12
    assert std == pytest.approx(exact_std, rel=0.05, abs=1e-3)
    assert expected_max_bootstrap(scores, n, num_samples=1000, seed=3) == \
        expected_max_bootstrap(scores, n, num_samples=1000, seed=3)


def test_curve_is_monotone_and_complete():
    rows = expected_max_curve(A, [1, 2, 5, 10], num_samples=5000)
    assert [r["n"] for r in rows] == [1, 2, 5, 10]
    exact = [r["exact_mean"] for r in rows]
    assert exact == sorted(exact) and exact[0] == pytest.approx(np.mean(A))
    assert all(abs(r["mean"] - r["exact_mean"]) < 1.0 for r in rows)


def test_sample_std():
    assert sample_std(B) == pytest.approx(np.std(B, ddof=1))
    assert math.isnan(sample_std([1.0]))
