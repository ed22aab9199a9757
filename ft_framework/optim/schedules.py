"""Learning-rate schedules: transformers' (``get_scheduler``), by the same names and keyword arguments.

Two halves with one job, the schedule a run's lr follows:

- what a config may name, checked without torch or transformers (the config layer loads without
  them): ``SCHEDULE_NAMES`` is transformers' ``SchedulerType`` values (a test keeps them equal),
  ``REFUSED_SCHEDULES`` those the loop cannot follow, ``SCHEDULE_KWARGS`` each schedule's
  ``scheduler_specific_kwargs`` and their valid values (``check_schedule``);
- the multiplier itself (``lr_schedule``): transformers' own lambda, read from the ``LambdaLR`` that
  ``get_scheduler`` builds on a one-parameter optimizer whose lr is the run's base lr (polynomial's
  ``lr_end`` and the cosine's ``min_lr`` are absolute lrs, which transformers divides by that lr).
  The trainer sets each group's lr itself (before backward: an overlapped offloaded step runs during
  it), so only the lambda is used, never the scheduler's state.
"""

from __future__ import annotations

from typing import Any, Callable

from ft_framework.errors import UserError

__all__ = ["REFUSED_SCHEDULES", "SCHEDULE_KWARGS", "SCHEDULE_NAMES", "USABLE_SCHEDULES", "check_schedule",
           "lr_schedule"]

# transformers.SchedulerType's values, in its order (transformers 5.24; tests/unit/optim/test_schedules.py).
SCHEDULE_NAMES = ("linear", "cosine", "cosine_with_restarts", "polynomial", "constant", "constant_with_warmup",
                  "inverse_sqrt", "reduce_lr_on_plateau", "cosine_with_min_lr", "cosine_warmup_with_min_lr",
                  "warmup_stable_decay", "greedy")

# Schedules that follow a metric, not the step: the loop sets lr from the step alone, before backward.
REFUSED_SCHEDULES = {
    "reduce_lr_on_plateau": "it lowers lr when an evaluation metric stops improving, and ft-train sets each step's "
                            "lr from the step alone (before backward)",
    "greedy": "it adapts lr to the training loss step by step, and ft-train sets each step's lr from the step "
              "alone (before backward)",
}
USABLE_SCHEDULES = tuple(name for name in SCHEDULE_NAMES if name not in REFUSED_SCHEDULES)

_WARMUP_SHAPES = ("linear", "cosine", "1-sqrt")


def _number(low: float | None = None, high: float | None = None, *, above: float | None = None) -> Callable:
    def check(value: Any) -> str | None:
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            return "a number"
        if (low is not None and value < low) or (high is not None and value > high) or (
                above is not None and value <= above):
            bounds = f"> {above}" if above is not None else (f"in [{low}, {high}]" if high is not None else f">= {low}")
            return f"a number {bounds}"
        return None
    return check


def _integer(low: int) -> Callable:
    def check(value: Any) -> str | None:
        if isinstance(value, bool) or not isinstance(value, int) or value < low:
            return f"an integer >= {low}"
        return None
    return check


def _one_of(*choices: str) -> Callable:
    def check(value: Any) -> str | None:
        return None if value in choices else "one of " + ", ".join(choices)
    return check


_CYCLES = _number(above=0)
_RATE = _number(0, 1)
# Each usable schedule's scheduler_specific_kwargs (transformers' names and meanings) and what each may be.
SCHEDULE_KWARGS: dict[str, dict[str, Callable[[Any], str | None]]] = {
    "linear": {},
    "cosine": {"num_cycles": _CYCLES},
    "cosine_with_restarts": {"num_cycles": _integer(1)},
    "polynomial": {"lr_end": _number(0), "power": _number(above=0)},
    "constant": {},
    "constant_with_warmup": {},
    "inverse_sqrt": {"timescale": _integer(1)},
    "cosine_with_min_lr": {"num_cycles": _CYCLES, "min_lr": _number(0), "min_lr_rate": _RATE},
    "cosine_warmup_with_min_lr": {"num_cycles": _CYCLES, "min_lr": _number(0), "min_lr_rate": _RATE,
                                  "warmup_lr_rate": _RATE},
    "warmup_stable_decay": {"num_decay_steps": _integer(0), "num_stable_steps": _integer(0),
                            "warmup_type": _one_of(*_WARMUP_SHAPES), "decay_type": _one_of(*_WARMUP_SHAPES),
                            "min_lr_ratio": _RATE, "num_cycles": _CYCLES},
}
_FLOOR_KEYS = ("min_lr", "min_lr_rate")  # the cosine-with-floor schedules need exactly one of them
_POLYNOMIAL_LR_END = 1e-7  # transformers' default lr_end of get_polynomial_decay_schedule_with_warmup


def check_schedule(name: str, kwargs: dict[str, Any], base_lr: float | None = None) -> str | None:
    """What is wrong with schedule `name` and its `kwargs` (one line without the key's path), or
    None. With `base_lr`, also the bounds that depend on it (polynomial's lr_end below it)."""
    valid = SCHEDULE_KWARGS[name]
    for key, value in kwargs.items():
        if key not in valid:
            return (f"{name} takes no key {key!r}; valid: {', '.join(valid)}" if valid else
                    f"{name} takes no kwargs (got {key!r})")
        wanted = valid[key](value)
        if wanted is not None:
            return f"{key} of {name} must be {wanted}, got {value!r}"
    if name == "warmup_stable_decay" and "num_decay_steps" not in kwargs:
        return "warmup_stable_decay needs num_decay_steps (the decay phase's length, in optimizer steps)"
    if name in ("cosine_with_min_lr", "cosine_warmup_with_min_lr") and sum(k in kwargs for k in _FLOOR_KEYS) != 1:
        return f"{name} needs exactly one of min_lr (an lr) and min_lr_rate (a fraction of the peak lr)"
    lr_end = kwargs.get("lr_end", _POLYNOMIAL_LR_END)
    if name == "polynomial" and base_lr is not None and not lr_end < base_lr:  # transformers refuses it too
        return f"lr_end of polynomial ({lr_end}) must be below the optimizer's lr ({base_lr})"
    return None


def lr_schedule(name: str, *, warmup_steps: int, total_steps: int, base_lr: float,
                kwargs: dict[str, Any] | None = None) -> Callable[[int], float]:
    """The multiplier of the peak lr at scheduler step s, transformers' own lambda for these arguments.

    ``constant`` with a warm-up is ``constant_with_warmup`` (transformers' ``constant`` ignores
    warm-up; ft-train's ``constant`` always warmed up, and its configs keep their meaning)."""
    import torch
    from transformers.optimization import SchedulerType, get_scheduler

    if name == "constant" and warmup_steps:
        name = "constant_with_warmup"
    kwargs = dict(kwargs or {})
    if name not in {member.value for member in SchedulerType}:
        import transformers

        raise UserError(f"schedule.name {name} is not in the installed transformers {transformers.__version__}; "
                        "upgrade transformers")
    if name == "warmup_stable_decay":
        stable = kwargs.get("num_stable_steps", total_steps - warmup_steps - kwargs["num_decay_steps"])
        if stable < 0:
            raise UserError(f"schedule.kwargs.num_decay_steps ({kwargs['num_decay_steps']}) and the warm-up "
                            f"({warmup_steps} steps) are longer than the run ({total_steps} steps)")
        if "num_stable_steps" in kwargs:
            total_steps = None  # the phases given: transformers warns when both are, and uses the phases
    optimizer = torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=base_lr)
    scheduler = get_scheduler(name, optimizer, num_warmup_steps=warmup_steps, num_training_steps=total_steps,
                              scheduler_specific_kwargs=kwargs)
    return scheduler.lr_lambdas[0]
