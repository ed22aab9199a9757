"""rank_launcher.py, the launcher of the tests' multi-process workers: each step of a plan gets its
ranks, with a launcher's environment, one step after another; a failing rank fails the launch at
once and takes its peers down; ranks die with the launching process (a test's timeout leaves
nothing); the test's side (launch) returns the output of a plan that ended well."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from rank_launcher import launch, step

HERE = Path(__file__).resolve().parent
WORKER = """
import json, os, sys, time
from pathlib import Path
sys.path.insert(0, {here!r})
from rank_launcher import run_plan

def record(out, phase):
    (Path(out) / f"{{phase}}_{{os.environ['RANK']}}.json").write_text(json.dumps(
        {{k: os.environ.get(k) for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR",
                                        "MASTER_PORT", "TORCHELASTIC_USE_AGENT_STORE")}} | {{"at": time.time()}}))
    print(f"recorded {{phase}} on rank {{os.environ['RANK']}}")

def write_pid(out):
    part = Path(out) / f"pid_{{os.environ['RANK']}}.part"
    part.write_text(str(os.getpid()))
    part.rename(Path(out) / f"pid_{{os.environ['RANK']}}")

def fail_or_hang(out):
    write_pid(out)
    if os.environ["RANK"] == "1":
        while not (Path(out) / "pid_0").exists():  # rank 0 is in its sleep
            time.sleep(0.01)
        raise ValueError("rank 1 fails")
    time.sleep(600)

def hang(out):
    write_pid(out)
    time.sleep(600)

run_plan({{"record": record, "fail_or_hang": fail_or_hang, "hang": hang}})
"""


def write_worker(directory: Path) -> Path:
    worker = directory / "worker.py"
    worker.write_text(WORKER.format(here=str(HERE)))
    return worker


def start(tmp_path: Path, plan: list[dict]) -> subprocess.Popen:
    """The worker on `plan`, as `launch` starts it, but left to the test to wait for."""
    work = tmp_path / "worker"
    work.mkdir()
    (work / "plan.json").write_text(json.dumps(plan))
    env = {**os.environ, "TORCHELASTIC_USE_AGENT_STORE": "True"}  # as if started by torchrun: not passed on
    return subprocess.Popen([sys.executable, str(write_worker(work)), str(work / "plan.json")],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    # A zombie (not yet reaped by its new parent) has stopped running.
    return Path(f"/proc/{pid}/stat").read_text().split()[2] != "Z"


def wait_for(pred, timeout=60.0):
    deadline = time.monotonic() + timeout
    while not pred():
        assert time.monotonic() < deadline
        time.sleep(0.05)


@pytest.fixture(scope="module")
def launched(tmp_path_factory):
    """Three steps that end well, one whose rank 1 fails while rank 0 sleeps, one never reached."""
    out = tmp_path_factory.mktemp("rank_launcher")
    proc = start(out, [step("record", 2, out=out, phase="two"), step("record", 1, out=out, phase="one"),
                       step("record", 2, out=out, phase="again"), step("fail_or_hang", 2, out=out),
                       step("record", 1, out=out, phase="never")])
    log, _ = proc.communicate(timeout=120)
    return out, proc.returncode, log


def test_each_step_runs_its_ranks_with_a_launchers_environment_in_order(launched):
    out, _, log = launched
    assert sorted(p.name for p in out.glob("*.json")) == ["again_0.json", "again_1.json", "one_0.json",
                                                           "two_0.json", "two_1.json"], log
    seen = {p.stem: json.loads(p.read_text()) for p in out.glob("*.json")}
    for name, env in seen.items():
        phase, rank = name.rsplit("_", 1)
        world = "1" if phase == "one" else "2"
        assert env["RANK"] == env["LOCAL_RANK"] == rank and env["WORLD_SIZE"] == env["LOCAL_WORLD_SIZE"] == world
        assert env["MASTER_ADDR"] == "127.0.0.1" and env["TORCHELASTIC_USE_AGENT_STORE"] is None
    # Each step has a rendezvous port of its own, and starts when the one before has ended.
    assert len({seen[f"{phase}_0"]["MASTER_PORT"] for phase in ("two", "one", "again")}) == 3
    assert max(seen["two_0"]["at"], seen["two_1"]["at"]) < seen["one_0"]["at"] < min(seen["again_0"]["at"],
                                                                                     seen["again_1"]["at"])


def test_a_failing_rank_fails_the_launch_and_its_peer_is_killed(launched):
    out, returncode, log = launched
    assert returncode == 1, log
    assert "ValueError: rank 1 fails" in log
    assert "rank_launcher: step 4 ('fail_or_hang'), rank 1 of 2 exited with 1" in log
    assert not alive(int((out / "pid_0").read_text()))  # the peer in its 600 s sleep
    assert not list(out.glob("never_*.json"))  # no step after a failed one


def test_ranks_die_with_the_launching_process(tmp_path):
    proc = start(tmp_path, [step("hang", 2, out=tmp_path)])
    wait_for(lambda: all((tmp_path / f"pid_{rank}").exists() for rank in (0, 1)))
    pids = [int((tmp_path / f"pid_{rank}").read_text()) for rank in (0, 1)]
    proc.send_signal(signal.SIGKILL)  # as subprocess.run(timeout=...) kills a worker
    proc.wait(timeout=60)
    wait_for(lambda: not any(map(alive, pids)))


def test_launch_returns_the_output_of_a_plan_that_ended_well_and_fails_on_one_that_did_not(tmp_path):
    worker = write_worker(tmp_path)
    log = launch(worker, [step("record", 2, out=tmp_path, phase="ok")], tmp_path, timeout=120)
    assert "recorded ok on rank 0" in log and "recorded ok on rank 1" in log
    with pytest.raises(AssertionError, match="rank_launcher: the plan names steps this worker does not know: "
                                             r"\['unknown'\]"):
        launch(worker, [step("record", 1, out=tmp_path, phase="never"), step("unknown", 1)], tmp_path, timeout=120)
    assert not (tmp_path / "never_0.json").exists()  # the plan is checked before any step runs


def test_a_hung_step_fails_naming_its_rank_and_where_it_waits(tmp_path):
    """A rank past the step watchdog (FT_TEST_STEP_WATCHDOG_S) prints its threads' stacks and exits
    1: the launch fails in seconds, naming the step and the rank, instead of waiting out its timeout."""
    worker = write_worker(tmp_path)
    started = time.monotonic()
    with pytest.raises(AssertionError) as failed:
        launch(worker, [step("hang", 2, out=tmp_path)], tmp_path, timeout=120, env={"FT_TEST_STEP_WATCHDOG_S": "3"})
    said = str(failed.value)
    assert "rank_launcher: step 1 ('hang'), rank " in said and "of 2 exited with 1" in said
    assert "Timeout (0:00:03)!" in said and "in hang" in said   # faulthandler's dump: the hung function
    assert time.monotonic() - started < 60
