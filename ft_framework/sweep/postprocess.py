"""Post-steps of a sweep and their part of the report.

``interpolate: {alphas: [0, 0.25, 0.5, 0.75, 1]}`` in a sweep file runs ft-interpolate on every
finished run once training is done (in the sweep's process, one run after another), writing each
run's interpolation.json and interpolation.png. The sweep gives every run an export directory
(``<run>/export``) when its config sets none, so that the final weights are there to interpolate.

ft-report then shows, per task, the interpolation curve of each method (the chosen setting's seeds
averaged): a table of the main metric at every α with ‖θ_α − θ*‖, the α that is best on the
selection split, and plots/interpolation_<task>.png. A run interpolated by hand (ft-interpolate
RUN_DIR) counts the same way.
"""

from __future__ import annotations

import json
import logging
from collections import defaultdict
from pathlib import Path
from typing import TYPE_CHECKING, Any, Sequence

from ft_framework.run.files import INTERPOLATION_FILE, RESULTS_FILE

if TYPE_CHECKING:
    from ft_framework.sweep.grid import PlannedRun
    from ft_framework.sweep.report import Report
    from ft_framework.sweep.spec import SweepSpec
    from ft_framework.sweep.store import SweepStore

logger = logging.getLogger(__name__)

__all__ = ["interpolation_wanted", "run_interpolations", "interpolation_curves",
           "interpolation_markdown", "write_interpolation_plots"]


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
    from ft_framework.interpolate import run_interpolation

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


# --------------------------------------------------------------------------------------------------
# Report
# --------------------------------------------------------------------------------------------------


def interpolation_curves(report: "Report") -> dict[tuple[str, str], dict[str, Any]]:
    """(method, task) -> the mean curve over the chosen setting's seeds that have interpolation.json."""
    from ft_framework.interpolate import mean_curves

    out = {}
    for (method, task), cell in report.cells.items():
        outs = []
        for run in cell.runs:
            path = run.directory / INTERPOLATION_FILE
            if path.is_file():
                try:
                    outs.append(json.loads(path.read_text()))
                except json.JSONDecodeError:
                    continue
        outs = [o for o in outs if outs and o["alphas"] == outs[0]["alphas"]]
        if outs:
            curve = mean_curves(outs)
            curve["best_alphas"] = [o["best_alpha"] for o in outs]
            out[(method, task)] = curve
    return out


def interpolation_markdown(report: "Report") -> str:
    """The report's section on interpolation toward θ* (empty when no run was interpolated)."""
    curves = interpolation_curves(report)
    if not curves:
        return ""
    lines = ["## Interpolation toward θ* (WiSE-FT): θ_α = θ* + α (θ − θ*)", "",
             "Per method and task, the chosen setting's runs (seeds averaged): the main metric on the selection "
             "split at each α (x100), ‖θ_α − θ*‖₂ at α = 1, and the α best on the selection split (of the mean "
             "curve; per seed in brackets). α = 1 is the fine-tuned model, α = 0 the pretrained one under the "
             "fine-tuned head.", ""]
    by_task: dict[str, list[tuple[str, dict[str, Any]]]] = defaultdict(list)
    for (method, task), curve in curves.items():
        by_task[task].append((method, curve))
    for task in [t for t in report.tasks if t in by_task]:
        entries = sorted(by_task[task], key=lambda mc: report.methods.index(mc[0]))
        alphas = entries[0][1]["alphas"]
        header = ["Method", "n", *[f"α={a:g}" for a in alphas], "‖θ−θ*‖ (α=1)", "best α"]
        rows = []
        for method, curve in entries:
            split, main = curve["selection_split"], curve["main_metric"]
            scores = {r["alpha"]: 100.0 * r["metrics"][split][main] for r in curve["rows"]}
            best = max(curve["rows"], key=lambda r: (r["metrics"][split][main], r["alpha"]))["alpha"]
            per_seed = ", ".join(f"{a:g}" for a in curve["best_alphas"])
            rows.append([method, str(curve["n"]), *[f"{scores.get(a, float('nan')):.1f}" for a in alphas],
                         f"{curve['rows'][-1]['distance']:.3f}", f"{best:g} ({per_seed})"])
        lines += [f"### {task}", "", _table(header, rows), ""]
    return "\n".join(lines)


def _table(header: Sequence[str], rows: Sequence[Sequence[str]]) -> str:
    out = ["| " + " | ".join(header) + " |", "|:---|" + "---:|" * (len(header) - 1)]
    out += ["| " + " | ".join(r) + " |" for r in rows]
    return "\n".join(out)


def write_interpolation_plots(report: "Report", directory: Path) -> list[Path]:
    """plots/interpolation_<task>.png: each method's mean curve (score vs α and vs ‖θ_α − θ*‖)."""
    from ft_framework.interpolate import plot_interpolation

    curves = interpolation_curves(report)
    written = []
    for task in report.tasks:
        entries = [(m, curves[(m, task)]) for m in report.methods if (m, task) in curves]
        if entries:
            written.append(plot_interpolation([c for _, c in entries], Path(directory) / f"interpolation_{task}.png",
                                              labels=[m for m, _ in entries]))
    return written
