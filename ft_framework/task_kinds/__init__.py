"""The kinds of task a run trains, found from its config as the strategies are: each owns its model
class, batch collation, loss and metrics, its forgetting probe and what the memory plan traces of it
(task_kinds/base.py says what a kind implements).

    kind = build_task_kind(cfg)          # cfg.data.task_spec().kind: classification, regression, causal_lm

A fourth kind is one TaskKind subclass with its `name` and `metrics`, registered here
(`register_task_kind`, from its own module or a plug-in's): its name becomes a valid data.problem,
whose tasks read your files as labelled texts (docs/design.md, "How to add a task kind").
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from ft_framework.data.tasks import CAUSAL_LM, TASK_KINDS, register_kind, unregister_kind
from ft_framework.task_kinds.base import (Baseline, EvalContext, LossNormalizer, MemoryRow, MicroBatchLoss, RunContext,
                                         TaskKind, TraceBatch, to_device)
from ft_framework.task_kinds.causal_lm import CausalLMKind
from ft_framework.task_kinds.classification import SequenceClassificationKind

if TYPE_CHECKING:
    from ft_framework.config import RunConfig

__all__ = ["Baseline", "EvalContext", "LossNormalizer", "MemoryRow", "MicroBatchLoss", "RunContext",
           "TASK_KIND_CLASSES", "TaskKind", "TraceBatch", "build_task_kind", "register_task_kind", "to_device",
           "unregister_task_kind"]

# A regression is a classifier with one output: the same module (metrics.py reads which from the spec).
TASK_KIND_CLASSES: dict[str, type[TaskKind]] = {
    "classification": SequenceClassificationKind,
    "regression": SequenceClassificationKind,
    CAUSAL_LM: CausalLMKind,
}


def build_task_kind(cfg: "RunConfig") -> TaskKind:
    """The kind of `cfg`'s task, built for that run."""
    spec = cfg.data.task_spec()
    return TASK_KIND_CLASSES[spec.kind](spec, cfg)


def register_task_kind(cls: type[TaskKind]) -> type[TaskKind]:
    """Makes `cls` the kind of data.problem `cls.name` (its tasks report `cls.metrics`); usable as a
    class decorator. Register before the config is validated, in every process of the run."""
    if not (isinstance(cls, type) and issubclass(cls, TaskKind)):
        raise TypeError(f"{cls!r} is not a TaskKind subclass")
    if cls.name in TASK_KINDS:
        raise ValueError(f"task kind {cls.name!r} is built in")
    register_kind(cls.name, tuple(cls.metrics))
    TASK_KIND_CLASSES[cls.name] = cls
    return cls


def unregister_task_kind(name: str) -> None:
    """Forgets a registered kind (a test's, at its end); a built-in kind stays."""
    if name in TASK_KINDS:
        raise ValueError(f"task kind {name!r} is built in")
    unregister_kind(name)
    TASK_KIND_CLASSES.pop(name, None)
