"""Signals end a run cleanly: SIGTERM (what SLURM and Kubernetes send before they preempt a job),
SIGINT (Ctrl-C) and SIGUSR1 (SLURM's ``--signal=USR1@90``).

With ``checkpoint.on_signal: save`` (the default) the first signal only sets a flag: every rank
finishes the optimizer step it is in, the ranks agree at the step boundary that one of them was
asked to stop (one small all-reduce, distributed/collectives.py), save a checkpoint, write
results.json with ``status: interrupted``, and the process exits with 128 + the signal's number.
A second signal exits at once (the last complete checkpoint stays intact: saves are atomic); the
same signal again within ECHO_S seconds is not a second one but its echo (SLURM signals every
process of a job step, and the launchers pass on what they got).
With ``checkpoint.on_signal: exit`` the first signal exits at once.
Under SLURM the run's job then requeues itself or ends for the sweep to submit it again, and the
next attempt resumes from this checkpoint (sweep/slurm_job.py, docs/multinode.md "Preemption").

    with StopSignals(on_signal="save", prog="ft-train") as stop:
        ... at each step boundary: if stop.agreed(strategy): save, write, return
"""

from __future__ import annotations

import os
import signal
import threading
import time
from typing import Any

from ft_framework.distributed import collectives
from ft_framework.run.failures import hold_sigterm

__all__ = ["HANDLED", "StopSignals", "exit_code", "interrupted_line"]

HANDLED = (signal.SIGTERM, signal.SIGINT, signal.SIGUSR1)
ECHO_S = 2.0


def exit_code(signum: int) -> int:
    """The shell's convention for a process ended by a signal: 128 + its number (143 for SIGTERM)."""
    return 128 + int(signum)


def _name(signum: int) -> str:
    return signal.Signals(signum).name


class StopSignals:
    """Handlers for :data:`HANDLED` while the loop runs (main thread only; elsewhere it does nothing)."""

    def __init__(self, *, on_signal: str = "save", prog: str = "ft-train"):
        self.on_signal = on_signal
        self.prog = prog
        self.received: int = 0  # the first signal's number, 0 while none came
        self._first_at = 0.0
        # The same signal again within this many seconds is the first one's echo, not a second
        # signal: SLURM signals every process of a job step, and torchrun / DeepSpeed's launcher
        # pass the signal they got on to their workers as well.
        self.echo_s = ECHO_S
        self._previous: dict[int, Any] = {}

    def __enter__(self) -> "StopSignals":
        if threading.current_thread() is threading.main_thread():
            for signum in HANDLED:
                self._previous[signum] = signal.signal(signum, self._handle)
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        failing = exc_type is not None and issubclass(exc_type, Exception)
        for signum, handler in self._previous.items():
            if signum == signal.SIGTERM and failing:
                # The loop raised: from this instant until the rank's one line is out (ft-train's
                # report_failure releases it), a launcher's SIGTERM, sent to every worker once one
                # fails, is held rather than ending this rank silently. Installed in place of our
                # handler, so no SIGTERM falls between the two. (One rank: nobody sends it; nothing held.)
                if hold_sigterm(restore_to=handler):
                    continue
            signal.signal(signum, handler)
        self._previous.clear()

    def _handle(self, signum: int, frame) -> None:
        now = time.monotonic()
        if self.received == signum and now - self._first_at < self.echo_s:
            return  # the launcher passing on the signal this process got too (SLURM signals every process)
        if self.received or self.on_signal == "exit":
            # Nothing is flushed or saved: the last complete checkpoint is the one to resume from.
            why = "a second signal" if self.received else "checkpoint.on_signal=exit"
            os.write(2, f"{self.prog}: {_name(signum)} ({why}): exiting now without a checkpoint; the last "
                        "complete checkpoint is intact (resume with checkpoint.resume_from=auto)\n".encode())
            os._exit(exit_code(signum))
        self.received, self._first_at = signum, now
        os.write(2, f"{self.prog}: {_name(signum)} received: finishing this step, then saving a checkpoint "
                    "(a second signal exits at once)\n".encode())

    def agreed(self, strategy) -> int:
        """At a step boundary, on every rank: the signal one of the ranks received (the largest
        number if several), or 0. Collective when there are several ranks."""
        if strategy.world_size > 1 and collectives.is_distributed():
            return collectives.any_rank_flag(self.received)
        return self.received


def interrupted_line(prog: str, signum: int, step: int, checkpoint: Any) -> str:
    """The one line ft-train prints when a signal stopped the run."""
    return (f"{prog}: stopped by {_name(signum)} at step {step}; checkpoint {checkpoint}; resume with the same "
            f"command and checkpoint.resume_from=auto (exit code {exit_code(signum)})")
