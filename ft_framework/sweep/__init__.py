"""Sweeps: a grid of runs from one YAML file, run locally, on a Ray cluster or as SLURM jobs, stored one directory
per run, and reported as the RecAdam paper's tables and figures.

    from ft_framework.sweep import load_sweep, run_sweep, build_report
    result = run_sweep(load_sweep("configs/sweeps/quickstart_grid.yaml"))
    print(build_report(result.store.root).markdown())

Modules: spec (the sweep file's schema), grid (expansion, run identity), store (the results
directory), runners (a run's subprocess, the local runner), ray_runner (the Ray runner), slurm_runner
(the SLURM runner) and slurm_job (inside a SLURM job), driver (a
sweep from start to end, which runner), postprocess (steps after the runs: interpolation), records
(the runs of a store as the report reads them), report and stats (tables, Levene's test, expected
best of n trials, the interpolation section), plots (PNG figures).
"""

from __future__ import annotations

import importlib
from typing import Any

# Each name's module, imported on first use: a SLURM job's runner (slurm_job.py) imports this package
# but needs neither the report's scipy nor the driver's torch.
_LAZY = {
    "SweepSpec": "spec", "RunnerSpec": "spec", "load_sweep": "spec", "validate_sweep": "spec",
    "PlannedRun": "grid", "expand": "grid", "run_identity": "grid",
    "SweepStore": "store", "SweepLockedError": "store",
    "LocalRunner": "runners", "SweepInterrupted": "runners", "RayRunner": "ray_runner", "SlurmRunner": "slurm_runner",
    "SweepResult": "driver", "make_runner": "driver", "plan_sweep": "driver", "run_sweep": "driver",
    "format_plan": "driver",
    "Report": "report", "build_report": "report",
}

__all__ = list(_LAZY)


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        return getattr(importlib.import_module(f"ft_framework.sweep.{_LAZY[name]}"), name)
    raise AttributeError(f"module 'ft_framework.sweep' has no attribute {name!r}")
