"""The Ray runner: one Ray task per run, asking for the run's CPUs / GPUs; Ray places them on the
nodes of an existing cluster (or a local instance when address is None / "local"). The task starts
the same subprocess as the local runner (runners.execute_run) on its node; the store directory must
be on a file system every node sees at the same path (NFS, Lustre, ...; a warning says so once when
it looks node-local, e.g. under /tmp), and ft_framework installed on every node. A run whose task is
lost with its node is submitted again and resumes from its latest checkpoint; a run that ended is
never run again. On SIGTERM / Ctrl-C the runner cancels its tasks, marks their runs interrupted,
and re-raises.
"""

from __future__ import annotations

import logging
import os
import time
from typing import Any, Sequence

from ft_framework.run.files import RunPaths
from ft_framework.sweep.grid import PlannedRun
from ft_framework.sweep.runners import CommandFn, OnChange, OnDone, build_command, execute_run, sigterm_raises
from ft_framework.sweep.spec import RunnerSpec
from ft_framework.sweep.store import SweepStore, now_iso

__all__ = ["RayRunner", "node_local_reason"]

logger = logging.getLogger(__name__)

# How often the Ray runner calls on_change (the index then shows which runs are running).
RAY_REFRESH_S = 10.0


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
            # "local" starts an instance of this sweep's own: without it ray.init joins whatever
            # cluster this machine last started (RAY_ADDRESS, /tmp/ray), where num_cpus is refused.
            ray.init(address="local", include_dashboard=False, **self.init_kwargs)
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
            with sigterm_raises():
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
                    except (ray.exceptions.RayError, ConnectionError) as exc:  # the cluster is going too
                        logger.warning("could not cancel the Ray task of run %s: %s", run.run_id, exc)
            for run in refs.values():
                if run.run_id not in states and store.read_status(run.run_id).get("state") == "running":
                    store.write_status(run.run_id, state="interrupted", ended=now_iso(),
                                       error="stopped with the sweep")
            raise
        finally:
            if connected_here:
                ray.shutdown()
        return states
