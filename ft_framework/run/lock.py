"""One writer per run: rank 0 holds an exclusive lock on a file in the output directory for the
whole run, so two ft-train on one directory cannot interleave their metrics.jsonl or checkpoints.

The lock is the file system's (flock through the `filelock` package): the kernel releases it when
the holding process dies, however it dies. Beside it, a JSON file records who holds it (host, pid,
start time), so that a second run can say who holds it, and a run that takes over a lock its dead
owner left can say whose it was. Across nodes the lock holds when the shared file system supports
flock (NFSv4, Lustre mounted with -o flock, GPFS, CephFS); docs/run_lifecycle.md says more.

    lock = hold_run_lock(strategy, paths)   # every rank; UserError (exit 2) when another run holds it
    ...
    lock.release()
"""

from __future__ import annotations

import datetime as _dt
import json
import logging
import os
import socket
from pathlib import Path
from typing import Any

from filelock import FileLock, Timeout

from ft_framework.errors import UserError
from ft_framework.run.failures import same_on_every_rank
from ft_framework.run.files import RUN_LOCK_FILE, RUN_LOCK_INFO_FILE, RunPaths
from ft_framework.run.output_dir import check_output_dir_usable

logger = logging.getLogger(__name__)

__all__ = ["RunLock", "RunLocked", "hold_run_lock"]


class RunLocked(UserError):
    """Another process holds the output directory's run lock."""


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's process: alive
        return True
    return True


def _describe(info: dict[str, Any] | None) -> str:
    if not info:
        return "another process (it has not recorded itself yet)"
    return f"pid {info.get('pid')} on host {info.get('host')} (started {info.get('started')})"


class RunLock:
    """The exclusive lock of one output directory (acquire/release from one process: rank 0)."""

    def __init__(self, output_dir: str | Path):
        self.root = Path(output_dir)
        self.path = self.root / RUN_LOCK_FILE
        self.info_path = self.root / RUN_LOCK_INFO_FILE
        self._lock = FileLock(str(self.path), timeout=0, is_singleton=False)

    def holder(self) -> dict[str, Any] | None:
        try:
            return json.loads(self.info_path.read_text())
        except (OSError, ValueError):
            return None

    def acquire(self) -> None:
        """Takes the lock, or raises RunLocked naming who holds it. Warns when it takes over the
        record of a process that is gone (the kernel freed its lock when it died)."""
        check_output_dir_usable(self.root)
        try:
            self._lock.acquire()
        except Timeout:
            raise RunLocked(f"logging.output_dir {str(self.root)!r} is in use by another run: {_describe(self.holder())} "
                            f"holds {self.path}; wait for it to end, stop it, or choose another "
                            "logging.output_dir") from None
        previous = self.holder()
        host = socket.gethostname()
        if previous and previous.get("pid") != os.getpid():
            same_host = previous.get("host") == host
            gone = same_host and not _alive(int(previous.get("pid", -1)))
            logger.warning("logging.output_dir %s: taking over the run lock left by %s, %s", self.root,
                           _describe(previous), "which is no longer running" if gone else
                           "whose lock was released (it ended, or the file system does not share locks across nodes)")
        info = {"host": host, "pid": os.getpid(), "started": _dt.datetime.now().astimezone().isoformat(timespec="seconds")}
        tmp = self.info_path.with_name(self.info_path.name + ".tmp")
        tmp.write_text(json.dumps(info))
        os.replace(tmp, self.info_path)

    def release(self) -> None:
        if self._lock.is_locked:
            self.info_path.unlink(missing_ok=True)
            self._lock.release()


def hold_run_lock(strategy, paths: RunPaths) -> RunLock | None:
    """Rank 0 takes the run lock of the output directory; every rank gets its verdict (collective),
    so a refused run exits 2 on every rank. Returns the lock on rank 0, None elsewhere."""
    lock, refused = None, None
    if strategy.is_main_process:
        lock = RunLock(paths.root)
        try:
            lock.acquire()
        except UserError as exc:
            refused = str(exc)
    if strategy.world_size > 1:
        refused = strategy.gather_objects(refused)[0]
    if refused is not None:
        raise same_on_every_rank(RunLocked(refused))
    return lock
