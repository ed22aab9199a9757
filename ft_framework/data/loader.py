"""The one entry point from a run's data settings to its tokenized TaskData: GLUE (hub or a local
directory) or a user's own files, then the same finishing steps for both.

    spec = cfg.data.task_spec()
    data = load_task_data(spec, tokenizer=tokenizer, **cfg.data.loader_arguments())
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Mapping

from ft_framework.data.examples import TaskData, build_task_data
from ft_framework.data.glue import glue_splits
from ft_framework.data.hub_tables import HubSource
from ft_framework.data.own_data import own_data_splits, own_hub_splits
from ft_framework.data.tasks import TaskSpec, get_task

__all__ = ["load_task_data", "load_glue"]


def load_task_data(spec: TaskSpec, *, tokenizer: Any, max_seq_length: int = 128, source: str = "hub",
                   hub_id: str = "nyu-mll/glue", files: Mapping[str, str | Path] | None = None,
                   split_dev_in_half: bool = False, split_seed: int = 0, max_train_examples: int | None = None,
                   max_eval_examples: int | None = None, hub: HubSource | None = None) -> TaskData:
    """Task ``spec``'s data: from ``files`` (split -> path) or ``hub`` (your own Hub data set) when
    given, else GLUE from ``source`` ("hub", with ``hub_id``, or a GLUE-layout directory)."""
    if files is not None:
        raw = own_data_splits(spec, files)
    elif hub is not None:
        raw = own_hub_splits(spec, hub)
    else:
        raw = glue_splits(spec, source, hub_id)
    return build_task_data(spec, raw, tokenizer=tokenizer, max_seq_length=max_seq_length,
                           split_dev_in_half=split_dev_in_half, split_seed=split_seed,
                           max_train_examples=max_train_examples, max_eval_examples=max_eval_examples)


def load_glue(
    task: str,
    *,
    tokenizer: Any,
    max_seq_length: int = 128,
    source: str = "hub",
    hub_id: str = "nyu-mll/glue",
    split_dev_in_half: bool = False,
    split_seed: int = 0,
    max_train_examples: int | None = None,
    max_eval_examples: int | None = None,
) -> TaskData:
    """Load and tokenize a GLUE task.

    ``source="hub"`` uses ``datasets.load_dataset(hub_id, task)``; any other value is a local directory in
    the original GLUE layout (``<dir>/RTE/train.tsv`` ...) or the task directory itself.
    ``max_train_examples`` / ``max_eval_examples`` keep the first N examples of the train file / of each
    dev file (before any split in half).
    """
    return load_task_data(get_task(task), tokenizer=tokenizer, max_seq_length=max_seq_length, source=source,
                          hub_id=hub_id, split_dev_in_half=split_dev_in_half, split_seed=split_seed,
                          max_train_examples=max_train_examples, max_eval_examples=max_eval_examples)
