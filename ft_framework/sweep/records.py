"""The runs of a sweep store (or the one run of a run directory) as the report reads them: one
RunRecord per run with its method, task, seed, setting (the axis values other than the task and the
seeds) and state, and for a finished run its score on the score split and on the selection split,
in the report's unit (points, x100, or a loss as it is: sweep/scores.py), from its status.json and
results.json.

    records = load_records("runs/sweeps/glue_recadam")
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterable, Sequence

import yaml

from ft_framework.config.overrides import yaml_error_text
from ft_framework.config.yaml_loader import load_yaml
from ft_framework.errors import quoted, shortened
from ft_framework.run.files import (INDEX_FILE, INTERPOLATION_FILE, METRICS_FILE, RESULTS_FILE, RUNS_SUBDIR,
                                    STATUS_FILE, SWEEP_FILE)

from ft_framework.user_files import MissingFile, UserFileError, open_binary, read_text

from ft_framework.sweep.scores import score_scale
from ft_framework.sweep.store import SweepStore, read_store_json

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
    score: float | None = None             # reported main metric on the score split (x100; a loss as is)
    selection_score: float | None = None   # the same on the selection split
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
    """The run's metrics.jsonl records (a regular file inside the run's directory, user_files.py);
    a line cut by a crash, or one that is no JSON object, is skipped."""
    path = run.directory / METRICS_FILE
    out = []
    if path.is_file():
        with open_binary(path, root=run.directory) as f:
            for line in f:
                try:
                    record = json.loads(line)
                except (json.JSONDecodeError, UnicodeDecodeError, RecursionError):
                    continue
                if isinstance(record, dict):
                    out.append(record)
    return out


def read_interpolation(run: RunRecord) -> dict[str, Any] | None:
    """The run's interpolation.json (ft-interpolate, or the sweep's post-step); None when it has
    none or the file is unreadable."""
    return read_store_json(run.directory / INTERPOLATION_FILE, run.directory)


def setting_label(setting: Iterable[tuple[str, str]]) -> str:
    parts = [f"{k.rsplit('.', 1)[-1]}={v}" for k, v in setting]
    return ", ".join(parts) if parts else "(single setting)"


def _value_text(value: Any) -> str:
    if isinstance(value, float):
        return f"{value:g}"
    if isinstance(value, (dict, list)):
        return json.dumps(value, sort_keys=True, separators=(",", ":"))
    return str(value)


def _seed_keys(root: Path) -> tuple[str, ...]:
    """report.seed_keys of the store's sweep.yaml (DEFAULT_SEED_KEYS without one). A store handed to
    us is data: read through user_files and the bounded YAML loader (no alias bombs, no duplicate
    keys, no nesting past NESTING_LIMIT); one that cannot be read is refused in one line."""
    path = root / SWEEP_FILE
    try:
        data = load_yaml(read_text(path, root=root, entry=f"the store's {SWEEP_FILE}")) or {}
    except MissingFile:
        return DEFAULT_SEED_KEYS
    except yaml.YAMLError as exc:
        raise UserFileError(f"{path}: {yaml_error_text(exc)}") from None
    report = data.get("report") if isinstance(data, dict) else None
    keys = report.get("seed_keys") if isinstance(report, dict) else None
    if keys is None:
        return DEFAULT_SEED_KEYS
    if not isinstance(keys, list) or not all(isinstance(k, str) for k in keys):
        raise UserFileError(f"{path}: report.seed_keys is {quoted(keys)}, not a list of config keys")
    return tuple(keys) or DEFAULT_SEED_KEYS


def _score_split(results: dict[str, Any]) -> str:
    """The held-out half ('test…') when the dev set was split, else the selection split."""
    selection = results["selection_split"]
    reported = results[results["reported"]]["metrics"]
    held_out = "test" + selection[len("validation"):] if selection.startswith("validation") else None
    return held_out if held_out in reported else selection


def _record_from(entry: dict[str, Any], directory: Path, state: str, seed_keys: Sequence[str]) -> RunRecord:
    axes = entry.get("axes") if isinstance(entry.get("axes"), dict) else {}
    setting = tuple((k, _value_text(v)) for k, v in axes.items() if k != "data.task" and k not in seed_keys)
    rec = RunRecord(run_id=entry["id"], method=entry["method"], task=entry.get("task"), seed=entry.get("seed"),
                    axes=axes, setting=setting, state=state, directory=directory)
    results = read_store_json(directory / RESULTS_FILE, directory) if state in ("finished", "diverged") else None
    if results is None:
        if state in ("finished", "diverged"):
            rec.state = "failed"
        return rec
    try:
        return _with_results(rec, results)
    except (KeyError, TypeError, ValueError, AttributeError) as exc:
        raise UserFileError(f"{directory / RESULTS_FILE}: not the results.json of a run of ft-train (it lacks what the "
                            f"report reads: {type(exc).__name__} {shortened(str(exc))})") from None


def _with_results(rec: RunRecord, results: dict[str, Any]) -> RunRecord:
    """`rec` with what a run's results.json says of it."""
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
    # Points (a loss as it is), rounded past float noise (0.58 -> 58.0, not 57.99999999999999).
    rec.score = round(score_scale(main) * float(metrics[split][main]), 10)
    rec.selection_score = round(score_scale(main) * float(metrics[selection][main]), 10)
    rec.failed = bool(results.get("failed"))
    rec.config = results.get("config")
    return rec


def load_records(directory: str | Path) -> list[RunRecord]:
    """Every run of a sweep store (or the one run of a run directory), finished or not."""
    root = Path(directory)
    if (root / RESULTS_FILE).is_file() and not (root / INDEX_FILE).is_file():
        results = read_store_json(root / RESULTS_FILE, root) or {}
        cfg = results.get("config") if isinstance(results.get("config"), dict) else {}
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
        status = read_store_json(run_dir / STATUS_FILE, run_dir) or {}
        state = status.get("state", entry.get("state", "pending"))
        records.append(_record_from(entry, run_dir, state, seed_keys))
    return records
