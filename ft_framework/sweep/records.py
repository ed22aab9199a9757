"""The runs of a sweep store (or the one run of a run directory) as the report reads them: one
RunRecord per run with its method, task, seed, setting (the axis values other than the task and the
seeds) and state, and for a finished run its score on the score split and on the selection split,
in points (x100), from its status.json and results.json.

    records = load_records("runs/sweeps/glue_recadam")
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterable, Sequence

import yaml

from ft_framework.config.yaml_loader import load_yaml
from ft_framework.run.files import (INDEX_FILE, INTERPOLATION_FILE, METRICS_FILE, RESULTS_FILE, RUNS_SUBDIR,
                                    STATUS_FILE, SWEEP_FILE)

from ft_framework.sweep.store import SweepStore

__all__ = ["DEFAULT_SEED_KEYS", "RunRecord", "load_records", "read_interpolation", "read_metrics", "setting_label"]

DEFAULT_SEED_KEYS = ("training.seed", "training.data_seed")


@dataclass
class RunRecord:
    """One run of the store, as the report sees it."""

    run_id: str
    method: str
    task: str
    seed: Any
    axes: dict[str, Any]
    setting: tuple[tuple[str, str], ...]   # axis values other than task and seeds, as text
    state: str
    directory: Path
    score: float | None = None             # reported main metric on the score split, x100
    selection_score: float | None = None   # the same on the selection split, x100
    failed: bool | None = None
    diverged: dict[str, Any] | None = None   # results.json's {"step", "what"} of a diverged run
    train_examples: int | None = None       # the training-set size the run had
    main_metric: str | None = None
    score_split: str | None = None
    config: dict[str, Any] | None = None

    @property
    def finished(self) -> bool:
        return self.state == "finished" and self.score is not None

    @property
    def setting_label(self) -> str:
        return setting_label(self.setting)


def read_metrics(run: RunRecord) -> list[dict[str, Any]]:
    """The run's metrics.jsonl records; a line cut by a crash is skipped."""
    path = run.directory / METRICS_FILE
    out = []
    if path.is_file():
        for line in path.read_text().splitlines():
            try:
                out.append(json.loads(line))
            except json.JSONDecodeError:
                continue
    return out


def read_interpolation(run: RunRecord) -> dict[str, Any] | None:
    """The run's interpolation.json (ft-interpolate, or the sweep's post-step); None when it has
    none or the file is unreadable."""
    return _read_json(run.directory / INTERPOLATION_FILE)


def setting_label(setting: Iterable[tuple[str, str]]) -> str:
    parts = [f"{k.rsplit('.', 1)[-1]}={v}" for k, v in setting]
    return ", ".join(parts) if parts else "(single setting)"


def _value_text(value: Any) -> str:
    if isinstance(value, float):
        return f"{value:g}"
    if isinstance(value, (dict, list)):
        return json.dumps(value, sort_keys=True, separators=(",", ":"))
    return str(value)


def _read_json(path: Path) -> dict[str, Any] | None:
    try:
        return json.loads(path.read_text())
    except (FileNotFoundError, json.JSONDecodeError):
        return None


def _seed_keys(root: Path) -> tuple[str, ...]:
    try:
        # a store handed to us is data: the bounded loader (no alias bombs, no duplicate keys)
        data = load_yaml((root / SWEEP_FILE).read_text()) or {}
        keys = (data.get("report") or {}).get("seed_keys")
        return tuple(keys) if keys else DEFAULT_SEED_KEYS
    except (FileNotFoundError, yaml.YAMLError, AttributeError):
        return DEFAULT_SEED_KEYS


def _score_split(results: dict[str, Any]) -> str:
    """The held-out half ('test…') when the dev set was split, else the selection split."""
    selection = results["selection_split"]
    reported = results[results["reported"]]["metrics"]
    held_out = "test" + selection[len("validation"):] if selection.startswith("validation") else None
    return held_out if held_out in reported else selection


def _record_from(entry: dict[str, Any], directory: Path, state: str, seed_keys: Sequence[str]) -> RunRecord:
    axes = entry.get("axes") or {}
    setting = tuple((k, _value_text(v)) for k, v in axes.items() if k != "data.task" and k not in seed_keys)
    rec = RunRecord(run_id=entry["id"], method=entry["method"], task=entry.get("task"), seed=entry.get("seed"),
                    axes=axes, setting=setting, state=state, directory=directory)
    results = _read_json(directory / RESULTS_FILE) if state in ("finished", "diverged") else None
    if results is None:
        if state in ("finished", "diverged"):
            rec.state = "failed"
        return rec
    rec.train_examples = results.get("train_examples")
    if results.get("diverged"):
        rec.state, rec.diverged, rec.failed = "diverged", results["diverged"], True
        rec.task = results.get("task", rec.task)
        return rec
    main, selection = results["main_metric"], results["selection_split"]
    metrics = results[results["reported"]]["metrics"]
    split = _score_split(results)
    rec.task = results.get("task", rec.task)
    rec.main_metric, rec.score_split = main, split
    # Points, rounded past float noise (0.58 -> 58.0, not 57.99999999999999).
    rec.score = round(100.0 * float(metrics[split][main]), 10)
    rec.selection_score = round(100.0 * float(metrics[selection][main]), 10)
    rec.failed = bool(results.get("failed"))
    rec.config = results.get("config")
    return rec


def load_records(directory: str | Path) -> list[RunRecord]:
    """Every run of a sweep store (or the one run of a run directory), finished or not."""
    root = Path(directory)
    if (root / RESULTS_FILE).is_file() and not (root / INDEX_FILE).is_file():
        results = _read_json(root / RESULTS_FILE) or {}
        cfg = results.get("config") or {}
        entry = {"id": root.name, "method": (cfg.get("optimizer") or {}).get("name", "run"),
                 "task": results.get("task"), "seed": (cfg.get("training") or {}).get("seed"), "axes": {}}
        return [_record_from(entry, root, "finished", DEFAULT_SEED_KEYS)]
    store = SweepStore(root)
    entries = store.list_runs()
    if not entries:
        raise FileNotFoundError(f"{root} holds neither a sweep ({INDEX_FILE}, {RUNS_SUBDIR}/) nor a run "
                                f"({RESULTS_FILE})")
    seed_keys = _seed_keys(root)
    records = []
    for entry in entries:
        run_dir = root / entry.get("dir", f"{RUNS_SUBDIR}/{entry['id']}")
        status = _read_json(run_dir / STATUS_FILE) or {}
        state = status.get("state", entry.get("state", "pending"))
        records.append(_record_from(entry, run_dir, state, seed_keys))
    return records
