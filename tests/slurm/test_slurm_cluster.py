"""The SLURM runner and srun against a real two-node SLURM cluster (tests/slurm/conftest.py), with the
tiny BERT on the quickstart task. One scenario, its parts running side by side to keep the wall time
short, checked by the tests below:

- the 4-run grid (2 seeds x 2 lrs) through ft-sweep's SLURM runner, with the same grid as the
  reference, its runs made in this process by ft-train's function (the sweep driver's store, one
  thread a run as the local runner gives each): same run ids, same results, same report;
- while it runs: the first run's job is sent SIGUSR1 (its batch step, as --signal=B:USR1 would) and
  requeues itself, resuming from its checkpoint; the second run's job is scancelled mid-run and the
  driver records it failed with SLURM's reason; then the driver is killed (SIGKILL) and started
  again: it follows the jobs still queued, submits the cancelled run again, and nothing twice;
- srun -N2 -n2 trains the DDP run (ranks from SLURM's variables, no torchrun) to the single
  process's result.
"""

from __future__ import annotations

import contextlib
import csv
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml

from tiny_run import write_run_config
from ft_framework.cli import report_main, train_main
from ft_framework.run.files import LOG_FILE, RUN_CONFIG_FILE
from ft_framework.sweep import load_sweep, run_sweep
from ft_framework.sweep.slurm_runner import store_tag
from ft_framework.sweep.store import SweepStore, now_iso

pytestmark = pytest.mark.slow
REPO = Path(__file__).resolve().parents[2]
STEPS = 40


def read_jsonl(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def train_records(run_dir: Path) -> list[dict]:
    return [r for r in read_jsonl(run_dir / "metrics.jsonl") if r["type"] == "train"]


def status(store: Path, run_id: str) -> dict:
    try:
        return json.loads((store / "runs" / run_id / "status.json").read_text())
    except (FileNotFoundError, json.JSONDecodeError):
        return {}


def reached_step(run_dir: Path, step: int) -> bool:
    try:
        return any(r["step"] >= step for r in train_records(run_dir))
    except (FileNotFoundError, json.JSONDecodeError):
        return False


def task_pid(run_dir: Path) -> int | None:
    """The pid of the run's ft-train task (started by slurmstepd on this host: the cluster's nodes are
    local), not srun's: the Python process whose arguments run ft_framework.cli on the run's config."""
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            argv = (entry / "cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        if Path(argv[0].decode(errors="replace")).name.startswith("python") and b"ft_framework.cli" in argv and \
                any(str(run_dir).encode() in a for a in argv):
            return int(entry.name)
    return None


def signal_pending(pid: int, signum: int) -> bool:
    """Whether `signum` waits for process `pid` (stopped: delivered once it continues)."""
    try:
        fields = dict(line.split(":\t", 1) for line in Path(f"/proc/{pid}/status").read_text().splitlines()
                      if ":\t" in line)
    except OSError:
        return False
    mask = 1 << (signum - 1)
    return any(int(fields.get(key, "0"), 16) & mask for key in ("ShdPnd", "SigPnd"))


def wait_until(what: str, condition, timeout: float, procs=()) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            tails = [p.communicate(timeout=10)[0][-2000:] for p in procs if p.poll() is not None]
            raise AssertionError(f"timed out waiting for {what}: {tails}")
        time.sleep(0.05)


class InProcessRunner:
    """A sweep runner that makes each run with ft-train's function in this process, one after
    another, on the one thread this process computes on (tests/conftest.py), as the local runner's
    num_cpus_per_run: 1 gives each run's process: the reference runs, without a Python process (and
    its imports) per run. The sweep driver (run_sweep) keeps the store as it does for any runner."""

    def run(self, store, runs, on_done=None, on_change=None) -> dict[str, str]:
        states = {}
        for run in runs:
            directory = store.run_dir(run.run_id)
            store.write_status(run.run_id, state="running", attempts=1, started=now_iso())
            with open(directory / LOG_FILE, "a") as log, contextlib.redirect_stdout(log), \
                    contextlib.redirect_stderr(log):
                code = train_main(["--config", str(directory / RUN_CONFIG_FILE)])
            states[run.run_id] = "finished" if code == 0 else "failed"
            store.write_status(run.run_id, state=states[run.run_id], returncode=code, ended=now_iso())
            if on_done is not None:
                on_done(run, states[run.run_id])
        return states


def ft_sweep(config: Path) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, str(REPO / "launch" / "sweep.py"), "--config", str(config),
                             "--no-progress"], cwd=config.parent, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)


@pytest.fixture(scope="module")
def scenario(slurm_cluster, tiny_bert_dir, tmp_path_factory):
    root = tmp_path_factory.mktemp("slurm_sweep")
    data = {"task": "sst2", "source": "builtin:quickstart", "max_seq_length": 32, "max_train_examples": 64,
            "max_eval_examples": 32}
    evaluation = {"num_evals": 1, "batch_size": 32}
    write_run_config(root / "base.yaml", tiny_bert_dir, root / "unused", data=data, evaluation=evaluation,
                     training={"max_steps": STEPS, "per_device_batch_size": 8, "seed": 1, "device": "cpu"})
    grid = {"base": "base.yaml", "axes": {"training.seed": [1, 2], "optimizer.hparams.lr": [1.0e-3, 2.0e-3]}}
    local = {**grid, "output_dir": str(root / "local"),
             "runner": {"name": "local", "max_parallel": 2, "num_cpus_per_run": 1}}
    slurm = {**grid, "output_dir": str(root / "slurm"),
             "runner": {"name": "slurm", "max_parallel": 4, "num_cpus_per_run": 1, "poll_s": 0.5, "requeue": True}}
    (root / "local.yaml").write_text(yaml.safe_dump(local, sort_keys=False))
    (root / "slurm.yaml").write_text(yaml.safe_dump(slurm, sort_keys=False))
    # The DDP run: the grid's (seed 1, lr 1e-3) run with half the batch on each of 2 ranks.
    ddp_cfg = write_run_config(root / "ddp.yaml", tiny_bert_dir, root / "ddp", data=data, evaluation=evaluation,
                               training={"max_steps": STEPS, "per_device_batch_size": 4, "seed": 1, "device": "cpu"},
                               strategy={"name": "ddp"})
    store = root / "slurm"
    procs = []
    try:
        # MASTER_ADDR: both nodes are this host, and their names (n1, n2) resolve nowhere; the port
        # and the ranks come from SLURM.
        env = {**os.environ, "MASTER_ADDR": "127.0.0.1", "OMP_NUM_THREADS": "1"}
        env = {k: v for k, v in env.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_PORT")}
        ddp = subprocess.Popen(["srun", "-N2", "-n2", "--time=10", sys.executable, "-m", "ft_framework.cli",
                                "--config", str(ddp_cfg)], cwd=root, env=env, stdout=subprocess.PIPE,
                               stderr=subprocess.STDOUT, text=True)
        procs.append(ddp)
        first = ft_sweep(root / "slurm.yaml")
        procs.append(first)

        def submitted() -> list[str]:  # run ids with a job, in the order they were submitted
            found = [(s.get("submitted"), d.name) for d in (store / "runs").glob("*")
                     if (s := status(store, d.name)).get("slurm_job_id")] if (store / "runs").is_dir() else []
            return [rid for _, rid in sorted(found)]

        # The first run to reach step 2 is sent USR1, the second one scancelled: both mid-run.
        signalled: list[str] = []

        def signal_the_next_at_step_2() -> bool:
            for rid in submitted():
                if rid not in signalled and reached_step(store / "runs" / rid, 2):
                    job = status(store, rid)["slurm_job_id"]
                    if signalled:
                        subprocess.run(["scancel", job], check=True)
                    else:
                        # The run's 40 steps take under a second, less than USR1's way (scancel, the
                        # batch step, the job's forward, srun, the task) may take on a loaded machine:
                        # the task waits, stopped, until USR1 has reached it.
                        pid = task_pid(store / "runs" / rid)
                        if pid is None:
                            continue
                        os.kill(pid, signal.SIGSTOP)
                        try:
                            subprocess.run(["scancel", "--signal=USR1", "--batch", job], check=True)
                            wait_until("USR1 to reach the stopped run", lambda: signal_pending(pid, signal.SIGUSR1),
                                       60, procs)
                        finally:
                            os.kill(pid, signal.SIGCONT)
                    signalled.append(rid)
                    break
            return len(signalled) == 2

        wait_until("two runs at step 2", signal_the_next_at_step_2, 180, procs)
        requeued, cancelled = signalled
        wait_until("the cancelled run recorded failed", lambda: status(store, cancelled).get("state") == "failed",
                   60, procs)
        cancelled_status = status(store, cancelled)
        first.send_signal(signal.SIGKILL)
        first_out = first.communicate(timeout=30)[0]
        before = {d.name: status(store, d.name) for d in (store / "runs").glob("*")}

        second = ft_sweep(root / "slurm.yaml")
        procs.append(second)
        # The reference runs, while the second driver follows the SLURM jobs.
        local_sweep = run_sweep(load_sweep(root / "local.yaml"), runner=InProcessRunner(), progress=False)
        second_out = second.communicate(timeout=300)[0]
        assert second.returncode == 0, second_out[-3000:]
        ddp_out = ddp.communicate(timeout=300)[0]
        assert ddp.returncode == 0, ddp_out[-3000:]
        assert local_sweep.complete and local_sweep.counts["finished"] == 4, local_sweep.counts
        queue = subprocess.run(["squeue", "-h", "-t", "all", "-o", "%i|%j"], capture_output=True, text=True,
                               check=True).stdout
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.communicate()
    jobs_of_store = {line.split("|")[0] for line in queue.splitlines()
                     if line.split("|")[1].startswith(f"ft-{store_tag_of(store)}-")}
    return {"root": root, "store": store, "local": root / "local", "requeued": requeued, "cancelled": cancelled,
            "cancelled_status": cancelled_status, "before": before, "second_out": second_out,
            "first_out": first_out, "jobs_of_store": jobs_of_store}


def store_tag_of(store: Path) -> str:
    return store_tag(SweepStore(store))


def assert_same_run(ours: Path, theirs: Path) -> None:
    a, b = json.loads((ours / "results.json").read_text()), json.loads((theirs / "results.json").read_text())
    assert a["final"]["step"] == b["final"]["step"] == STEPS
    assert a["final"]["metrics"].keys() == b["final"]["metrics"].keys()
    for split, metrics in b["final"]["metrics"].items():
        assert a["final"]["metrics"][split] == pytest.approx(metrics, rel=1e-6), split
    assert a["failed"] == b["failed"]
    assert [r["loss"] for r in train_records(ours)] == pytest.approx([r["loss"] for r in train_records(theirs)],
                                                                      rel=1e-6)


def test_the_grid_through_slurm_gives_the_local_runs_ids_results_and_report(scenario, tmp_path):
    store, local = scenario["store"], scenario["local"]
    ids = sorted(p.name for p in (local / "runs").iterdir())
    assert len(ids) == 4 and sorted(p.name for p in (store / "runs").iterdir()) == ids
    assert "4 runs in" in scenario["second_out"] and "4 finished" in scenario["second_out"]
    for rid in ids:
        assert status(store, rid)["state"] == "finished"
        assert_same_run(store / "runs" / rid, local / "runs" / rid)
        assert json.loads((store / "runs" / rid / "results.json").read_text())["slurm"]["job_id"] \
            == status(store, rid)["slurm_job_id"]
    reports = {}
    for name, directory in (("slurm", store), ("local", local)):
        assert report_main([str(directory), "--out", str(tmp_path / name), "--no-plots",
                            "--bootstrap-samples", "200"]) == 0
        reports[name] = list(csv.DictReader((tmp_path / name / "report.csv").open()))
    assert reports["slurm"] == reports["local"] and reports["slurm"]


def test_a_job_sent_usr1_requeues_itself_and_resumes_to_the_uninterrupted_run(scenario):
    store, rid = scenario["store"], scenario["requeued"]
    run_dir = store / "runs" / rid
    results = json.loads((run_dir / "results.json").read_text())
    assert results["slurm"]["restart_count"] == 1  # SLURM started the same job again
    final = status(store, rid)
    assert final["state"] == "finished" and len(final["slurm_job_ids"]) == 1 and final["attempts"] == 2
    log = (run_dir / "log.txt").read_text()
    assert "stopped by SIGUSR1 at step" in log and "(resuming from its latest checkpoint)" in log
    assert_same_run(run_dir, scenario["local"] / "runs" / rid)


def test_a_scancelled_job_is_failed_with_slurms_reason_and_the_next_sweep_submits_it_again(scenario):
    store, rid = scenario["store"], scenario["cancelled"]
    failed = scenario["cancelled_status"]
    first_job = failed["slurm_job_id"]
    assert failed["state"] == "failed" and failed["error"].startswith(f"SLURM job {first_job} CANCELLED"), failed
    assert "stopped by SIGTERM at step" in failed["error"]  # the run saved a checkpoint on the way out
    final = status(store, rid)
    assert final["state"] == "finished" and final["slurm_job_ids"][0] == first_job and len(final["slurm_job_ids"]) == 2
    assert "(resuming from its latest checkpoint)" in (store / "runs" / rid / "log.txt").read_text()
    assert_same_run(store / "runs" / rid, scenario["local"] / "runs" / rid)


def test_a_driver_killed_mid_sweep_and_started_again_submits_nothing_twice(scenario):
    store = scenario["store"]
    recorded = {rid: status(store, rid)["slurm_job_ids"] for rid in scenario["before"]}
    every_id = [j for ids in recorded.values() for j in ids]
    # One job per run (the cancelled one: its job and the one the second sweep submitted), every job
    # of this store that SLURM knows is recorded in the store, and none twice.
    assert len(every_id) == len(set(every_id)) == 5, recorded
    assert set(every_id) == scenario["jobs_of_store"]
    for rid, ids in recorded.items():
        assert len(ids) == (2 if rid == scenario["cancelled"] else 1), (rid, ids)
    # The runs the killed driver left queued or running were followed, not submitted again.
    for rid, before in scenario["before"].items():
        if before.get("state") == "running":
            assert recorded[rid][0] == before["slurm_job_id"]


def test_srun_two_tasks_train_ddp_as_one_process_does(scenario):
    ddp, single = scenario["root"] / "ddp", None
    for run_dir in (scenario["local"] / "runs").iterdir():
        axes = json.loads((run_dir / "run.json").read_text())["axes"]
        if axes == {"training.seed": 1, "optimizer.hparams.lr": 1.0e-3}:
            single = run_dir
    a, b = json.loads((single / "results.json").read_text()), json.loads((ddp / "results.json").read_text())
    assert b["config"]["strategy"]["name"] == "ddp" and "slurm" in b
    assert a["final"]["metrics"] == b["final"]["metrics"]
    # Rank 0 logs its half-batch loss; the parameters (their distance from theta*) follow the same path.
    dist_a = [r["forgetting_distance"] for r in train_records(single)]
    dist_b = [r["forgetting_distance"] for r in train_records(ddp)]
    assert len(dist_a) == len(dist_b) == STEPS and dist_b == pytest.approx(dist_a, rel=1e-4)
