"""Whether a peer's process still lives: a witness that a killed process cannot keep up.

A rank killed without a word (SIGKILL, the kernel's out-of-memory killer, a lost node) writes
nothing on the failure board (peer_failures.py). So each rank, once the process group is made,
opens a listening TCP socket and publishes its address (peer_failures.py puts it in the rendezvous
store). Nothing ever accepts on it: the kernel completes a connection to a listening socket by
itself, so the witness needs no thread and answers even while the process is busy or stopped; and
the kernel closes it when the process ends, however it ends. A survivor probes it: a refused
connection means the peer's process is gone, no answer within the probe's timeout means its node
cannot be reached. The decision reads only socket error numbers, never an error's text.

A forked child (a data-loader worker) closes its inherited copy at once: it would otherwise keep
the witness answering after the rank itself died. exec'd children do not inherit it (Python's
sockets are not inheritable).
"""

from __future__ import annotations

import errno
import ipaddress
import os
import selectors
import socket
import time

__all__ = ["ALIVE", "GONE", "UNREACHABLE", "close_witness", "open_witness", "probe"]

ALIVE = "alive"
GONE = "gone"  # the connection was refused: nothing listens, the process ended
UNREACHABLE = "unreachable"  # no answer in time, or no route: the node is down or cut off
# Each survivor probes each peer at most once, when it fails; connections nobody accepts wait in
# the backlog, so it must hold one per possible prober.
_MIN_BACKLOG = 128
_witness: dict[str, socket.socket] = {}


def _close_inherited_copy() -> None:
    sock = _witness.pop("socket", None)
    if sock is not None:
        sock.close()


os.register_at_fork(after_in_child=_close_inherited_copy)


def _local_address_towards(host: str, port: int) -> str:
    """The address of this machine's interface that routes to host:port (where the ranks met): the
    peers reach the rendezvous the same way, so they can reach this address too. A UDP socket's
    connect only chooses the route; it sends nothing."""
    family, _, _, _, address = socket.getaddrinfo(host, port, type=socket.SOCK_DGRAM)[0]
    with socket.socket(family, socket.SOCK_DGRAM) as udp:
        udp.connect(address)
        return udp.getsockname()[0]


def open_witness(rendezvous_host: str, rendezvous_port: int, world_size: int) -> str | None:
    """Opens this process's witness; returns its address ("host ip port", for the peers), or None
    when no socket could be opened (then the peers cannot tell whether this rank lives)."""
    close_witness()
    try:
        ip = _local_address_towards(rendezvous_host, rendezvous_port)
        sock = socket.socket(socket.AF_INET6 if ":" in ip else socket.AF_INET, socket.SOCK_STREAM)
        sock.bind((ip, 0))
        sock.listen(max(_MIN_BACKLOG, world_size))
    except OSError:
        return None
    _witness["socket"] = sock
    return f"{socket.gethostname()} {ip} {sock.getsockname()[1]}"


def close_witness() -> None:
    _close_inherited_copy()


def _target(address: str) -> tuple[str, int] | None:
    """Where to probe a published witness, or None where it cannot be probed from here: a loopback
    address published on another host (its hostname resolved to 127.0.1.1 there) would reach this
    host, not the peer."""
    try:
        host, ip, port = address.split()
        loopback = ipaddress.ip_address(ip).is_loopback
    except ValueError:
        return None
    if loopback and host != socket.gethostname():
        return None
    return ip, int(port)


def _verdict(error: int) -> str:
    if error == 0:
        return ALIVE
    return GONE if error == errno.ECONNREFUSED else UNREACHABLE


def probe(addresses: dict[int, str], timeout_s: float = 3.0) -> dict[int, str]:
    """rank -> ALIVE, GONE or UNREACHABLE for each published witness address that can be probed
    from here; all of them at once, within `timeout_s`."""
    verdicts: dict[int, str] = {}
    pending = selectors.DefaultSelector()
    try:
        for rank, address in addresses.items():
            target = _target(address)
            if target is None:
                continue
            sock = socket.socket(socket.AF_INET6 if ":" in target[0] else socket.AF_INET, socket.SOCK_STREAM)
            sock.setblocking(False)
            error = sock.connect_ex(target)
            if error in (errno.EINPROGRESS, errno.EAGAIN):
                pending.register(sock, selectors.EVENT_WRITE, rank)
            else:
                verdicts[rank] = _verdict(error)
                sock.close()
        deadline = time.monotonic() + timeout_s
        while pending.get_map():
            left = deadline - time.monotonic()
            if left <= 0:
                break
            for key, _ in pending.select(left):
                sock = key.fileobj
                verdicts[key.data] = _verdict(sock.getsockopt(socket.SOL_SOCKET, socket.SO_ERROR))
                pending.unregister(sock)
                sock.close()
        for key in list(pending.get_map().values()):  # no answer in time
            verdicts[key.data] = UNREACHABLE
            pending.unregister(key.fileobj)
            key.fileobj.close()
    finally:
        pending.close()
    return verdicts
