"""A free TCP port for a launcher's rendezvous. Without torch: the sweep's runners pick ports for the
runs they start, and a SLURM job's runner (sweep/slurm_job.py) starts without importing torch."""

from __future__ import annotations

import socket

__all__ = ["free_port"]


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port free on `host` now, for a launcher's rendezvous (another process may take it
    before the launcher binds it; single-machine runs and tests accept that race)."""
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]
