"""The host allocator policy ft-train sets at start (run/allocator.py): with it, the memory of freed
tensors at or above its threshold returns to the system even when a live block sits above them in
the heap; without it, glibc's default (a threshold that grows as large blocks are freed) keeps it.
Blocks below the threshold reuse the heap: no fresh zeroed pages each time (the quickstart's cost
under the old 128 KiB threshold)."""

from __future__ import annotations

import json
import platform
import subprocess
import sys

import pytest

# A fresh process: frees one block of twice the policy's threshold (glibc then raises its mmap
# threshold above it unless the policy fixed it), allocates 100 more with a 100 KiB block after each
# (kept), frees the 100, and reports how much the resident set still holds (the 10 MiB of kept
# blocks, and the freed 100 x 2 MiB unless they went back to the system).
PROBE = r"""
import ctypes, json, sys
from ft_framework.run.allocator import MMAP_THRESHOLD_BYTES, set_host_allocator_policy

libc = ctypes.CDLL("libc.so.6")
libc.malloc.restype, libc.malloc.argtypes = ctypes.c_void_p, [ctypes.c_size_t]
libc.free.argtypes = [ctypes.c_void_p]
MIB = 1 << 20
LARGE = 2 * MMAP_THRESHOLD_BYTES

def rss_mib():
    for line in open("/proc/self/status"):
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024

def block(size):  # what a CPU tensor's storage is: malloc'ed, then written
    pointer = libc.malloc(size)
    ctypes.memset(pointer, 1, size)
    return pointer

line = set_host_allocator_policy("predictable" if sys.argv[1] == "policy" else "glibc")
libc.free(block(LARGE))               # a large block allocated and freed
before = rss_mib()
big, small = [], []
for _ in range(100):
    big.append(block(LARGE))
    small.append(block(100 * 1024))   # a live heap block after each (below both thresholds)
grown = rss_mib() - before
for pointer in big:
    libc.free(pointer)
print(json.dumps({"line": line, "kept_mib": rss_mib() - before, "grown_mib": grown, "large_mib": LARGE / MIB}))
"""

# A fresh process: a 512 KiB block (one of the quickstart's activations: 16 sentences of about 20
# tokens x 384 floats) allocated, written and freed 200 times; the minor page faults that cost (a
# fresh mapping is faulted in page by page, zeroed by the kernel, every time; a block the heap
# reuses is not).
REUSE = r"""
import ctypes, json, resource, sys
from ft_framework.run.allocator import set_host_allocator_policy

libc = ctypes.CDLL("libc.so.6")
libc.malloc.restype, libc.malloc.argtypes = ctypes.c_void_p, [ctypes.c_size_t]
libc.free.argtypes = [ctypes.c_void_p]
size = 512 * 1024
set_host_allocator_policy("predictable" if sys.argv[1] == "policy" else "glibc")
faults = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
for _ in range(200):
    pointer = libc.malloc(size)
    ctypes.memset(pointer, 1, size)
    libc.free(pointer)
print(json.dumps({"faults": resource.getrusage(resource.RUSAGE_SELF).ru_minflt - faults,
                  "pages": 200 * size // 4096}))
"""

needs_glibc = pytest.mark.skipif(platform.libc_ver()[0] != "glibc", reason="the policy is glibc's mmap threshold")


def probe(mode: str, script: str = PROBE) -> dict:
    out = subprocess.run([sys.executable, "-c", script, mode], check=True, capture_output=True, text=True).stdout
    return json.loads(out.strip().splitlines()[-1])


@needs_glibc
def test_freed_tensors_return_to_the_system_with_the_policy_and_not_without():
    default, policy = probe("default"), probe("policy")
    touched = 100 * policy["large_mib"]
    assert default["grown_mib"] > touched and policy["grown_mib"] > touched
    assert default["kept_mib"] > touched - 5  # glibc's default keeps the holes between the kept blocks
    assert policy["kept_mib"] < 20             # each large block was its own mmap, unmapped when freed
    assert policy["line"].startswith("host allocator: glibc mmap threshold fixed at 1 MiB")
    assert default["line"].startswith("host allocator: glibc's own (training.host_allocator: glibc")


@needs_glibc
def test_a_block_below_the_threshold_reuses_the_heap_without_fresh_pages():
    """The quickstart's cost under a 128 KiB threshold: every activation of a few hundred KiB was a
    fresh mapping, faulted in and zeroed at each use. Below the threshold the heap reuses it, as
    under glibc's own policy."""
    policy, default = probe("policy", REUSE), probe("default", REUSE)
    assert policy["faults"] < policy["pages"] / 10, policy   # 200 reuses: about one block's pages in all
    assert default["faults"] < default["pages"] / 10, default


def test_auto_holds_a_run_with_a_memory_budget_to_its_plan_and_leaves_the_others_to_glibc():
    """training.host_allocator: auto (the default) is the predictable policy where the run has a
    memory budget and glibc's own otherwise; an explicit choice is kept either way."""
    from ft_framework.config.schema import TrainingConfig
    from ft_framework.run.allocator import resolve_policy

    assert TrainingConfig(max_steps=1).host_allocator == "auto"
    assert resolve_policy("auto", None) == "glibc"
    assert resolve_policy("auto", 20.0) == "predictable"
    assert resolve_policy("predictable", None) == "predictable"
    assert resolve_policy("glibc", 20.0) == "glibc"


AUTO = r"""
import sys
from ft_framework.run.allocator import apply_run_policy
print(apply_run_policy("auto", float(sys.argv[1]) if sys.argv[1] != "none" else None))
"""


@needs_glibc
@pytest.mark.parametrize("budget, policy", [("none", "glibc's own"), ("20", "glibc mmap threshold fixed at 1 MiB")])
def test_the_line_names_the_policy_and_the_setting_that_chose_it(budget, policy):
    line = subprocess.run([sys.executable, "-c", AUTO, budget], check=True, capture_output=True,
                          text=True).stdout.strip()
    assert line.startswith(f"host allocator: {policy}"), line
    assert ("with training.memory_budget_gib set" if budget != "none" else "without training.memory_budget_gib") \
        in line, line
