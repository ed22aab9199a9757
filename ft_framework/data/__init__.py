"""GLUE data loading: task specs, tokenized datasets and a dynamic-padding collator."""

from ft_framework.data.glue import (
    GLUE_TASKS,
    GlueCollator,
    GlueData,
    TaskSpec,
    TokenizedDataset,
    get_task,
    load_glue,
    make_collator,
)

__all__ = [
    "GLUE_TASKS",
    "GlueCollator",
    "GlueData",
    "TaskSpec",
    "TokenizedDataset",
    "get_task",
    "load_glue",
    "make_collator",
]
