from datetime import timedelta

import pytest
import torch.distributed as dist

from ft_framework.distributed import peer_failures
from ft_framework.distributed.rendezvous import free_port


@pytest.fixture
def board(monkeypatch):
    """A 2-rank job's store hosted here (as rank 0 hosts it under the deepspeed launcher), seen as
    rank 0; its failure board and witness addresses registered (test_peer_failures.py, test_liveness.py)."""
    store = dist.TCPStore("127.0.0.1", free_port(), 1, is_master=True, timeout=timedelta(seconds=30),
                          wait_for_workers=False)
    monkeypatch.setattr(peer_failures, "_board", {})
    peer_failures.register_store(store, world_size=2, store_host_rank=0)
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "2")
    yield store
    monkeypatch.setattr(peer_failures, "_board", {})
