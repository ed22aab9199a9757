"""Joining the process group a launcher describes, within a bounded time and with one clear line
when it cannot be joined.

torch's own env:// join waits as long as the process group's collective timeout (30 minutes under
gloo) for a node that never comes, and then fails with a C++ stack trace. Here the rendezvous store
is created first, as env:// would create it (rank 0 hosts it on MASTER_ADDR:MASTER_PORT; under
torchrun every rank is a client of the agent's store), but with its own timeout:
``FT_RENDEZVOUS_TIMEOUT_S`` seconds (default 300). When that runs out, every rank raises
:class:`RendezvousFailed` with one line naming the address, how many ranks it expected, and what to
check. The process group is then created on that store, with the usual collective timeout.

torchrun's agents meet at their own rendezvous (``--rdzv-endpoint``) before any worker starts; the
one-line form of *its* failures is ``python -m ft_framework.distributed.torchrun`` (ft_framework/torchrun.py).
Under ``srun`` without a launcher, distributed/slurm_env.py first sets the same variables from SLURM's.
"""

from __future__ import annotations

import os
import socket
import time
from datetime import timedelta

import torch.distributed as dist

from ft_framework.distributed import peer_failures
from ft_framework.distributed.ports import free_port  # noqa: F401  (owned by ports.py; the launchers' tests import it here)

from ft_framework.errors import UserError

__all__ = ["DEFAULT_TIMEOUT_S", "TIMEOUT_ENV", "RendezvousFailed", "free_port", "join_process_group",
           "rendezvous_timeout_s"]

TIMEOUT_ENV = "FT_RENDEZVOUS_TIMEOUT_S"
DEFAULT_TIMEOUT_S = 300.0


class RendezvousFailed(UserError):
    """This rank could not meet the others within the rendezvous timeout."""


def rendezvous_timeout_s() -> float:
    raw = os.environ.get(TIMEOUT_ENV)
    if raw is None or not raw.strip():
        return DEFAULT_TIMEOUT_S
    try:
        value = float(raw)
    except ValueError:
        value = -1.0
    if value <= 0:
        raise UserError(f"{TIMEOUT_ENV}={raw!r} must be a positive number of seconds")
    return value


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {text[0] if text else ''}".strip().rstrip(":")


def _wait_until_reachable(addr: str, port: int, deadline: float) -> None:
    """Returns once a TCP connection to addr:port succeeds; TimeoutError at `deadline`."""
    last: OSError | None = None
    while True:
        left = deadline - time.monotonic()
        if left <= 0:
            raise TimeoutError(f"no connection to ({addr}, {port})" + (f": {last.strerror or last}" if last else ""))
        try:
            with socket.create_connection((addr, port), timeout=min(5.0, left)):
                return
        except OSError as exc:
            last = exc
            time.sleep(min(0.5, max(0.0, deadline - time.monotonic())))


def _use_agent_store() -> bool:
    # As torch.distributed.rendezvous: torchrun's agent hosts the store, every worker is a client.
    return os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == str(True)


def join_process_group(backend: str, timeout_s: float | None = None, **init_kwargs) -> None:
    """init_process_group(backend) from the launcher's environment (RANK, WORLD_SIZE, MASTER_ADDR,
    MASTER_PORT), failing within `timeout_s` (default: FT_RENDEZVOUS_TIMEOUT_S, 300 s) with
    :class:`RendezvousFailed` when the ranks cannot meet. `init_kwargs` go to init_process_group
    (device_id under nccl)."""
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    addr, port = os.environ.get("MASTER_ADDR"), os.environ.get("MASTER_PORT")
    if not addr or not port:
        dist.init_process_group(backend=backend, **init_kwargs)  # another init method (the launcher's)
        return
    timeout_s = timeout_s if timeout_s is not None else rendezvous_timeout_s()
    where = f"{addr}:{port}"
    agent = _use_agent_store()
    if agent and os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") not in ("", "0"):
        # The agent's store still holds the failed attempt's addresses: gloo / nccl would read them
        # and hang or fail connecting (pytorch/pytorch#135712).
        raise RendezvousFailed(
            f"torchrun restarted this worker (restart {os.environ['TORCHELASTIC_RESTART_COUNT']}) but shares its "
            f"rendezvous store at {where} with the workers, which still holds the failed attempt's addresses: "
            "launch with python -m ft_framework.distributed.torchrun (same arguments), or set "
            "TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 for torchrun on every node")
    hosting = rank == 0 and not agent
    deadline = time.monotonic() + timeout_s
    try:
        if not hosting:
            # Probed from Python first: c10d logs every failed attempt with a C++ stack trace.
            _wait_until_reachable(addr, int(port), deadline)
        remaining = max(1.0, deadline - time.monotonic())
        # As env:// creates it; every rank counts itself in (wait_for_workers), the host waits for all.
        store = dist.TCPStore(addr, int(port), world, is_master=hosting, timeout=timedelta(seconds=remaining),
                              wait_for_workers=True, multi_tenant=not agent)
    except (RuntimeError, TimeoutError, OSError) as exc:
        if hosting:
            problem = (f"rank 0 of {world} hosted the rendezvous at {where} but not all {world} ranks joined "
                       f"within {timeout_s:g} s ({_first_line(exc)})")
        else:
            problem = (f"rank {rank} of {world} could not reach the rendezvous at {where} within {timeout_s:g} s "
                       f"({_first_line(exc)})")
        raise RendezvousFailed(
            f"{problem}: start every node with the same master address and port (deepspeed --master_addr/"
            f"--master_port, torchrun --rdzv-endpoint; under srun the first host of the node list and a port from "
            f"the job id, or MASTER_ADDR / MASTER_PORT) and the same number of nodes, check that node 0 is up "
            f"and {where} is reachable from every node, or give slow starters longer with {TIMEOUT_ENV}=SECONDS"
        ) from None
    # A prefix, as env:// adds one: the store is shared with the launcher's own keys.
    prefixed = dist.PrefixStore("default_pg", store)
    try:
        dist.init_process_group(backend=backend, store=prefixed, rank=rank, world_size=world, **init_kwargs)
    except (RuntimeError, TimeoutError, OSError) as exc:
        raise RendezvousFailed(
            f"rank {rank} of {world} met the others at {where} but could not connect to them "
            f"({_first_line(exc)}): check that the nodes reach each other on the interface of their hostname "
            "(or name it with GLOO_SOCKET_IFNAME / NCCL_SOCKET_IFNAME)") from None
    peer_failures.register_store(store, world_size=world, store_host_rank=None if agent else 0, rank=rank,
                                 rendezvous=(addr, int(port)))
