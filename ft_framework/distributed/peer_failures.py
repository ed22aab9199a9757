"""Which rank failed first: a board in the rendezvous store that the ranks of a job share.

When one rank fails (its own error: bad data, out of memory, a bug), the others fail a moment later
in whatever collective they were in, with an error that says only that a connection closed. Telling
the two apart must not depend on the wording of those errors (gloo raises a plain RuntimeError, and
its text changes between releases). So the rank whose own error it is writes it on this board
before it exits (and so before its sockets close), and a rank whose collective then fails reads the
board: a peer's entry means "another rank failed, that rank shows its error".

The board lives in the TCP store the ranks met through (rendezvous.py registers it). Under torchrun
the launcher's agent hosts that store, so it outlives every worker; under other launchers rank 0
hosts it, and a store that cannot be reached any more means rank 0 itself is gone. A process group
made by the launcher's own init method has no store of ours: then nothing is announced and only the
exception's type tells (torch's DistBackendError, DistNetworkError, DistStoreError).

A rank killed without a word (SIGKILL, the out-of-memory killer, a lost node) writes nothing here.
For those, each rank also publishes the address of its liveness witness (liveness.py: a socket
the kernel closes when the process dies) in the same store, and :func:`silent_peers` probes the
witnesses of the others: a rank whose witness is gone or unreachable died without announcing it.
"""

from __future__ import annotations

import os
import time
from datetime import timedelta
from typing import TYPE_CHECKING

from ft_framework.distributed import liveness

if TYPE_CHECKING:
    import torch.distributed as dist

__all__ = ["announce_failure", "failed_peers", "register_store", "silent_peers", "STORE_GONE"]

# failed_peers() returns this as the "summary" of rank 0 when the store it hosted cannot be reached.
STORE_GONE = "the rendezvous store it hosted is gone"
_PREFIX = "ft_failed"
_WITNESS_PREFIX = "ft_witness"
_OP_TIMEOUT = timedelta(seconds=5)
_board: dict[str, object] = {}


def register_store(store: dist.Store, *, world_size: int, store_host_rank: int | None, rank: int | None = None,
                   rendezvous: tuple[str, int] | None = None) -> None:
    """Called once the process group is made: `store` is the one the ranks met through;
    `store_host_rank` the rank whose process hosts it (None: the launcher's agent does). With this
    process's `rank` and the `rendezvous` (host, port) it met the others at, it also opens its
    liveness witness and publishes its address, for :func:`silent_peers` on the other ranks."""
    # torch is imported here, not at the top: run/failures.py imports this module, and ft-train reports
    # a config error through it before torch is loaded (docs/design.md, "Layers").
    import torch.distributed as dist

    # One board per torchrun restart round: a restarted round must not read the last round's entries.
    round_ = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
    witnesses = dist.PrefixStore(f"{_WITNESS_PREFIX}/{round_}", store)
    _board.update(store=dist.PrefixStore(f"{_PREFIX}/{round_}", store), witnesses=witnesses, world_size=world_size,
                  host=store_host_rank)
    if rank is None or rendezvous is None or world_size < 2:  # nobody to tell
        return
    address = liveness.open_witness(*rendezvous, world_size)
    if address is None:
        return
    try:  # no set_timeout here: it is the store's, and the process group's own waits use it too
        witnesses.set(str(rank), address.encode())
    except (RuntimeError, OSError):  # not published: a witness nobody can find is no use
        liveness.close_witness()


def announce_failure(rank: int, summary: str) -> bool:
    """Writes this rank's own failure on the board; False where there is no board or it is gone."""
    store = _board.get("store")
    if store is None:
        return False
    try:
        store.set_timeout(_OP_TIMEOUT)
        store.set(str(rank), summary.encode()[:500])
        return True
    except (RuntimeError, OSError):  # the store (hosted by a rank that is gone) cannot be reached
        return False


def failed_peers(own_rank: int, wait_s: float = 3.0) -> dict[int, str]:
    """The other ranks that announced a failure, waiting up to `wait_s` for the first entry (a failing
    rank announces just before it exits, which is what made our collective fail). Empty without a
    board. When the store cannot be reached, its host rank is reported with :data:`STORE_GONE`."""
    store, world = _board.get("store"), int(_board.get("world_size") or 0)
    if store is None:
        return {}
    keys = [str(r) for r in range(world) if r != own_rank]
    deadline = time.monotonic() + wait_s
    try:
        store.set_timeout(_OP_TIMEOUT)
        while True:
            found = [k for k in keys if store.check([k])]
            if found or time.monotonic() >= deadline:
                return {int(k): store.get(k).decode(errors="replace") for k in found}
            time.sleep(0.1)
    except (RuntimeError, OSError):  # DistStoreError is a RuntimeError: the store's host went away
        host = _board.get("host")
        return {host: STORE_GONE} if host is not None and host != own_rank else {}


def silent_peers(own_rank: int, timeout_s: float = 3.0) -> dict[int, str]:
    """The other ranks that died without a word, by their liveness witness: rank ->
    :data:`liveness.GONE` (its process ended) or :data:`liveness.UNREACHABLE` (its node does not
    answer within `timeout_s`). Empty without a board, or when the store cannot be read."""
    store, world = _board.get("witnesses"), int(_board.get("world_size") or 0)
    if store is None:
        return {}
    keys = [str(r) for r in range(world) if r != own_rank]
    try:
        store.set_timeout(_OP_TIMEOUT)
        published = [k for k in keys if store.check([k])]  # a rank killed before it published is not
        values = store.multi_get(published) if published else []
    except (RuntimeError, OSError):  # the store's host went away: failed_peers() says so
        return {}
    addresses = {int(k): bytes(v).decode(errors="replace") for k, v in zip(published, values)}
    return {r: v for r, v in sorted(liveness.probe(addresses, timeout_s).items()) if v != liveness.ALIVE}
