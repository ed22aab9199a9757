"""``python -m ft_framework.distributed.torchrun [torchrun arguments]``: torchrun, with its failures told in one line.

The same arguments and behaviour as ``torchrun`` (it calls torch.distributed.run). What differs is
what a failure or a signal prints on the node it happens on: instead of torchrun's tracebacks (with C++ frames
for a socket that timed out) and its failure table, one line saying what happened and what to check:

- this node cannot reach the rendezvous (``--rdzv-endpoint``; ``read_timeout``, default 60 s),
- the rendezvous did not fill up: another node never joined (``join_timeout``, default 600 s),
- a worker failed: which ranks, with which exit code or signal, which failed first (the worker's
  own error line is above; one killed by a signal, SIGKILL or the out-of-memory killer, has none);
- a signal stopped it (SIGTERM from SLURM or Kubernetes): exit code 128 + its number, no traceback.

Both timeouts are torchrun's ``--rdzv-conf join_timeout=S,read_timeout=S``. The exit code is
torchrun's: 1.

One behaviour differs on purpose: restarts (``--max-restarts``) work. torchrun shares its
rendezvous store with the workers by default, and a restarted worker group then reads the failed
attempt's addresses from it and hangs or fails connecting (pytorch/pytorch#135712). This launcher
sets ``TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1`` (unless it is set), so every round of workers gets a
fresh store. Use it on every node (or set that variable on every node for plain torchrun).

    python -m ft_framework.distributed.torchrun --nnodes 2 --nproc-per-node 1 --rdzv-backend c10d \\
        --rdzv-endpoint NODE0:29400 --rdzv-id job1 launch/train.py --config run.yaml

Under SLURM, one launcher per node (srun's tasks are the launchers; torchrun starts the GPUs' processes):

    srun --nodes 2 --ntasks-per-node 1 python -m ft_framework.distributed.torchrun --nnodes 2 \\
        --nproc-per-node 4 --rdzv-backend c10d --rdzv-endpoint $(scontrol show hostnames | head -n1):29400 \\
        --rdzv-id $SLURM_JOB_ID launch/train.py --config run.yaml

(or one process per GPU as srun's tasks, without torchrun: distributed/slurm_env.py, docs/multinode.md).
"""

from __future__ import annotations

import os
import signal
import sys

__all__ = ["main", "describe_failure"]

PROG = "ft_framework.distributed.torchrun"
# Workers of each rendezvous round get their own store (see the module docstring).
FRESH_STORE_ENV = "TORCH_DISABLE_SHARE_RDZV_TCP_STORE"
# torchrun's defaults (torch/distributed/elastic/rendezvous/{c10d_rendezvous_backend,dynamic_rendezvous}.py).
_DEFAULT_CONF = {"join_timeout": "600", "read_timeout": "60"}


def _rdzv_conf(text: str | None) -> dict[str, str]:
    conf = dict(_DEFAULT_CONF)
    for item in (text or "").split(","):
        key, sep, value = item.partition("=")
        if sep and key.strip():
            conf[key.strip()] = value.strip()
    return conf


def _cause(exc: BaseException) -> str:
    inner = exc.__cause__ or exc.__context__
    if inner is None:
        return ""
    lines = str(inner).strip().splitlines()
    return f" ({type(inner).__name__}: {lines[0]})" if lines else f" ({type(inner).__name__})"


def describe_failure(exc: BaseException, args) -> str | None:
    """One line for a torchrun failure on this node, or None when it is not one of ours to tell."""
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.elastic.rendezvous.api import (RendezvousClosedError, RendezvousConnectionError,
                                                          RendezvousError, RendezvousTimeoutError)

    endpoint = getattr(args, "rdzv_endpoint", "") or "(none)"
    conf = _rdzv_conf(getattr(args, "rdzv_conf", ""))
    nnodes = getattr(args, "nnodes", "?")
    same = (f"start every node with the same --rdzv-endpoint {endpoint}, --rdzv-id "
            f"{getattr(args, 'rdzv_id', '?')} and --nnodes {nnodes}")
    if isinstance(exc, RendezvousConnectionError):
        return (f"{PROG}: this node cannot reach the rendezvous at {endpoint} within read_timeout="
                f"{conf['read_timeout']} s{_cause(exc)}: start the node whose address it is first, check that "
                f"{endpoint} is reachable from here, and {same}")
    if isinstance(exc, RendezvousTimeoutError):
        return (f"{PROG}: the rendezvous at {endpoint} did not fill up within join_timeout={conf['join_timeout']} s "
                f"(not all of --nnodes {nnodes} joined){_cause(exc)}: {same}, and check that every node reaches "
                f"{endpoint}")
    if isinstance(exc, RendezvousClosedError):
        return f"{PROG}: the rendezvous at {endpoint} was closed (the job ended on another node){_cause(exc)}"
    if isinstance(exc, RendezvousError):
        return f"{PROG}: rendezvous at {endpoint} failed: {type(exc).__name__}{_cause(exc)}: {same}"
    if isinstance(exc, ChildFailedError):
        first, first_failure = exc.get_first_failure()
        parts = []
        for rank, failure in sorted(exc.failures.items()):
            code = failure.exitcode
            how = f"killed by {_signal_name(-code)}" if code < 0 else f"exit code {code}"
            order = " first" if rank == first and len(exc.failures) > 1 else ""
            parts.append(f"rank {rank} (local rank {failure.local_rank}, pid {failure.pid}) {how}{order}")
        if first_failure.exitcode < 0:  # a signal ended it before it could print anything
            told = (f"rank {first} printed nothing: {_signal_name(-first_failure.exitcode)} ended it (kill -9, or "
                    "the kernel's out-of-memory killer, which the node's kernel log records: dmesg); the other "
                    "ranks' lines are above")
        else:
            told = "their own error lines are above"
        return (f"{PROG}: workers failed on this node: {'; '.join(parts)}; {told}"
                + (" (after the restarts --max-restarts allowed)" if int(getattr(args, 'max_restarts', 0) or 0)
                   else ""))
    return None


def _signal_name(number: int) -> str:
    try:
        return signal.Signals(number).name
    except ValueError:
        return f"signal {number}"


def _quiet_cpp_logs_here():
    """Keeps c10d's C++ logs (a stack trace per failed connection attempt) out of this process's
    output, unless the user set their level: the one line says it. The workers do not inherit it."""
    if "TORCH_CPP_LOG_LEVEL" in os.environ:
        return
    os.environ["TORCH_CPP_LOG_LEVEL"] = "FATAL"
    try:
        import torch  # noqa: F401 - c10 reads the level once, when it loads
    finally:
        del os.environ["TORCH_CPP_LOG_LEVEL"]


def main(argv: list[str] | None = None) -> int:
    _quiet_cpp_logs_here()
    from torch.distributed import run as torchrun

    args = torchrun.parse_args(sys.argv[1:] if argv is None else argv)
    os.environ.setdefault(FRESH_STORE_ENV, "1")  # read when the rendezvous handler is made, in run()
    from torch.distributed.elastic.multiprocessing.api import SignalException

    try:
        torchrun.run(args)
    except SignalException as exc:  # SIGTERM/SIGINT/...: torchrun passed it on to the workers and waited
        # (up to 30 s) for them: ft-train's ranks saved a checkpoint and said where (run/signals.py).
        sig = signal.Signals(exc.sigval)
        print(f"{PROG}: stopped by {sig.name}; the workers got it too and stopped (their line above says "
              "where the checkpoint is)", file=sys.stderr, flush=True)
        return 128 + int(sig)
    except Exception as exc:  # noqa: BLE001 - told in one line when we know it, re-raised otherwise
        line = describe_failure(exc, args)
        if line is None:
            raise
        print(line, file=sys.stderr, flush=True)
        return 1
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
