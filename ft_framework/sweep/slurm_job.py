"""Inside a SLURM batch job of the sweep: run one run of the store, as the local runner would
(runners.execute_run: the same command, log.txt, status.json, resume from the latest checkpoint).

    python -m ft_framework.sweep.slurm_job STORE_ROOT RUN_ID RUNNER_SPEC_JSON   (the job script's last line)

SIGUSR1 (``--signal=B:USR1@N`` before the time limit, or a preemption) and SIGTERM (scancel, SLURM's
preemption) reach this process, the batch step's; it passes them on to the run, which saves a
checkpoint and writes results.json with ``status: interrupted`` (run/signals.py). Then, after
SIGUSR1 and with ``runner.requeue``, the job requeues itself (``scontrol requeue``): SLURM starts it
again (SLURM_RESTART_COUNT one higher) and the run resumes from its checkpoint. Otherwise the run
ends interrupted and the sweep's driver submits it again (sweep/slurm_runner.py).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

from ft_framework.config import load_config
from ft_framework.run.files import RUN_CONFIG_FILE
from ft_framework.sweep.grid import PlannedRun
from ft_framework.sweep.runners import CommandFn, _LiveProcesses, build_command, execute_run
from ft_framework.sweep.spec import RunnerSpec
from ft_framework.sweep.store import SweepStore, now_iso

__all__ = ["job_command", "run_in_job", "main"]

PROG = "ft_framework.sweep.slurm_job"


def job_command(config_path: Path, cfg, spec: RunnerSpec, resume: bool) -> list[str]:
    """A run's command inside its job: as the local runner's on one node; on several nodes each
    process is a task of srun (ranks from SLURM's variables: distributed/slurm_env.py)."""
    if spec.nodes_per_run == 1:
        return build_command(config_path, cfg, spec, resume)
    procs = spec.procs_per_run or max(1, spec.num_gpus_per_run)
    tail = ["--config", str(config_path)] + (["checkpoint.resume_from=latest"] if resume else [])
    return ["srun", f"--nodes={spec.nodes_per_run}", f"--ntasks-per-node={procs}", "--kill-on-bad-exit=1",
            sys.executable, "-m", "ft_framework.cli", *tail]


def _planned_run(store: SweepStore, run_id: str) -> PlannedRun:
    """The run as the driver planned it, from what the store keeps (config.yaml, run.json)."""
    info = store.read_run_info(run_id)
    if info is None:
        raise FileNotFoundError(f"{store.run_dir(run_id)} has no run.json: not a run of the sweep store {store.root}")
    cfg = load_config(store.run_dir(run_id) / RUN_CONFIG_FILE, check_paths=False)
    return PlannedRun(run_id=run_id, method=info["method"], axes=info.get("axes") or {}, config=cfg,
                      fixed=info.get("fixed") or {})


def run_in_job(store_root: str | Path, run_id: str, spec: RunnerSpec,
               command_fn: CommandFn = job_command) -> int:
    """Runs `run_id` of the store in this job; returns the job's exit code."""
    store = SweepStore(store_root)
    if store.is_done(run_id):  # a job that SLURM started again after its run ended
        return 0
    run = _planned_run(store, run_id)
    live = _LiveProcesses()
    received: list[int] = []

    def forward(signum, frame) -> None:
        received.append(signum)
        for proc in live.snapshot():
            try:
                os.killpg(proc.pid, signum)  # the run's own process group (torchrun's / srun's tasks too)
            except (ProcessLookupError, PermissionError):
                pass

    for signum in (signal.SIGUSR1, signal.SIGTERM):
        signal.signal(signum, forward)
    state = execute_run(store, run, spec, cwd=os.getcwd(), live=live, command_fn=command_fn,
                        node=os.environ.get("SLURMD_NODENAME"), node_kind="slurm node")
    job_id = os.environ.get("SLURM_JOB_ID")
    if state == "interrupted" and signal.SIGUSR1 in received and spec.requeue and job_id:
        status = store.read_status(run_id)
        store.write_status(run_id, state="running", note=f"requeued SLURM job {job_id} after SIGUSR1 at {now_iso()} "
                           f"({status.get('error')}); it resumes from its checkpoint")
        done = subprocess.run(["scontrol", "requeue", job_id], capture_output=True, text=True)
        if done.returncode != 0:
            why = (done.stderr or done.stdout).strip().splitlines()
            store.write_status(run_id, state="interrupted",
                               error=f"scontrol requeue {job_id} failed: {why[-1] if why else done.returncode}")
            return 1
        return 0
    return 0 if state in ("finished", "diverged") else 1


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if len(args) != 3:
        print(f"usage: python -m {PROG} STORE_ROOT RUN_ID RUNNER_SPEC_JSON", file=sys.stderr)
        return 2
    spec = RunnerSpec.model_validate(json.loads(args[2]))
    return run_in_job(args[0], args[1], spec)


if __name__ == "__main__":
    sys.exit(main())
