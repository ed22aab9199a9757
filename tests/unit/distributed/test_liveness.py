"""The liveness witness (distributed/liveness.py) of real processes: it answers while its process
lives, whatever the process does, and is refused once the process is killed, even by SIGKILL and
even while a forked child of it still runs. report_failure names such a rank in one line."""

from __future__ import annotations

import io
import os
import signal
import socket
import subprocess
import sys
import textwrap

import pytest

from ft_framework.distributed import liveness, peer_failures
from ft_framework.run.failures import EXIT_CRASH, report_failure

# A rank's process as rendezvous.py leaves it: its witness open and published on the board.
RANK_PROCESS = textwrap.dedent("""
    import os, time
    from datetime import timedelta
    import torch.distributed as dist
    from ft_framework.distributed import peer_failures
    port = int(os.environ["STORE_PORT"])
    store = dist.TCPStore("127.0.0.1", port, 2, is_master=False, timeout=timedelta(seconds=30))
    peer_failures.register_store(store, world_size=2, store_host_rank=0, rank=1, rendezvous=("127.0.0.1", port))
    print("ready", flush=True)
    time.sleep(120)
""")

# A process with a witness and a forked child (a data-loader worker, say) that outlives it; no torch.
FORKING_PROCESS = textwrap.dedent("""
    import os, time
    from ft_framework.distributed import liveness
    address = liveness.open_witness("127.0.0.1", 9, world_size=2)
    ready_r, ready_w = os.pipe()
    if os.fork() == 0:
        os.write(ready_w, b"1")  # the fork hooks (closing the inherited witness) have run by now
        time.sleep(120)
        os._exit(0)
    os.read(ready_r, 1)  # the child runs: what the test sees next is the child's socket state, not a race
    print(address, flush=True)
    time.sleep(120)
""")


def start(script: str, **env: str) -> tuple[subprocess.Popen, str]:
    """The process and the first line it prints."""
    proc = subprocess.Popen([sys.executable, "-c", script], env={**os.environ, "OMP_NUM_THREADS": "1", **env},
                            stdout=subprocess.PIPE, text=True, start_new_session=True)
    return proc, proc.stdout.readline().strip()


def kill_session(proc: subprocess.Popen) -> None:
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    proc.wait(timeout=30)


def raised(exc: Exception) -> Exception:
    try:
        raise exc
    except Exception as caught:  # noqa: BLE001 - with its traceback, as report_failure gets it
        return caught


@pytest.mark.slow  # a second process that imports torch
def test_a_rank_killed_without_a_word_is_named_in_one_line_and_a_live_one_is_not(board):
    proc, said = start(RANK_PROCESS, STORE_PORT=str(board.port))
    assert said == "ready"
    try:
        # While rank 1 lives (even stopped: the kernel answers for it), a plain RuntimeError is this
        # rank's own: its traceback.
        os.kill(proc.pid, signal.SIGSTOP)
        assert peer_failures.silent_peers(0) == {}
        out = io.StringIO()
        assert report_failure(raised(RuntimeError("an error of this rank")), prog="ft-train", stream=out) == EXIT_CRASH
        assert out.getvalue().startswith("Traceback")
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait(timeout=30)
        assert peer_failures.silent_peers(0) == {1: liveness.GONE}
        assert peer_failures.silent_peers(1) == {}  # a rank never probes itself
        out = io.StringIO()
        assert report_failure(raised(RuntimeError("any wording at all")), prog="ft-train", stream=out) == EXIT_CRASH
    finally:
        kill_session(proc)
    [line] = out.getvalue().splitlines()
    assert line.startswith("ft-train (rank 0): stopped: rank 1 died without reporting an error (its process is "
                           "gone: killed by a signal such as SIGKILL")
    assert "resume from the last checkpoint with checkpoint.resume_from=auto" in line
    assert line.endswith("here: RuntimeError: any wording at all")


def test_a_forked_child_does_not_keep_a_killed_processs_witness_alive():
    proc, address = start(FORKING_PROCESS)
    try:
        assert liveness.probe({1: address}) == {1: liveness.ALIVE}
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait(timeout=30)
        assert liveness.probe({1: address}) == {1: liveness.GONE}
    finally:
        kill_session(proc)  # the child, in the same session


def test_refused_is_gone_no_answer_is_unreachable_and_a_foreign_loopback_is_not_probed():
    here = socket.gethostname()
    with socket.socket() as bound_only, socket.socket() as full:
        bound_only.bind(("127.0.0.1", 0))  # nothing listens: refused, as at a dead process's address
        full.bind(("127.0.0.1", 0))
        full.listen(0)  # room for one connection nobody accepts; the kernel drops the next ones unanswered
        refused, busy = bound_only.getsockname()[1], full.getsockname()[1]
        assert liveness.probe({1: f"{here} 127.0.0.1 {busy}"}, timeout_s=5) == {1: liveness.ALIVE}
        verdicts = liveness.probe({1: f"{here} 127.0.0.1 {refused}", 2: f"another-host 127.0.1.1 {busy}",
                                   3: f"{here} 127.0.0.1 {busy}"}, timeout_s=0.5)
    assert verdicts == {1: liveness.GONE, 3: liveness.UNREACHABLE}
