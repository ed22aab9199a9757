"""A sweep from start to end: expand the grid, sync it into the store, run what is not finished.

    result = run_sweep(load_sweep("configs/sweeps/quickstart_grid.yaml"))

Re-running a sweep skips finished and diverged runs and runs the failed, interrupted and pending
ones again (an interrupted run with a checkpoint resumes from it).
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Sequence

import yaml

from ft_framework.sweep.grid import PlannedRun, expand
from ft_framework.sweep.ray_runner import RayRunner
from ft_framework.sweep.postprocess import run_interpolations
from ft_framework.sweep.runners import LocalRunner
from ft_framework.sweep.slurm_runner import SlurmRunner
from ft_framework.sweep.spec import RunnerSpec, SweepSpec
from ft_framework.sweep.store import DONE_STATES, STATES, SweepStore

__all__ = ["SweepResult", "make_runner", "plan_sweep", "run_sweep", "format_plan"]


@dataclass
class SweepResult:
    store: SweepStore
    runs: list[PlannedRun]
    counts: dict[str, int]
    # Run ids this invocation ran, with their final states.
    ran: dict[str, str] = field(default_factory=dict)

    @property
    def complete(self) -> bool:
        """Every run finished or diverged (an outcome of its hyper-parameters, not a failure to run)."""
        return sum(self.counts.get(s, 0) for s in DONE_STATES) == len(self.runs)


def plan_sweep(spec: SweepSpec, overrides: Sequence[str] = (), output_dir: str | Path | None = None
               ) -> tuple[SweepStore, list[PlannedRun]]:
    """The store and the expanded runs (nothing is written)."""
    store = SweepStore(output_dir if output_dir is not None else spec.output_dir)
    return store, expand(spec, overrides, store_root=store.root)


def _sweep_text(spec: SweepSpec, overrides: Sequence[str]) -> str:
    data: dict[str, Any] = spec.model_dump(mode="json", exclude_none=False)
    if spec.source_dir is not None and isinstance(spec.base, str):
        data["base"] = str(spec.resolve_path(spec.base))
    data["command_line_overrides"] = list(overrides)
    return yaml.safe_dump(data, sort_keys=False)


def format_plan(store: SweepStore, runs: Sequence[PlannedRun]) -> str:
    """The runs of a grid, one a line, with their state in the store (for --dry-run)."""
    lines = []
    states = {}
    for run in runs:
        state = store.read_status(run.run_id).get("state", "pending")
        if state in DONE_STATES and not store.is_done(run.run_id):
            state = "failed"
        if state == "running":
            state = "running?"  # only true while another sweep holds the store
        states[run.run_id] = state
    width = max([len(r.method) for r in runs] + [6])
    for i, run in enumerate(runs, 1):
        axes = "  ".join(f"{k}={_fmt(v)}" for k, v in run.axes.items())
        lines.append(f"{i:4d}  {run.run_id}  {states[run.run_id]:<11} {run.method:<{width}}  {axes}")
    counts = {s: sum(v.rstrip("?") == s for v in states.values()) for s in STATES}
    todo = len(runs) - sum(counts[s] for s in DONE_STATES)
    head = (f"{len(runs)} runs in {store.root}: {counts['finished']} finished, {todo} to run"
            + "".join(f", {counts[s]} {s}" for s in ("diverged", "failed", "interrupted") if counts[s]))
    return "\n".join([head, f"{'#':>4}  {'run id':<12}  {'state':<11} {'method':<{width}}  axes", *lines])


def _fmt(value: Any) -> str:
    return f"{value:g}" if isinstance(value, float) else str(value)


def make_runner(spec: RunnerSpec, **kwargs: Any) -> LocalRunner | RayRunner | SlurmRunner:
    """The runner a sweep's `runner:` section names."""
    if spec.name == "ray":
        return RayRunner(spec, **kwargs)
    if spec.name == "slurm":
        return SlurmRunner(spec, **kwargs)
    return LocalRunner(spec, **kwargs)


def run_sweep(spec: SweepSpec, overrides: Sequence[str] = (), *, output_dir: str | Path | None = None,
              runner: LocalRunner | RayRunner | SlurmRunner | None = None, progress: bool = True,
              planned: tuple[SweepStore, list[PlannedRun]] | None = None) -> SweepResult:
    """Runs every run of the grid that is not finished; returns the counts per state.

    Holds the store's lock throughout, so two sweeps never run the same store at once. Raises
    KeyboardInterrupt (SIGTERM: SweepInterrupted) after recording the runs it stopped.
    `planned`: the result of plan_sweep for these arguments, to skip expanding the grid again.
    """
    store, runs = planned if planned is not None else plan_sweep(spec, overrides, output_dir)
    runner = runner if runner is not None else make_runner(spec.runner)
    with store.lock():
        counts = store.sync(runs, sweep_text=_sweep_text(spec, overrides))
        todo = [r for r in runs if not store.is_done(r.run_id)]
        index_lock = threading.Lock()

        def refresh(*_: Any) -> None:
            with index_lock:
                counts.update(store.write_index(runs))

        bar = None
        if progress and todo:
            from tqdm.auto import tqdm

            bar = tqdm(total=len(runs), initial=len(runs) - len(todo), desc="sweep", unit="run", dynamic_ncols=True)
        failed = 0

        def on_done(run: PlannedRun, state: str) -> None:
            nonlocal failed
            refresh()
            failed += state not in DONE_STATES
            if bar is not None:
                bar.update(1)
                bar.set_postfix(last=f"{run.run_id} {state}", failed=failed)

        ran: dict[str, str] = {}
        try:
            ran = runner.run(store, todo, on_done=on_done, on_change=refresh) if todo else {}
        finally:
            if bar is not None:
                bar.close()
            refresh()
        run_interpolations(spec, store, runs)  # the sweep's `interpolate:` post-step, if any
    return SweepResult(store=store, runs=runs, counts=dict(counts), ran=ran)
