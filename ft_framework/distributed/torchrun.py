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

The node that hosts the c10d rendezvous waits for the other nodes' verdicts before it exits when its
workers failed or a signal stopped it (at most LINGER_S seconds). torchrun keeps the rendezvous
store inside the host node's launcher, which used to exit as soon as its own workers failed: a node
whose workers were slower to exit (a config error every rank prints, under load) then lost the
rendezvous, stopped its workers and said it could not reach the rendezvous, instead of telling what
its workers said. Here the host starts the store's server itself before torchrun runs (torchrun's
multi-tenant store shares it), so the server outlives torchrun.run, and every other node adds its
verdict to the store once its own workers are done.

Another behaviour differs on purpose: restarts (``--max-restarts``) work. torchrun shares its
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

import ipaddress
import os
import signal
import socket
import sys
import time
from datetime import timedelta
from typing import Any

__all__ = ["LINGER_S", "main", "describe_failure"]

PROG = "ft_framework.distributed.torchrun"
# How long the rendezvous host waits, after its workers failed, for the other nodes' verdicts: a
# node's launcher sees its workers' exits within torchrun's --monitor-interval once they exit, and
# a worker reporting an error exits within seconds; a node that is gone never reports.
LINGER_S = 15.0
# How long a node tries to reach the host to give its verdict (the host may be gone).
VERDICT_CONNECT_S = 3.0
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


def _is_this_machine(host: str) -> bool:
    """Whether `host` names this machine: a loopback address, its host name, or one of its addresses
    (as torchrun decides who hosts the c10d store when the config does not say)."""
    if host in (socket.gethostname(), socket.getfqdn(), "localhost"):
        return True
    try:
        addresses = {info[4][0] for info in socket.getaddrinfo(host, None)}
        if any(ipaddress.ip_address(address.split("%")[0]).is_loopback for address in addresses):
            return True
        local = {info[4][0] for info in socket.getaddrinfo(socket.gethostname(), None)}
    except (OSError, ValueError):
        return False
    return bool(addresses & local)


def _rendezvous_endpoint(args) -> tuple[str, int] | None:
    """(host, port) of a multi-node c10d rendezvous, or None (one node, another backend, no port)."""
    from torch.distributed.elastic.rendezvous.utils import parse_rendezvous_endpoint
    from torch.distributed.run import parse_min_max_nnodes

    if getattr(args, "rdzv_backend", "") != "c10d" or getattr(args, "standalone", False):
        return None
    if parse_min_max_nnodes(str(args.nnodes))[1] <= 1:
        return None
    host, port = parse_rendezvous_endpoint(getattr(args, "rdzv_endpoint", ""), default_port=29400)
    return (host, port) if port > 0 else None


def _host_the_rendezvous_store(args) -> Any:
    """On the node that is to host the rendezvous store: its server, started before torchrun's (which
    shares it: multi_tenant), so that it lives as long as this process; None on the other nodes.
    The same decision as torchrun's: `is_host` in --rdzv-conf when given, else whether the endpoint
    names this machine, and whoever binds the port first when several processes here would."""
    from torch.distributed import TCPStore

    endpoint = _rendezvous_endpoint(args)
    if endpoint is None:
        return None
    conf = _rdzv_conf(getattr(args, "rdzv_conf", ""))
    is_host = conf.get("is_host", "").strip().lower()
    if is_host in ("0", "false", "no", "n") or (not is_host and not _is_this_machine(endpoint[0])):
        return None
    try:
        return TCPStore(endpoint[0], endpoint[1], is_master=True, multi_tenant=True, wait_for_workers=False,
                        timeout=timedelta(seconds=float(conf["read_timeout"])))
    except (RuntimeError, ValueError, OSError):  # the port is taken: another process here hosts it
        return None


def _verdicts_key(args) -> str:
    return f"ft_framework.distributed.torchrun/{getattr(args, 'rdzv_id', 'none')}/verdicts"


def _give_verdict(args) -> None:
    """Tells the rendezvous host that this node's launcher is done (nothing happens if it is gone)."""
    from torch.distributed import TCPStore

    endpoint = _rendezvous_endpoint(args)
    if endpoint is None:
        return
    try:
        store = TCPStore(endpoint[0], endpoint[1], is_master=False, wait_for_workers=False,
                         timeout=timedelta(seconds=VERDICT_CONNECT_S))
        store.add(_verdicts_key(args), 1)
    except (RuntimeError, ValueError, OSError):  # the host is gone: nobody waits for us
        return


def _wait_for_verdicts(args, store: Any) -> None:
    """Keeps the rendezvous store up until every other node gave its verdict, or LINGER_S passed."""
    from torch.distributed.run import parse_min_max_nnodes

    others = parse_min_max_nnodes(str(args.nnodes))[1] - 1
    deadline = time.monotonic() + LINGER_S
    try:
        while store.add(_verdicts_key(args), 0) < others and time.monotonic() < deadline:
            time.sleep(0.05)
    except (RuntimeError, ValueError, OSError):
        return


def main(argv: list[str] | None = None) -> int:
    _quiet_cpp_logs_here()
    from torch.distributed import run as torchrun

    args = torchrun.parse_args(sys.argv[1:] if argv is None else argv)
    os.environ.setdefault(FRESH_STORE_ENV, "1")  # read when the rendezvous handler is made, in run()
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError

    host_store = _host_the_rendezvous_store(args)
    workers_ran = False  # the rendezvous completed: other nodes' workers ran too, and may still be exiting
    try:
        torchrun.run(args)
    except SignalException as exc:  # SIGTERM/SIGINT/...: torchrun passed it on to the workers and waited
        # (up to 30 s) for them: ft-train's ranks saved a checkpoint and said where (run/signals.py).
        workers_ran = True
        sig = signal.Signals(exc.sigval)
        print(f"{PROG}: stopped by {sig.name}; the workers got it too and stopped (their line above says "
              "where the checkpoint is)", file=sys.stderr, flush=True)
        return 128 + int(sig)
    except Exception as exc:  # noqa: BLE001 - told in one line when we know it, re-raised otherwise
        workers_ran = isinstance(exc, ChildFailedError)
        line = describe_failure(exc, args)
        if line is None:
            raise
        print(line, file=sys.stderr, flush=True)
        return 1
    finally:
        # Only after workers ran and failed or were stopped: a node that never joined has nobody to
        # tell, and after a success torchrun's exit barrier has already waited for every node.
        if workers_ran and host_store is None:
            _give_verdict(args)
        elif workers_ran:
            _wait_for_verdicts(args, host_store)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
