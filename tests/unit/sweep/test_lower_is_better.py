"""The report when the main metric is lower-is-better (a decoder's completion_loss): hand-made
sweep stores whose answers are worked out in the comments, and the same numbers under a
higher-is-better metric, where the answers differ. Covers the frontier (non-dominated points,
forgetting at matched accuracy, the decoder's axes and Spearman rows), Table 1's best seed and
averages, the best setting, the expected best of n trials and the scores' unit."""

from __future__ import annotations

import itertools
import json
import math

import numpy as np
import pytest
import scipy.stats

from ft_framework.cli import report_main
from ft_framework.sweep import build_report
from ft_framework.sweep.frontier import non_dominated
from ft_framework.sweep.stats import expected_max_exact
from sweep_helpers import write_results

LOSS, ACCURACY = "completion_loss", "accuracy"

# (step, score, kl_from_pretrained, lm_loss_gained, ‖θ − θ*‖) of each evaluation, one run per method.
EVALS = {
    "vanilla": [(2, 2.00, 0.10, 0.20, 1.0), (4, 1.50, 0.30, 0.25, 2.0), (6, 1.00, 0.60, 0.50, 3.0)],
    "recadam": [(2, 2.10, 0.05, 0.30, 0.5), (4, 1.40, 0.20, 0.40, 1.5), (6, 1.01, 0.40, 0.45, 2.5)],
}


def _write_run(root, run_id, method, seed, *, task, main, final, evals=(), axes=None):
    axes = {"data.task": task, "training.seed": seed, **(axes or {})}
    d = root / "runs" / run_id
    d.mkdir(parents=True)
    (d / "run.json").write_text(json.dumps({"id": run_id, "method": method, "task": task, "seed": seed,
                                            "axes": axes}))
    (d / "status.json").write_text(json.dumps({"state": "finished", "attempts": 1}))
    write_results(d, task=task, score=final, failed=False, main=main, curves=False)
    lines = [{"type": "eval", "step": step, "metrics": {"validation": {main: score}}, "forgetting_distance": dist,
              "forgetting": {"kl_from_pretrained": kl, "lm_loss_gained": gained, "lm_loss": 3.0 + gained,
                             "lm_loss_pretrained": 3.0, "cka_drift_last": kl / 2, "cka_drift_mean": kl / 3}}
             for step, score, kl, gained, dist in evals]
    (d / "metrics.jsonl").write_text("".join(json.dumps(x) + "\n" for x in lines))
    return {"id": run_id, "method": method, "task": task, "seed": seed, "axes": axes, "state": "finished",
            "dir": f"runs/{run_id}"}


def write_frontier_store(root, main):
    entries = [_write_run(root, f"{method[:3]}1".ljust(12, "x"), method, 1, task="custom", main=main,
                          final=evals[-1][1], evals=evals) for method, evals in EVALS.items()]
    (root / "index.json").write_text(json.dumps({"runs": entries}))


def _by_step(points):
    return {(p.method, p.step): p for p in points}


def test_non_dominated_points_follow_the_metric_direction():
    points = [(s, kl) for evals in EVALS.values() for _, s, kl, _, _ in evals]
    # Lower is better: only vanilla at step 4 (1.50, 0.30) is dominated, by recadam at step 4 (1.40, 0.20).
    assert non_dominated(points, lower_is_better=True) == [True, False, True, True, True, True]
    # Higher is better: recadam at step 2 (2.10, 0.05) has the best score and the least forgetting.
    assert non_dominated(points) == [False, False, False, True, False, False]


def _brute_force(points, lower):
    better = (lambda a, b: a < b) if lower else (lambda a, b: a > b)
    return [not any((better(s2, s) or s2 == s) and f2 <= f and (better(s2, s) or f2 < f)
                    for j, (s2, f2) in enumerate(points) if j != i) for i, (s, f) in enumerate(points)]


@pytest.mark.parametrize("seed", range(30))
def test_non_dominated_lower_is_better_equals_brute_force_with_ties(seed):
    rng = np.random.default_rng(100 + seed)
    points = [(float(rng.integers(0, 6)), float(rng.integers(0, 6))) for _ in range(int(rng.integers(1, 25)))]
    assert non_dominated(points, lower_is_better=True) == _brute_force(points, lower=True)
    assert non_dominated(points) == _brute_force(points, lower=False)


def test_frontier_of_a_lower_is_better_metric(tmp_path):
    write_frontier_store(tmp_path / "store", LOSS)
    frontier = build_report(tmp_path / "store", bootstrap_samples=50).frontier
    # A decoder's points carry the KL and the LM loss gained: both are axes, the KL first.
    assert frontier.measures == ["kl_from_pretrained", "lm_loss_gained"]
    assert frontier.metrics == {"custom": LOSS}
    kl = _by_step(frontier.axes[0].points["custom"])
    assert kl[("vanilla", 6)].score == 1.00   # a loss is reported as it is, not x100
    assert sorted(k for k, p in kl.items() if p.non_dominated) == [
        ("recadam", 2), ("recadam", 4), ("recadam", 6), ("vanilla", 2), ("vanilla", 6)]
    # On lm_loss_gained: recadam 2 (2.10, 0.30) is dominated by vanilla 2 (2.00, 0.20); recadam 4
    # (1.40, 0.40) and vanilla 4 (1.50, 0.25) stand; recadam 6 (1.01, 0.45) beats vanilla 4 on score.
    gained = _by_step(frontier.axes[1].points["custom"])
    assert sorted(k for k, p in gained.items() if p.non_dominated) == [
        ("recadam", 4), ("recadam", 6), ("vanilla", 2), ("vanilla", 4), ("vanilla", 6)]

    # Matched: vanilla's best loss is 1.00, the target 1.00 / 0.99 = 1.0101; vanilla reaches it at
    # step 6 (KL 0.60), recadam at step 6 (1.01, KL 0.40).
    rows = {(r["measure"], r["method"]): r for r in frontier.matched_rows}
    for method, forgetting in (("vanilla", 0.60), ("recadam", 0.40)):
        row = rows[("kl_from_pretrained", method)]
        assert row["target"] == pytest.approx(1.0 / 0.99)
        assert (row["reached"], row["points"], row["forgetting"], row["score"]) == (1, 3, forgetting,
                                                                                    EVALS[method][2][1])
    assert rows[("lm_loss_gained", "recadam")]["forgetting"] == 0.45

    # Spearman: one row per measure the points recorded (the two axes, then the CKA drifts).
    corr = {(r["measure"], r["method"]): r for r in frontier.correlation_rows}
    assert list(dict.fromkeys(r["measure"] for r in frontier.correlation_rows)) == [
        "kl_from_pretrained", "lm_loss_gained", "cka_drift_last", "cka_drift_mean"]
    points = [e for evals in EVALS.values() for e in evals]
    for measure, column in (("kl_from_pretrained", 2), ("lm_loss_gained", 3)):
        ref = scipy.stats.spearmanr([e[4] for e in points], [e[column] for e in points]).statistic
        assert corr[(measure, "all")]["n"] == 6 and corr[(measure, "all")]["rho"] == pytest.approx(ref)
    assert corr[("kl_from_pretrained", "all")]["rho"] == pytest.approx(1.0)   # distance and KL rise together

    text = build_report(tmp_path / "store", bootstrap_samples=50).markdown()
    for line in ("### custom: non-dominated points on kl_from_pretrained",
                 "### custom: non-dominated points on lm_loss_gained", "#### lm_loss_gained",
                 "custom: completion_loss, as is; lower is better", "| custom | lm_loss_gained | all | 6 |"):
        assert line in text, line


def test_the_same_numbers_under_a_higher_is_better_metric_give_other_answers(tmp_path):
    write_frontier_store(tmp_path / "store", ACCURACY)
    frontier = build_report(tmp_path / "store", bootstrap_samples=50).frontier
    kl = _by_step(frontier.axes[0].points["custom"])
    assert kl[("vanilla", 6)].score == pytest.approx(100.0)   # points, x100
    # Higher is better: recadam at step 2 (210, KL 0.05) dominates every other point.
    assert [k for k, p in kl.items() if p.non_dominated] == [("recadam", 2)]
    # Vanilla's best is 200 (step 2), the target 198: vanilla reaches it at step 2 (KL 0.10),
    # recadam at step 2 (KL 0.05).
    rows = {r["method"]: r for r in frontier.axes[0].matched_rows}
    assert rows["vanilla"]["target"] == pytest.approx(198.0)
    assert (rows["vanilla"]["forgetting"], rows["recadam"]["forgetting"]) == (0.10, 0.05)


def write_table_store(root):
    """Final completion losses: vanilla (one setting) 1.2 and 1.0; recadam k=0.1: 1.5, 1.7 (mean
    1.6), k=1: 0.9, 1.1 (mean 1.0); and an accuracy task (rte) for the averages."""
    entries = []
    for method, k, seed, loss in (("vanilla", None, 1, 1.2), ("vanilla", None, 2, 1.0),
                                  ("recadam", 0.1, 1, 1.5), ("recadam", 0.1, 2, 1.7),
                                  ("recadam", 1.0, 1, 0.9), ("recadam", 1.0, 2, 1.1)):
        axes = {} if k is None else {"optimizer.hparams.anneal_k": k}
        run_id = f"{method[:3]}{seed}{'' if k is None else int(k * 10)}".ljust(12, "x")
        entries.append(_write_run(root, run_id, method, seed, task="custom", main=LOSS, final=loss, axes=axes))
        if k != 0.1:
            entries.append(_write_run(root, run_id.replace("x", "r", 1), method, seed, task="rte", main=ACCURACY,
                                      final=0.6 + 0.1 * seed, axes=axes))
    (root / "index.json").write_text(json.dumps({"runs": entries}))


def test_table1_best_setting_and_expected_best_of_a_loss(tmp_path):
    write_table_store(tmp_path / "store")
    report = build_report(tmp_path / "store", bootstrap_samples=4000)
    assert report.metrics == {"custom": LOSS, "rte": ACCURACY}
    # The best setting of recadam is the one with the lower mean loss, k = 1.
    assert report.cells[("recadam", "custom")].setting == (("optimizer.hparams.anneal_k", "1"),)
    assert report.table1_value("recadam", "median", "custom") == pytest.approx(1.0)   # as is, not x100
    # The best seed of a loss is its min; "max" stays the plain maximum.
    assert report.table1_value("vanilla", "best", "custom") == pytest.approx(1.0)
    assert report.table1_value("vanilla", "max", "custom") == pytest.approx(1.2)
    assert report.table1_value("vanilla", "best", "rte") == pytest.approx(80.0)
    # An average over a loss and an accuracy means nothing: left empty; the counts still sum.
    assert math.isnan(report.table1_value("vanilla", "median", "avg"))
    assert report.table1_value("vanilla", "n", "avg") == 4
    text = report.markdown()
    assert "| vanilla Best | 80.0 | 1.000 | – | – | – |" in text, text
    # The best of n trials is the lowest loss: for vanilla's [1.2, 1.0] and n = 2,
    # P(best = 1.0) = 1 - (1/2)^2 = 3/4, so E = 0.75 * 1.0 + 0.25 * 1.2 = 1.05.
    row = next(r for r in report.expected_rows if (r["method"], r["task"], r["n"]) == ("vanilla", "custom", 2))
    assert row["exact_mean"] == pytest.approx(1.05)
    assert abs(row["mean"] - 1.05) < 0.01


def _brute_force_best_of_n(scores, n, selection, lower):
    sign = -1.0 if lower else 1.0
    picks = [max(draw, key=lambda i: (sign * selection[i], sign * scores[i]))
             for draw in itertools.product(range(len(scores)), repeat=n)]
    best = np.array([scores[i] for i in picks])
    return best.mean(), best.std()


@pytest.mark.parametrize("n", [1, 2, 3])
def test_expected_best_of_a_lower_is_better_metric_equals_enumeration(n):
    losses = [1.3, 0.9, 1.1, 0.9, 2.0]             # a tie at the best selection score
    selection = [1.2, 0.8, 1.0, 0.8, 1.9]
    for lower in (True, False):
        mean, std = expected_max_exact(losses, n, selection, lower_is_better=lower)
        ref_mean, ref_std = _brute_force_best_of_n(losses, n, selection, lower)
        assert mean == pytest.approx(ref_mean, abs=1e-12) and std == pytest.approx(ref_std, abs=1e-9)


def test_a_task_with_two_main_metrics_is_refused_in_one_line(tmp_path, capsys):
    root = tmp_path / "store"
    entries = [_write_run(root, "a".ljust(12, "x"), "vanilla", 1, task="custom", main=LOSS, final=1.0),
               _write_run(root, "b".ljust(12, "x"), "recadam", 1, task="custom", main="exact_match", final=0.5)]
    (root / "index.json").write_text(json.dumps({"runs": entries}))
    assert report_main([str(root), "--no-plots"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "different main metrics ('completion_loss' and 'exact_match')" in err[0], err
