"""Bounds for tests of hostile inputs, so that a regression fails the test instead of taking the run
with it: `no_block` turns a read that blocks (a named pipe opened for reading) into a TimeoutError,
and `memory_bounded` turns an endless read (/dev/zero) into a MemoryError instead of the
out-of-memory killer."""

from __future__ import annotations

import contextlib
import resource
import signal
from typing import Iterator

BLOCKS_AFTER_S = 15  # each guarded call takes a second or less: only a blocked one gets there


@contextlib.contextmanager
def no_block(what: str, seconds: int = BLOCKS_AFTER_S) -> Iterator[None]:
    """SIGALRM after `seconds` raises TimeoutError naming `what` (the named pipe that was opened).
    It works where the blocked call returns to Python on a signal (Python's own open and read); a
    library blocking in C without doing so (pyarrow's open) needs a child process with a deadline."""
    def blocked(signum, frame):
        raise TimeoutError(f"still blocked after {seconds} s: {what}")

    previous = signal.signal(signal.SIGALRM, blocked)
    signal.alarm(seconds)
    try:
        yield
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, previous)


@contextlib.contextmanager
def memory_bounded(extra: int = 1 << 30) -> Iterator[None]:
    """This process may map at most `extra` bytes more while the block runs (RLIMIT_AS, restored after)."""
    with open("/proc/self/status") as status:
        mapped = next(int(line.split()[1]) * 1024 for line in status if line.startswith("VmSize:"))
    soft, hard = resource.getrlimit(resource.RLIMIT_AS)
    bound = mapped + extra if hard == resource.RLIM_INFINITY else min(mapped + extra, hard)
    resource.setrlimit(resource.RLIMIT_AS, (bound, hard))
    try:
        yield
    finally:
        resource.setrlimit(resource.RLIMIT_AS, (soft, hard))
