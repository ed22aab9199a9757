"""A task's data: task specs (tasks.py); reading files (readers.py), GLUE (glue.py) or a user's own
files (own_data.py) into raw splits, tokenized by examples.py, all through loader.py; collation
(examples.py); and which examples each rank sees (sharding.py).

The task specs are imported eagerly and the rest on first use, so ``from ft_framework.data import
get_task`` (the config does this) does not import torch.
"""

from __future__ import annotations

import importlib
from typing import Any

from ft_framework.data.tasks import GLUE_TASK_NAMES, GLUE_TASKS, TaskSpec, get_task

_LAZY = {
    "Collator": "examples", "TaskData": "examples", "TokenizedDataset": "examples", "make_collator": "examples",
    "load_glue": "loader", "load_task_data": "loader",
    "epoch_batches": "sharding", "eval_shard": "sharding", "restore_order": "sharding",
    "batches_per_epoch": "sharding",
}

__all__ = ["GLUE_TASKS", "GLUE_TASK_NAMES", "TaskSpec", "get_task", *_LAZY]


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        return getattr(importlib.import_module(f"ft_framework.data.{_LAZY[name]}"), name)
    raise AttributeError(f"module 'ft_framework.data' has no attribute {name!r}")
