"""Runners: execute the runs of a sweep, each as a subprocess (`python -m ft_framework.cli
--config <run>/config.yaml`, or torchrun / deepspeed for multi-process strategies) whose stdout
and stderr go to the run's log.txt.

- LocalRunner(max_parallel): one run after another, or N at a time on this machine's CPU slots /
  GPUs (each slot gets its own CUDA_VISIBLE_DEVICES).
- RayRunner(address), in ray_runner.py: one Ray task per run on a Ray cluster, each starting the
  same subprocess (execute_run) on its node.

Every child process dies with its parent (Linux PR_SET_PDEATHSIG), so killing the sweep - even with
SIGKILL - leaves no run behind that could write into the store. On SIGTERM / Ctrl-C the runner stops
its runs, marks them interrupted, and re-raises; finished runs are on disk already.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import threading
import time
from concurrent.futures import FIRST_COMPLETED, ThreadPoolExecutor, wait
from contextlib import contextmanager
from pathlib import Path
from typing import Callable, Iterator, Sequence

from ft_framework.config import RunConfig
from ft_framework.distributed.ports import free_port
from ft_framework.run.files import LOG_FILE, RESULTS_FILE, RUN_CONFIG_FILE

from ft_framework.sweep.grid import PlannedRun
from ft_framework.sweep.spec import RunnerSpec
from ft_framework.sweep.store import SweepStore, diverged_error, now_iso

__all__ = ["SweepInterrupted", "build_command", "execute_run", "LocalRunner", "threads_per_run",
           "sigterm_raises"]

# Runs `argv[2:]` in place of itself after asking the kernel to SIGKILL it when its parent dies.
_EXEC_WITH_PDEATHSIG = """\
import ctypes, os, signal, sys
try:
    ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
except (OSError, AttributeError):  # not Linux (no prctl): the run outlives a killed sweep
    pass
if os.getppid() != int(sys.argv[1]):
    os._exit(137)  # the parent died before prctl
os.execvp(sys.argv[2], sys.argv[2:])
"""

CommandFn = Callable[[Path, RunConfig, RunnerSpec, bool], list]
OnDone = Callable[[PlannedRun, str], None]
OnChange = Callable[[], None]


class SweepInterrupted(KeyboardInterrupt):
    """The sweep got SIGTERM (Ctrl-C arrives as KeyboardInterrupt, its base class)."""


def build_command(config_path: Path, cfg: RunConfig, spec: RunnerSpec, resume: bool) -> list[str]:
    """The command line of one run, from its strategy and the runner's launcher settings."""
    tail = ["--config", str(config_path)] + (["checkpoint.resume_from=latest"] if resume else [])
    procs = spec.procs_per_run or max(1, spec.num_gpus_per_run)
    launcher = spec.launcher
    if launcher == "auto":
        # DDP / FSDP / DeepSpeed read RANK and WORLD_SIZE from a launcher, even with one process.
        launcher = "python" if cfg.strategy.name == "single" else "torchrun"
    if launcher == "python":
        if cfg.strategy.name != "single":
            raise ValueError(f"strategy {cfg.strategy.name!r} needs a distributed launcher; "
                             "set runner.launcher to torchrun or deepspeed (or auto)")
        return [sys.executable, "-m", "ft_framework.cli", *tail]
    if launcher == "torchrun":
        return [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={procs}",
                "-m", "ft_framework.cli", *tail]
    # DeepSpeed's launcher; note it picks GPUs itself (torchrun keeps the runner's assignment).
    return ["deepspeed", f"--num_gpus={procs}", f"--master_port={free_port()}", "--module",
            "ft_framework.cli", *tail]


def threads_per_run(spec: RunnerSpec, default_cpus: float) -> int:
    cpus = spec.num_cpus_per_run if spec.num_cpus_per_run is not None else default_cpus
    return max(1, int(cpus))


class _LiveProcesses:
    """Child processes of this sweep that are running now, to stop them on an interrupt."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._procs: set[subprocess.Popen] = set()

    def add(self, proc: subprocess.Popen) -> None:
        with self._lock:
            self._procs.add(proc)

    def remove(self, proc: subprocess.Popen) -> None:
        with self._lock:
            self._procs.discard(proc)

    def snapshot(self) -> list[subprocess.Popen]:
        """The processes running now, for a signal handler to pass its signal on to them. Without the
        lock: the handler runs in the thread that adds and removes, possibly while it holds the lock."""
        return list(self._procs)

    def terminate_all(self, grace_s: float = 10.0) -> None:
        with self._lock:
            procs = list(self._procs)
        for sig in (signal.SIGTERM, signal.SIGKILL):
            for proc in procs:
                if proc.poll() is None:
                    try:
                        os.killpg(proc.pid, sig)  # the run's own process group: torchrun's ranks too
                    except (ProcessLookupError, PermissionError):
                        pass
            deadline = time.monotonic() + grace_s
            while any(p.poll() is None for p in procs) and time.monotonic() < deadline:
                time.sleep(0.05)


def _log_tail(path: Path, start: int, lines: int = 1) -> str:
    try:
        with open(path, "rb") as f:
            f.seek(start)
            text = f.read().decode(errors="replace")
    except FileNotFoundError:
        return ""
    kept = [ln.strip() for ln in text.splitlines() if ln.strip()]
    return " | ".join(kept[-lines:])[-500:]


def execute_run(store: SweepStore, run: PlannedRun, spec: RunnerSpec, *, env: dict[str, str] | None = None,
                cwd: str | None = None, stop: threading.Event | None = None, live: _LiveProcesses | None = None,
                command_fn: CommandFn = build_command, on_change: Callable[[], None] | None = None,
                node: str | None = None, node_kind: str = "ray node") -> str:
    """Runs one attempt of `run` as a subprocess and records it in the store; returns the final
    state: finished, diverged, failed or interrupted. `on_change` is called once the run is marked running.
    `node`: the Ray node (or, with node_kind "slurm node", SLURM's node) it runs on (recorded in status.json)."""
    run_id = run.run_id
    directory = store.run_dir(run_id)
    resume = store.prepare_attempt(run_id)
    cmd = [str(c) for c in command_fn(directory / RUN_CONFIG_FILE, run.config, spec, resume)]
    attempts = int(store.read_status(run_id).get("attempts", 0)) + 1
    host = socket.gethostname()
    store.write_status(run_id, state="running", attempts=attempts, started=now_iso(), ended=None, returncode=None,
                       error=None, note=None, host=host, node=node, pid=None, command=cmd, resumed=resume)
    log_path = directory / LOG_FILE
    child_env = {**os.environ, **(env or {}), "PYTHONUNBUFFERED": "1"}
    if cwd is not None and not Path(cwd).is_dir():
        cwd = None
    started = time.monotonic()
    with open(log_path, "ab") as log:
        log_start = log.tell()
        where = host + (f" ({node_kind} {node})" if node else "")
        header = (f"==== attempt {attempts} of run {run_id} ({run.label()}) on {where} at {now_iso()}"
                  f"{' (resuming from its latest checkpoint)' if resume else ''}\n$ {' '.join(cmd)}\n")
        log.write(header.encode())
        log.flush()
        log_start += len(header.encode())
        try:
            proc = subprocess.Popen([sys.executable, "-c", _EXEC_WITH_PDEATHSIG, str(os.getpid()), *cmd],
                                    stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, cwd=cwd,
                                    env=child_env, start_new_session=True)
        except OSError as e:
            return store.write_status(run_id, state="failed", ended=now_iso(), error=f"cannot start: {e}")["state"]
        if live is not None:
            live.add(proc)
        store.write_status(run_id, pid=proc.pid)
        if on_change is not None:
            on_change()
        try:
            rc = proc.wait()
        finally:
            if live is not None:
                live.remove(proc)
    seconds = round(time.monotonic() - started, 3)
    has_results = (directory / RESULTS_FILE).is_file()
    results = store.read_results(run_id) if has_results else None
    if rc == 0 and has_results:
        state, error = "finished", None
    elif results is not None and results.get("diverged"):
        # ft-train exits 3 (torchrun turns any failure into 1): results.json says where and why.
        state, error = "diverged", diverged_error(results)
    elif results is not None and results.get("status") == "interrupted":
        # A signal stopped it after a checkpoint (run/signals.py): the next ft-sweep resumes from it.
        state, error = "interrupted", (f"stopped by {results.get('signal')} at step {results.get('steps')}, "
                                       f"checkpoint saved (exit code {rc})")
    elif stop is not None and stop.is_set():
        state, error = "interrupted", f"stopped with the sweep (exit code {rc})"
    else:
        why = f"exit code {rc}" if rc >= 0 else f"killed by signal {-rc}"
        if rc == 0:
            why = "exited 0 without writing results.json"
        state, error = "failed", f"{why}: {_log_tail(log_path, log_start)}".rstrip(": ")
    store.write_status(run_id, state=state, ended=now_iso(), returncode=rc, error=error, seconds=seconds, pid=None)
    return state


@contextmanager
def sigterm_raises() -> Iterator[None]:
    """In the main thread, SIGTERM raises SweepInterrupted (as Ctrl-C raises KeyboardInterrupt)."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def handler(signum, frame):
        raise SweepInterrupted(f"signal {signum}")

    previous = signal.signal(signal.SIGTERM, handler)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


class LocalRunner:
    """Runs on this machine, `max_parallel` at a time, each run a subprocess."""

    def __init__(self, spec: RunnerSpec | None = None, *, max_parallel: int | None = None,
                 command_fn: CommandFn = build_command, gpu_ids: Sequence[int] | None = None):
        spec = spec or RunnerSpec()
        if max_parallel is not None:
            spec = spec.model_copy(update={"max_parallel": max_parallel})
        self.spec = spec
        self.command_fn = command_fn
        self.gpu_ids = list(gpu_ids) if gpu_ids is not None else None
        self.cwd = os.getcwd()

    def _slots(self) -> list[dict[str, str]]:
        """Environment of each parallel slot: its CPU threads and its own GPUs."""
        n = self.spec.max_parallel
        threads = threads_per_run(self.spec, (os.cpu_count() or 1) / n)
        g = self.spec.num_gpus_per_run
        envs = []
        if g:
            gpus = self.gpu_ids if self.gpu_ids is not None else _local_gpu_ids()
            if len(gpus) < g:
                raise RuntimeError(f"each run asks for {g} GPU(s) but this machine has {len(gpus)}")
            n = min(n, len(gpus) // g)
            for i in range(n):
                envs.append({"CUDA_VISIBLE_DEVICES": ",".join(str(x) for x in gpus[i * g:(i + 1) * g])})
        else:
            envs = [{} for _ in range(n)]
        procs = self.spec.procs_per_run or max(1, g)
        per_proc = str(max(1, threads // procs))
        return [{**e, "OMP_NUM_THREADS": per_proc, "MKL_NUM_THREADS": per_proc} for e in envs]

    def run(self, store: SweepStore, runs: Sequence[PlannedRun], on_done: OnDone | None = None,
            on_change: OnChange | None = None) -> dict[str, str]:
        """Runs `runs`; returns run id -> final state. `on_done(run, state)` is called (in this
        thread) as each run ends, `on_change()` (in a worker thread) as each starts. Raises
        KeyboardInterrupt (SweepInterrupted on SIGTERM) after stopping and recording the runs in flight."""
        slots_env = self._slots()
        free: list[int] = list(range(len(slots_env)))
        free_lock = threading.Lock()
        stop = threading.Event()
        live = _LiveProcesses()
        states: dict[str, str] = {}

        def one(run: PlannedRun) -> str | None:
            if stop.is_set():
                return None
            with free_lock:
                slot = free.pop(0)
            try:
                return execute_run(store, run, self.spec, env=slots_env[slot], cwd=self.cwd, stop=stop,
                                   live=live, command_fn=self.command_fn, on_change=on_change)
            finally:
                with free_lock:
                    free.append(slot)

        pool = ThreadPoolExecutor(max_workers=len(slots_env), thread_name_prefix="ft-sweep")
        futures = {}
        try:
            with sigterm_raises():
                futures = {pool.submit(one, run): run for run in runs}
                pending = set(futures)
                while pending:
                    done, pending = wait(pending, timeout=0.5, return_when=FIRST_COMPLETED)
                    for fut in done:
                        run = futures[fut]
                        state = fut.result()
                        if state is not None:
                            states[run.run_id] = state
                            if on_done is not None:
                                on_done(run, state)
        except BaseException:
            stop.set()
            for fut in futures:
                fut.cancel()
            live.terminate_all()
            pool.shutdown(wait=True)
            for fut, run in futures.items():
                if fut.done() and not fut.cancelled() and fut.exception() is None and fut.result() is not None:
                    states[run.run_id] = fut.result()
            raise
        finally:
            pool.shutdown(wait=True)
        return states


def _local_gpu_ids() -> list[int]:
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    if visible is not None:
        return [int(x) for x in visible.split(",") if x.strip().isdigit()]
    import torch

    return list(range(torch.cuda.device_count()))

