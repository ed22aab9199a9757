"""The SLURM runner's pure parts, without a cluster (the real cluster: tests/slurm/): the job script,
squeue's lines, what a job that left the queue means for its run, a restarted driver finding its
jobs, and the runner's settings."""

from __future__ import annotations

import json
import shlex

import pytest
from sweep_helpers import sweep_dict

from ft_framework.config import ConfigError
from ft_framework.errors import UserError
from ft_framework.sweep.driver import plan_sweep
from ft_framework.sweep.slurm_runner import (ALIVE_STATES, PREEMPTED_RUN_RETRIES, JobState, SlurmRunner, job_name,
                                             job_outcome, parse_squeue, render_job_script, store_tag)
from ft_framework.sweep.spec import RunnerSpec, validate_sweep
from ft_framework.sweep.store import SweepStore


def test_the_job_script_carries_the_runners_settings_then_the_users_lines(tmp_path):
    store = SweepStore(tmp_path / "my store")
    spec = RunnerSpec(name="slurm", partition="gpu", time="04:00:00", num_gpus_per_run=4, num_cpus_per_run=16,
                      nodes_per_run=2, requeue=True, sbatch_lines=["#SBATCH --account=lab", "#SBATCH --time=01:00:00"])
    script = render_job_script(store, "abc123", spec, python="/opt/py/bin/python")
    lines = script.splitlines()
    assert lines[0] == "#!/bin/bash"
    sbatch = [ln for ln in lines if ln.startswith("#SBATCH")]
    assert sbatch == [f"#SBATCH --job-name=ft-{store_tag(store)}-abc123", "#SBATCH --nodes=2",
                      "#SBATCH --ntasks-per-node=4", "#SBATCH --cpus-per-task=4", "#SBATCH --gpus-per-node=4",
                      "#SBATCH --partition=gpu", "#SBATCH --time=04:00:00", "#SBATCH --signal=B:USR1@90",
                      "#SBATCH --requeue", "#SBATCH --open-mode=append",
                      "#SBATCH --account=lab", "#SBATCH --time=01:00:00"]  # the user's last: sbatch takes the last
    assert lines[-2] == "export OMP_NUM_THREADS=4 MKL_NUM_THREADS=4 PYTHONUNBUFFERED=1"
    argv = shlex.split(lines[-1])
    assert argv[:4] == ["exec", "/opt/py/bin/python", "-m", "ft_framework.sweep.slurm_job"]
    assert argv[4:6] == [str(store.root), "abc123"]  # a path with a space survives the shell
    assert RunnerSpec.model_validate(json.loads(argv[6])) == spec


def test_one_node_runs_one_task_and_no_signal_when_asked_for_none(tmp_path):
    spec = RunnerSpec(name="slurm", signal_before_end_s=None)
    script = render_job_script(SweepStore(tmp_path), "r1", spec)
    assert "#SBATCH --ntasks=1" in script and "#SBATCH --cpus-per-task=1" in script
    assert "--signal" not in script and "#SBATCH --no-requeue" in script and "--partition" not in script


def test_job_names_tell_stores_apart(tmp_path):
    a, b = SweepStore(tmp_path / "a"), SweepStore(tmp_path / "b")
    assert job_name(a, "r1") != job_name(b, "r1") and job_name(a, "r1").endswith("-r1")
    assert store_tag(SweepStore(tmp_path / "a")) == store_tag(a)


def test_squeue_lines_are_read_by_job_id():
    text = "12|ft-x-r1|RUNNING|None\n13|ft-x-r2|PENDING|Resources\nnot a line\n14_2|ft-x-r3|CANCELLED|None|x\n"
    jobs = parse_squeue(text)
    assert jobs["12"] == JobState("12", "ft-x-r1", "RUNNING", "None")
    assert jobs["13"].reason == "Resources" and jobs["14_2"].reason == "None|x" and len(jobs) == 3


def test_states_that_may_still_run_the_run():
    assert {"PENDING", "RUNNING", "COMPLETING", "REQUEUED", "SUSPENDED"} <= ALIVE_STATES
    assert not {"COMPLETED", "CANCELLED", "FAILED", "TIMEOUT", "NODE_FAIL", "PREEMPTED", "OUT_OF_MEMORY"} & ALIVE_STATES


RUNNING = {"state": "running"}
PREEMPTED = {"state": "interrupted", "error": "stopped by SIGUSR1 at step 4, checkpoint saved (exit code 138)"}
CANCELLED_RUN = {"state": "interrupted", "error": "stopped by SIGTERM at step 4, checkpoint saved (exit code 143)"}
CRASHED = {"state": "failed", "error": "exit code 1: ValueError: boom"}


@pytest.mark.parametrize("job, status, done, retries, want", [
    # The run recorded its own outcome: the store says how it ended.
    (JobState("1", "n", "COMPLETED", "None"), {"state": "finished"}, True, True, ("done", None)),
    # Killed before it recorded anything: failed with SLURM's state and reason.
    (JobState("1", "n", "CANCELLED", "None"), RUNNING, False, True,
     ("failed", "SLURM job 1 CANCELLED before its run recorded an outcome")),
    (JobState("1", "n", "NODE_FAIL", "NodeDown"), RUNNING, False, True,
     ("failed", "SLURM job 1 NODE_FAIL, reason NodeDown before its run recorded an outcome")),
    (JobState("1", "n", "TIMEOUT", "TimeLimit"), RUNNING, False, True,
     ("failed", "SLURM job 1 TIMEOUT, reason TimeLimit before its run recorded an outcome")),
    (None, RUNNING, False, True, ("failed", "SLURM job 1 left the queue (no accounting to ask how it ended) "
                                            "before its run recorded an outcome")),
    # scancel: the run saved a checkpoint, but a cancel is the user's word: failed, not resubmitted now.
    (JobState("1", "n", "CANCELLED", "None"), CANCELLED_RUN, False, True,
     ("failed", f"SLURM job 1 CANCELLED: {CANCELLED_RUN['error']}")),
    # A preempted run with its checkpoint is submitted again, while retries last.
    (JobState("1", "n", "FAILED", "NonZeroExitCode"), PREEMPTED, False, True,
     ("resubmit", f"SLURM job 1 FAILED, reason NonZeroExitCode: {PREEMPTED['error']}")),
    (JobState("1", "n", "PREEMPTED", "None"), PREEMPTED, False, False,
     ("failed", f"SLURM job 1 PREEMPTED: {PREEMPTED['error']}")),
    # The run failed by itself: its own error, with SLURM's word.
    (JobState("1", "n", "FAILED", "NonZeroExitCode"), CRASHED, False, True,
     ("failed", f"SLURM job 1 FAILED, reason NonZeroExitCode: {CRASHED['error']}")),
])
def test_a_job_that_left_the_queue(job, status, done, retries, want):
    assert job_outcome(job, "1", status, done, retries) == want


def test_slurm_settings_belong_to_the_slurm_runner():
    base = {"base": {"model": {"name_or_path": "x"}}}
    spec = validate_sweep({**base, "runner": {"name": "slurm", "partition": "gpu", "nodes_per_run": 2,
                                               "sbatch_lines": ["#SBATCH --mem=8G"]}})
    assert spec.runner.partition == "gpu" and spec.runner.nodes_per_run == 2
    with pytest.raises(ConfigError, match="runner: runner.partition applies to the slurm runner only"):
        validate_sweep({**base, "runner": {"name": "local", "partition": "gpu"}})
    with pytest.raises(ConfigError, match="must be one line starting with '#SBATCH '"):
        validate_sweep({**base, "runner": {"name": "slurm", "sbatch_lines": ["--mem=8G"]}})
    with pytest.raises(ConfigError, match="runner.name.*slurm"):
        validate_sweep({**base, "runner": {"name": "slurmm"}})


def test_a_missing_or_failing_slurm_command_is_one_line(tmp_path, monkeypatch):
    monkeypatch.setenv("PATH", str(tmp_path))  # no squeue, no sbatch
    with pytest.raises(UserError, match="needs SLURM's squeue on PATH"):
        SlurmRunner(RunnerSpec(name="slurm")).run(SweepStore(tmp_path / "store"), [])
    failing = tmp_path / "squeue"
    failing.write_text("#!/bin/sh\necho 'squeue: error: Unable to contact slurm controller' >&2\nexit 1\n")
    failing.chmod(0o755)
    with pytest.raises(UserError, match="cannot read the queue: squeue failed .*Unable to contact slurm controller"):
        SlurmRunner(RunnerSpec(name="slurm")).run(SweepStore(tmp_path / "store"), [])


def planned(tmp_path):
    store, runs = plan_sweep(validate_sweep(sweep_dict(runner={"name": "slurm"})), output_dir=tmp_path / "store")
    store.sync(runs)
    return store, runs


def test_a_restarted_driver_follows_queued_jobs_by_recorded_id_or_by_name(tmp_path):
    store, runs = planned(tmp_path)
    a, b, c, d = (r.run_id for r in runs[:4])
    store.write_status(a, state="running", slurm_job_id="11", slurm_job_ids=["11"])
    store.write_status(b, state="running", slurm_job_id="12", slurm_job_ids=["12"])  # its job ended
    store.write_status(c, state="pending")  # submitted, then the driver died before recording the id
    queue = {"11": JobState("11", job_name(store, a), "RUNNING", "None"),
             "12": JobState("12", job_name(store, b), "COMPLETED", "None"),
             "13": JobState("13", job_name(store, c), "PENDING", "Resources"),
             "14": JobState("14", f"ft-{'0' * 8}-{d}", "RUNNING", "None")}  # another store's job
    adopted = SlurmRunner(RunnerSpec(name="slurm"))._adopt(store, runs, queue)
    assert adopted == {a: "11", c: "13"}
    assert store.read_status(c)["slurm_job_ids"] == ["13"] and store.read_status(c)["state"] == "running"
    # A store sync (a new ft-sweep) leaves runs with a SLURM job to the SLURM runner.
    store.sync(runs)
    assert store.read_status(a)["state"] == "running"


def test_a_job_killed_after_its_run_saved_on_a_signal_counts_as_preempted(tmp_path):
    store, runs = planned(tmp_path)
    run = runs[0]
    store.write_status(run.run_id, state="running", slurm_job_id="21", slurm_job_ids=["21"])
    (store.run_dir(run.run_id) / "results.json").write_text(json.dumps(
        {"status": "interrupted", "signal": "SIGUSR1", "steps": 7}))
    retries: dict[str, int] = {}
    runner = SlurmRunner(RunnerSpec(name="slurm"))
    assert runner._settle(store, run, "21", JobState("21", "n", "FAILED", "NonZeroExitCode"), retries) == "resubmit"
    assert store.read_status(run.run_id)["error"] == (
        "SLURM job 21 FAILED, reason NonZeroExitCode: stopped by SIGUSR1 at step 7, checkpoint saved; "
        f"submitted again (1 of {PREEMPTED_RUN_RETRIES})")
    store.write_status(run.run_id, state="running")
    retries[run.run_id] = PREEMPTED_RUN_RETRIES
    assert runner._settle(store, run, "21", None, retries) == "failed"
    assert store.read_status(run.run_id)["state"] == "failed"
