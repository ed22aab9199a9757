"""How the torchrun workers of these tests end once their results are written.

A worker that finished its work can still die at interpreter exit: a native thread pool of a
library it imported (Arrow's, through datasets/pandas, is the one reported upstream with exactly
this message) is destroyed while a thread is still joinable, and std::terminate aborts the
process ("terminate called without an active exception", SIGABRT). CI saw it twice, once in
fsdp_worker.py and once in ds_worker.py, each time after the phase's results were written. The
tests check those results, not the interpreter's teardown, so a worker leaves with os._exit once
every rank is done and its output is flushed."""

from __future__ import annotations

import os
import sys

import torch.distributed as dist


def finish() -> None:
    """Every rank is done (a barrier), the process group is closed, output flushed; exit 0 now."""
    if dist.is_initialized():
        dist.barrier()
        dist.destroy_process_group()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)
