"""The names of the files a run and a sweep write: the one place they are spelled. Other tools read
these files (ft-report, a user's scripts), so a name here is an on-disk contract.

A run's output directory (``logging.output_dir``)::

    results.json            the final results (written last, atomically: its presence means "done")
    metrics.jsonl           one JSON record per log line or evaluation
    trackers.json           the MLflow / W&B runs it logs to (a resumed run logs into the same ones)
    tensorboard/            TensorBoard events (logging.tensorboard: true)
    checkpoints/latest      the name of the newest complete checkpoint
    checkpoints/step_N/     one checkpoint: the strategy's files, trainer_state.pt and a COMPLETE marker
    checkpoints/best/       the best evaluation's checkpoint, same layout (evaluation.select_best: true)
    .export_checkpoint/     scratch: the final step's checkpoint, saved for the export and removed after
    interpolation.json      ft-interpolate's results, and its plot interpolation.png
    forgetting_reference/   a causal LM's forgetting probe as θ* answered it before the first step
                            (one safetensors file per rank that measured it), read again on resume
    benchmark_reference.json  θ*'s lm-eval benchmark scores (evaluation.benchmarks), read again on resume
    overwritten-<timestamp>/  a previous run's files, moved aside by logging.overwrite=true
    .ft-train.lock(.json)   the one-writer lock rank 0 holds while the run lives, and who holds it

A sweep's store adds, at its root, index.json, sweep.yaml and runs/<run id>/ (each a run output
directory plus config.yaml, run.json, status.json, log.txt and, for a sweep that interpolates,
export/). ft-report writes report.md, its CSVs and plots/ into the sweep directory (or --out).

    paths = RunPaths(cfg.logging.output_dir)
    paths.results, paths.metrics, paths.latest_checkpoint
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

# ---- a run's output directory --------------------------------------------------------------------
RESULTS_FILE = "results.json"
METRICS_FILE = "metrics.jsonl"
TENSORBOARD_DIR = "tensorboard"
CHECKPOINTS_DIR = "checkpoints"
EXPORT_SCRATCH_DIR = ".export_checkpoint"  # the final step's checkpoint when none was saved at it
TRACKERS_FILE = "trackers.json"
INTERPOLATION_FILE = "interpolation.json"
INTERPOLATION_PLOT = "interpolation.png"
FORGETTING_REFERENCE_DIR = "forgetting_reference"
BENCHMARK_REFERENCE_FILE = "benchmark_reference.json"
MOVED_ASIDE_PREFIX = "overwritten-"  # + a timestamp: the directory logging.overwrite moves a run into
RUN_LOCK_FILE = ".ft-train.lock"  # held (flock) by rank 0 for the whole run: one writer per output directory
RUN_LOCK_INFO_FILE = ".ft-train.lock.json"  # who holds it: host, pid, start time

# ---- in the output root (the directory that holds runs' output directories) -------------------------
MLFLOW_DB_FILE = "mlflow.db"  # the default MLflow store: sqlite:///<output root>/mlflow.db
MLFLOW_ARTIFACTS_DIR = "mlflow-artifacts"  # its artifacts, beside it

# ---- inside checkpoints/ -------------------------------------------------------------------------
LATEST_FILE = "latest"
CHECKPOINT_PREFIX = "step_"
BEST_CHECKPOINT = "best"  # evaluation.select_best's checkpoint (never pruned, never `latest`)
COMPLETE_MARKER = "COMPLETE"
TRAINER_STATE_FILE = "trainer_state.pt"

# ---- a sweep's store -----------------------------------------------------------------------------
INDEX_FILE = "index.json"
SWEEP_FILE = "sweep.yaml"
RUNS_SUBDIR = "runs"
LOCK_FILE = ".sweep.lock"
# ...and in each run directory of the store, besides the run's own files:
RUN_CONFIG_FILE = "config.yaml"
RUN_INFO_FILE = "run.json"
STATUS_FILE = "status.json"
LOG_FILE = "log.txt"
EXPORT_DIR = "export"  # the final weights, when the sweep interpolates and the config sets no export_dir

# ---- ft-report's output (the sweep directory unless --out) ------------------------------------
REPORT_FILE = "report.md"
REPORT_PLOTS_DIR = "plots"  # each plot's file name is spelled where it is drawn (sweep/plots.py)


def checkpoint_name(step: int) -> str:
    """Directory name of the checkpoint after optimizer step `step` (zero-padded: sorts by step)."""
    return f"{CHECKPOINT_PREFIX}{step:08d}"


@dataclass(frozen=True)
class RunPaths:
    """The paths of a run's files under its output directory."""

    root: Path

    def __init__(self, root: str | Path):
        object.__setattr__(self, "root", Path(root))

    @property
    def results(self) -> Path:
        return self.root / RESULTS_FILE

    @property
    def metrics(self) -> Path:
        return self.root / METRICS_FILE

    @property
    def tensorboard(self) -> Path:
        return self.root / TENSORBOARD_DIR

    @property
    def checkpoints(self) -> Path:
        return self.root / CHECKPOINTS_DIR

    @property
    def best_checkpoint(self) -> Path:
        """The best evaluation's checkpoint (evaluation.select_best), in the sharded layout."""
        return self.checkpoints / BEST_CHECKPOINT

    @property
    def forgetting_reference(self) -> Path:
        """θ*'s answers to a causal LM's forgetting probe, kept for the run's later measurements."""
        return self.root / FORGETTING_REFERENCE_DIR

    @property
    def benchmark_reference(self) -> Path:
        """θ*'s benchmark scores (evaluation.benchmarks), kept for the run's later measurements."""
        return self.root / BENCHMARK_REFERENCE_FILE

    @property
    def export_scratch(self) -> Path:
        return self.root / EXPORT_SCRATCH_DIR

    @property
    def latest_checkpoint(self) -> Path:
        """The pointer file naming the newest complete checkpoint (absent before the first save)."""
        return self.checkpoints / LATEST_FILE
