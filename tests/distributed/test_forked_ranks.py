"""forked_ranks.py, the launcher of the DeepSpeed, FSDP and resharding workers: each phase's ranks
get a launcher's environment and run one after another; a failing rank fails the launch at once
and takes its peers down; ranks die with the launching process (a test's timeout leaves nothing)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

HERE = Path(__file__).resolve().parent
LAUNCHER = """
import json, os, sys, time
from pathlib import Path
sys.path.insert(0, {here!r})
from forked_ranks import run_phases

out = Path({out!r})

def record(phase):
    def work():
        (out / f"{{phase}}_{{os.environ['RANK']}}.json").write_text(json.dumps(
            {{k: os.environ.get(k) for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR",
                                            "MASTER_PORT", "TORCHELASTIC_USE_AGENT_STORE")}} | {{"at": time.time()}}))
    return work

def write_pid():
    part = out / f"pid_{{os.environ['RANK']}}.part"
    part.write_text(str(os.getpid()))
    part.rename(out / f"pid_{{os.environ['RANK']}}")

def fail_or_hang():
    write_pid()
    if os.environ["RANK"] == "1":
        while not (out / "pid_0").exists():  # rank 0 is in its sleep
            time.sleep(0.01)
        raise ValueError("rank 1 fails")
    time.sleep(600)

def hang():
    write_pid()
    time.sleep(600)

run_phases([{phases}])
"""


def start(tmp_path: Path, phases: str) -> subprocess.Popen:
    script = LAUNCHER.format(here=str(HERE), out=str(tmp_path), phases=phases)
    env = {**os.environ, "TORCHELASTIC_USE_AGENT_STORE": "True"}  # as if started by torchrun: not passed on
    return subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True, env=env)


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
    """Three phases that end well, one whose rank 1 fails while rank 0 sleeps, one never reached."""
    out = tmp_path_factory.mktemp("forked_ranks")
    proc = start(out, '("two", 2, record("two")), ("one", 1, record("one")), ("again", 2, record("again")), '
                      '("fails", 2, fail_or_hang), ("never", 1, record("never"))')
    log, _ = proc.communicate(timeout=120)
    return out, proc.returncode, log


def test_each_phase_runs_its_ranks_with_a_launchers_environment_in_order(launched):
    out, _, log = launched
    assert sorted(p.name for p in out.glob("*.json")) == ["again_0.json", "again_1.json", "one_0.json",
                                                           "two_0.json", "two_1.json"], log
    seen = {p.stem: json.loads(p.read_text()) for p in out.glob("*.json")}
    for name, env in seen.items():
        phase, rank = name.rsplit("_", 1)
        world = "1" if phase == "one" else "2"
        assert env["RANK"] == env["LOCAL_RANK"] == rank and env["WORLD_SIZE"] == env["LOCAL_WORLD_SIZE"] == world
        assert env["MASTER_ADDR"] == "127.0.0.1" and env["TORCHELASTIC_USE_AGENT_STORE"] is None
    # Each phase has a rendezvous port of its own, and starts when the one before has ended.
    assert len({seen[f"{phase}_0"]["MASTER_PORT"] for phase in ("two", "one", "again")}) == 3
    assert max(seen["two_0"]["at"], seen["two_1"]["at"]) < seen["one_0"]["at"] < min(seen["again_0"]["at"],
                                                                                     seen["again_1"]["at"])


def test_a_failing_rank_fails_the_launch_and_its_peer_is_killed(launched):
    out, returncode, log = launched
    assert returncode == 1, log
    assert "ValueError: rank 1 fails" in log
    assert "forked_ranks: phase 'fails', rank 1 of 2 exited with 1" in log
    assert not alive(int((out / "pid_0").read_text()))  # the peer in its 600 s sleep
    assert not list(out.glob("never_*.json"))  # no phase after a failed one


def test_ranks_die_with_the_launching_process(tmp_path):
    proc = start(tmp_path, '("hangs", 2, hang)')
    wait_for(lambda: all((tmp_path / f"pid_{rank}").exists() for rank in (0, 1)))
    pids = [int((tmp_path / f"pid_{rank}").read_text()) for rank in (0, 1)]
    proc.send_signal(signal.SIGKILL)  # as subprocess.run(timeout=...) kills a worker
    proc.wait(timeout=60)
    wait_for(lambda: not any(map(alive, pids)))
