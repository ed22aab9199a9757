"""The SLURM runner: one batch job per run, submitted with ``sbatch``; the store stays the one record
of every run (docs/multinode.md).

Each job runs ``python -m ft_framework.sweep.slurm_job`` (sweep/slurm_job.py), which runs the run as
the local runner does and records its outcome in the store. The driver (this module) submits at most
``runner.max_parallel`` jobs at once, records each job's id in the run's status.json
(``slurm_job_id``, and every id it was ever given in ``slurm_job_ids``), and reads the queue
(``squeue``) every ``runner.poll_s`` seconds. It needs no accounting (sacct): when a job has left the
running states, the store says how its run ended; a job that ended without its run recording an
outcome (killed, cancelled before it started, node failure) or that SLURM cancelled is marked failed
with SLURM's state and reason, and the next ft-sweep submits it again. A run that a signal stopped
with a checkpoint (a preemption: ``status: interrupted``) is submitted again at once, up to
PREEMPTED_RUN_RETRIES times, and resumes from its checkpoint.

The driver can die: its jobs stay in the queue. ft-sweep started again finds them (by the job id in
status.json, and by the job name, which carries the store's tag and the run id, for a job submitted
just before the driver died) and follows them instead of submitting them again.
"""

from __future__ import annotations

import hashlib
import json
import logging
import shlex
import shutil
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Sequence

from ft_framework.errors import UserError
from ft_framework.sweep.grid import PlannedRun
from ft_framework.sweep.runners import OnChange, OnDone, sigterm_raises
from ft_framework.sweep.spec import RunnerSpec
from ft_framework.sweep.store import SweepStore, atomic_write_text, now_iso

__all__ = ["SlurmRunner", "JobState", "render_job_script", "job_name", "store_tag", "parse_squeue",
           "job_outcome", "ALIVE_STATES", "PREEMPTED_RUN_RETRIES", "JOB_SCRIPT_FILE"]

logger = logging.getLogger(__name__)

# The job script the runner submits, kept in the run's directory (sbatch it by hand to run it again).
JOB_SCRIPT_FILE = "slurm_job.sh"
# SLURM's stdout / stderr of the job (the run's own output goes to log.txt).
JOB_OUTPUT_FILE = "slurm-%j.out"
# Job states in which a job may still run its run (squeue's %T); any other state, or a job squeue
# no longer lists, has ended.
ALIVE_STATES = frozenset({"PENDING", "CONFIGURING", "RUNNING", "COMPLETING", "SUSPENDED", "REQUEUED",
                          "REQUEUE_FED", "REQUEUE_HOLD", "RESIZING", "SIGNALING", "STAGE_OUT", "RESV_DEL_HOLD",
                          "STOPPED"})
# A preempted run (stopped by a signal with a checkpoint, its job not cancelled) is submitted again
# this many times in one ft-sweep.
PREEMPTED_RUN_RETRIES = 3


@dataclass(frozen=True)
class JobState:
    """One job as squeue lists it."""

    job_id: str
    name: str
    state: str
    reason: str


def store_tag(store: SweepStore) -> str:
    """A short tag of the store's path: the job names of two stores never collide."""
    return hashlib.sha1(str(store.root).encode()).hexdigest()[:8]


def job_name(store: SweepStore, run_id: str) -> str:
    return f"ft-{store_tag(store)}-{run_id}"


def render_job_script(store: SweepStore, run_id: str, spec: RunnerSpec, python: str = sys.executable) -> str:
    """The batch script of one run: its #SBATCH lines (the runner's settings, then its extra lines,
    which win), then the in-job runner."""
    procs = spec.procs_per_run or max(1, spec.num_gpus_per_run)
    lines = ["#!/bin/bash", f"#SBATCH --job-name={job_name(store, run_id)}", f"#SBATCH --nodes={spec.nodes_per_run}"]
    if spec.nodes_per_run > 1:
        lines.append(f"#SBATCH --ntasks-per-node={procs}")
        cpus_per_task = max(1, int(spec.num_cpus_per_run or 1) // procs)
    else:
        lines.append("#SBATCH --ntasks=1")
        cpus_per_task = max(1, int(spec.num_cpus_per_run or 1))
    lines.append(f"#SBATCH --cpus-per-task={cpus_per_task}")
    if spec.num_gpus_per_run:
        lines.append(f"#SBATCH --gpus-per-node={spec.num_gpus_per_run}")
    if spec.partition:
        lines.append(f"#SBATCH --partition={spec.partition}")
    if spec.time:
        lines.append(f"#SBATCH --time={spec.time}")
    if spec.signal_before_end_s:
        # B: to the batch step, which passes it on to the run (sweep/slurm_job.py).
        lines.append(f"#SBATCH --signal=B:USR1@{spec.signal_before_end_s}")
    lines.append("#SBATCH --requeue" if spec.requeue else "#SBATCH --no-requeue")
    lines.append("#SBATCH --open-mode=append")
    lines.extend(spec.sbatch_lines)
    threads = str(max(1, cpus_per_task))
    spec_json = json.dumps(spec.model_dump(mode="json"), sort_keys=True)
    lines += [f"export OMP_NUM_THREADS={threads} MKL_NUM_THREADS={threads} PYTHONUNBUFFERED=1",
              "exec " + " ".join(shlex.quote(a) for a in
                                 [python, "-m", "ft_framework.sweep.slurm_job", str(store.root), run_id, spec_json])]
    return "\n".join(lines) + "\n"


def parse_squeue(text: str) -> dict[str, JobState]:
    """squeue -h -o '%i|%j|%T|%r' output: job id -> JobState."""
    jobs: dict[str, JobState] = {}
    for line in text.splitlines():
        parts = line.strip().split("|", 3)
        if len(parts) == 4:
            jobs[parts[0]] = JobState(*parts)
    return jobs


def job_outcome(job: JobState | None, job_id: str, status: dict, done: bool,
                preempted_retries_left: bool) -> tuple[str, str | None]:
    """What the driver does with a run whose job `job` (None: squeue no longer lists it) is no longer
    alive, given the run's status.json: ("done", None) when the run recorded its outcome, ("resubmit",
    why) for a preempted run, ("failed", SLURM's reason) otherwise."""
    if done:
        return "done", None
    if job is None:
        slurm = f"SLURM job {job_id} left the queue (no accounting to ask how it ended)"
    else:
        reason = "" if job.reason in ("", "None", "(null)") else f", reason {job.reason}"
        slurm = f"SLURM job {job_id} {job.state}{reason}"
    state = status.get("state")
    if state == "interrupted" and (job is None or job.state != "CANCELLED") and preempted_retries_left:
        return "resubmit", f"{slurm}: {status.get('error')}"
    if state in ("failed", "interrupted") and status.get("error"):
        return "failed", f"{slurm}: {status.get('error')}"
    return "failed", f"{slurm} before its run recorded an outcome"


def _run_slurm(args: list[str], what: str, timeout: float = 60) -> str:
    """A SLURM command's stdout; UserError in one line when it is missing or fails."""
    if shutil.which(args[0]) is None:
        raise UserError(f"the slurm runner needs SLURM's {args[0]} on PATH (run ft-sweep on a login node of the cluster)")
    try:
        done = subprocess.run(args, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        raise UserError(f"{what}: {args[0]} did not answer within {timeout:g} s; is slurmctld up?") from None
    if done.returncode != 0:
        lines = (done.stderr or done.stdout).strip().splitlines()
        raise UserError(f"{what}: {args[0]} failed ({lines[-1] if lines else f'exit code {done.returncode}'})")
    return done.stdout


class SlurmRunner:
    """One sbatch job per run, at most `max_parallel` in the queue at once."""

    def __init__(self, spec: RunnerSpec | None = None, *, poll_s: float | None = None):
        spec = spec or RunnerSpec(name="slurm")
        if poll_s is not None:
            spec = spec.model_copy(update={"poll_s": poll_s})
        self.spec = spec
        self.cwd = str(Path.cwd())
        # Job ids this runner submitted, in order (the tests check nothing is submitted twice).
        self.submitted: list[str] = []

    # ---- the queue ---------------------------------------------------------------------------
    def _queue(self, store: SweepStore) -> dict[str, JobState]:
        """This user's jobs of this store that squeue lists (any state), by job id."""
        out = _run_slurm(["squeue", "-h", "-t", "all", "--me", "-o", "%i|%j|%T|%r"],
                         "cannot read the queue")
        prefix = f"ft-{store_tag(store)}-"
        return {jid: job for jid, job in parse_squeue(out).items() if job.name.startswith(prefix)}

    def _submit(self, store: SweepStore, run: PlannedRun) -> str:
        directory = store.run_dir(run.run_id)
        script = directory / JOB_SCRIPT_FILE
        atomic_write_text(script, render_job_script(store, run.run_id, self.spec))
        out = _run_slurm(["sbatch", "--parsable", f"--output={directory / JOB_OUTPUT_FILE}", f"--chdir={self.cwd}",
                          str(script)], f"cannot submit run {run.run_id}")
        job_id = out.strip().split(";")[0]
        self.submitted.append(job_id)
        ids = list(store.read_status(run.run_id).get("slurm_job_ids") or [])
        store.write_status(run.run_id, state="running", slurm_job_id=job_id, slurm_job_ids=[*ids, job_id],
                           submitted=now_iso(), ended=None, returncode=None, error=None, pid=None,
                           note=f"submitted as SLURM job {job_id}")
        return job_id

    def _adopt(self, store: SweepStore, runs: Sequence[PlannedRun], queue: dict[str, JobState]) -> dict[str, str]:
        """Runs whose job is still in the queue (a previous driver submitted it): run id -> job id."""
        alive_by_name = {job.name: jid for jid, job in sorted(queue.items(), key=lambda kv: int(kv[0].split("_")[0]))
                         if job.state in ALIVE_STATES}
        adopted: dict[str, str] = {}
        for run in runs:
            recorded = store.read_status(run.run_id).get("slurm_job_id")
            job = queue.get(str(recorded)) if recorded else None
            if job is not None and job.state in ALIVE_STATES:
                adopted[run.run_id] = str(recorded)
            elif job_name(store, run.run_id) in alive_by_name:  # submitted just before the driver died
                jid = alive_by_name[job_name(store, run.run_id)]
                ids = list(store.read_status(run.run_id).get("slurm_job_ids") or [])
                store.write_status(run.run_id, state="running", slurm_job_id=jid,
                                   slurm_job_ids=ids + ([jid] if jid not in ids else []),
                                   note=f"SLURM job {jid} found in the queue by its name")
                adopted[run.run_id] = jid
        return adopted

    def _settle(self, store: SweepStore, run: PlannedRun, job_id: str, job: JobState | None,
                retries: dict[str, int]) -> str:
        """The run's state once its job ended: its own, 'failed' (SLURM's reason), or 'resubmit'."""
        # Final: a job leaves the alive states only once every process of it has exited.
        status = store.read_status(run.run_id)
        results = store.read_results(run.run_id) if status.get("state") == "running" else None
        if results is not None and results.get("status") == "interrupted":
            # The run saved its checkpoint on a signal, but SLURM killed the job before it recorded that.
            status = {**status, "state": "interrupted", "error": f"stopped by {results.get('signal')} at step "
                      f"{results.get('steps')}, checkpoint saved"}
        action, why = job_outcome(job, job_id, status, store.is_done(run.run_id),
                                  retries.get(run.run_id, 0) < PREEMPTED_RUN_RETRIES)
        if action == "done":
            return status["state"]
        if action == "resubmit":
            retries[run.run_id] = retries.get(run.run_id, 0) + 1
            store.write_status(run.run_id, state="interrupted", error=f"{why}; submitted again "
                               f"({retries[run.run_id]} of {PREEMPTED_RUN_RETRIES})")
            return "resubmit"
        store.write_status(run.run_id, state="failed", ended=status.get("ended") or now_iso(), pid=None,
                           error=why, slurm_state=job.state if job else None)
        return "failed"

    def run(self, store: SweepStore, runs: Sequence[PlannedRun], on_done: OnDone | None = None,
            on_change: OnChange | None = None) -> dict[str, str]:
        """As LocalRunner.run. On SIGTERM / Ctrl-C the jobs stay in the queue (their runs stay
        'running' with their job ids) and KeyboardInterrupt is raised: ft-sweep started again follows them."""
        states: dict[str, str] = {}
        retries: dict[str, int] = {}
        by_id = {run.run_id: run for run in runs}
        in_flight = self._adopt(store, runs, self._queue(store))
        waiting = [run for run in runs if run.run_id not in in_flight]
        if on_change is not None and in_flight:
            on_change()
        try:
            with sigterm_raises():
                while waiting or in_flight:
                    while waiting and len(in_flight) < self.spec.max_parallel:
                        run = waiting.pop(0)
                        if store.is_done(run.run_id):
                            states[run.run_id] = store.read_status(run.run_id)["state"]
                            continue
                        in_flight[run.run_id] = self._submit(store, run)
                        if on_change is not None:
                            on_change()
                    time.sleep(self.spec.poll_s)
                    queue = self._queue(store)
                    for run_id, job_id in list(in_flight.items()):
                        job = queue.get(job_id)
                        if job is not None and job.state in ALIVE_STATES:
                            continue
                        del in_flight[run_id]
                        state = self._settle(store, by_id[run_id], job_id, job, retries)
                        if state == "resubmit":
                            waiting.insert(0, by_id[run_id])
                            continue
                        states[run_id] = state
                        if on_done is not None:
                            on_done(by_id[run_id], state)
        except KeyboardInterrupt:
            if in_flight:
                logger.warning("%d SLURM job(s) of this sweep stay in the queue (%s); run ft-sweep again to follow "
                               "them, or scancel them", len(in_flight), ", ".join(sorted(in_flight.values())))
            raise
        return states
