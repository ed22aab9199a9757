"""The host allocator policy ft-train sets at start, so that the process's memory follows its live
tensors (the memory plan's host side, docs/memory.md) without costing a CPU run its time.

Why: glibc's malloc serves a request below its mmap threshold from the heap (the main arena), and
the threshold grows, by default, up to 32 MiB as large blocks are freed. A CPU run frees
activations of many sizes every step; the holes they leave in the heap cannot be handed back to
the kernel while a block above them lives, and later requests of other sizes do not fit them. On
a RoBERTa-base-size run (batch 8 x 256 tokens, fp32, CPU) the process peaked at 5.24-5.36 GiB for
3.79 GiB of live tensors; ``MALLOC_ARENA_MAX=2`` changed nothing and ``malloc_trim`` at phase
boundaries saved 0.4 GiB. A fixed threshold (``mallopt(M_MMAP_THRESHOLD, ...)``, which also turns
off the threshold's growth) serves every block at or above it by its own mmap, returned to the
kernel when it is freed: at 128 KiB the same run peaked at 4.31 GiB.

Which threshold: each block served by mmap is a fresh mapping whose pages the kernel zeroes on
first touch, every time, where the heap would have reused them. At 128 KiB that covered the
quickstart's small activations too (16 short sentences: a hidden state is a few hundred KiB), and
the quickstart took 1.24x as long (30.7 s against 24.7 s, system time 11 s against 3.5 s, for
4.5% less peak memory). At :data:`MMAP_THRESHOLD_BYTES` (1 MiB) a block below it reuses the heap,
and the quickstart runs as fast as under glibc's own policy, while the tensors that make a large
run's peak (a batch's activations, a layer's gradients: megabytes each) still go back to the
system when freed (docs/benchmarks.md, "The host allocator's cost"). Holes below 1 MiB can stay in
the heap; they are a small share of a run whose tensors are large.

Its cost where activations are megabytes: a decoder's SFT step (SmolLM2-135M, 4 x 256 tokens)
allocates its activations, each 2-200 MB, afresh every step; mapped and zeroed each time, the step
took 1.4x as long as under glibc's own policy, which reuses them in its heap (docs/benchmarks.md).
So the policy is on where a run is held to its plan, ``training.memory_budget_gib`` (``auto``, the
default), or where asked (``predictable``); ``glibc`` keeps glibc's own policy.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import platform

M_TRIM_THRESHOLD = -1           # <malloc.h>: mallopt's parameter numbers
M_MMAP_THRESHOLD = -3
MMAP_THRESHOLD_BYTES = 1024 * 1024
# Free memory at the top of the heap that glibc keeps instead of handing it back (sbrk): twice the
# mmap threshold, as glibc's own policy sets it when it raises that threshold. At glibc's default
# (128 KiB, kept once the mmap threshold is fixed) a freed block below the mmap threshold at the
# heap's top went back to the kernel and the next one was faulted in afresh, each time.
TRIM_THRESHOLD_BYTES = 2 * MMAP_THRESHOLD_BYTES


def resolve_policy(host_allocator: str, memory_budget_gib: float | None) -> str:
    """The policy a run's ``training.host_allocator`` names: "auto" is "predictable" where the run
    has a memory budget (``training.memory_budget_gib``: it is held to its plan) and "glibc"
    otherwise (no time lost to fresh pages: a decoder's SFT step took 1.4x as long under the
    predictable policy, docs/benchmarks.md)."""
    if host_allocator == "auto":
        return "predictable" if memory_budget_gib is not None else "glibc"
    return host_allocator


def set_host_allocator_policy(policy: str = "predictable", *, why: str | None = None) -> str:
    """With `policy` "predictable" (resolve_policy), sets glibc's mmap threshold to
    :data:`MMAP_THRESHOLD_BYTES` where glibc is the allocator; "glibc" leaves glibc's own policy.
    `why`: the setting that chose it, for the line. Returns one line for the run's log saying what
    was done (or why nothing was)."""
    if policy == "glibc":
        return (f"host allocator: glibc's own ({why or 'training.host_allocator: glibc'}; freed tensors may stay in "
                "its heap, so the process can hold more than the memory plan's tensors)")
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
    if mallopt(M_TRIM_THRESHOLD, TRIM_THRESHOLD_BYTES) != 1:
        return "host allocator: glibc mmap threshold fixed, its trim threshold refused (mallopt M_TRIM_THRESHOLD)"
    return (f"host allocator: glibc mmap threshold fixed at {_size(MMAP_THRESHOLD_BYTES)} (mallopt "
            "M_MMAP_THRESHOLD): freed tensors of that size or more return to the system, smaller ones reuse the heap"
            + (f" ({why})" if why else ""))


def apply_run_policy(host_allocator: str, memory_budget_gib: float | None) -> str:
    """resolve_policy, then set_host_allocator_policy, with the line saying which setting chose it."""
    policy = resolve_policy(host_allocator, memory_budget_gib)
    if host_allocator != "auto":
        why = f"training.host_allocator: {host_allocator}"
    elif memory_budget_gib is not None:
        why = "training.host_allocator: auto, with training.memory_budget_gib set"
    else:
        why = "training.host_allocator: auto, without training.memory_budget_gib"
    return set_host_allocator_policy(policy, why=why)


def _size(nbytes: int) -> str:
    return f"{nbytes // 2**20} MiB" if nbytes % 2**20 == 0 else f"{nbytes // 1024} KiB"


__all__ = ["MMAP_THRESHOLD_BYTES", "apply_run_policy", "resolve_policy", "set_host_allocator_policy"]
