"""The report on a store of known results: Table 1 against a hand computation, best settings,
Levene's test and the expected best of n against scipy / the closed form, CSV and plots, ft-report."""

from __future__ import annotations

import csv
import json
import math

import numpy as np
import pytest
import scipy.stats

from ft_framework.cli import report_main
from ft_framework.sweep import build_report
from ft_framework.sweep.report import STATISTICS
from ft_framework.sweep.stats import expected_max_exact
from sweep_helpers import write_results

SEEDS = (1, 2, 3)


def _score(method, task, k, seed):
    """Validation score (fraction) of a synthetic run; vanilla is noisier and fails once on RTE."""
    if method == "vanilla":
        if task == "rte" and seed == 2:
            return 0.47
        return {"rte": 0.66, "mrpc": 0.84, "sst2": 0.90}[task] + 0.02 * (seed - 2) ** 2 * (-1) ** seed
    base = {"rte": 0.70, "mrpc": 0.86, "sst2": 0.91}[task] + (0.01 if k == 1.0 else 0.0) * (1 if task != "sst2" else -1)
    return base + 0.004 * seed


@pytest.fixture()
def store(tmp_path):
    root = tmp_path / "store"
    runs, entries = [], []
    for method, ks in (("recadam", (0.1, 1.0)), ("vanilla", (None,))):
        for task in ("rte", "mrpc", "sst2"):
            for k in ks:
                for seed in SEEDS:
                    run_id = f"{method[:3]}{task}{seed}{'' if k is None else int(k * 10)}".ljust(12, "x")
                    axes = {"data.task": task, "training.seed": seed}
                    if k is not None:
                        axes["optimizer.hparams.anneal_k"] = k
                    d = root / "runs" / run_id
                    d.mkdir(parents=True)
                    (d / "run.json").write_text(json.dumps({"id": run_id, "method": method, "task": task,
                                                            "seed": seed, "axes": axes}))
                    (d / "status.json").write_text(json.dumps({"state": "finished", "attempts": 1}))
                    val = _score(method, task, k, seed)
                    main = "f1" if task == "mrpc" else "accuracy"
                    # MRPC with the dev set split in half: selection on validation, score on test.
                    test = val - 0.01 * seed if task == "mrpc" else None
                    write_results(d, task=task, score=val, failed=val <= 0.5, main=main, test_score=test)
                    entries.append({"id": run_id, "method": method, "task": task, "seed": seed, "axes": axes,
                                    "state": "finished", "dir": f"runs/{run_id}"})
                    runs.append(dict(id=run_id, method=method, task=task, k=k, seed=seed, val=100 * val,
                                     score=100 * (test if test is not None else val), failed=val <= 0.5))
    # One run that never finished.
    d = root / "runs" / "pendingxxxxx"
    d.mkdir()
    (d / "run.json").write_text(json.dumps({"id": "pendingxxxxx", "method": "vanilla", "task": "rte", "seed": 9,
                                            "axes": {"data.task": "rte", "training.seed": 9}}))
    (d / "status.json").write_text(json.dumps({"state": "failed", "attempts": 1, "error": "exit code 1"}))
    entries.append({"id": "pendingxxxxx", "method": "vanilla", "task": "rte", "seed": 9,
                    "axes": {"data.task": "rte", "training.seed": 9}, "state": "failed", "dir": "runs/pendingxxxxx"})
    (root / "index.json").write_text(json.dumps({"runs": entries}))
    return root, runs


def _hand_table(runs):
    """Per (method, task): best k by mean validation score, then that setting's stats."""
    out = {}
    for method in ("recadam", "vanilla"):
        for task in ("rte", "mrpc", "sst2"):
            mine = [r for r in runs if r["method"] == method and r["task"] == task]
            ks = sorted({r["k"] for r in mine}, key=lambda k: -1 if k is None else k)
            best = max(ks, key=lambda k: np.mean([r["val"] for r in mine if r["k"] == k]))
            scores = [r["score"] for r in mine if r["k"] == best]
            out[(method, task)] = dict(k=best, median=np.median(scores), max=np.max(scores), mean=np.mean(scores),
                                       std=np.std(scores, ddof=1), failed=sum(r["failed"] for r in mine if r["k"] == best),
                                       n=len(scores), scores=scores)
    return out


def test_table1_matches_a_hand_computation(store):
    root, runs = store
    report = build_report(root, bootstrap_samples=2000)
    hand = _hand_table(runs)
    assert report.methods == ["recadam", "vanilla"] and report.tasks == ["sst2", "mrpc", "rte"]
    for (method, task), h in hand.items():
        cell = report.cells[(method, task)]
        expected_setting = () if h["k"] is None else (("optimizer.hparams.anneal_k", f"{h['k']:g}"),)
        assert cell.setting == expected_setting
        for stat in ("median", "max", "mean", "std", "failed", "n"):
            assert report.table1_value(method, stat, task) == pytest.approx(h[stat]), (method, task, stat)
        # Averages: SST-2 is the only > 10k task here; RTE and MRPC are < 10k; Avg covers all three.
        for stat in ("median", "max", "std"):
            assert report.table1_value(method, stat, "avg_gt10k") == pytest.approx(hand[(method, "sst2")][stat])
            assert report.table1_value(method, stat, "avg_lt10k") == pytest.approx(
                np.mean([hand[(method, t)][stat] for t in ("rte", "mrpc")]))
            assert report.table1_value(method, stat, "avg") == pytest.approx(
                np.mean([hand[(method, t)][stat] for t in ("rte", "mrpc", "sst2")]))
    assert report.table1_value("vanilla", "failed", "avg") == 1
    # RecAdam's best k differs per task: k = 1 on RTE / MRPC, k = 0.1 on SST-2.
    assert hand[("recadam", "rte")]["k"] == 1.0 and hand[("recadam", "sst2")]["k"] == 0.1


def test_levene_and_expected_max_rows(store):
    root, runs = store
    report = build_report(root, bootstrap_samples=20_000)
    hand = _hand_table(runs)
    assert {r["task"] for r in report.levene_rows} == {"rte", "mrpc", "sst2"}
    for row in report.levene_rows:
        ref = scipy.stats.levene(hand[("recadam", row["task"])]["scores"], hand[("vanilla", row["task"])]["scores"])
        assert (row["method_a"], row["method_b"]) == ("recadam", "vanilla")
        assert row["statistic"] == pytest.approx(ref.statistic) and row["pvalue"] == pytest.approx(ref.pvalue)
    for row in report.expected_rows:
        mine = [r for r in runs if r["method"] == row["method"] and r["task"] == row["task"]]
        assert row["trials"] == len(mine)
        exact, exact_std = expected_max_exact([r["score"] for r in mine], row["n"], [r["val"] for r in mine])
        assert row["exact_mean"] == pytest.approx(exact)
        assert abs(row["mean"] - exact) < 5 * exact_std / math.sqrt(20_000) + 1e-9
    ns = sorted({r["n"] for r in report.expected_rows if r["method"] == "recadam"})
    assert ns == [1, 2, 3, 5, 6]  # up to the 6 trials (2 settings x 3 seeds)


def test_outputs_csv_markdown_and_plots(store, tmp_path, capsys):
    root, runs = store
    assert report_main([str(root), "--out", str(tmp_path / "out"), "--bootstrap-samples", "500"]) == 0
    printed = capsys.readouterr().out
    assert "| recadam Median |" in printed and "Avg <10k" in printed and "pendingxxxxx" in printed
    out = tmp_path / "out"
    rows = list(csv.DictReader((out / "report.csv").open()))
    hand = _hand_table(runs)
    median = next(r for r in rows if r["method"] == "vanilla" and r["statistic"] == "median")
    assert float(median["rte"]) == pytest.approx(hand[("vanilla", "rte")]["median"])
    assert float(median["avg"]) == pytest.approx(np.mean([hand[("vanilla", t)]["median"] for t in ("rte", "mrpc", "sst2")]))
    assert median["avg_gt10k"] and float(median["avg_gt10k"]) == pytest.approx(hand[("vanilla", "sst2")]["median"])
    for name in ("settings.csv", "levene.csv", "expected_max.csv", "runs.csv", "report.md"):
        assert (out / name).stat().st_size > 0, name
    runs_csv = list(csv.DictReader((out / "runs.csv").open()))
    assert len(runs_csv) == len(runs) + 1 and {r["state"] for r in runs_csv} == {"finished", "failed"}
    pngs = {p.name: p for p in (out / "plots").glob("*.png")}
    assert {"scores_boxplot.png", "expected_max.png", "learning_curves_rte.png", "forgetting_rte.png",
            "lambda_rte.png"} <= set(pngs)
    for p in pngs.values():
        data = p.read_bytes()
        assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 5000, p.name


def test_without_an_index_the_run_directories_are_read(store):
    root, runs = store
    with_index = build_report(root, bootstrap_samples=100)
    (root / "index.json").unlink()
    without = build_report(root, bootstrap_samples=100)
    assert sorted(without.methods) == sorted(with_index.methods) and len(without.records) == len(runs) + 1
    assert without.table1_rows() == sorted(with_index.table1_rows(), key=lambda r: (
        list(STATISTICS).index(r["statistic"]), without.methods.index(r["method"])))


def test_report_of_a_single_run_directory(tmp_path):
    write_results(tmp_path / "run", task="rte", score=0.7, failed=False,
                  config={"optimizer": {"name": "adamw"}, "training": {"seed": 3}})
    report = build_report(tmp_path / "run", bootstrap_samples=100)
    assert report.methods == ["adamw"] and report.table1_value("adamw", "median", "rte") == pytest.approx(70.0)
    assert "adamw Median" in report.markdown()


def test_report_of_nothing_is_a_clear_error(tmp_path, capsys):
    assert report_main([str(tmp_path)]) == 2
    assert "neither a sweep" in capsys.readouterr().err
