"""Sweeps: a grid of runs from one YAML file, run locally or on a Ray cluster, stored one directory
per run, and reported as the RecAdam paper's tables and figures.

    from ft_framework.sweep import load_sweep, run_sweep, build_report
    result = run_sweep(load_sweep("configs/sweeps/quickstart_grid.yaml"))
    print(build_report(result.store.root).markdown())

Modules: spec (the sweep file's schema), grid (expansion, run identity), store (the results
directory), runners (a run's subprocess, the local runner), ray_runner (the Ray runner), driver (a
sweep from start to end, which runner), postprocess (steps after the runs: interpolation), records
(the runs of a store as the report reads them), report and stats (tables, Levene's test, expected
best of n trials, the interpolation section), plots (PNG figures).
"""

from ft_framework.sweep.driver import SweepResult, format_plan, make_runner, plan_sweep, run_sweep
from ft_framework.sweep.grid import PlannedRun, expand, run_identity
from ft_framework.sweep.report import Report, build_report
from ft_framework.sweep.ray_runner import RayRunner
from ft_framework.sweep.runners import LocalRunner, SweepInterrupted
from ft_framework.sweep.slurm_runner import SlurmRunner
from ft_framework.sweep.spec import RunnerSpec, SweepSpec, load_sweep, validate_sweep
from ft_framework.sweep.store import SweepLockedError, SweepStore

__all__ = [
    "SweepSpec", "RunnerSpec", "load_sweep", "validate_sweep",
    "PlannedRun", "expand", "run_identity",
    "SweepStore", "SweepLockedError",
    "LocalRunner", "RayRunner", "SlurmRunner", "SweepInterrupted", "make_runner",
    "SweepResult", "plan_sweep", "run_sweep", "format_plan",
    "Report", "build_report",
]
