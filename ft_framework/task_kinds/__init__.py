"""The kinds of task a run trains, found from its config as the strategies are: each owns its model
class, batch collation, loss and metrics (task_kinds/base.py says what a kind implements).

    kind = build_task_kind(cfg)          # cfg.data.task_spec().kind: classification, regression, causal_lm

A fourth kind is one module with a TaskKind subclass, its name in data/tasks.py's TASK_KINDS (the
config's data.problem values) and an entry in TASK_KIND_CLASSES below (docs/design.md).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from ft_framework.data.tasks import CAUSAL_LM, TaskSpec
from ft_framework.models.loading import ModelClass
from ft_framework.task_kinds.base import (Baseline, EvalContext, LossNormalizer, MicroBatchLoss, RunContext,
                                         TaskKind, to_device)
from ft_framework.task_kinds.causal_lm import CausalLMKind
from ft_framework.task_kinds.classification import SequenceClassificationKind

if TYPE_CHECKING:
    from ft_framework.config import RunConfig

__all__ = ["Baseline", "EvalContext", "LossNormalizer", "MicroBatchLoss", "RunContext", "TASK_KIND_CLASSES", "TaskKind",
           "build_task_kind", "model_class_of", "to_device"]

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


def model_class_of(spec: TaskSpec, cfg: "RunConfig") -> ModelClass:
    """What `spec`'s kind loads (the memory plan builds it on the meta device)."""
    return TASK_KIND_CLASSES[spec.kind](spec, cfg).model_class
