"""The host allocator policy ft-train sets at start, so that the process's memory follows its live
tensors (the memory plan's host side, docs/memory.md).

Why: glibc's malloc serves a request below its mmap threshold from the heap (the main arena), and
the threshold grows, by default, up to 32 MiB as large blocks are freed. A CPU run frees
activations of many sizes every step; the holes they leave in the heap cannot be handed back to
the kernel while a block above them lives, and later requests of other sizes do not fit them. On
a RoBERTa-base-size run (batch 8 x 256 tokens, fp32, CPU) the process peaked at 5.24-5.36 GiB for
3.79 GiB of live tensors; ``MALLOC_ARENA_MAX=2`` changed nothing and ``malloc_trim`` at phase
boundaries saved 0.4 GiB. A fixed threshold of 128 KiB (``mallopt(M_MMAP_THRESHOLD, 131072)``,
which also turns off the threshold's growth) serves every tensor of 128 KiB or more by its own
mmap, returned to the kernel when it is freed: the same run peaked at 4.31 GiB.

Its cost: each such tensor is a fresh mapping whose pages the kernel zeroes on first touch. On
small CPU runs (MiniLM-size, 4 steps) it took 16-19% off the peak and added 33-50% wall time on a
busy machine, and the quickstart took 15.3-16.2 s against 12.1-12.7 s on a quiet one (-4.5% peak)
(docs/benchmarks.md, "The ft-train process against its plan"); GPU runs allocate few large host
blocks through malloc. So it is a choice, ``training.host_allocator`` (predictable by default).
"""

from __future__ import annotations

import ctypes
import ctypes.util
import platform

M_MMAP_THRESHOLD = -3           # <malloc.h>: mallopt's parameter number of the mmap threshold
MMAP_THRESHOLD_BYTES = 128 * 1024


def set_host_allocator_policy(policy: str = "predictable") -> str:
    """With `policy` "predictable" (``training.host_allocator``), sets glibc's mmap threshold to
    :data:`MMAP_THRESHOLD_BYTES` where glibc is the allocator; "glibc" leaves glibc's own policy.
    Returns one line for the run's log saying what was done (or why nothing was)."""
    if policy == "glibc":
        return "host allocator: glibc's own (training.host_allocator: glibc; freed tensors may stay in its heap)"
    libc_name, _ = platform.libc_ver()
    if libc_name != "glibc":
        return f"host allocator: left as it is (the C library is {libc_name or 'not glibc'}; the policy is glibc's)"
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        mallopt = libc.mallopt
    except (OSError, AttributeError) as exc:
        return f"host allocator: left as it is (glibc's mallopt is not reachable: {exc})"
    mallopt.argtypes, mallopt.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
    if mallopt(M_MMAP_THRESHOLD, MMAP_THRESHOLD_BYTES) != 1:
        return "host allocator: left as it is (glibc's mallopt refused M_MMAP_THRESHOLD)"
    return (f"host allocator: glibc mmap threshold fixed at {MMAP_THRESHOLD_BYTES // 1024} KiB "
            "(mallopt M_MMAP_THRESHOLD): freed tensors return to the system, the process follows its live tensors")


__all__ = ["MMAP_THRESHOLD_BYTES", "set_host_allocator_policy"]
