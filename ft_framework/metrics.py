"""Task metrics, the majority-class (regression: mean) baseline and the failed-run test of Mosbach et
al. (2020), for GLUE tasks and a user's own data alike: each function takes a TaskSpec or a GLUE name.

The formulas are written out with numpy (no scikit-learn/scipy at run time); degenerate inputs such as
constant predictions give 0 for correlation-type metrics instead of NaN.
"""

from __future__ import annotations

from typing import Any, Mapping

import numpy as np

from ft_framework.data.tasks import TaskSpec, get_task

# --------------------------------------------------------------------------------------------------
# Elementary metrics
# --------------------------------------------------------------------------------------------------


def _to_numpy(x: Any) -> np.ndarray:
    """numpy view of a numpy array, list or torch tensor (any device / dtype, incl. bf16)."""
    if hasattr(x, "detach"):
        x = x.detach().float().cpu().numpy() if x.is_floating_point() else x.detach().cpu().numpy()
    return np.asarray(x)


def accuracy(preds: np.ndarray, labels: np.ndarray) -> float:
    """Fraction of exact matches."""
    return float(np.mean(preds == labels)) if len(labels) else 0.0


def f1_positive(preds: np.ndarray, labels: np.ndarray, positive: int = 1) -> float:
    """F1 score of the ``positive`` class; 0 when there are no true or predicted positives."""
    tp = np.sum((preds == positive) & (labels == positive))
    fp = np.sum((preds == positive) & (labels != positive))
    fn = np.sum((preds != positive) & (labels == positive))
    denom = 2 * tp + fp + fn
    return float(2 * tp / denom) if denom else 0.0


def matthews_corrcoef(preds: np.ndarray, labels: np.ndarray) -> float:
    """Matthews correlation (multiclass R_K form, equal to the binary MCC); 0 when undefined."""
    classes, encoded = np.unique(np.concatenate([labels, preds]), return_inverse=True)
    y_true, y_pred = encoded[: len(labels)], encoded[len(labels) :]
    k = len(classes)
    confusion = np.zeros((k, k), dtype=np.float64)
    np.add.at(confusion, (y_true, y_pred), 1.0)
    t = confusion.sum(axis=1)  # true occurrences per class
    p = confusion.sum(axis=0)  # predicted occurrences per class
    c = np.trace(confusion)
    s = confusion.sum()
    cov_tp = c * s - t @ p
    cov_pp = s * s - p @ p
    cov_tt = s * s - t @ t
    denom = cov_tt * cov_pp
    # A constant prediction (or constant truth) makes the denominator 0: MCC is defined as 0 there.
    return float(cov_tp / np.sqrt(denom)) if denom > 0 else 0.0


def pearson(x: np.ndarray, y: np.ndarray) -> float:
    """Pearson correlation; 0 when either input is constant."""
    x = np.asarray(x, dtype=np.float64)
    y = np.asarray(y, dtype=np.float64)
    # Test constancy exactly: x - x.mean() of a constant can be rounding noise rather than 0.
    if len(x) < 2 or np.ptp(x) == 0 or np.ptp(y) == 0:
        return 0.0
    xc, yc = x - x.mean(), y - y.mean()
    denom = np.sqrt(np.dot(xc, xc) * np.dot(yc, yc))
    if denom == 0 or not np.isfinite(denom):
        return 0.0
    # Clip: rounding can push |r| a hair above 1.
    return float(np.clip(np.dot(xc, yc) / denom, -1.0, 1.0))


def mean_squared_error(preds: np.ndarray, labels: np.ndarray) -> float:
    """Mean of the squared differences; 0 for no examples."""
    diff = np.asarray(preds, dtype=np.float64) - np.asarray(labels, dtype=np.float64)
    return float(np.mean(diff * diff)) if len(diff) else 0.0


def rankdata_average(x: np.ndarray) -> np.ndarray:
    """1-based ranks, ties given the average of the ranks they span (scipy's ``method="average"``)."""
    x = np.asarray(x)
    order = np.argsort(x, kind="mergesort")
    sorted_x = x[order]
    # new_group[i] is True where sorted_x[i] starts a new group of tied values.
    new_group = np.concatenate([[True], sorted_x[1:] != sorted_x[:-1]])
    group_of_sorted = np.cumsum(new_group) - 1
    starts = np.concatenate([np.flatnonzero(new_group), [len(x)]])
    # A group occupying sorted positions [a, b) has 1-based ranks a+1..b, whose mean is (a + 1 + b) / 2.
    avg_rank = 0.5 * (starts[:-1] + 1 + starts[1:])
    ranks = np.empty(len(x), dtype=np.float64)
    ranks[order] = avg_rank[group_of_sorted]
    return ranks


def spearman(x: np.ndarray, y: np.ndarray) -> float:
    """Spearman rank correlation: Pearson of average ranks; 0 when either input is constant."""
    return pearson(rankdata_average(x), rankdata_average(y))


# --------------------------------------------------------------------------------------------------
# Task-level API
# --------------------------------------------------------------------------------------------------


def _predicted_classes(predictions: np.ndarray) -> np.ndarray:
    """Argmax of (N, C) logits; a 1-D array is taken as class ids already."""
    if predictions.ndim == 2:
        return predictions.argmax(axis=-1)
    if predictions.ndim == 1:
        return predictions.astype(np.int64)
    raise ValueError(f"classification predictions must be (N, C) logits or (N,) ids, got {predictions.shape}")


def _regression_scores(predictions: np.ndarray) -> np.ndarray:
    if predictions.ndim == 2 and predictions.shape[1] == 1:
        return predictions[:, 0]
    if predictions.ndim == 1:
        return predictions
    raise ValueError(f"regression predictions must be (N,) or (N, 1), got {predictions.shape}")


# Every metric a TaskSpec may list, as a function of (predictions, labels): class ids for a
# classification task, float scores for a regression task.
METRICS: dict[str, Any] = {
    "accuracy": accuracy,
    "f1": f1_positive,
    "mcc": matthews_corrcoef,
    "pearson": pearson,
    "spearmanr": spearman,
    "mse": mean_squared_error,
}
# Metrics that are the mean of two others (GLUE's combined scores), computed from those two.
AVERAGED_METRICS: dict[str, tuple[str, str]] = {
    "accuracy_f1_avg": ("accuracy", "f1"),
    "pearson_spearman_avg": ("pearson", "spearmanr"),
}


def _spec(task: TaskSpec | str) -> TaskSpec:
    return task if isinstance(task, TaskSpec) else get_task(task)


def compute_metrics(task: TaskSpec | str, predictions: Any, labels: Any) -> dict[str, float]:
    """The metrics the task's spec lists (``get_task(task).metrics``, in that order) of
    ``predictions`` (logits, or scores for STS-B) against ``labels``.

    CoLA: mcc, accuracy. STS-B: pearson, spearmanr, pearson_spearman_avg. MRPC/QQP: f1, accuracy,
    accuracy_f1_avg. Other tasks: accuracy. Own data: tasks.own_data_task's.
    """
    spec = _spec(task)
    predictions = _to_numpy(predictions)
    labels = _to_numpy(labels).reshape(-1)
    if len(predictions) != len(labels):
        raise ValueError(f"{len(predictions)} predictions but {len(labels)} labels")

    if spec.is_regression:
        preds = _regression_scores(predictions).astype(np.float64)
    else:
        preds = _predicted_classes(predictions)
        labels = labels.astype(np.int64)

    computed: dict[str, float] = {}

    def value(name: str) -> float:
        if name not in computed:
            if name in AVERAGED_METRICS:
                a, b = AVERAGED_METRICS[name]
                computed[name] = (value(a) + value(b)) / 2
            elif name in METRICS:
                computed[name] = METRICS[name](preds, labels)
            else:
                raise ValueError(f"task {spec.name!r} lists metric {name!r}, which ft_framework.metrics does "
                                 f"not compute; known: {', '.join([*METRICS, *AVERAGED_METRICS])}")
        return computed[name]

    return {name: value(name) for name in spec.metrics}


# Metrics where a smaller value is the better one (every other metric: larger is better). A task's
# main metric may be one of them (a causal LM's completion_loss): model selection and the failed-run
# test read the direction from here.
LOWER_IS_BETTER = frozenset({"mse", "completion_loss", "perplexity"})


def is_better(metric: str, value: float, than: float) -> bool:
    """Whether `value` of `metric` is strictly better than `than` (NaN is never better)."""
    if np.isnan(value):
        return False
    if np.isnan(than):
        return True
    return value < than if metric in LOWER_IS_BETTER else value > than


def main_metric(task: TaskSpec | str) -> str:
    """Name of the task's headline metric (its TaskSpec's main_metric)."""
    return _spec(task).main_metric


def majority_baseline(task: TaskSpec | str, train_labels: Any, eval_labels: Any) -> dict[str, float]:
    """Metrics on ``eval_labels`` (one split) of always predicting the TRAIN majority class.

    For regression (STS-B, own data) the constant prediction is the train mean. Ties between classes go
    to the smallest label id.
    """
    if isinstance(eval_labels, Mapping):
        raise TypeError("majority_baseline takes the labels of one eval split, not a dict of splits")
    spec = _spec(task)
    train_labels = _to_numpy(train_labels).reshape(-1)
    eval_labels = _to_numpy(eval_labels).reshape(-1)
    if len(train_labels) == 0:
        raise ValueError("majority_baseline needs at least one train label")
    if spec.is_regression:
        constant = np.full(len(eval_labels), float(np.mean(train_labels)))
        return compute_metrics(spec, constant, eval_labels)
    majority = int(np.bincount(train_labels.astype(np.int64), minlength=spec.num_labels).argmax())
    return compute_metrics(spec, np.full(len(eval_labels), majority, dtype=np.int64), eval_labels)


def is_failed(task: TaskSpec | str, metrics: Mapping[str, float], baseline: Mapping[str, float]) -> bool:
    """Mosbach et al.'s failed run: the main metric is no better than the baseline's (NaN fails): the
    majority class's for a classifier, the mean's for a regression, the model before fine-tuning for
    a causal LM."""
    spec = _spec(task)
    name = spec.main_metric
    for what, values in (("metrics", metrics), ("baseline", baseline)):
        if name not in values:
            raise KeyError(f"{what} lack the main metric {name!r} of task {spec.name!r}; got {sorted(values)}")
    value = float(metrics[name])
    return bool(np.isnan(value) or not is_better(name, value, float(baseline[name])))
