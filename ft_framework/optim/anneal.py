"""Annealing coefficient lambda(t) of RecAdam's Objective Shifting (Chen et al. 2020, §3.2)."""

from __future__ import annotations

import math

ANNEAL_FUNCTIONS = ("sigmoid", "linear", "constant")


def validate_anneal(fun: str, k: float, t0: float, w: float) -> None:
    """Raises ValueError for an annealing setup that cannot be evaluated or is meaningless."""
    if fun not in ANNEAL_FUNCTIONS:
        raise ValueError(f"unknown anneal_fun {fun!r}; valid: {', '.join(ANNEAL_FUNCTIONS)}")
    if not w >= 0:
        raise ValueError(f"anneal_w must be >= 0, got {w}")
    if fun == "sigmoid" and not k >= 0:
        # lambda(t) must rise from ~0 to w; a negative k would anneal the wrong way round.
        raise ValueError(f"anneal_k must be >= 0 (math.inf allowed), got {k}")
    if fun == "linear" and not t0 > 0:
        raise ValueError(f"anneal_t0 must be > 0 for the linear anneal_fun, got {t0}")


def anneal_lambda(fun: str, t: float, k: float, t0: float, w: float) -> float:
    """lambda(t): sigmoid w/(1+exp(-k(t-t0))), linear w*min(1, t/t0), or constant w.

    The sigmoid is evaluated without overflow for any k, including k = inf (a step at t0:
    lambda is 0 before t0, w/2 at t0 and w after it) and k = 0 (constant w/2).
    """
    if fun == "sigmoid":
        d = t - t0
        if d == 0 or k == 0:
            return 0.5 * w
        if math.isinf(k):
            return w if d > 0 else 0.0
        x = k * d
        if x >= 0:
            return w / (1.0 + math.exp(-x))
        e = math.exp(x)  # x < 0: exp cannot overflow, and w*e/(1+e) keeps full precision near 0
        return w * e / (1.0 + e)
    if fun == "linear":
        return w * min(1.0, t / t0)
    if fun == "constant":
        return w
    raise ValueError(f"unknown anneal_fun {fun!r}; valid: {', '.join(ANNEAL_FUNCTIONS)}")
