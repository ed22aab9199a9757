"""Grid expansion: a SweepSpec becomes a list of resolved, validated run configs, each with an
identity that is a hash of its resolved config.

    runs = expand(load_sweep("configs/sweeps/quickstart_grid.yaml"), store_root="runs/sweeps/q")
    runs[0].run_id, runs[0].method, runs[0].axes, runs[0].config  # RunConfig, output_dir set

The identity is sha256 of the canonical JSON of the resolved config's values that differ from the
schema's defaults, without the keys that do not change what a run computes (where it writes,
whether it draws a progress bar, whether it resumes), first 12 hex digits. The same config in two
sweeps is the same run id; a key a later release adds at a default that computes what the run
computed before (a method that is off unless asked for) leaves every earlier run id as it was, so
re-running a sweep that gained methods runs only the new ones.
"""

from __future__ import annotations

import hashlib
import itertools
import json
import math
from copy import deepcopy
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterable, Sequence

from ft_framework.config import (ConfigError, RunConfig, apply_overrides, parse_override, resolve_task_overrides,
                                 set_path, validate_config)
from ft_framework.run.files import EXPORT_DIR, RUNS_SUBDIR

from ft_framework.sweep.spec import SweepSpec

__all__ = ["PlannedRun", "IDENTITY_EXCLUDED", "run_identity", "expand", "RUNS_SUBDIR"]

# Config keys left out of a run's identity: they change where and how a run reports, not its result.
IDENTITY_EXCLUDED: tuple[tuple[str, ...], ...] = (
    ("logging", "output_dir"),
    # Interpolation after training evaluates the finished model; it does not change it.
    ("evaluation", "interpolation"),
    ("logging", "progress_bar"),
    ("checkpoint", "resume_from"),
    # Trackers (ft_framework/tracking.py): where a run reports, not what it computes.
    ("logging", "report_to"),
    ("logging", "run_name"),
    ("logging", "experiment"),
    ("logging", "mlflow"),
    ("logging", "wandb"),
)


@dataclass
class PlannedRun:
    """One run of the grid."""

    run_id: str
    method: str
    # Axis key -> value of this run (shared axes first, then the method's own).
    axes: dict[str, Any]
    config: RunConfig
    # Config keys the method fixes (for the record).
    fixed: dict[str, Any] = field(default_factory=dict)

    @property
    def task(self) -> str:
        return self.config.data.task_spec().name

    @property
    def seed(self) -> int:
        return self.config.training.seed

    @property
    def output_dir(self) -> Path:
        return Path(self.config.logging.output_dir)

    def label(self) -> str:
        """method + axis values, for listings and logs."""
        parts = [f"{k.rsplit('.', 1)[-1]}={_short(v)}" for k, v in self.axes.items()]
        return " ".join([self.method, *parts])

    def describe(self) -> dict[str, Any]:
        """What the store keeps about the run besides its config (run.json / index entries)."""
        return {"id": self.run_id, "method": self.method, "task": self.task, "seed": self.seed,
                "axes": _jsonable(self.axes), "fixed": _jsonable(self.fixed)}


def _short(value: Any) -> str:
    if isinstance(value, float):
        return f"{value:g}"
    if isinstance(value, (dict, list)):
        return json.dumps(value, separators=(",", ":"), sort_keys=True)
    return str(value)


def _jsonable(value: Any) -> Any:
    """JSON-safe copy: inf/nan floats as strings are avoided by keeping them as floats (json allows)."""
    return json.loads(json.dumps(value, default=str))


def _canonical(value: Any) -> Any:
    """Normalizes numbers so 1 and 1.0 hash alike only where the schema made them alike already."""
    if isinstance(value, dict):
        return {str(k): _canonical(v) for k, v in sorted(value.items(), key=lambda kv: str(kv[0]))}
    if isinstance(value, (list, tuple)):
        return [_canonical(v) for v in value]
    if isinstance(value, float) and not math.isfinite(value):
        return {"__float__": repr(value)}
    return value


def run_identity(config: RunConfig) -> str:
    """12 hex digits of sha256 over the canonical JSON of the resolved config (see module doc)."""
    data = config.model_dump(mode="json", exclude_defaults=True)
    for path in IDENTITY_EXCLUDED:
        node = data
        for part in path[:-1]:
            node = node.get(part) if isinstance(node, dict) else None
            if node is None:
                break
        if isinstance(node, dict):
            node.pop(path[-1], None)
    text = json.dumps(_canonical(data), sort_keys=True, separators=(",", ":"), allow_nan=False)
    return hashlib.sha256(text.encode()).hexdigest()[:12]


def _with(data: dict[str, Any], values: dict[str, Any], overrides: Sequence[str]) -> dict[str, Any]:
    out = deepcopy(data)
    for key, value in values.items():
        set_path(out, key, value)
    return apply_overrides(out, overrides) if overrides else out


def _combinations(axes: dict[str, list[Any]]) -> Iterable[dict[str, Any]]:
    keys = list(axes)
    for values in itertools.product(*(axes[k] for k in keys)):
        yield dict(zip(keys, values))


def expand(spec: SweepSpec, overrides: Sequence[str] = (), store_root: str | Path | None = None) -> list[PlannedRun]:
    """Every run of the grid, validated with the real run-config schema.

    Order: methods in file order; within a method the product of the shared axes then the method's
    axes, the last axis varying fastest. Values are applied in the order: the sweep's `set`, the
    method's `set`, the axis values, the command-line `overrides` (every run); all of them win over
    the base config's task_overrides.
    Each run's logging.output_dir is ``<store_root>/runs/<run id>`` and its progress bar is off.
    """
    overrides = list(overrides)
    for text in overrides:
        parse_override(text)  # a malformed override is an error before anything runs
    root = Path(store_root if store_root is not None else spec.output_dir).absolute()
    methods = spec.methods or {None: None}
    runs: list[PlannedRun] = []
    seen: dict[str, PlannedRun] = {}
    base_cache: dict[Any, dict[str, Any]] = {}
    for method_name, method in methods.items():
        key = json.dumps(method.base, sort_keys=True, default=str) if method and method.base is not None else None
        if key not in base_cache:
            try:
                base_cache[key] = spec.base_data(method_name)
            except ConfigError as e:
                where = f"methods.{method_name}.base" if key is not None else "base"
                raise ConfigError(f"{where}: {e}") from None
        base = base_cache[key]
        fixed = {**spec.set, **(method.set if method else {})}
        axes = {**spec.axes, **(method.axes if method else {})}
        for combo in _combinations(axes):
            values = {**fixed, **combo}
            data = _with(base, values, overrides)
            label = method_name if method_name is not None else "(no method)"
            where = f"for method {label} with {', '.join(f'{k}={_short(v)}' for k, v in combo.items()) or 'no axes'}"
            # Merge the run's own task_overrides entry first: the other tasks' entries are checked
            # by the runs of those tasks (validating every variant of every run is 9x the work).
            data = _with(resolve_task_overrides(data), values, overrides)  # the sweep's values win
            cfg = validate_config(data, where=where)
            name = method_name if method_name is not None else cfg.optimizer.name
            run_id = run_identity(cfg)
            run_dir = root / RUNS_SUBDIR / run_id
            # Trackers: the sweep's runs share one MLflow experiment / W&B group, named by the sweep.
            logging_cfg = cfg.logging.model_copy(update={
                "output_dir": str(run_dir), "progress_bar": False,
                "experiment": cfg.logging.experiment or spec.name or root.name,
                "run_name": cfg.logging.run_name or " ".join(
                    [name, *[f"{k.rsplit('.', 1)[-1]}={_short(v)}" for k, v in combo.items()]])})
            update: dict[str, Any] = {"logging": logging_cfg}
            if getattr(spec, "interpolate", None) is not None:
                # Each run interpolates itself at its end (its own process and resources); the
                # post-step does the ones that did not. Both need the final weights: exported into the run.
                if not cfg.checkpoint.export_dir:
                    update["checkpoint"] = cfg.checkpoint.model_copy(update={"export_dir": str(run_dir / EXPORT_DIR)})
                update["evaluation"] = cfg.evaluation.model_copy(update={"interpolation": spec.interpolate})
            cfg = cfg.model_copy(update=update)
            run = PlannedRun(run_id=run_id, method=name, axes=dict(combo), config=cfg, fixed=fixed)
            if run_id in seen:
                other = seen[run_id]
                raise ConfigError(
                    f"two grid points resolve to the same run config (id {run_id}): [{other.label()}] and "
                    f"[{run.label()}]; an axis value has no effect there (or a method repeats another)")
            seen[run_id] = run
            runs.append(run)
    _refuse_shared_exports(runs)
    return runs


def _refuse_shared_exports(runs: Sequence[PlannedRun]) -> None:
    """Two runs exporting into one checkpoint.export_dir (the base config sets one for every run)
    would replace each other's export, or refuse it: refused in one line before anything runs."""
    by_dir: dict[str, list[PlannedRun]] = {}
    for run in runs:
        if run.config.checkpoint.export_dir:
            by_dir.setdefault(str(Path(run.config.checkpoint.export_dir).absolute()), []).append(run)
    for directory, sharing in by_dir.items():
        if len(sharing) > 1:
            raise ConfigError(
                f"checkpoint.export_dir: {len(sharing)} runs of the sweep ({sharing[0].run_id}, {sharing[1].run_id}"
                f"{', ...' if len(sharing) > 2 else ''}) would all export into {directory}, each replacing or "
                "refusing the other's export; leave it unset in the sweep's base config (with interpolate: set, each "
                "run exports into its own runs/<id>/export) or give it a value per run (an axis)")
