"""Tests for ft_framework.metrics against scikit-learn and scipy."""

import warnings

import numpy as np
import pytest
import torch

from ft_framework.metrics import (
    compute_metrics,
    is_failed,
    main_metric,
    majority_baseline,
    matthews_corrcoef,
    pearson,
    rankdata_average,
    spearman,
)

sklearn_metrics = pytest.importorskip("sklearn.metrics")
scipy_stats = pytest.importorskip("scipy.stats")

SEEDS = range(5)


def _logits_for(preds: np.ndarray, num_classes: int, rng: np.random.Generator) -> np.ndarray:
    """Random logits whose argmax is ``preds``."""
    logits = rng.normal(size=(len(preds), num_classes))
    logits[np.arange(len(preds)), preds] = logits.max(axis=1) + 1.0
    return logits


@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize("num_classes", [2, 3])
def test_mcc_matches_sklearn(seed, num_classes):
    rng = np.random.default_rng(seed)
    labels = rng.integers(0, num_classes, size=50)
    preds = np.where(rng.random(50) < 0.6, labels, rng.integers(0, num_classes, size=50))
    assert matthews_corrcoef(preds, labels) == pytest.approx(sklearn_metrics.matthews_corrcoef(labels, preds))


@pytest.mark.parametrize("seed", SEEDS)
def test_cola_metrics_match_sklearn(seed):
    rng = np.random.default_rng(seed)
    labels = rng.integers(0, 2, size=40)
    preds = np.where(rng.random(40) < 0.7, labels, 1 - labels)
    metrics = compute_metrics("cola", _logits_for(preds, 2, rng), labels)
    assert metrics == {
        "mcc": pytest.approx(sklearn_metrics.matthews_corrcoef(labels, preds)),
        "accuracy": pytest.approx(sklearn_metrics.accuracy_score(labels, preds)),
    }


@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize("task", ["mrpc", "qqp"])
def test_f1_tasks_match_sklearn(seed, task):
    rng = np.random.default_rng(seed)
    labels = rng.integers(0, 2, size=30)
    preds = np.where(rng.random(30) < 0.6, labels, 1 - labels)
    metrics = compute_metrics(task, torch.tensor(_logits_for(preds, 2, rng)), torch.tensor(labels))
    f1 = sklearn_metrics.f1_score(labels, preds)
    acc = sklearn_metrics.accuracy_score(labels, preds)
    assert metrics == {
        "f1": pytest.approx(f1),
        "accuracy": pytest.approx(acc),
        "accuracy_f1_avg": pytest.approx((f1 + acc) / 2),
    }


@pytest.mark.parametrize("task,num_classes", [("sst2", 2), ("mnli", 3), ("qnli", 2), ("rte", 2), ("wnli", 2)])
def test_accuracy_tasks(task, num_classes):
    rng = np.random.default_rng(0)
    labels = rng.integers(0, num_classes, size=25)
    preds = rng.integers(0, num_classes, size=25)
    metrics = compute_metrics(task, _logits_for(preds, num_classes, rng), labels)
    assert metrics == {"accuracy": pytest.approx(sklearn_metrics.accuracy_score(labels, preds))}


@pytest.mark.parametrize("seed", SEEDS)
def test_rankdata_with_ties_matches_scipy(seed):
    x = np.random.default_rng(seed).integers(0, 6, size=30).astype(float)
    assert list(rankdata_average(x)) == pytest.approx(list(scipy_stats.rankdata(x, method="average")))


@pytest.mark.parametrize("seed", SEEDS)
def test_stsb_metrics_match_scipy(seed):
    rng = np.random.default_rng(seed)
    # Rounded values give plenty of ties in both arrays.
    labels = np.round(rng.uniform(0, 5, size=40) * 2) / 2
    scores = np.round(labels + rng.normal(scale=1.0, size=40), 1)
    expected_p = scipy_stats.pearsonr(scores, labels)[0]
    expected_s = scipy_stats.spearmanr(scores, labels)[0]
    for predictions in (scores, scores[:, None], torch.tensor(scores[:, None], dtype=torch.float64)):
        metrics = compute_metrics("stsb", predictions, labels)
        assert metrics == {
            "pearson": pytest.approx(expected_p),
            "spearmanr": pytest.approx(expected_s),
            "pearson_spearman_avg": pytest.approx((expected_p + expected_s) / 2),
        }


def test_correlations_of_constant_inputs_are_zero_without_warnings():
    labels = np.array([0, 1, 1, 0, 1])
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert matthews_corrcoef(np.ones(5, dtype=int), labels) == 0.0
        assert matthews_corrcoef(np.ones(5, dtype=int), np.ones(5, dtype=int)) == 0.0
        assert pearson(np.full(5, 2.3), labels) == 0.0
        assert pearson(np.full(5, 0.1 + 0.2), labels) == 0.0  # a constant whose mean is not exact
        assert spearman(np.full(5, 2.3), labels) == 0.0
        assert compute_metrics("stsb", np.full(5, 2.5), labels.astype(float))["pearson"] == 0.0
        assert compute_metrics("mrpc", np.zeros(5, dtype=int), labels)["f1"] == 0.0


def test_bad_inputs():
    with pytest.raises(ValueError, match="3 predictions but 2 labels"):
        compute_metrics("rte", np.zeros((3, 2)), [0, 1])
    with pytest.raises(ValueError, match="regression predictions"):
        compute_metrics("stsb", np.zeros((3, 2)), [0.0, 1.0, 2.0])
    with pytest.raises(ValueError, match="unknown GLUE task"):
        compute_metrics("squad", np.zeros((3, 2)), [0, 1, 1])


def test_main_metric():
    tasks = ("cola", "stsb", "mrpc", "qqp", "rte")
    assert [main_metric(t) for t in tasks] == ["mcc", "pearson", "f1", "f1", "accuracy"]


def test_majority_baseline_classification():
    train = [1, 1, 0, 1, 0]  # majority: 1
    dev = np.array([1, 0, 0, 1])
    assert majority_baseline("rte", train, dev) == {"accuracy": 0.5}
    assert majority_baseline("cola", train, dev) == {"mcc": 0.0, "accuracy": 0.5}
    mrpc = majority_baseline("mrpc", train, dev)
    assert mrpc["f1"] == pytest.approx(sklearn_metrics.f1_score(dev, np.ones(4, dtype=int)))
    # Majority of TRAIN, not of eval: train majority 0 on an all-1 dev set.
    assert majority_baseline("sst2", [0, 0, 1], [1, 1, 1]) == {"accuracy": 0.0}
    # Ties go to the smallest id; MNLI has three classes.
    assert majority_baseline("mnli", [2, 1, 2, 1, 0], [1, 1, 2]) == {"accuracy": pytest.approx(2 / 3)}


def test_majority_baseline_regression_predicts_train_mean():
    baseline = majority_baseline("stsb", np.array([1.0, 2.0, 4.5]), np.array([0.0, 5.0, 2.5]))
    assert baseline == {"pearson": 0.0, "spearmanr": 0.0, "pearson_spearman_avg": 0.0}


def test_majority_baseline_rejects_dict_of_splits():
    with pytest.raises(TypeError, match="one eval split"):
        majority_baseline("rte", [0, 1], {"validation": [0, 1]})


def test_is_failed():
    baseline = majority_baseline("rte", [0, 0, 1], [0, 1, 1, 0])  # accuracy 0.5
    assert is_failed("rte", {"accuracy": 0.5}, baseline)  # equal counts as failed
    assert is_failed("rte", {"accuracy": 0.4}, baseline)
    assert not is_failed("rte", {"accuracy": 0.51}, baseline)
    assert is_failed("rte", {"accuracy": float("nan")}, baseline)
    assert is_failed("cola", {"mcc": 0.0, "accuracy": 0.9}, {"mcc": 0.0, "accuracy": 0.7})
    assert not is_failed("mrpc", {"f1": 0.9, "accuracy": 0.6}, {"f1": 0.8, "accuracy": 0.7})
    with pytest.raises(KeyError, match="'mcc'"):
        is_failed("cola", {"accuracy": 0.9}, {"mcc": 0.0})
