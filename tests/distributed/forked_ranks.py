"""Starts the ranks of the tests' multi-process workers (ds_worker.py, reshard_worker.py,
fsdp_worker.py, forked_train.py, tests/examples/hf_deepspeed_worker.py) by forking one process that
has imported everything, phase after phase.

Why not a torchrun launch per phase: a 2-rank torchrun costs its agent (~1.7 s of CPU: torch and
torch.distributed.elastic) and each rank's own imports (torch, the trainer, transformers, DeepSpeed:
3-7 s of CPU each) before any work, and some workers need several world sizes in turn (2 ranks,
then 1 loading their checkpoint, then 2 again): three launches, seven such processes. Here one
process imports once and forks the ranks of each phase; they share its imports (copy-on-write) and
join a process group of their own per phase from the environment a launcher sets (RANK, WORLD_SIZE,
LOCAL_RANK, LOCAL_WORLD_SIZE, MASTER_ADDR, MASTER_PORT: rank 0 hosts the rendezvous, as under the
deepspeed launcher or srun), so each rank runs what it runs under a launcher, from a fresh process
group.

The parent only imports and forks: a fork copies neither threads nor a process group safely, so it
refuses to fork once it has a second thread. Before it forks, it freezes what it allocated
(gc.freeze, as the Python docs advise before a fork): the ranks' garbage collections skip those
objects (DeepSpeed calls gc.collect itself, 0.35 s of CPU each over all that torch, transformers
and DeepSpeed leave alive) and leave their pages shared. A rank that fails fails the launch at once
(its peers are killed, the parent exits 1 naming the phase and rank); a rank whose parent dies is
killed too (PR_SET_PDEATHSIG), so a test's timeout leaves nothing running.
"""

from __future__ import annotations

import ctypes
import gc
import importlib
import importlib.util
import os
import signal
import sys
import threading
import traceback
from typing import Callable, Sequence

from ft_framework.distributed.ports import free_port
from worker_exit import finish

# (name, number of ranks, what each rank runs): a phase's ranks start when the one before has ended.
Phase = tuple[str, int, Callable[[], None]]
_LAUNCHER_VARIABLES = ("TORCHELASTIC_USE_AGENT_STORE", "TORCHELASTIC_RESTART_COUNT", "GROUP_RANK", "ROLE_RANK")


def preimport_deepspeed_initialize() -> None:
    """The first deepspeed.initialize in a process imports DeepSpeed's Muon optimizer module, and
    torch.compile's inductor with it (deepspeed/runtime/zero/utils.py, is_zero_supported_optimizer:
    ~1 s of CPU): a DeepSpeed worker imports it once, before its ranks are forked."""
    if importlib.util.find_spec("deepspeed.runtime.zero.muon.muon_optimizer") is not None:
        importlib.import_module("deepspeed.runtime.zero.muon.muon_optimizer")


def preimport_model_module(path: str) -> None:
    """Imports the transformers modeling module of the model at `path`, as each rank's
    from_pretrained would (~1 s of CPU for BERT's): once, before the ranks are forked. Without
    loading the model: a progress bar would start tqdm's monitor thread, and its lock would be one
    that every forked rank shares."""
    import transformers  # here: the launcher itself (test_forked_ranks.py) does without it

    model_type = transformers.AutoConfig.from_pretrained(path).model_type.replace("-", "_")
    module = f"transformers.models.{model_type}.modeling_{model_type}"
    if importlib.util.find_spec(module) is not None:
        importlib.import_module(module)


def _die_with_parent(parent: int) -> None:
    if sys.platform.startswith("linux"):
        pr_set_pdeathsig = 1
        ctypes.CDLL(None, use_errno=True).prctl(pr_set_pdeathsig, signal.SIGKILL)
    if os.getppid() != parent:  # the parent died before the line above
        os._exit(1)


def _rank(parent: int, rank: int, world: int, port: int, work: Callable[[], None]):
    """In the forked child: the launcher's environment for (rank, world), the work, then
    worker_exit.finish (every rank done, process group closed, exit 0). Never returns."""
    try:
        _die_with_parent(parent)
        for name in _LAUNCHER_VARIABLES:
            os.environ.pop(name, None)
        os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank),
                          LOCAL_WORLD_SIZE=str(world), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
        work()
        finish()
    except BaseException:  # noqa: BLE001 - reported, then this rank fails the launch
        traceback.print_exc()
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(1)  # reached only when work() or finish() raised


def run_phases(phases: Sequence[Phase]) -> None:
    """Runs each phase's ranks (forked from this process), one phase after another; SystemExit(1)
    naming the phase and rank when a rank fails (after killing the phase's other ranks)."""
    parent = os.getpid()
    for name, world, work in phases:
        if threading.active_count() > 1:
            raise RuntimeError(f"forked_ranks: the launching process runs {threading.active_count()} threads; "
                               "fork it before anything starts one")
        port = free_port()
        gc.freeze()
        sys.stdout.flush()
        sys.stderr.flush()
        ranks = {}
        for rank in range(world):
            pid = os.fork()
            if pid == 0:
                _rank(parent, rank, world, port, work)
            ranks[pid] = rank
        while ranks:
            pid, status = os.waitpid(-1, 0)
            rank = ranks.pop(pid, None)
            if rank is None:
                continue
            code = os.waitstatus_to_exitcode(status)
            if code != 0:
                for other in ranks:
                    os.kill(other, signal.SIGKILL)
                for other in ranks:
                    os.waitpid(other, 0)
                raise SystemExit(f"forked_ranks: phase {name!r}, rank {rank} of {world} exited with {code}")
