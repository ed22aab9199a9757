"""A real small file system for tests of a full disk: a tmpfs of a given size, mounted for the
duration of a `with` block (needs the right to mount, as root in a container has; otherwise the
test is skipped with the reason)."""

from __future__ import annotations

import contextlib
import subprocess
from pathlib import Path

import pytest


@contextlib.contextmanager
def small_filesystem(path: Path, size_bytes: int):
    """`path` (created) as the mount point of a tmpfs of `size_bytes`; unmounted afterwards."""
    path.mkdir(parents=True, exist_ok=True)
    mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size_bytes}", "tmpfs", str(path)],
                             capture_output=True, text=True)
    if mounted.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here to fill a disk ({mounted.stderr.strip() or 'mount failed'})")
    try:
        yield path
    finally:
        subprocess.run(["umount", "-l", str(path)], check=False)
