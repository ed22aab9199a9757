"""srun's task environment as the launcher variables (distributed/slurm_env.py), without a cluster:
SLURM's host-list expansion (checked against `scontrol show hostnames` where SLURM is installed),
ranks, the rendezvous address and port, and what results.json records of the job."""

from __future__ import annotations

import os
import shutil
import subprocess

import pytest

from ft_framework.distributed.slurm_env import (PORT_BASE, PORT_SPAN, adopt_slurm_launch, expand_hostlist,
                                                port_for_job, slurm_job_record, slurm_launch_env)
from ft_framework.errors import UserError

AWKWARD = {
    "n[1-3,5],gpu-a[01-02]": ["n1", "n2", "n3", "n5", "gpu-a01", "gpu-a02"],
    "n1": ["n1"],
    "node-[08-11]": ["node-08", "node-09", "node-10", "node-11"],
    "r[1-2]-n[01-02],x": ["r1-n01", "r1-n02", "r2-n01", "r2-n02", "x"],
    "a[9-10],b[098-100]": ["a9", "a10", "b098", "b099", "b100"],
    "c[7],c[1-2]": ["c7", "c1", "c2"],
    "gpu001,gpu003": ["gpu001", "gpu003"],
}


@pytest.mark.parametrize("text", sorted(AWKWARD))
def test_hostlist_expands_as_scontrol_does(text):
    assert expand_hostlist(text) == AWKWARD[text]


def test_hostlist_matches_scontrol_show_hostnames_where_slurm_is_installed(tmp_path):
    if shutil.which("scontrol") is None:
        pytest.skip("SLURM's scontrol is not installed (bash scripts/install.sh --test as root installs it)")
    # scontrol expands without a cluster, but reads a config first.
    (tmp_path / "slurm.conf").write_text("ClusterName=x\nSlurmctldHost=localhost\n")
    for text, want in AWKWARD.items():
        done = subprocess.run(["scontrol", "show", "hostnames", text], capture_output=True, text=True,
                              env={**os.environ, "SLURM_CONF": str(tmp_path / "slurm.conf")})
        assert done.stdout.split() == want == expand_hostlist(text), (text, done.stderr)


@pytest.mark.parametrize("bad", ["n[1-3", "n1-3]", "n[3-1]", "n[a-b]", "n[[1]]"])
def test_a_malformed_hostlist_is_an_error(bad):
    with pytest.raises(ValueError, match="host list"):
        expand_hostlist(bad)


def srun_env(**extra):
    env = {"SLURM_JOB_ID": "4321", "SLURM_STEP_ID": "0", "SLURM_PROCID": "3", "SLURM_NTASKS": "4",
           "SLURM_LOCALID": "1", "SLURM_JOB_NODELIST": "gpu-a[01-02]", "SLURM_STEP_NODELIST": "gpu-a[02-03]"}
    return {**env, **extra}


def test_an_srun_task_gets_rank_world_local_rank_and_the_steps_first_host():
    assert slurm_launch_env(srun_env()) == {"RANK": "3", "WORLD_SIZE": "4", "LOCAL_RANK": "1",
                                            "MASTER_ADDR": "gpu-a02", "MASTER_PORT": str(PORT_BASE + 4321)}
    env = srun_env()
    del env["SLURM_STEP_NODELIST"]
    assert slurm_launch_env(env)["MASTER_ADDR"] == "gpu-a01"  # the job's node list when the step's is missing
    # The user's MASTER_ADDR / MASTER_PORT win.
    assert slurm_launch_env(srun_env(MASTER_ADDR="10.0.0.1", MASTER_PORT="29500"))["MASTER_ADDR"] == "10.0.0.1"
    assert slurm_launch_env(srun_env(MASTER_PORT="29500"))["MASTER_PORT"] == "29500"


def test_the_batch_script_and_launched_processes_are_not_srun_tasks():
    batch = srun_env()
    del batch["SLURM_STEP_ID"]  # the batch step: SLURM_PROCID=0 but no step id
    assert slurm_launch_env(batch) is None
    assert slurm_launch_env(srun_env(RANK="0")) is None  # torchrun / deepspeed described it already
    assert slurm_launch_env({}) is None


def test_an_incomplete_task_environment_is_one_line():
    env = srun_env()
    del env["SLURM_NTASKS"]
    with pytest.raises(UserError, match="SLURM_NTASKS is not set"):
        slurm_launch_env(env)
    with pytest.raises(UserError, match="cannot read SLURM's node list.*MASTER_ADDR"):
        slurm_launch_env(srun_env(SLURM_STEP_NODELIST="n[1-"))


def test_ports_differ_between_jobs_and_stay_below_the_ephemeral_range():
    ports = {port_for_job(j) for j in range(1, 200)}
    assert len(ports) == 199 and max(port_for_job(j) for j in range(10 ** 6)) < 32768
    assert port_for_job("77_3") == port_for_job(77) == PORT_BASE + 77  # an array task's id
    assert port_for_job(PORT_SPAN + 5) == PORT_BASE + 5


def test_adopt_sets_the_launcher_variables(monkeypatch):
    for key in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        # set first, so that monkeypatch records each as absent and removes what adopt sets: a
        # RANK/MASTER_ADDR left in this worker made a later test's accelerate wait for a rendezvous
        monkeypatch.setenv(key, "unset")
        monkeypatch.delenv(key)
    for key, value in srun_env().items():
        monkeypatch.setenv(key, value)
    assert adopt_slurm_launch() is True
    assert (os.environ["RANK"], os.environ["WORLD_SIZE"], os.environ["MASTER_ADDR"]) == ("3", "4", "gpu-a02")
    assert adopt_slurm_launch() is False  # RANK is set now: nothing to do


def test_results_record_the_job_and_its_restarts():
    assert slurm_job_record({}) is None
    assert slurm_job_record({"SLURM_JOB_ID": "12", "SLURM_RESTART_COUNT": "2"}) == {"job_id": "12", "restart_count": 2}
    assert slurm_job_record({"SLURM_JOB_ID": "12"}) == {"job_id": "12", "restart_count": 0}
