"""Post-steps of a sweep (their part of the report is in report.py and plots.py).

``interpolate: {alphas: [0, 0.25, 0.5, 0.75, 1]}`` in a sweep file becomes every run's
``evaluation.interpolation`` (ft_framework/sweep/grid.py), so each run interpolates itself at its end,
in its own process and on its own resources (a Ray sweep spreads the work over the cluster), writing
its interpolation.json and interpolation.png. The sweep gives every run an export directory
(``<run>/export``) when its config sets none, so that the final weights are there to interpolate.
This post-step then runs ft-interpolate, in the sweep's process and one run after another, only on
the finished runs that still have no up-to-date interpolation.json: runs that finished before the
sweep asked for it, or whose own interpolation failed (their log says why).

ft-report then shows, per task, the interpolation curve of each method (the chosen setting's seeds
averaged): a table of the main metric at every α with ‖θ_α − θ*‖, the α that is best on the
selection split, and plots/interpolation_<task>.png. A run interpolated by hand (ft-interpolate
RUN_DIR) counts the same way.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import TYPE_CHECKING, Sequence

from ft_framework.interpolate import run_interpolation
from ft_framework.run.files import INTERPOLATION_FILE, RESULTS_FILE

if TYPE_CHECKING:
    from ft_framework.sweep.grid import PlannedRun
    from ft_framework.sweep.spec import SweepSpec
    from ft_framework.sweep.store import SweepStore

logger = logging.getLogger(__name__)

__all__ = ["interpolation_wanted", "run_interpolations"]


def interpolation_wanted(spec: "SweepSpec") -> bool:
    return getattr(spec, "interpolate", None) is not None


def _up_to_date(run_dir: Path, alphas: Sequence[float]) -> bool:
    try:
        saved = json.loads((run_dir / INTERPOLATION_FILE).read_text())
    except (FileNotFoundError, json.JSONDecodeError):
        return False
    results = run_dir / RESULTS_FILE
    fresh = (run_dir / INTERPOLATION_FILE).stat().st_mtime >= results.stat().st_mtime if results.is_file() else False
    return fresh and [float(a) for a in saved.get("alphas", [])] == sorted({float(a) for a in alphas})


def run_interpolations(spec: "SweepSpec", store: "SweepStore", runs: Sequence["PlannedRun"],
                       device: str | None = None) -> dict[str, str]:
    """Interpolates every finished run that has no up-to-date interpolation.json; returns run id ->
    "done", "skipped" (up to date) or the error. Errors are logged and never stop the sweep."""
    if not interpolation_wanted(spec):
        return {}
    if device is None:
        import torch

        device = "cuda" if torch.cuda.is_available() else "cpu"
    alphas = list(spec.interpolate.alphas)
    out: dict[str, str] = {}
    for run in runs:
        if not store.is_finished(run.run_id):
            continue
        run_dir = store.run_dir(run.run_id)
        if _up_to_date(run_dir, alphas):
            out[run.run_id] = "skipped"
            continue
        try:
            run_interpolation(run_dir, alphas, device=device, theta_star=spec.interpolate.theta_star)
            out[run.run_id] = "done"
        except Exception as exc:  # noqa: BLE001 - one run's problem must not stop the others
            logger.warning("interpolation of run %s failed: %s", run.run_id, exc)
            out[run.run_id] = f"failed: {exc}"
    return out
