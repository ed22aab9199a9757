"""Learning-rate schedules (optim/schedules.py): transformers' names, keyword arguments and values,
step for step against transformers' own schedulers driving a real torch optimizer."""

from __future__ import annotations

import inspect

import pytest
import torch
from transformers.optimization import (TYPE_TO_SCHEDULER_FUNCTION, SchedulerType, get_cosine_schedule_with_warmup,
                                       get_scheduler)

from ft_framework.errors import UserError
from ft_framework.optim.schedules import (REFUSED_SCHEDULES, SCHEDULE_KWARGS, SCHEDULE_NAMES, USABLE_SCHEDULES,
                                          check_schedule, lr_schedule)

# Two groups with their own peak lrs (layer-wise decay gives each group its own): awkward values.
PEAKS = (3e-4, 7.3e-5)


def _optimizer() -> torch.optim.Optimizer:
    weights = [torch.nn.Parameter(torch.ones(3)), torch.nn.Parameter(torch.ones(5))]
    return torch.optim.AdamW([{"params": [w], "lr": lr} for w, lr in zip(weights, PEAKS)], lr=PEAKS[0])


def _transformers_lrs(scheduler, optimizer, total: int) -> list[list[float]]:
    """Each group's lr at transformers' steps 1..total (the optimizer steps before each scheduler step,
    as the Trainer does)."""
    lrs = []
    for _ in range(total):
        optimizer.step()
        scheduler.step()
        lrs.append([group["lr"] for group in optimizer.param_groups])
    return lrs


def _our_lrs(schedule, total: int) -> list[list[float]]:
    """Each group's lr at ft-train's steps 0..total-1: the peak times the schedule's value for k + 1."""
    return [[peak * schedule(step + 1) for peak in PEAKS] for step in range(total)]


def test_names_are_transformers_scheduler_types():
    assert SCHEDULE_NAMES == tuple(member.value for member in SchedulerType)
    assert set(USABLE_SCHEDULES) | set(REFUSED_SCHEDULES) == set(SCHEDULE_NAMES)


@pytest.mark.parametrize("name", USABLE_SCHEDULES)
def test_every_kwarg_is_one_transformers_takes(name):
    taken = inspect.signature(TYPE_TO_SCHEDULER_FUNCTION[SchedulerType(name)]).parameters
    assert set(SCHEDULE_KWARGS[name]) <= set(taken) - {"optimizer", "num_warmup_steps", "num_training_steps",
                                                        "last_epoch"}


@pytest.mark.parametrize("total,warmup,cycles", [(23, 7, 0.5), (17, 0, 0.5), (13, 13, 0.5), (29, 4, 1.75)])
def test_cosine_with_warmup_equals_get_cosine_schedule_with_warmup_step_for_step(total, warmup, cycles):
    optimizer = _optimizer()
    theirs = _transformers_lrs(get_cosine_schedule_with_warmup(optimizer, warmup, total, num_cycles=cycles),
                               optimizer, total)
    ours = _our_lrs(lr_schedule("cosine", warmup_steps=warmup, total_steps=total, base_lr=PEAKS[0],
                                kwargs={} if cycles == 0.5 else {"num_cycles": cycles}), total)
    assert ours == theirs  # bit for bit: the same lambda times the same peak
    assert min(ours[0]) > 0  # ft-train's convention, step k at the value for k + 1: the first step moves


CASES = [
    ("linear", {}), ("cosine", {"num_cycles": 0.8}), ("cosine_with_restarts", {"num_cycles": 3}),
    ("polynomial", {"lr_end": 1e-6, "power": 2.0}), ("constant", {}), ("constant_with_warmup", {}),
    ("inverse_sqrt", {"timescale": 5}), ("inverse_sqrt", {}),
    ("cosine_with_min_lr", {"min_lr": 2e-5}), ("cosine_with_min_lr", {"min_lr_rate": 0.1, "num_cycles": 0.4}),
    ("cosine_warmup_with_min_lr", {"min_lr_rate": 0.05, "warmup_lr_rate": 0.2}),
    ("warmup_stable_decay", {"num_decay_steps": 6}),
    ("warmup_stable_decay", {"num_decay_steps": 5, "num_stable_steps": 4, "warmup_type": "1-sqrt",
                             "decay_type": "linear", "min_lr_ratio": 0.1}),
]


@pytest.mark.filterwarnings("ignore:Both num_training_steps and num_stable_steps")  # transformers', given both
@pytest.mark.parametrize("name,kwargs", CASES, ids=[f"{n}-{i}" for i, (n, _) in enumerate(CASES)])
def test_every_schedule_equals_transformers_get_scheduler(name, kwargs):
    total, warmup = 19, 3
    assert check_schedule(name, kwargs, base_lr=PEAKS[0]) is None
    optimizer = _optimizer()
    scheduler = get_scheduler(name, optimizer, num_warmup_steps=warmup, num_training_steps=total,
                              scheduler_specific_kwargs=kwargs)
    theirs = _transformers_lrs(scheduler, optimizer, total)
    ours = _our_lrs(lr_schedule(name, warmup_steps=warmup if name != "constant" else 0, total_steps=total,
                                base_lr=PEAKS[0], kwargs=kwargs), total)
    assert ours == theirs


def test_warmup_stable_decay_longer_than_the_run_is_refused():
    with pytest.raises(UserError, match=r"num_decay_steps \(8\) and the warm-up \(3 steps\) are longer than the "
                                        r"run \(10 steps\)"):
        lr_schedule("warmup_stable_decay", warmup_steps=3, total_steps=10, base_lr=1e-3, kwargs={"num_decay_steps": 8})


def test_constant_with_a_warm_up_warms_up():
    """ft-train's constant schedule always warmed up (transformers' constant ignores warm-up): with a
    warm-up it is constant_with_warmup, without one constant."""
    warm = lr_schedule("constant", warmup_steps=4, total_steps=10, base_lr=1e-3)
    assert [warm(s) for s in (1, 2, 4, 9)] == [0.25, 0.5, 1.0, 1.0]
    assert [lr_schedule("constant", warmup_steps=0, total_steps=10, base_lr=1e-3)(s) for s in (0, 1, 10)] == [1, 1, 1]


@pytest.mark.parametrize("total,warmup", [(16, 3), (16, 0), (10, 1), (5, 5), (7, 9)])
def test_linear_and_constant_are_the_formulas_ft_train_had(total, warmup):
    """Before it took transformers' schedules, ft-train's own: warm-up s / w, then (total - s) /
    (total - w) or 1. A recorded run and a checkpoint resumed mid-run keep their lrs."""
    for name in ("linear", "constant"):
        schedule = lr_schedule(name, warmup_steps=warmup, total_steps=total, base_lr=1e-3)
        for step in range(1, total + 1):
            old = (step / warmup if warmup and step < warmup else
                   1.0 if name == "constant" else max(0.0, (total - step) / max(1, total - warmup)))
            assert schedule(step) == old, (name, step)


@pytest.mark.parametrize("name,kwargs,message", [
    ("linear", {"num_cycles": 2}, "linear takes no kwargs (got 'num_cycles')"),
    ("cosine", {"min_lr": 0.1}, "cosine takes no key 'min_lr'; valid: num_cycles"),
    ("cosine", {"num_cycles": 0}, "num_cycles of cosine must be a number > 0, got 0"),
    ("cosine", {"num_cycles": "half"}, "num_cycles of cosine must be a number, got 'half'"),
    ("cosine_with_restarts", {"num_cycles": 1.5}, "must be an integer >= 1, got 1.5"),
    ("cosine_with_min_lr", {}, "needs exactly one of min_lr (an lr) and min_lr_rate"),
    ("cosine_with_min_lr", {"min_lr": 1e-6, "min_lr_rate": 0.1}, "needs exactly one of min_lr"),
    ("cosine_warmup_with_min_lr", {"min_lr_rate": 1.5}, "min_lr_rate of cosine_warmup_with_min_lr must be a number "
                                                        "in [0, 1], got 1.5"),
    ("warmup_stable_decay", {}, "warmup_stable_decay needs num_decay_steps"),
    ("warmup_stable_decay", {"num_decay_steps": 3, "decay_type": "exp"},
     "decay_type of warmup_stable_decay must be one of linear, cosine, 1-sqrt, got 'exp'"),
    ("inverse_sqrt", {"timescale": True}, "timescale of inverse_sqrt must be an integer >= 1, got True"),
    ("polynomial", {"lr_end": 1e-3}, "lr_end of polynomial (0.001) must be below the optimizer's lr (0.0003)"),
])
def test_check_schedule_names_what_is_wrong(name, kwargs, message):
    problem = check_schedule(name, kwargs, base_lr=PEAKS[0])
    assert problem is not None and message in problem, problem
