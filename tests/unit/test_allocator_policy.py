"""The host allocator policy ft-train sets at start (run/allocator.py): with it, the memory of freed
tensors returns to the system even when a live block sits above them in the heap; without it,
glibc's default (a threshold that grows as large blocks are freed) keeps it."""

from __future__ import annotations

import json
import platform
import subprocess
import sys

import pytest

# A fresh process: frees one 1 MiB block (glibc then raises its mmap threshold above 1 MiB unless
# the policy fixed it), allocates 100 more with a 100 KiB block after each (kept), frees the 100,
# and reports how much the resident set still holds (the 10 MiB of kept blocks, and the freed
# 100 MiB unless they went back to the system).
PROBE = r"""
import ctypes, json, sys
from ft_framework.run.allocator import set_host_allocator_policy

libc = ctypes.CDLL("libc.so.6")
libc.malloc.restype, libc.malloc.argtypes = ctypes.c_void_p, [ctypes.c_size_t]
libc.free.argtypes = [ctypes.c_void_p]
MIB = 1 << 20

def rss_mib():
    for line in open("/proc/self/status"):
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024

def block(size):  # what a CPU tensor's storage is: malloc'ed, then written
    pointer = libc.malloc(size)
    ctypes.memset(pointer, 1, size)
    return pointer

line = set_host_allocator_policy("predictable" if sys.argv[1] == "policy" else "glibc")
libc.free(block(MIB))                 # 1 MiB allocated and freed
before = rss_mib()
big, small = [], []
for _ in range(100):
    big.append(block(MIB))            # 1 MiB each
    small.append(block(100 * 1024))   # a live heap block after each (below both thresholds)
grown = rss_mib() - before
for pointer in big:
    libc.free(pointer)
print(json.dumps({"line": line, "kept_mib": rss_mib() - before, "grown_mib": grown}))
"""

needs_glibc = pytest.mark.skipif(platform.libc_ver()[0] != "glibc", reason="the policy is glibc's mmap threshold")


def probe(mode: str) -> dict:
    out = subprocess.run([sys.executable, "-c", PROBE, mode], check=True, capture_output=True, text=True).stdout
    return json.loads(out.strip().splitlines()[-1])


@needs_glibc
def test_freed_tensors_return_to_the_system_with_the_policy_and_not_without():
    default, policy = probe("default"), probe("policy")
    assert default["grown_mib"] > 105 and policy["grown_mib"] > 105   # 110 MiB touched in both
    assert default["kept_mib"] > 100       # glibc's default keeps the 1 MiB holes between the kept blocks
    assert policy["kept_mib"] < 20         # each 1 MiB block was its own mmap, unmapped when freed
    assert policy["line"].startswith("host allocator: glibc mmap threshold fixed at 128 KiB")
    assert default["line"].startswith("host allocator: glibc's own (training.host_allocator: glibc")
