"""The forgetting-frontier sweep (configs/sweeps/forgetting_frontier.yaml: every method) on the tiny
BERT, one seed, each run reporting to MLflow (one experiment for the sweep), interpolated at its
end as the sweep's `interpolate:` asks, and ft-report showing the interpolation curves and the
learning–forgetting frontier, consistent with the runs' own files."""

from __future__ import annotations

import csv
import json
import math
from pathlib import Path

import pytest
import yaml

from tiny_run import sweep_in_this_process, write_run_config
from ft_framework.cli import report_main

pytest.importorskip("peft")
pytest.importorskip("mlflow")
pytestmark = pytest.mark.slow
REPO = Path(__file__).resolve().parents[2]
# The methods of the frontier sweep as the file defines them (the tiny model takes them as they are).
METHODS = yaml.safe_load((REPO / "configs" / "sweeps" / "forgetting_frontier.yaml").read_text())["methods"]


def test_frontier_sweep_of_every_method_with_interpolation_tracking_and_report(tiny_bert_dir, tmp_path, monkeypatch):
    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")  # MLflow 3: its file store is opt-in
    write_run_config(tmp_path / "base.yaml", tiny_bert_dir, tmp_path / "unused",
                     training={"max_steps": 3, "per_device_batch_size": 8, "seed": 1, "device": "cpu"},
                     evaluation={"num_evals": 2, "batch_size": 32})
    mlruns = (tmp_path / "mlruns").as_uri()
    sweep = {
        "name": "forget_test",
        "base": "base.yaml",
        "output_dir": str(tmp_path / "store"),
        "set": {"logging.report_to": ["mlflow"], "logging.mlflow.tracking_uri": mlruns},
        "axes": {"training.seed": [1]},
        "methods": METHODS,
        "interpolate": {"alphas": [0.0, 0.5, 1.0]},
        "runner": {"name": "local", "max_parallel": 2, "num_cpus_per_run": 1},
    }
    (tmp_path / "sweep.yaml").write_text(yaml.safe_dump(sweep, sort_keys=False))
    code, output = sweep_in_this_process(tmp_path, ["--config", str(tmp_path / "sweep.yaml"), "--no-progress"])
    assert code == 0, output[-6000:]

    index = json.loads((tmp_path / "store" / "index.json").read_text())
    runs = {entry["method"]: tmp_path / "store" / entry.get("dir", f"runs/{entry['id']}") for entry in index["runs"]}
    assert set(runs) == set(METHODS) and len(METHODS) >= 7
    for method, run_dir in runs.items():
        results = json.loads((run_dir / "results.json").read_text())
        interp = json.loads((run_dir / "interpolation.json").read_text())
        assert interp["alphas"] == [0.0, 0.5, 1.0]
        assert interp["rows"][-1]["metrics"] == results["final"]["metrics"], method
        # Each run interpolated itself at its end (the sweep's post-step found it up to date).
        assert f"wrote {run_dir}/interpolation.json" in (run_dir / "log.txt").read_text(), method
        assert (run_dir / "export" / "config.json").is_file()
    assert (runs["lora"] / "export" / "adapter" / "adapter_config.json").is_file()

    from mlflow.tracking import MlflowClient

    client = MlflowClient(mlruns)
    experiment = client.get_experiment_by_name("forget_test")
    tracked = client.search_runs([experiment.experiment_id])
    assert sorted(r.info.run_name for r in tracked) == sorted(f"{m} seed=1" for m in METHODS)
    for run in tracked:
        artifacts = {a.path for a in client.list_artifacts(run.info.run_id)}
        assert {"results.json", "interpolation.json", "interpolation.png"} <= artifacts

    assert report_main([str(tmp_path / "store"), "--bootstrap-samples", "100"]) == 0
    report = (tmp_path / "store" / "report.md").read_text()
    assert "## Interpolation toward θ*" in report
    section = report.split("## Interpolation toward θ*")[1]
    assert all(f"| {m} |" in section for m in METHODS)
    assert (tmp_path / "store" / "plots" / "interpolation_sst2.png").stat().st_size > 0
    check_frontier(tmp_path / "store", runs, report)


def check_frontier(store: Path, runs: dict[str, Path], report: str) -> None:
    """The frontier's figure, tables and points against the runs' metrics.jsonl and interpolation.json."""
    assert (store / "plots" / "frontier_sst2.png").stat().st_size > 0
    for heading in ("## Learning–forgetting frontier", "### Forgetting at matched accuracy",
                    "### Does ‖θ − θ*‖ predict functional forgetting?"):
        assert heading in report
    with open(store / "frontier.csv") as f:
        points = list(csv.DictReader(f))
    measure = points[0]["measure"]
    records = {m: [json.loads(line) for line in (d / "metrics.jsonl").read_text().splitlines()] for m, d in runs.items()}
    has_mlm = all("mlm_forgetting" in r["forgetting"] for rs in records.values() for r in rs if r.get("type") == "eval")
    assert measure == ("mlm_forgetting" if has_mlm else "cka_drift_last")   # ft-report's automatic choice
    for method, run_dir in runs.items():
        evals = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
        evals = [r for r in evals if r.get("type") == "eval"]
        want = sorted((r["step"], r["forgetting"][measure], r["forgetting_distance"]) for r in evals)
        got = sorted((int(p["step"]), float(p["forgetting"]), float(p["distance"])) for p in points
                     if p["method"] == method and p["kind"] == "eval")
        assert got == [pytest.approx(w) for w in want], method
        rows = json.loads((run_dir / "interpolation.json").read_text())["rows"]
        got = sorted((float(p["alpha"]), float(p["forgetting"])) for p in points
                     if p["method"] == method and p["kind"] == "interpolated")
        # θ_1 is the run's reported model, counted once, as an evaluation point.
        assert got == [pytest.approx((r["alpha"], r["forgetting"][measure])) for r in rows if r["alpha"] != 1.0], method
        # θ_0 is θ* under the fine-tuned head: its encoder forgot nothing.
        assert abs(got[0][1]) < 1e-4, method
    assert any(p["non_dominated"] == "True" for p in points)
    with open(store / "matched_accuracy.csv") as f:
        matched = {r["method"]: r for r in csv.DictReader(f)}
    assert set(METHODS) <= set(matched)
    assert int(matched["vanilla"]["reached"]) >= 1   # vanilla's best point reaches 99% of itself
    with open(store / "forgetting_correlation.csv") as f:
        overall = next(r for r in csv.DictReader(f) if r["method"] == "all")
    assert int(overall["n"]) == sum(p["kind"] == "eval" for p in points)
    assert math.isfinite(float(overall["rho"])) and -1.0 <= float(overall["rho"]) <= 1.0
