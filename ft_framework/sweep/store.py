"""The results store of a sweep: one directory per run id, plus an index.

    <root>/index.json            every run of the grid: id, method, task, seed, axes, state, attempts
    <root>/sweep.yaml            the sweep file and command-line overrides it was last run with
    <root>/runs/<id>/config.yaml the resolved run config (`ft-train --config` runs it by hand)
    <root>/runs/<id>/run.json    method and axis values of the run
    <root>/runs/<id>/status.json {state, attempts, started, ended, returncode, error, host, pid}
    <root>/runs/<id>/log.txt     stdout + stderr of every attempt
    <root>/runs/<id>/results.json, metrics.jsonl, checkpoints/   written by the trainer

Every file is replaced atomically (written next to it, then renamed), so a killed sweep leaves
each file either old or new. A run counts as finished only when status.json says so AND its
results.json exists. Run states: pending, running, finished, failed, interrupted, and diverged: the
run stopped on a NaN/inf loss or gradient norm and wrote results.json saying so (an outcome of its
hyper-parameters, like finished: a re-run of the sweep does not run it again).
"""

from __future__ import annotations

import datetime as _dt
import fcntl
import json
import os
import shutil
import socket
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Iterator, Sequence

import yaml

from ft_framework.path_containment import resolve_inside
from ft_framework.user_files import MissingFile, UserFileError, read_json, read_text
from ft_framework.run.files import (INDEX_FILE, LOCK_FILE, RESULTS_FILE, RUN_CONFIG_FILE, RUN_INFO_FILE,
                                    RUNS_SUBDIR, STATUS_FILE, SWEEP_FILE, RunPaths)

from ft_framework.sweep.grid import PlannedRun

__all__ = ["DONE_STATES", "STATES", "SweepStore", "SweepLockedError", "atomic_write_text", "now_iso", "read_store_json"]

STATES = ("pending", "running", "finished", "failed", "interrupted", "diverged")
# States a run ends in for good: a re-run of the sweep skips them.
DONE_STATES = ("finished", "diverged")


class SweepLockedError(RuntimeError):
    """Another sweep process is working on this store."""


def diverged_error(results: dict[str, Any]) -> str:
    """status.json's error of a diverged run, from its results.json."""
    d = results.get("diverged") or {}
    return f"diverged at step {d.get('step')}: {d.get('what')}"


def now_iso() -> str:
    return _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds")


def atomic_write_text(path: Path, text: str) -> None:
    """Writes `text` to `path` so readers (and a crash) see either the old or the new file."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_text(text)
    os.replace(tmp, path)


def read_store_json(path: Path, root: Path) -> dict[str, Any] | None:
    """A JSON object of a sweep store (a run's status.json, results.json, run.json; the index), read as
    a file a user hands us (user_files.py): a regular file inside `root`, at most WHOLE_FILE_LIMIT
    bytes, an object nested at most NESTING_LIMIT deep. None when it does not exist; anything else
    that is wrong with it is refused in one line naming it (UserFileError)."""
    try:
        return read_json(path, root=root)
    except MissingFile:
        return None


def _is_run_entry(entry: Any) -> bool:
    """A run's entry of the index (or its run.json): a mapping with its id and method as text."""
    return isinstance(entry, dict) and isinstance(entry.get("id"), str) and isinstance(entry.get("method"), str)


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _cmdline(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
    except OSError:
        return ""


class SweepStore:
    """A sweep's directory of runs."""

    def __init__(self, root: str | Path):
        self.root = Path(root).absolute()
        self.runs_dir = self.root / RUNS_SUBDIR

    # ---- paths and files -------------------------------------------------------------------
    def run_dir(self, run_id: str) -> Path:
        return self.runs_dir / run_id

    def read_status(self, run_id: str) -> dict[str, Any]:
        return (read_store_json(self.run_dir(run_id) / STATUS_FILE, self.run_dir(run_id))
                or {"state": "pending", "attempts": 0})

    def write_status(self, run_id: str, **fields: Any) -> dict[str, Any]:
        """Merges `fields` into the run's status.json (atomically) and returns the new status."""
        status = {**self.read_status(run_id), **fields}
        if status["state"] not in STATES:
            raise ValueError(f"unknown run state {status['state']!r}; valid: {', '.join(STATES)}")
        atomic_write_text(self.run_dir(run_id) / STATUS_FILE, json.dumps(status, indent=2))
        return status

    def read_results(self, run_id: str) -> dict[str, Any] | None:
        return read_store_json(self.run_dir(run_id) / RESULTS_FILE, self.run_dir(run_id))

    def read_run_info(self, run_id: str) -> dict[str, Any] | None:
        return read_store_json(self.run_dir(run_id) / RUN_INFO_FILE, self.run_dir(run_id))

    def is_finished(self, run_id: str) -> bool:
        return (self.read_status(run_id).get("state") == "finished"
                and (self.run_dir(run_id) / RESULTS_FILE).is_file())

    def is_done(self, run_id: str) -> bool:
        """Finished or diverged (with its results.json): nothing left to run."""
        return (self.read_status(run_id).get("state") in DONE_STATES
                and (self.run_dir(run_id) / RESULTS_FILE).is_file())

    # ---- the sweep's lock ------------------------------------------------------------------
    @contextmanager
    def lock(self) -> Iterator[None]:
        """Held while a sweep works on the store; a second sweep on the same store fails fast.

        The kernel drops the lock when the holder dies, however it dies.
        """
        self.root.mkdir(parents=True, exist_ok=True)
        fd = os.open(self.root / LOCK_FILE, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                holder = os.pread(fd, 200, 0).decode(errors="replace").strip() or "unknown"
                raise SweepLockedError(f"another ft-sweep is running on {self.root} ({holder}); "
                                       "wait for it or stop it first") from None
            os.ftruncate(fd, 0)
            os.pwrite(fd, f"pid {os.getpid()} on {socket.gethostname()}\n".encode(), 0)
            yield
        finally:
            os.close(fd)

    # ---- syncing the grid into the store ---------------------------------------------------
    def sync(self, runs: Sequence[PlannedRun], *, sweep_text: str | None = None) -> dict[str, int]:
        """Creates the directories of new runs, writes their config and run.json, settles runs a
        dead sweep left 'running' (call with the lock held) and rewrites the index."""
        self.runs_dir.mkdir(parents=True, exist_ok=True)
        if sweep_text is not None:
            atomic_write_text(self.root / SWEEP_FILE, sweep_text)
        for run in runs:
            directory = self.run_dir(run.run_id)
            directory.mkdir(parents=True, exist_ok=True)
            info = run.describe()
            if read_store_json(directory / RUN_INFO_FILE, directory) != info:
                atomic_write_text(directory / RUN_INFO_FILE, json.dumps(info, indent=2))
            if not self.is_done(run.run_id):
                text = yaml.safe_dump(run.config.to_dict(), sort_keys=False)
                config_path = directory / RUN_CONFIG_FILE
                if not config_path.is_file() or read_text(config_path, root=directory) != text:
                    atomic_write_text(config_path, text)
            if not (directory / STATUS_FILE).is_file():
                self.write_status(run.run_id, state="pending", attempts=0)
            else:
                self._settle_stale(run.run_id)
        return self.write_index(runs)

    def _settle_stale(self, run_id: str) -> None:
        """A run still marked running while we hold the lock belongs to a sweep that died."""
        status = self.read_status(run_id)
        if status.get("state") != "running":
            return
        if status.get("slurm_job_id"):
            return  # a SLURM job runs it, outliving any sweep: the SLURM runner asks squeue (sweep/slurm_runner.py)
        pid = status.get("pid")
        if (type(pid) is int and pid > 0 and status.get("host") == socket.gethostname() and _pid_alive(pid)
                and str(self.run_dir(run_id)) in _cmdline(pid)):
            # Normally dead with its sweep (PR_SET_PDEATHSIG); make sure before running it again
            # (the command line names the run's directory, so a recycled pid is left alone).
            try:
                os.killpg(pid, 9)
            except (ProcessLookupError, PermissionError):
                pass
        results = self.read_results(run_id)
        if results is not None and results.get("diverged"):
            self.write_status(run_id, state="diverged", ended=status.get("ended") or now_iso(),
                              error=diverged_error(results),
                              note="recovered: results.json written before the sweep died")
        elif results is not None and "final" in results:
            # The trainer wrote results.json (its last act) but the sweep died before recording it.
            self.write_status(run_id, state="finished", ended=status.get("ended") or now_iso(),
                              error=None, note="recovered: results.json written before the sweep died")
        else:
            self.write_status(run_id, state="interrupted", ended=now_iso(),
                              error="the sweep running it stopped (killed or lost) before the run ended")

    def prepare_attempt(self, run_id: str) -> bool:
        """Clears what a previous attempt left, keeping checkpoints. Returns True when the run can
        resume from a checkpoint (then the trainer drops the logs past it)."""
        paths = RunPaths(self.run_dir(run_id))
        paths.results.unlink(missing_ok=True)
        resumable = paths.latest_checkpoint.is_file()
        if not resumable:
            paths.metrics.unlink(missing_ok=True)
            shutil.rmtree(paths.tensorboard, ignore_errors=True)
        return resumable

    # ---- the index --------------------------------------------------------------------------
    def index_entries(self, runs: Sequence[PlannedRun]) -> list[dict[str, Any]]:
        entries = []
        for run in runs:
            status = self.read_status(run.run_id)
            state = status.get("state", "pending")
            if state in DONE_STATES and not (self.run_dir(run.run_id) / RESULTS_FILE).is_file():
                state = "failed"
            entries.append({**run.describe(), "state": state, "attempts": status.get("attempts", 0),
                            "dir": f"{RUNS_SUBDIR}/{run.run_id}"})
        return entries

    def write_index(self, runs: Sequence[PlannedRun]) -> dict[str, int]:
        """Rewrites index.json from the runs' status files; returns the count of runs per state."""
        entries = self.index_entries(runs)
        counts = {s: sum(e["state"] == s for e in entries) for s in STATES}
        index = {"updated": now_iso(), "total": len(entries), "counts": counts, "runs": entries}
        atomic_write_text(self.root / INDEX_FILE, json.dumps(index, indent=2))
        return counts

    def read_index(self) -> dict[str, Any] | None:
        return read_store_json(self.root / INDEX_FILE, self.root)

    def list_runs(self) -> list[dict[str, Any]]:
        """Index entries of the store (from index.json, else from the run directories). Each entry's
        run directory ("dir") must stay inside the store (path_containment.py): an index naming a
        place outside, or a run directory that is a symlink leading out, is refused in one line
        (NameOutsideError) before anything there is read."""
        index = self.read_index()
        if index is not None:
            entries = index.get("runs")
            if not isinstance(entries, list) or not all(_is_run_entry(entry) for entry in entries):
                raise UserFileError(f"{self.root / INDEX_FILE}: its runs entry is not a list of runs, each with its id "
                                    "and method (it was not written by ft-sweep, or it was tampered with)")
            for entry in entries:
                entry.setdefault("dir", f"{RUNS_SUBDIR}/{entry.get('id')}")
                resolve_inside(self.root, entry["dir"], entry=f"{INDEX_FILE}'s run directory")
            return entries
        entries = []
        for directory in sorted(p for p in self.runs_dir.glob("*")
                                if resolve_inside(self.root, f"{RUNS_SUBDIR}/{p.name}", entry="the run directory")
                                and p.is_dir()):
            info = self.read_run_info(directory.name)
            if info is None:
                continue
            if not _is_run_entry(info):
                raise UserFileError(f"{directory / RUN_INFO_FILE}: not the record of a run, with its id and method (it "
                                    "was not written by ft-sweep, or it was tampered with)")
            entries.append({**info, "state": self.read_status(directory.name).get("state", "pending"),
                            "dir": f"{RUNS_SUBDIR}/{directory.name}"})
        return entries
