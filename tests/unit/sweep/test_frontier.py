"""The learning–forgetting frontier of ft-report, on sweep stores written here with known points:
the non-dominated set against a brute-force search, the matched-accuracy table and Spearman's rho
against computations written in the test, and the figure and CSVs written."""

from __future__ import annotations

import csv
import itertools
import json

import numpy as np
import pytest
import scipy.stats

from ft_framework.cli import report_main
from ft_framework.sweep import build_report
from ft_framework.sweep.frontier import _spearman, non_dominated
from sweep_helpers import write_results

METHODS = ("vanilla", "recadam", "lora")
SEEDS = (1, 2)
STEPS = (2, 4, 6)
ALPHAS = (0.0, 0.5, 1.0)


def brute_force_non_dominated(points):
    out = []
    for i, (s, f) in enumerate(points):
        dominated = any(s2 >= s and f2 <= f and (s2 > s or f2 < f) for j, (s2, f2) in enumerate(points) if j != i)
        out.append(not dominated)
    return out


@pytest.mark.parametrize("seed", range(40))
def test_non_dominated_equals_brute_force_with_ties(seed):
    rng = np.random.default_rng(seed)
    n = int(rng.integers(1, 30))
    # Small integer grids make ties in score, in forgetting and whole duplicate points common.
    points = [(float(rng.integers(0, 6)), float(rng.integers(0, 6))) for _ in range(n)]
    assert non_dominated(points) == brute_force_non_dominated(points)


def _forgetting(rng, with_mlm):
    out = {"cka_drift_last": float(rng.uniform(0.0, 0.5)), "cka_drift_mean": float(rng.uniform(0.0, 0.3))}
    if with_mlm:
        out["mlm_forgetting"] = float(rng.uniform(0.0, 2.0))
    return out


def write_store(root, *, with_mlm=True, methods=METHODS, interpolate=("recadam",), without_forgetting=1):
    """Finished runs of a sweep on sst2 whose eval records carry forgetting and distance."""
    rng = np.random.default_rng(7)
    entries, truth = [], []
    runs = [(m, s) for m in methods for s in SEEDS]
    for i, (method, seed) in enumerate(runs + [("vanilla", 90 + j) for j in range(without_forgetting)]):
        run_id = f"{method[:3]}{seed}".ljust(12, "x")
        axes = {"data.task": "sst2", "training.seed": seed}
        d = root / "runs" / run_id
        d.mkdir(parents=True)
        (d / "run.json").write_text(json.dumps({"id": run_id, "method": method, "task": "sst2", "seed": seed,
                                                "axes": axes}))
        (d / "status.json").write_text(json.dumps({"state": "finished", "attempts": 1}))
        write_results(d, task="sst2", score=0.8, failed=False, curves=False)
        lines = []
        for step in STEPS:
            score = float(rng.uniform(0.6, 0.9))
            record = {"type": "eval", "step": step, "metrics": {"validation": {"accuracy": score}}}
            if i < len(runs):
                record["forgetting"] = _forgetting(rng, with_mlm)
                record["forgetting_distance"] = float(rng.uniform(0.1, 3.0))
                truth.append({"method": method, "run": run_id, "kind": "eval", "score": 100 * score,
                              "forgetting": record["forgetting"], "distance": record["forgetting_distance"]})
            lines.append(record)
            lines.append({"type": "train", "step": step, "loss": 0.5, "forgetting_distance": 1.0})
        (d / "metrics.jsonl").write_text("\n".join(json.dumps(x) for x in lines) + "\n")
        if method in interpolate and i < len(runs):
            rows = []
            for alpha in ALPHAS:
                score = float(rng.uniform(0.6, 0.9))
                row = {"alpha": alpha, "metrics": {"validation": {"accuracy": score}}, "distance": alpha,
                       "forgetting": _forgetting(rng, with_mlm)}
                rows.append(row)
                if alpha == 1.0:   # θ_1 is the run's reported model, an evaluation point already
                    continue
                truth.append({"method": method, "run": run_id, "kind": "interpolated", "score": 100 * score,
                              "forgetting": row["forgetting"], "distance": alpha, "alpha": alpha})
            best = max(rows, key=lambda r: r["metrics"]["validation"]["accuracy"])["alpha"]
            (d / "interpolation.json").write_text(json.dumps({"alphas": list(ALPHAS), "rows": rows, "best_alpha": best,
                                                              "selection_split": "validation",
                                                              "main_metric": "accuracy"}))
        entries.append({"id": run_id, "method": method, "task": "sst2", "seed": seed, "axes": axes,
                        "state": "finished", "dir": f"runs/{run_id}"})
    (root / "index.json").write_text(json.dumps({"runs": entries}))
    return truth


def _spearman_by_hand(x, y):
    def ranks(values):  # average ranks of ties, 1-based
        order = sorted(range(len(values)), key=lambda i: values[i])
        out = [0.0] * len(values)
        i = 0
        while i < len(order):
            j = i
            while j + 1 < len(order) and values[order[j + 1]] == values[order[i]]:
                j += 1
            for k in order[i:j + 1]:
                out[k] = (i + j) / 2 + 1
            i = j + 1
        return out

    rx, ry = np.array(ranks(x)), np.array(ranks(y))
    rx, ry = rx - rx.mean(), ry - ry.mean()
    return float((rx * ry).sum() / np.sqrt((rx ** 2).sum() * (ry ** 2).sum()))


def test_frontier_points_matched_table_and_spearman(tmp_path):
    truth = write_store(tmp_path / "store")
    report = build_report(tmp_path / "store", bootstrap_samples=50)
    frontier = report.frontier
    assert frontier.measure == "mlm_forgetting"   # every point has it
    assert frontier.left_out == 1
    points = frontier.points["sst2"]
    assert len(points) == len(truth)
    got = sorted((p.method, p.run_id, p.kind, round(p.score, 9), p.forgetting, p.non_dominated) for p in points)
    flags = brute_force_non_dominated([(t["score"], t["forgetting"]["mlm_forgetting"]) for t in truth])
    want = sorted((t["method"], t["run"], t["kind"], round(t["score"], 9), t["forgetting"]["mlm_forgetting"], flag)
                  for t, flag in zip(truth, flags))
    assert got == want
    assert 0 < sum(flags) < len(flags)

    target = 0.99 * max(t["score"] for t in truth if t["method"] == "vanilla" and t["kind"] == "eval")
    rows = {r["method"]: r for r in frontier.matched_rows}
    assert set(rows) == {"vanilla", "recadam", "recadam + WiSE-FT", "lora"}
    for label, row in rows.items():
        method = label.split(" + ")[0]
        kinds = ("eval", "interpolated") if "WiSE-FT" in label else ("eval",)
        reaching = [t["forgetting"]["mlm_forgetting"] for t in truth
                    if t["method"] == method and t["kind"] in kinds and t["score"] >= target]
        assert row["target"] == pytest.approx(target)
        assert row["reached"] == len(reaching)
        assert row["forgetting"] == (min(reaching) if reaching else None)

    # One row per measure the points recorded, the axis first.
    measures = ["mlm_forgetting", "cka_drift_last", "cka_drift_mean"]
    assert list(dict.fromkeys(r["measure"] for r in frontier.correlation_rows)) == measures
    evals = [t for t in truth if t["kind"] == "eval"]
    for measure in measures:
        corr = {r["method"]: r for r in frontier.correlation_rows if r["measure"] == measure}
        assert corr["all"]["n"] == len(evals)
        assert corr["all"]["rho"] == pytest.approx(
            _spearman_by_hand([t["distance"] for t in evals], [t["forgetting"][measure] for t in evals]))
        for method in METHODS:
            own = [t for t in evals if t["method"] == method]
            assert corr[method]["n"] == len(own)
            assert corr[method]["rho"] == pytest.approx(
                _spearman_by_hand([t["distance"] for t in own], [t["forgetting"][measure] for t in own]))


def test_measure_falls_back_to_cka_and_can_be_chosen(tmp_path):
    truth = write_store(tmp_path / "store", with_mlm=False)
    assert build_report(tmp_path / "store", bootstrap_samples=50).frontier.measure == "cka_drift_last"
    chosen = build_report(tmp_path / "store", bootstrap_samples=50, forgetting_measure="cka_drift_mean").frontier
    assert sorted(p.forgetting for p in chosen.points["sst2"]) == sorted(t["forgetting"]["cka_drift_mean"]
                                                                          for t in truth)


def test_ft_report_writes_the_frontier_figure_tables_and_section(tmp_path, capsys):
    write_store(tmp_path / "store")
    assert report_main([str(tmp_path / "store"), "--bootstrap-samples", "50"]) == 0
    store = tmp_path / "store"
    assert (store / "plots" / "frontier_sst2.png").stat().st_size > 0
    text = (store / "report.md").read_text()
    for heading in ("## Learning–forgetting frontier", "### sst2: non-dominated points",
                    "### Forgetting at matched accuracy", "### Does ‖θ − θ*‖ predict functional forgetting?"):
        assert heading in text
    assert "Left out: 1 finished runs without forgetting metrics" in text
    with open(store / "frontier.csv") as f:
        rows = list(csv.DictReader(f))
    assert {r["kind"] for r in rows} == {"eval", "interpolated"}
    assert sum(r["non_dominated"] == "True" for r in rows) >= 1
    assert (store / "matched_accuracy.csv").is_file() and (store / "forgetting_correlation.csv").is_file()


def test_reference_method_errors_and_absence(tmp_path, capsys):
    write_store(tmp_path / "store", methods=("recadam", "lora"), without_forgetting=0)
    report = build_report(tmp_path / "store", bootstrap_samples=50)
    assert report.frontier.matched_rows == []
    assert "--reference-method" in report.markdown()
    chosen = build_report(tmp_path / "store", bootstrap_samples=50, reference_method="lora").frontier
    assert {r["reference"] for r in chosen.matched_rows} == {"lora"}
    assert report_main([str(tmp_path / "store"), "--reference-method", "vanilla", "--no-plots"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "valid: recadam, lora" in err[0]
    assert report_main([str(tmp_path / "store"), "--forgetting-measure", "l2", "--no-plots"]) == 2
    assert "valid: auto, mlm_forgetting, cka_drift_last, cka_drift_mean" in capsys.readouterr().err


def test_runs_without_forgetting_give_no_frontier_tables(tmp_path):
    root = tmp_path / "store"
    write_store(root, methods=(), without_forgetting=2)
    report = build_report(root, bootstrap_samples=50)
    assert not report.frontier.tasks and report.frontier.left_out == 2
    assert "frontier.csv" not in report.csv_tables()
    assert "No run has functional forgetting metrics (2 finished runs" in report.markdown()


def test_brute_force_helper_is_itself_right():
    # A 2-D staircase: (3,3) dominates (2,4)? no (forgetting higher is worse): (3,3) beats (2,4) on both.
    points = [(3.0, 3.0), (2.0, 4.0), (4.0, 5.0), (4.0, 5.0), (1.0, 1.0)]
    assert brute_force_non_dominated(points) == [True, False, True, True, True]
    assert all(len(non_dominated(list(p))) == len(p) for p in itertools.permutations(points[:3]))


@pytest.mark.parametrize("seed", range(8))
def test_exact_spearman_pvalue_equals_enumeration_by_hand(seed):
    rng = np.random.default_rng(seed)
    n = int(rng.integers(3, 8))
    x = rng.integers(0, 4, n).astype(float).tolist()   # ties included
    # odd seeds: ties in y too, where rho's null is not symmetric and "|rho| at least as large" is the rule
    y = (rng.integers(0, 3, n) if seed % 2 else rng.normal(size=n)).astype(float).tolist()
    if len(set(x)) < 2:
        x[0] = 9.0
    if len(set(y)) < 2:
        y[0] = 9.0
    rho = _spearman_by_hand(x, y)
    count = 0
    perms = list(itertools.permutations(y))
    for perm in perms:
        count += abs(_spearman_by_hand(x, list(perm))) >= abs(rho) - 1e-12
    assert _spearman(x, y) == pytest.approx((rho, count / len(perms)), abs=1e-12)


# The values the hand-written enumeration that scipy.stats.permutation_test replaced gave (sweep/frontier.py
# before issue 52); the last one has ties in both x and y, where scipy's two-sided test of rho reads 5/9.
@pytest.mark.parametrize("x, y, rho, pvalue", [
    ([1, 2, 3, 4], [1.5, 2.5, 3.5, 4.5], 1.0, 2 / 24),
    ([1, 2, 3, 4, 5], [2, 1, 4, 3, 5], 0.8, 16 / 120),
    ([1, 2, 3], [3, 1, 2], -0.5, 1.0),
    ([0.1, 0.5, 0.2, 0.9, 0.4, 0.7, 0.3, 0.8], [1, 3, 2, 8, 4, 5, 6, 7], 0.8333333333333335, 0.015376984126984126),
    ([1, 2, 2, 3, 5, 4], [1, 1, 2, 3, 3, 0.5], 0.3134677528639293, 0.5666666666666667),
])
def test_spearman_pvalues_of_the_former_implementation(x, y, rho, pvalue):
    assert _spearman(x, y) == pytest.approx((rho, pvalue), abs=1e-12)


def test_spearman_of_a_constant_and_beyond_the_exact_limit():
    assert all(np.isnan(v) for v in _spearman([1.0, 1.0, 1.0], [1.0, 2.0, 3.0]))
    x, y = list(range(9)), [2, 1, 3, 5, 4, 6, 8, 7, 9]   # 9 points: scipy's t approximation
    assert _spearman(x, y)[1] == pytest.approx(scipy.stats.spearmanr(x, y).pvalue, rel=1e-12)
