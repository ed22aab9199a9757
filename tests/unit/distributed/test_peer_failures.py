"""The failure board (distributed/peer_failures.py) on a real TCPStore, and report_failure's choice
between a one-line "another rank failed" and this rank's own traceback: made from the board and
torch's exception types, never from the error's text."""

from __future__ import annotations

import io
import os
from datetime import timedelta

import torch.distributed as dist

from ft_framework.distributed import peer_failures
from ft_framework.run.failures import EXIT_CRASH, EXIT_USER_ERROR, report_failure
from ft_framework.errors import UserError
from ft_framework.distributed.rendezvous import free_port


def test_an_announced_failure_is_read_by_the_other_rank_only(board):
    assert peer_failures.failed_peers(0, wait_s=0) == {}
    assert peer_failures.announce_failure(1, "RuntimeError: out of memory")
    assert peer_failures.failed_peers(0, wait_s=0) == {1: "RuntimeError: out of memory"}
    assert peer_failures.failed_peers(1, wait_s=0) == {}  # a rank never reads its own entry


def test_without_a_board_nothing_is_announced_or_read(monkeypatch):
    monkeypatch.setattr(peer_failures, "_board", {})
    assert peer_failures.announce_failure(0, "x") is False
    assert peer_failures.failed_peers(1, wait_s=0) == {}


def test_a_store_that_is_gone_names_its_host_rank(monkeypatch):
    port = free_port()
    host = dist.TCPStore("127.0.0.1", port, 2, is_master=True, timeout=timedelta(seconds=10), wait_for_workers=False)
    client = dist.TCPStore("127.0.0.1", port, 2, is_master=False, timeout=timedelta(seconds=2))
    monkeypatch.setattr(peer_failures, "_board", {})
    peer_failures.register_store(client, world_size=2, store_host_rank=0)
    del host  # rank 0's process, which hosted the store, is gone
    assert peer_failures.failed_peers(1, wait_s=0) == {0: peer_failures.STORE_GONE}
    monkeypatch.setenv("RANK", "1")
    monkeypatch.setenv("WORLD_SIZE", "2")
    out = io.StringIO()
    assert report_failure(RuntimeError("read error"), prog="ft-train", stream=out) == EXIT_CRASH
    # Whether rank 0 announced its own error went with its board: the line says both cases.
    assert out.getvalue() == ("ft-train (rank 1): stopped: rank 0 went away: the rendezvous store it hosted is gone "
                              "(its error line is above if it printed one; if not, it was killed: SIGKILL, the "
                              "out-of-memory killer, a lost node); this rank stops without saving: resume from the "
                              "last checkpoint with checkpoint.resume_from=auto; here: RuntimeError: read error\n")


def test_a_peer_entry_makes_one_line_whatever_the_error_says(board):
    peer_failures.announce_failure(1, "error: bad data")
    out = io.StringIO()
    code = report_failure(RuntimeError("some wording gloo never used"), prog="ft-train", stream=out)
    assert code == EXIT_CRASH
    assert out.getvalue().strip() == ("ft-train (rank 0): stopped: another rank failed or went away (rank 1 shows "
                                      "its error); here: RuntimeError: some wording gloo never used")


def test_an_error_that_mentions_a_peer_is_still_this_ranks_own_without_an_entry(board):
    """The text once decided: 'connection closed by peer' made a one-liner. Now only the board does:
    this rank reports its traceback and writes its error on the board for the others."""
    out = io.StringIO()
    try:
        raise RuntimeError("Connection closed by peer [127.0.0.1]:1234")
    except RuntimeError as exc:
        code = report_failure(exc, prog="ft-train", stream=out)
    assert code == EXIT_CRASH
    assert out.getvalue().startswith("Traceback") and "stopped:" not in out.getvalue()
    assert peer_failures.failed_peers(1, wait_s=0) == {0: "RuntimeError: Connection closed by peer [127.0.0.1]:1234"}


def test_torchs_own_distributed_error_types_are_a_peer_failure(board):
    out = io.StringIO()
    report_failure(dist.DistNetworkError("anything"), prog="ft-train", stream=out)
    assert "stopped: another rank failed or went away (that rank shows its error)" in out.getvalue()
    assert "Traceback" not in out.getvalue()


def test_a_user_error_of_one_rank_is_announced_and_printed_by_that_rank(board):
    out = io.StringIO()
    assert report_failure(UserError("train.tsv: bad data"), prog="ft-train", stream=out) == EXIT_USER_ERROR
    assert out.getvalue().strip() == "ft-train (rank 0): error: train.tsv: bad data"
    assert peer_failures.failed_peers(1, wait_s=0) == {0: "error: train.tsv: bad data"}


def test_a_launchers_sigterm_while_a_rank_reports_waits_until_the_line_is_out():
    """torchrun and DeepSpeed's launcher SIGTERM the other workers as soon as one dies; a survivor
    that is reporting why it stopped finishes its line first, then the signal ends it."""
    import subprocess
    import sys
    import textwrap

    script = textwrap.dedent("""
        import os, signal, time
        from ft_framework.run.failures import sigterm_held
        with sigterm_held():
            os.kill(os.getpid(), signal.SIGTERM)
            time.sleep(0.5)  # the handler has run by now: the signal arrived while held
            print("the line", flush=True)
        print("not reached", flush=True)
    """)
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=60,
                          env={**os.environ, "RANK": "1", "WORLD_SIZE": "2"})
    assert proc.returncode == -15 and proc.stdout == "the line\n", (proc.returncode, proc.stdout, proc.stderr)


LOOP_RAISES_THEN_SIGTERM = """
import os, signal, time
from ft_framework.errors import UserError
from ft_framework.run.failures import report_failure
from ft_framework.run.signals import StopSignals
try:
    with StopSignals(prog="ft-train"):
        raise UserError("train.jsonl:3: the row is bad")  # the training loop raises
except UserError as exc:
    os.kill(os.getpid(), signal.SIGTERM)  # the launcher's SIGTERM, after the loop's handlers are gone
    time.sleep(0.5)  # the gap widened: before the fix the signal's default action ended the rank here
    print("reporting", flush=True)
    report_failure(exc, prog="ft-train")
print("not reached", flush=True)
"""


def test_a_sigterm_between_the_loop_and_the_report_waits_for_the_line():
    """With several ranks the hold begins as the loop's handlers go (run/signals.py), not when
    report_failure starts: the line is printed, then the held SIGTERM ends the rank. One rank holds
    nothing (no launcher sends it one), and the signal acts at once."""
    import subprocess
    import sys

    def run(world: str) -> subprocess.CompletedProcess:
        return subprocess.run([sys.executable, "-c", LOOP_RAISES_THEN_SIGTERM], capture_output=True, text=True,
                              timeout=60, env={**os.environ, "RANK": "1", "WORLD_SIZE": world})

    two = run("2")
    assert two.returncode == -15 and two.stdout == "reporting\n", (two.returncode, two.stdout, two.stderr)
    assert two.stderr.strip() == "ft-train (rank 1): error: train.jsonl:3: the row is bad", two.stderr
    one = run("1")
    assert one.returncode == -15 and one.stdout == "" and one.stderr == "", (one.returncode, one.stdout, one.stderr)


def test_a_hold_nobody_releases_lets_a_late_sigterm_through():
    """A caller of Trainer.fit other than ft-train may never report: after HOLD_LIMIT_S a SIGTERM
    acts again."""
    import subprocess
    import sys

    script = ("import os, signal, time\n"
              "from ft_framework.run import failures\n"
              "failures.HOLD_LIMIT_S = 0.2\n"
              "assert failures.hold_sigterm()\n"
              "time.sleep(0.5)\n"
              "os.kill(os.getpid(), signal.SIGTERM)\n"
              "time.sleep(5)\n"
              "print('not reached', flush=True)\n")
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=60,
                          env={**os.environ, "RANK": "0", "WORLD_SIZE": "2"})
    assert proc.returncode == -15 and proc.stdout == "", (proc.returncode, proc.stdout, proc.stderr)
