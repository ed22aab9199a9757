"""The forgetting-methods grid on the tiny BERT: vanilla, RecAdam and LoRA on the same seed, each run
reporting to MLflow (one experiment for the sweep), interpolated by the sweep's `interpolate:`
post-step, and ft-report showing the interpolation curves per method."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from tiny_run import write_run_config
from ft_framework.cli import report_main

pytest.importorskip("peft")
pytest.importorskip("mlflow")
REPO = Path(__file__).resolve().parents[2]


def test_grid_of_methods_with_interpolation_post_step_and_tracking(tiny_bert_dir, tmp_path, monkeypatch):
    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")  # MLflow 3: its file store is opt-in
    write_run_config(tmp_path / "base.yaml", tiny_bert_dir, tmp_path / "unused",
                     training={"max_steps": 3, "per_device_batch_size": 8, "seed": 1, "device": "cpu"},
                     evaluation={"num_evals": 1, "batch_size": 32})
    mlruns = (tmp_path / "mlruns").as_uri()
    sweep = {
        "name": "forget_test",
        "base": "base.yaml",
        "output_dir": str(tmp_path / "store"),
        "set": {"logging.report_to": ["mlflow"], "logging.mlflow.tracking_uri": mlruns},
        "axes": {"training.seed": [1]},
        "methods": {"vanilla": {"optimizer": {"name": "adamw", "hparams": {"lr": 5e-3}}},
                    "recadam": {},
                    "lora": {"model.lora": {"r": 4, "alpha": 8},
                             "optimizer": {"name": "adamw", "hparams": {"lr": 5e-3}}}},
        "interpolate": {"alphas": [0.0, 0.5, 1.0]},
        "runner": {"name": "local", "max_parallel": 2, "num_cpus_per_run": 1},
    }
    (tmp_path / "sweep.yaml").write_text(yaml.safe_dump(sweep, sort_keys=False))
    out = subprocess.run([sys.executable, str(REPO / "launch" / "sweep.py"), "--config", str(tmp_path / "sweep.yaml"),
                          "--no-progress"], cwd=tmp_path, capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]

    index = json.loads((tmp_path / "store" / "index.json").read_text())
    runs = {entry["method"]: tmp_path / "store" / entry.get("dir", f"runs/{entry['id']}") for entry in index["runs"]}
    assert set(runs) == {"vanilla", "recadam", "lora"}
    for method, run_dir in runs.items():
        results = json.loads((run_dir / "results.json").read_text())
        interp = json.loads((run_dir / "interpolation.json").read_text())
        assert interp["alphas"] == [0.0, 0.5, 1.0]
        assert interp["rows"][-1]["metrics"] == results["final"]["metrics"], method
        assert (run_dir / "export" / "config.json").is_file()
    assert (runs["lora"] / "export" / "adapter" / "adapter_config.json").is_file()

    from mlflow.tracking import MlflowClient

    client = MlflowClient(mlruns)
    experiment = client.get_experiment_by_name("forget_test")
    tracked = client.search_runs([experiment.experiment_id])
    assert sorted(r.info.run_name for r in tracked) == ["lora seed=1", "recadam seed=1", "vanilla seed=1"]
    for run in tracked:
        artifacts = {a.path for a in client.list_artifacts(run.info.run_id)}
        assert {"results.json", "interpolation.json", "interpolation.png"} <= artifacts

    assert report_main([str(tmp_path / "store"), "--bootstrap-samples", "100"]) == 0
    report = (tmp_path / "store" / "report.md").read_text()
    assert "## Interpolation toward θ*" in report
    section = report.split("## Interpolation toward θ*")[1]
    assert all(f"| {m} |" in section for m in ("vanilla", "recadam", "lora"))
    assert (tmp_path / "store" / "plots" / "interpolation_sst2.png").stat().st_size > 0
