"""How a command-line run ends: its exit code, and what it prints when it fails.

=====  ==========================================================================================
code   meaning
=====  ==========================================================================================
0      finished; results.json written
1      crashed (a bug, out of memory, a lost peer): the traceback is printed
2      user error (:class:`~ft_framework.errors.UserError`): one line, no traceback (``--debug``
       prints it)
3      diverged (:data:`EXIT_DIVERGED`): results.json says where and why (run/divergence.py stops
       the run)
128+N  stopped by signal N (143 SIGTERM, 130 SIGINT, 138 SIGUSR1) after saving a checkpoint;
       results.json has ``status: interrupted`` (run/signals.py); a second signal exits at once
=====  ==========================================================================================

docs/run_lifecycle.md has the table for users.

With several ranks, an error every rank hits alike (a config error, the output-directory guard, a
refused resume) is printed by rank 0 only; an error only one rank hits (its data, its memory) is
printed by that rank, and the ranks that then lose their peer print one short line, not a traceback:
the failing rank writes its error on a board in the rendezvous store before it exits
(distributed/peer_failures.py), and a rank whose collective then breaks finds it there. A peer
that died without a word (kill -9, the out-of-memory killer, a lost node) wrote nothing there; its
liveness witness tells instead (distributed/liveness.py: a socket the kernel closes when a process
dies), and the survivors name it in one line. The decision never reads the text of an error.
"""

from __future__ import annotations

import os
import re
import signal
import sys
import threading
import time
import traceback
from contextlib import contextmanager
from typing import Any, Iterator, TextIO

from ft_framework.distributed.liveness import GONE
from ft_framework.distributed.peer_failures import STORE_GONE, announce_failure, failed_peers, silent_peers
from ft_framework.errors import UserError

__all__ = ["EXIT_CRASH", "EXIT_DIVERGED", "EXIT_OK", "EXIT_USER_ERROR", "HOLD_LIMIT_S", "error_line", "hold_sigterm",
           "is_peer_failure", "print_user_error", "release_sigterm", "report_failure", "same_on_every_rank",
           "sigterm_held"]

EXIT_OK = 0
EXIT_CRASH = 1
EXIT_USER_ERROR = 2
EXIT_DIVERGED = 3

_SAME_ON_EVERY_RANK = "_ft_same_on_every_rank"


def same_on_every_rank(exc: BaseException) -> BaseException:
    """Marks `exc` as one that every rank raises alike, so only rank 0 prints it."""
    setattr(exc, _SAME_ON_EVERY_RANK, True)
    return exc


def is_peer_failure(exc: BaseException) -> bool:
    """torch says, by the exception's type, that the process group or its store failed."""
    # Imported here: ft-train reports a config error through this module before torch is loaded.
    import torch.distributed as dist

    return isinstance(exc, (dist.DistBackendError, dist.DistNetworkError, dist.DistStoreError))


def _peer_summary(exc: BaseException) -> str:
    """`exc`'s first sentence without the backend's source location ("[.../pair.cc:553] ")."""
    text = str(exc).strip().splitlines()[0] if str(exc).strip() else ""
    text = re.sub(r"^\[[^\]]*\]\s*", "", text).split(". ")[0]
    return f"{type(exc).__name__}: {text[:160]}" if text else type(exc).__name__


def _rank_and_world() -> tuple[int, int]:
    try:
        return int(os.environ.get("RANK", 0)), int(os.environ.get("WORLD_SIZE", 1))
    except ValueError:
        return 0, 1


def _one_line(exc: BaseException | str) -> str:
    """The message on one line: a multi-line one (several config keys) joins its lines with "; "."""
    lines = [" ".join(line.split()) for line in str(exc).strip().splitlines() if line.strip()]
    if not lines:
        return type(exc).__name__
    head, rest = lines[0], lines[1:]
    return head + (" " if head.endswith(":") else "; ") + "; ".join(rest) if rest else head


def error_line(prog: str, error: BaseException | str) -> str:
    """How every command line of ours shows an error the user can fix, the form argparse uses for its
    own: ``PROG: error: MESSAGE``, on one line (a message of several lines joined with "; ")."""
    return f"{prog}: error: {_one_line(error)}"


def print_user_error(prog: str, error: BaseException | str, stream: TextIO | None = None) -> int:
    """Prints `error` as `error_line` does and returns the exit code of a user error (2)."""
    print(error_line(prog, error), file=stream or sys.stderr, flush=True)
    return EXIT_USER_ERROR


def report_failure(exc: BaseException, *, prog: str, debug: bool = False, same_on_every_rank: bool = False,
                   stream: TextIO | None = None) -> int:
    """Prints `exc` the way the command line shows it and returns the exit code.

    `same_on_every_rank`: the error came from a step every rank runs alike (loading the config)."""
    stream = stream or sys.stderr
    rank, world = _rank_and_world()
    tag = prog if world <= 1 else f"{prog} (rank {rank})"
    with sigterm_held():
        if isinstance(exc, UserError):  # ConfigError is one too
            alike = same_on_every_rank or getattr(exc, _SAME_ON_EVERY_RANK, False)
            if world > 1 and not alike:  # this rank's own problem: the others read it from the board
                announce_failure(rank, f"error: {_one_line(exc)}")
            if debug:
                traceback.print_exception(exc, file=stream)
            if rank == 0 or not alike or debug:
                print(error_line(tag, exc), file=stream, flush=True)
            return EXIT_USER_ERROR
        line = _lost_peer_line(exc, rank) if world > 1 and not debug else None
        if line is not None:
            print(f"{tag}: {line}", file=stream, flush=True)
            return EXIT_CRASH
        if world > 1:
            announce_failure(rank, _peer_summary(exc))
        traceback.print_exception(exc, file=stream)
        return EXIT_CRASH


# A launcher's SIGTERM held while a failing rank finds out and says why it failed (module docstring):
# the handler it replaced, when the hold began, and the SIGTERMs that came meanwhile. One hold per
# process, in the main thread only (signal handlers live there).
_hold: dict[str, Any] = {}
# A hold nobody released (a caller of Trainer.fit that is not ft-train) stops holding after this
# long: reporting a failure takes a few seconds (failed_peers waits at most 3 s for a peer's entry).
HOLD_LIMIT_S = 60.0


def hold_sigterm(restore_to: Any = None) -> bool:
    """From now on a SIGTERM is held, not acted on, until :func:`release_sigterm`; `restore_to` is the
    handler to put back then (the current one when None). Whether a hold is on now: none starts
    outside the main thread or with one rank, and a hold already on is kept as it is. run/signals.py
    starts the hold the moment the training loop raises, in place of its own handler, so that no
    SIGTERM falls between the loop and the line."""
    if _hold:
        return True
    if _rank_and_world()[1] <= 1 or threading.current_thread() is not threading.main_thread():
        return False
    _hold.update(restore_to=signal.getsignal(signal.SIGTERM) if restore_to is None else restore_to,
                 since=time.monotonic(), held=[])

    def record(signum: int, frame: Any) -> None:
        if time.monotonic() - _hold["since"] > HOLD_LIMIT_S:  # nobody is reporting any more
            release_sigterm()
            signal.raise_signal(signum)
            return
        _hold["held"].append(signum)

    signal.signal(signal.SIGTERM, record)
    return True


def release_sigterm() -> None:
    """Ends the hold: the replaced handler is back, and a SIGTERM that came meanwhile is delivered
    now (the launcher's stop, once the line is out). Does nothing when no hold is on."""
    if not _hold:
        return
    restore_to, held = _hold["restore_to"], _hold["held"]
    _hold.clear()
    signal.signal(signal.SIGTERM, signal.SIG_DFL if restore_to is None else restore_to)
    if held:
        signal.raise_signal(signal.SIGTERM)


@contextmanager
def sigterm_held() -> Iterator[None]:
    """Holds SIGTERM while a rank finds out and says why it failed (a hold already on, from the
    loop, is kept), then releases it. When one worker dies, torchrun and DeepSpeed's launcher send
    SIGTERM to the others at once, and the default action would end a survivor before its line is out."""
    hold_sigterm()
    try:
        yield
    finally:
        release_sigterm()


_NOT_SAVED = "this rank stops without saving: resume from the last checkpoint with checkpoint.resume_from=auto"


def _lost_peer_line(exc: BaseException, rank: int) -> str | None:
    """The one line of a rank whose failure is a peer's, or None when `exc` is this rank's own."""
    # A rank that failed on its own wrote that on the board before it exited, and so before its
    # exit broke the collective that raised `exc` here: an entry means this is not our error.
    peers = failed_peers(rank, wait_s=3.0 if is_peer_failure(exc) else 0.0)
    # No entry: a peer that died without a word is found by its witness.
    silent = {} if peers else silent_peers(rank)
    if silent:
        named = "; ".join(
            f"rank {r} died without reporting an error (its process is gone: killed by a signal such as SIGKILL or "
            "by the out-of-memory killer; the launcher's output names the signal)" if how == GONE else
            f"rank {r} cannot be reached and reported no error (its node is down or cut off)"
            for r, how in silent.items())
        return f"stopped: {named}; {_NOT_SAVED}; here: {_peer_summary(exc)}"
    if list(peers.values()) == [STORE_GONE]:  # its board went with it: whether it announced is unknown
        [host] = peers
        return (f"stopped: rank {host} went away: {STORE_GONE} (its error line is above if it printed one; if not, "
                f"it was killed: SIGKILL, the out-of-memory killer, a lost node); {_NOT_SAVED}; "
                f"here: {_peer_summary(exc)}")
    if peers or is_peer_failure(exc):
        # Only the ranks are named: their errors are theirs to print, once.
        named = ", ".join(f"rank {r}" for r in sorted(peers))
        return (f"stopped: another rank failed or went away ({named or 'that rank'} shows its error); "
                f"here: {_peer_summary(exc)}")
    return None


def diverged_line(prog: str, results: dict[str, Any]) -> str:
    """The line ft-train prints for a diverged run."""
    d = results["diverged"]
    return (f"{prog}: diverged at step {d['step']}: {d['what']}; training stopped, results.json records it "
            "(failed: true). Lower the learning rate (optimizer.hparams.lr) or the pull "
            "(optimizer.hparams.pretrain_cof), or clip gradients (training.max_grad_norm)")
