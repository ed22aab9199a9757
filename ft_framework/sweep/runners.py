"""Runners: execute the runs of a sweep, each as a subprocess (`python -m ft_framework.cli
--config <run>/config.yaml`, or torchrun / deepspeed for multi-process strategies) whose stdout
and stderr go to the run's log.txt.

- LocalRunner(max_parallel): one run after another, or N at a time on this machine's CPU slots /
  GPUs (each slot gets its own CUDA_VISIBLE_DEVICES).
- RayRunner(address): one Ray task per run, asking for the run's CPUs / GPUs; Ray places them on
  the nodes of an existing cluster (or a local instance when address is None / "local"). The task
  starts the same subprocess on its node; the store directory must be on a file system every node
  sees at the same path (NFS, Lustre, ...; a warning says so once when it looks node-local, e.g.
  under /tmp), and ft_framework installed on every node. A run whose task is lost with its node is
  submitted again and resumes from its latest checkpoint; a run that ended is never run again.

Every child process dies with its parent (Linux PR_SET_PDEATHSIG), so killing the sweep - even with
SIGKILL - leaves no run behind that could write into the store. On SIGTERM / Ctrl-C the runner stops
its runs, marks them interrupted, and re-raises; finished runs are on disk already.
"""

from __future__ import annotations

import logging
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
from typing import Any, Callable, Iterator, Sequence

from ft_framework.config import RunConfig
from ft_framework.run_files import LOG_FILE, RESULTS_FILE, RUN_CONFIG_FILE

from .grid import PlannedRun
from .spec import RunnerSpec
from .store import SweepStore, diverged_error, now_iso

__all__ = ["SweepInterrupted", "build_command", "execute_run", "LocalRunner", "RayRunner", "make_runner",
           "threads_per_run"]

# Runs `argv[2:]` in place of itself after asking the kernel to SIGKILL it when its parent dies.
_EXEC_WITH_PDEATHSIG = """\
import ctypes, os, signal, sys
try:
    ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
except Exception:
    pass
if os.getppid() != int(sys.argv[1]):
    os._exit(137)  # the parent died before prctl
os.execvp(sys.argv[2], sys.argv[2:])
"""

logger = logging.getLogger(__name__)

CommandFn = Callable[[Path, RunConfig, RunnerSpec, bool], list]
OnDone = Callable[[PlannedRun, str], None]
OnChange = Callable[[], None]
# How often the Ray runner calls on_change (the index then shows which runs are running).
RAY_REFRESH_S = 10.0


class SweepInterrupted(KeyboardInterrupt):
    """The sweep got SIGTERM (Ctrl-C arrives as KeyboardInterrupt, its base class)."""


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("", 0))
        return s.getsockname()[1]


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
    return ["deepspeed", f"--num_gpus={procs}", f"--master_port={_free_port()}", "--module",
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
                node: str | None = None) -> str:
    """Runs one attempt of `run` as a subprocess and records it in the store; returns the final
    state: finished, diverged, failed or interrupted. `on_change` is called once the run is marked running.
    `node`: the Ray node it runs on (recorded in status.json)."""
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
        where = host + (f" (ray node {node})" if node else "")
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
def _sigterm_raises() -> Iterator[None]:
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
            with _sigterm_raises():
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


def _ray_execute(store_root: str, run: PlannedRun, spec: RunnerSpec, env: dict[str, str], cwd: str,
                 command_fn: CommandFn = build_command) -> str:
    """The body of a run's Ray task: the same subprocess as the local runner, on the task's node.
    A run the store already has an outcome for is never run again (a task submitted again after its
    node was lost may find its run ended before the node went)."""
    import ray

    store = SweepStore(store_root)
    if store.is_done(run.run_id):
        return store.read_status(run.run_id)["state"]
    return execute_run(store, run, spec, env=env, cwd=cwd, command_fn=command_fn,
                       node=ray.get_runtime_context().get_node_id())


# A run whose Ray task was lost with its node or worker process is submitted again (resuming from its
# latest checkpoint) up to this many times; a run that failed by itself is not.
LOST_RUN_RETRIES = 3
# Directories that are node-local on (nearly) every cluster.
_NODE_LOCAL_PREFIXES = ("/tmp", "/var/tmp", "/dev/shm", "/run", "/scratch/local")


def node_local_reason(path: str | os.PathLike) -> str | None:
    """Why `path` looks node-local (each node would have its own copy), or None. A heuristic: under
    /tmp and the like, or on a tmpfs."""
    resolved = os.path.realpath(path)
    prefixes = list(_NODE_LOCAL_PREFIXES)
    for var in ("TMPDIR",):
        if os.environ.get(var):
            prefixes.append(os.path.realpath(os.environ[var]))
    for prefix in prefixes:
        if resolved == prefix or resolved.startswith(prefix.rstrip("/") + "/"):
            return f"is under {prefix}"
    best, fstype = "", ""
    try:
        with open("/proc/self/mounts") as mounts:
            for line in mounts:
                fields = line.split()
                if len(fields) >= 3 and (resolved == fields[1] or resolved.startswith(fields[1].rstrip("/") + "/")):
                    if len(fields[1]) > len(best):
                        best, fstype = fields[1], fields[2]
    except OSError:
        return None
    return f"is on a {fstype} at {best}" if fstype in ("tmpfs", "ramfs") else None


def _is_lost(exc: BaseException) -> bool:
    """The task died with its node or worker process (not: the task's own code raised)."""
    from ray import exceptions as rex

    if isinstance(exc, (rex.RayTaskError, rex.TaskCancelledError, rex.GetTimeoutError)):
        return False
    return isinstance(exc, rex.RayError)


class RayRunner:
    """One Ray task per run on an existing cluster (or a local Ray instance)."""

    def __init__(self, spec: RunnerSpec | None = None, *, address: str | None = None,
                 init_kwargs: dict[str, Any] | None = None, command_fn: CommandFn = build_command):
        spec = spec or RunnerSpec(name="ray")
        if address is not None:
            spec = spec.model_copy(update={"address": address})
        self.spec = spec
        self.init_kwargs = dict(init_kwargs or {})
        self.command_fn = command_fn  # pickled into the tasks: a module-level function
        self.cwd = os.getcwd()

    def _connect(self) -> bool:
        """Connects to Ray unless already connected; True when this call connected."""
        import ray

        if ray.is_initialized():
            return False
        address = self.spec.address
        if address in (None, "", "local"):
            ray.init(include_dashboard=False, **self.init_kwargs)
        else:
            ray.init(address=address, **self.init_kwargs)
        return True

    @staticmethod
    def _warn_if_store_is_node_local(store: SweepStore) -> None:
        """Once per sweep: a multi-node cluster with a store that each node would have its own copy of."""
        import ray

        nodes = [n for n in ray.nodes() if n.get("Alive")]
        reason = node_local_reason(store.root) if len(nodes) > 1 else None
        if reason:
            logger.warning(
                "the sweep store %s %s, which looks node-local, but the Ray cluster has %d nodes: runs on the "
                "other nodes would write their results, logs and checkpoints to their own disks, and a run "
                "retried on another node would not find its checkpoint. Put the store on a file system every "
                "node mounts at the same path (NFS, Lustre, GPFS, ...) with --output-dir",
                store.root, reason, len(nodes))

    @staticmethod
    def _resubmit_lost(store: SweepStore, run: PlannedRun, exc: BaseException, attempt: int) -> str:
        """Marks a run whose task was lost as interrupted (it runs again); returns the warning."""
        from ft_framework.run_files import RunPaths

        resumable = RunPaths(store.run_dir(run.run_id)).latest_checkpoint.is_file()
        cause = str(exc).strip().splitlines()[0][:200] if str(exc).strip() else ""
        why = f"lost with its node or worker ({type(exc).__name__}: {cause})".replace(": )", ")")
        store.write_status(run.run_id, state="interrupted", ended=now_iso(), pid=None,
                           error=f"{why}; submitted again ({attempt} of {LOST_RUN_RETRIES})")
        return (f"run {run.run_id} {why}: submitted again ({attempt} of {LOST_RUN_RETRIES}), "
                + ("resuming from its latest checkpoint" if resumable else "from the start (no checkpoint yet)"))

    def run(self, store: SweepStore, runs: Sequence[PlannedRun], on_done: OnDone | None = None,
            on_change: OnChange | None = None) -> dict[str, str]:
        """As LocalRunner.run; on_change() is called every RAY_REFRESH_S seconds. A run whose task is
        lost with its node (or worker) runs again, from its checkpoint, up to LOST_RUN_RETRIES times;
        a run that already ended is never run again."""
        try:
            import ray
        except ImportError as e:
            raise RuntimeError("the ray runner needs Ray: pip install 'ft_framework[ray]'") from e
        connected_here = self._connect()
        states: dict[str, str] = {}
        refs: dict[Any, PlannedRun] = {}
        try:
            cpus = float(self.spec.num_cpus_per_run or 1.0)
            gpus = self.spec.num_gpus_per_run
            total = ray.cluster_resources()
            if cpus > total.get("CPU", 0) or gpus > total.get("GPU", 0):
                raise RuntimeError(f"each run asks for {cpus:g} CPU(s) and {gpus} GPU(s), but the Ray cluster "
                                   f"has {total.get('CPU', 0):g} CPU(s) and {total.get('GPU', 0):g} GPU(s)")
            procs = self.spec.procs_per_run or max(1, gpus)
            per_proc = str(max(1, int(cpus) // procs))
            env = {"OMP_NUM_THREADS": per_proc, "MKL_NUM_THREADS": per_proc}
            self._warn_if_store_is_node_local(store)
            # Lost tasks are submitted again below (not by Ray): the store decides whether a run ended.
            task = ray.remote(_ray_execute).options(num_cpus=cpus, num_gpus=gpus, max_retries=0)
            lost: dict[str, int] = {}
            with _sigterm_raises():
                for run in runs:
                    refs[task.remote(str(store.root), run, self.spec, env, self.cwd, self.command_fn)] = run
                pending = list(refs)
                last_refresh = time.monotonic()
                while pending:
                    done, pending = ray.wait(pending, num_returns=1, timeout=1.0)
                    if on_change is not None and time.monotonic() - last_refresh > RAY_REFRESH_S:
                        on_change()
                        last_refresh = time.monotonic()
                    for ref in done:
                        run = refs[ref]
                        try:
                            state = ray.get(ref)
                        except Exception as e:  # the worker died, the node was lost, ...
                            if store.is_done(run.run_id):  # it ended before its node went: keep that
                                state = store.read_status(run.run_id)["state"]
                            elif _is_lost(e) and lost.get(run.run_id, 0) < LOST_RUN_RETRIES:
                                lost[run.run_id] = lost.get(run.run_id, 0) + 1
                                again = self._resubmit_lost(store, run, e, lost[run.run_id])
                                new_ref = task.remote(str(store.root), run, self.spec, env, self.cwd, self.command_fn)
                                refs[new_ref] = run
                                pending.append(new_ref)
                                if on_change is not None:
                                    on_change()
                                logger.warning("%s", again)
                                continue
                            else:
                                state = store.write_status(run.run_id, state="failed", ended=now_iso(), pid=None,
                                                           error=f"ray task failed: {type(e).__name__}: {e}"[:500])["state"]
                        states[run.run_id] = state
                        if on_done is not None:
                            on_done(run, state)
        except BaseException:
            for ref, run in refs.items():
                if run.run_id not in states:
                    try:
                        ray.cancel(ref, force=True)  # kills the worker; its run dies with it
                    except Exception:
                        pass
            for run in refs.values():
                if run.run_id not in states and store.read_status(run.run_id).get("state") == "running":
                    store.write_status(run.run_id, state="interrupted", ended=now_iso(),
                                       error="stopped with the sweep")
            raise
        finally:
            if connected_here:
                ray.shutdown()
        return states


def make_runner(spec: RunnerSpec, **kwargs: Any) -> LocalRunner | RayRunner:
    """The runner a sweep's `runner:` section names."""
    if spec.name == "ray":
        return RayRunner(spec, **kwargs)
    return LocalRunner(spec, **kwargs)
