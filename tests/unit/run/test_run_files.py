"""The run files' names are an on-disk contract (ft-report, users' scripts and older runs read
them): this is the one test that spells them, so a rename is a deliberate, visible change."""

from __future__ import annotations

from pathlib import Path

from ft_framework.run import files as run_files
from ft_framework.run.files import RunPaths, checkpoint_name


def test_the_names_on_disk():
    assert (run_files.RESULTS_FILE, run_files.METRICS_FILE, run_files.TENSORBOARD_DIR) == (
        "results.json", "metrics.jsonl", "tensorboard")
    assert (run_files.CHECKPOINTS_DIR, run_files.LATEST_FILE, run_files.COMPLETE_MARKER,
            run_files.TRAINER_STATE_FILE) == ("checkpoints", "latest", "COMPLETE", "trainer_state.pt")
    assert (run_files.INDEX_FILE, run_files.SWEEP_FILE, run_files.RUNS_SUBDIR) == ("index.json", "sweep.yaml", "runs")
    assert (run_files.RUN_CONFIG_FILE, run_files.RUN_INFO_FILE, run_files.STATUS_FILE, run_files.LOG_FILE) == (
        "config.yaml", "run.json", "status.json", "log.txt")
    assert (run_files.TRACKERS_FILE, run_files.INTERPOLATION_FILE, run_files.INTERPOLATION_PLOT) == (
        "trackers.json", "interpolation.json", "interpolation.png")
    assert (run_files.MOVED_ASIDE_PREFIX, run_files.EXPORT_DIR) == ("overwritten-", "export")
    assert (run_files.REPORT_FILE, run_files.REPORT_PLOTS_DIR) == ("report.md", "plots")


def test_run_paths_and_checkpoint_names():
    paths = RunPaths("runs/x")
    assert paths.results == Path("runs/x/results.json") and paths.metrics == Path("runs/x/metrics.jsonl")
    assert paths.best_checkpoint == Path("runs/x/checkpoints/best") and paths.tensorboard == Path("runs/x/tensorboard")
    assert paths.latest_checkpoint == Path("runs/x/checkpoints/latest")
    assert paths.export_scratch == Path("runs/x/.export_checkpoint")
    # Zero-padded so that sorting the names sorts the checkpoints by step.
    assert checkpoint_name(7) == "step_00000007"
    assert sorted(checkpoint_name(s) for s in (100, 7, 12)) == [checkpoint_name(s) for s in (7, 12, 100)]
