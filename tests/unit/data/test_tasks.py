"""TaskSpec: the one owner of each GLUE task's facts, and the readers that must agree with it."""

from __future__ import annotations

import typing

import numpy as np
import pytest

from ft_framework.config import GLUE_TASK_NAMES, DataConfig
from ft_framework.data.tasks import GLUE_TASKS, TaskSpec, get_task
from ft_framework.errors import UserError
from ft_framework.metrics import compute_metrics
from ft_framework.sweep.report import LARGE_TASKS, SMALL_TASKS, TASK_ORDER, _size_title


def test_titles_sizes_and_metrics():
    titles = {n: s.title for n, s in GLUE_TASKS.items()}
    assert titles == {"cola": "CoLA", "sst2": "SST-2", "mrpc": "MRPC", "qqp": "QQP", "stsb": "STS-B",
                      "mnli": "MNLI", "qnli": "QNLI", "rte": "RTE", "wnli": "WNLI"}
    assert get_task("sst2").train_size == 67_000 and get_task("rte").train_size == 2_500
    assert get_task("cola").metrics == ("mcc", "accuracy")
    assert get_task("qqp").metrics == ("f1", "accuracy", "accuracy_f1_avg")
    assert get_task("stsb").metrics == ("pearson", "spearmanr", "pearson_spearman_avg")
    assert get_task("stsb").is_regression and not get_task("rte").is_regression
    assert [get_task(t).size_title for t in ("sst2", "rte", "wnli")] == ["SST-2 67k", "RTE 2.5k", "WNLI 0.6k"]


def test_main_metric_must_be_one_of_the_metrics():
    with pytest.raises(ValueError, match="main_metric 'f1' is not in \\('accuracy',\\)"):
        TaskSpec("x", "X", ("sentence",), ("0", "1"), ("validation",), ("accuracy",), "f1", 10)


def test_unknown_task_suggests_and_lists_the_valid_ones():
    with pytest.raises(UserError, match="unknown GLUE task 'sst3' \\(did you mean 'sst2'\\?\\); valid tasks: cola"):
        get_task("sst3")


@pytest.mark.parametrize("task", sorted(GLUE_TASKS))
def test_compute_metrics_reports_exactly_the_specs_metrics_in_order(task):
    spec = get_task(task)
    labels = np.array([0.5, 1.0, 3.0, 4.5], dtype=np.float32) if spec.is_regression else np.array([0, 1, 1, 0])
    preds = labels[:, None] if spec.is_regression else np.eye(spec.num_labels)[np.array([0, 1, 0, 0])]
    assert tuple(compute_metrics(task, preds, labels)) == spec.metrics


def test_the_config_and_the_report_read_the_specs():
    assert GLUE_TASK_NAMES == tuple(GLUE_TASKS)
    # `GlueTask | None`: unset for your own data (data.source: files).
    glue_task, none = typing.get_args(DataConfig.model_fields["task"].annotation)
    assert typing.get_args(glue_task) == GLUE_TASK_NAMES and none is type(None)
    assert TASK_ORDER == ("mnli", "qqp", "qnli", "sst2", "cola", "stsb", "mrpc", "rte", "wnli")
    assert set(LARGE_TASKS) == {t for t, s in GLUE_TASKS.items() if s.train_size > 10_000}
    assert set(SMALL_TASKS) == {t for t, s in GLUE_TASKS.items() if s.train_size < 10_000} - {"wnli"}
    assert _size_title("mnli") == "MNLI 393k" and _size_title("not-a-task") == "not-a-task"
