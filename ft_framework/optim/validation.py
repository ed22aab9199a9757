"""The one place that checks an optimizer's hyper-parameters and predicts whether its pull toward
theta* overshoots. The config (when a YAML file is loaded) and the optimizer (when a param group is
added, and when a schedule changes lr) call these same functions, so the two cannot drift.

    hparams = validate_hparams("recadam", {"lr": 2e-5, "pretrain_cof": 5000})
    factor = pull_overshoot("recadam", hparams)   # >= 1: the pull overshoots theta*
"""

from __future__ import annotations

from typing import Any, Mapping

from ft_framework.errors import did_you_mean, quoted

from ft_framework.optim.anneal import ANNEAL_FUNCTIONS, validate_anneal
from ft_framework.optim.registry import optimizer_factory, optimizer_hparams


class PullOvershootWarning(RuntimeWarning):
    """The pull toward theta* removes at least 1 x (theta - theta*) in one step: it overshoots theta*."""


def optimizer_defaults(name: str) -> dict[str, Any]:
    """Every hyper-parameter of registered optimizer `name` with its default."""
    return dict(optimizer_hparams(name))


def validate_hparams(name: str, hparams: Mapping[str, Any], *, not_here: Mapping[str, str] = {}) -> dict[str, Any]:
    """`hparams` checked against optimizer `name`: unknown names, types (coerced to the default's
    type: int -> float, list -> tuple) and ranges. `not_here` maps names that must be set
    elsewhere to where. Raises ValueError with a one-line message."""
    defaults = optimizer_defaults(name)
    valid = ", ".join(k for k in defaults if k not in not_here)
    out: dict[str, Any] = {}
    for key, value in hparams.items():
        if key in not_here:
            raise ValueError(f"set {quoted(key)} as {not_here[key]}, not in optimizer.hparams")
        if key not in defaults:
            raise ValueError(f"unknown hyper-parameter {quoted(key)} for optimizer {quoted(name)}"
                             f"{did_you_mean(key, defaults)}; valid: {valid}")
        out[key] = _coerce_like(key, value, defaults[key])
    check_ranges({**defaults, **out})
    return out


def check_ranges(hparams: Mapping[str, Any]) -> None:
    """Signs and ranges of whichever of the common hyper-parameters `hparams` holds (None = unset)."""
    def given(key: str) -> bool:
        return hparams.get(key) is not None

    if given("lr") and not hparams["lr"] >= 0:
        raise ValueError(f"lr must be >= 0, got {hparams['lr']}")
    if given("betas"):
        b1, b2 = hparams["betas"]
        if not (0 <= b1 < 1 and 0 <= b2 < 1):
            raise ValueError(f"betas must be in [0, 1), got {list(hparams['betas'])}")
    if given("eps") and not hparams["eps"] > 0:
        raise ValueError(f"eps must be > 0, got {hparams['eps']}")
    if given("weight_decay") and not hparams["weight_decay"] >= 0:
        raise ValueError(f"weight_decay must be >= 0, got {hparams['weight_decay']}")
    if given("pretrain_cof") and not hparams["pretrain_cof"] >= 0:
        raise ValueError(f"pretrain_cof must be >= 0, got {hparams['pretrain_cof']}")
    if given("ewc_lambda") and not hparams["ewc_lambda"] >= 0:
        raise ValueError(f"ewc_lambda must be >= 0, got {hparams['ewc_lambda']}")
    anneal_keys = ("anneal_fun", "anneal_k", "anneal_t0", "anneal_w")
    if given("anneal_fun") and hparams["anneal_fun"] not in ANNEAL_FUNCTIONS:
        raise ValueError(f"unknown anneal_fun {quoted(hparams['anneal_fun'])}; valid: {', '.join(ANNEAL_FUNCTIONS)}")
    if all(given(k) for k in anneal_keys):
        validate_anneal(*(hparams[k] for k in anneal_keys))


def pull_overshoot(name: str, hparams: Mapping[str, Any]) -> float:
    """The largest fraction of (theta - theta*) that one step's pull of optimizer `name` removes,
    over every step t >= 1, with `hparams` (unset ones take the optimizer's defaults); 0.0 for a rule
    without a pull. At 1 or more the pull overshoots theta* and training diverges.

    The rule-specific formula is the optimizer class's own `max_pull(hparams)` (RecAdam:
    lr * (anneal_w - lambda(1)) * pretrain_cof, strongest at t = 1 because lambda only rises, and 0
    for anneal_fun constant; prior_wd: lr * weight_decay). A rule without `max_pull` has no pull.
    """
    merged = {**optimizer_defaults(name), **{k: v for k, v in hparams.items() if v is not None}}
    if merged.get("lr") is None:
        return 0.0
    return rule_max_pull(optimizer_factory(name), merged)


def rule_max_pull(rule: Any, hparams: Mapping[str, Any]) -> float:
    """`rule.max_pull(hparams)` (complete hyper-parameters, e.g. a param group), 0.0 for a rule
    without a pull. The optimizer checks its groups with this, the config with pull_overshoot."""
    max_pull = getattr(rule, "max_pull", None)
    return 0.0 if max_pull is None else float(max_pull(hparams))


def overshoot_message(factor: float, where: str) -> str:
    return (f"{where}: the pull toward the pretrained weights removes {factor:.3g} x (theta - theta*) in "
            "one step (>= 1 overshoots theta* and training diverges); lower lr or the pull's strength (pretrain_cof, "
            "anneal_w, prior_wd's weight_decay, ewc_lambda)")


def _coerce_like(key: str, value: Any, default: Any) -> Any:
    """Brings `value` to the type of the hyper-parameter's default (int -> float, list -> tuple)."""
    if default is None or value is None:
        return value
    if isinstance(default, bool):
        if not isinstance(value, bool):
            raise ValueError(f"hyper-parameter {quoted(key)} must be true or false, got {quoted(value)}")
        return value
    if isinstance(default, (int, float)):
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise ValueError(f"hyper-parameter {quoted(key)} must be a number, got {quoted(value)}")
        return float(value) if isinstance(default, float) else value
    if isinstance(default, (tuple, list)):
        if not isinstance(value, (tuple, list)) or len(value) != len(default):
            raise ValueError(f"hyper-parameter {quoted(key)} must be a list of {len(default)} values like "
                             f"{list(default)}, got {quoted(value)}")
        return tuple(_coerce_like(key, v, d) for v, d in zip(value, default))
    if isinstance(default, str) and not isinstance(value, str):
        raise ValueError(f"hyper-parameter {quoted(key)} must be a string, got {quoted(value)}")
    return value
