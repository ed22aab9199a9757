"""The process tests/recipes/test_export_atomic.py kills exports in: it imports everything and runs
one export itself (so that every lazy import and cache is warm), then for each line on stdin forks a
child that exports CHECKPOINT to OUT (replacing what is there, as `ft-export --overwrite` does):
`export` lets it finish, `kill SECONDS` sends it SIGKILL that long after the fork. It answers each
line with the seconds the child lived and its wait status. Forking keeps each try to the export's
own duration (a fresh interpreter would spend seconds importing torch first)."""

from __future__ import annotations

import os
import signal
import sys
import time
import traceback

# The answers go to the real stdout; anything else printed there (a library's import notice) goes to stderr.
ANSWERS = os.fdopen(os.dup(1), "w")
os.dup2(2, 1)

import torch  # noqa: E402

torch.set_num_threads(1)  # no thread pool in the parent: forking it is safe

import threading  # noqa: E402

import tqdm.std  # noqa: E402

from ft_framework.checkpointing.export import export_pretrained  # noqa: E402

# tqdm's write lock is a multiprocessing lock, a semaphore every forked child shares with this
# process: a child killed while its progress bar holds it leaves it taken for good, and the next
# child's progress bar waits forever. Each child gets a lock of its own (a thread lock, copied by
# fork), and no monitor thread that could hold it at a fork.
tqdm.std.tqdm.set_lock(threading.RLock())
tqdm.std.tqdm.monitor_interval = 0


def main(checkpoint: str, out: str, warm_up: str) -> None:
    export_pretrained(checkpoint, warm_up, replace="always")
    print("ready", file=ANSWERS, flush=True)
    for line in sys.stdin:
        command = line.split()
        started = time.monotonic()
        pid = os.fork()
        if pid == 0:
            try:
                export_pretrained(checkpoint, out, replace="always")
            except BaseException:
                traceback.print_exc()
                os._exit(3)
            os._exit(0)
        if command[0] == "kill":
            time.sleep(float(command[1]))
            os.kill(pid, signal.SIGKILL)  # an already finished child is a zombie until reaped: no error
        _, status = os.waitpid(pid, 0)
        print(f"{time.monotonic() - started:.6f} {status}", file=ANSWERS, flush=True)


if __name__ == "__main__":
    main(*sys.argv[1:4])
