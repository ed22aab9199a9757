"""Launching "nodes" on one machine: each node is its own launcher process (torchrun, deepspeed)
on loopback addresses, logging into a file; every process a test starts is killed by the end of it.

Launchers start their workers in new sessions (torchrun) or plain children (deepspeed), so a test's
processes are found by walking the process tree from the launchers (/proc), not by process group.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from tiny_run import write_run_config
from ft_framework.distributed.rendezvous import free_port  # noqa: F401  (the tests take it from here)

# The run every multi-node case is compared with: FSDP2 on 2 ranks, 8 steps, 2 evaluations; with
# dropout, so each rank's random stream must continue exactly after a restart.
STEPS = 8
RUN = dict(model={"dropout": 0.1},
           training={"max_steps": STEPS, "per_device_batch_size": 4, "seed": 1, "data_seed": 2, "device": "cpu"},
           evaluation={"num_evals": 2, "batch_size": 16})

# The DeepSpeed runs' strategy section (otherwise RUN): ZeRO-2 with the optimizer offloaded.
ZERO2_OFFLOAD = {"name": "deepspeed", "deepspeed": {"zero_stage": 2, "offload_optimizer": True}}

REPO = Path(__file__).resolve().parents[2]
TRAIN = REPO / "launch" / "train.py"
LOOPBACK = "127.0.0.1"


def base_env(**extra: str) -> dict[str, str]:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1", "DS_ACCELERATOR": "cpu",
           "PYTHONUNBUFFERED": "1", "TOKENIZERS_PARALLELISM": "false"}
    env.update(extra)
    return env


def children_map() -> dict[int, list[int]]:
    kids: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            stat = Path(f"/proc/{entry}/stat").read_text()
        except OSError:
            continue
        ppid = int(stat.rsplit(")", 1)[1].split()[1])
        kids.setdefault(ppid, []).append(int(entry))
    return kids


def descendants(pid: int) -> list[int]:
    kids, out, todo = children_map(), [], [pid]
    while todo:
        for child in kids.get(todo.pop(), []):
            out.append(child)
            todo.append(child)
    return out


def cmdline(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
    except OSError:
        return ""


def worker_pid(launcher_pid: int, rank: int) -> int | None:
    """The launcher's worker process whose RANK is `rank` (the launcher sets it in the worker's environment)."""
    for pid in descendants(launcher_pid):
        try:
            environ = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
        except OSError:
            continue
        if f"RANK={rank}".encode() in environ and any(e.startswith(b"LOCAL_RANK=") for e in environ):
            return pid
    return None


class Launches:
    """The launcher processes of one test (the `launches` fixture kills what is left of them)."""

    def __init__(self, directory: Path):
        self.directory = Path(directory)
        self.procs: list[tuple[subprocess.Popen, Path]] = []
        self._known: set[int] = set()

    def start(self, name: str, cmd: list[str], *, env: dict[str, str] | None = None,
              cwd: Path | None = None) -> subprocess.Popen:
        log = self.directory / f"{name}.log"
        with open(log, "wb") as f:
            proc = subprocess.Popen([str(c) for c in cmd], stdout=f, stderr=subprocess.STDOUT,
                                    stdin=subprocess.DEVNULL, env=env or base_env(), cwd=cwd or self.directory,
                                    start_new_session=True)
        proc.log_path = log  # type: ignore[attr-defined]
        self.procs.append((proc, log))
        return proc

    def remember_tree(self) -> None:
        """Notes every live descendant, so it is killed at the end even if its parent dies first."""
        for proc, _ in self.procs:
            if proc.poll() is None:
                self._known.update(descendants(proc.pid))

    def wait(self, procs: list[subprocess.Popen], timeout: float) -> list[int]:
        """Exit codes of `procs`; fails the test (after killing them) when one outlives `timeout`."""
        deadline = time.monotonic() + timeout
        codes = []
        for proc in procs:
            while proc.poll() is None:
                if time.monotonic() > deadline:
                    self.kill_all()
                    raise AssertionError(f"{proc.args[:6]} still running after {timeout:g} s; logs:\n"
                                         + "\n".join(self.tail(p) for p in procs))
                self.remember_tree()
                time.sleep(0.2)
            codes.append(proc.returncode)
        return codes

    @staticmethod
    def log(proc: subprocess.Popen) -> str:
        return Path(proc.log_path).read_text(errors="replace")  # type: ignore[attr-defined]

    def tail(self, proc: subprocess.Popen, chars: int = 4000) -> str:
        return f"---- {proc.log_path} ----\n" + self.log(proc)[-chars:]  # type: ignore[attr-defined]

    def kill_all(self) -> None:
        self.remember_tree()
        pids = set(self._known)
        for proc, _ in self.procs:
            pids.add(proc.pid)
        for pid in pids:
            try:
                os.kill(pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass
        for proc, _ in self.procs:
            try:
                proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                pass


def torchrun_node(node_rank: int, nnodes: int, endpoint: str, run_id: str, script_args: list[str], *,
                  nproc: int = 1, rdzv_conf: str | None = None, extra: list[str] = (),
                  wrapper: bool = True) -> list[str]:
    """One node's torchrun command (through python -m ft_framework.distributed.torchrun, torchrun's arguments)."""
    launcher = ["-m", "ft_framework.distributed.torchrun"] if wrapper else ["-m", "torch.distributed.run"]
    cmd = [sys.executable, *launcher, "--nnodes", str(nnodes), "--nproc-per-node", str(nproc),
           "--node-rank", str(node_rank), "--rdzv-backend", "c10d", "--rdzv-endpoint", endpoint,
           "--rdzv-id", run_id, "--local-addr", LOOPBACK, *extra]
    if rdzv_conf:
        cmd += ["--rdzv-conf", rdzv_conf]
    return cmd + [str(a) for a in script_args]


def deepspeed_node(node_rank: int, hostfile: Path, master_port: int, script_args: list[str]) -> list[str]:
    """One node's DeepSpeed launcher command in its ssh-free multi-node mode."""
    return ["deepspeed", "--hostfile", str(hostfile), "--no_ssh", "--num_nodes", "2", "--node_rank", str(node_rank),
            "--master_addr", LOOPBACK, "--master_port", str(master_port), *[str(a) for a in script_args]]


def write_hostfile(path: Path, nodes: int = 2, slots: int = 1) -> Path:
    # In --no_ssh mode the names are labels: each launcher runs its own node (--node_rank).
    path.write_text("".join(f"node{i} slots={slots}\n" for i in range(nodes)))
    return path


def read_jsonl(path) -> list[dict]:
    return [json.loads(line) for line in Path(path).read_text().splitlines() if line.strip()]


# results.json keys that describe the run, not where or how long it ran.
RESULT_KEYS = ("task", "main_metric", "selection_split", "steps", "final", "best", "reported",
               "baseline", "failed")


def comparable_results(output_dir) -> dict:
    results = json.loads((Path(output_dir) / "results.json").read_text())
    return {k: results.get(k) for k in RESULT_KEYS}


def fsdp_config(path: Path, model_dir: Path, output_dir: Path, **sections) -> Path:
    """The reference run's config (FSDP2 unless `strategy` says otherwise); `sections` update it."""
    merged = {k: dict(v) for k, v in {**RUN, "strategy": {"name": "fsdp"}}.items()}
    for section, values in sections.items():
        merged.setdefault(section, {}).update(values)
    return write_run_config(path, model_dir, output_dir, **merged)
