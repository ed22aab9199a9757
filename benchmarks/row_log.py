"""Rows written as they are measured: one JSON object per line, appended, flushed and synced to disk
before the measurement goes on, so a benchmark killed at any second (a time limit, an out-of-memory
kill, a GPU window that ends) keeps every row it finished. benchmarks/gpu_suite.py and
benchmarks/gpu_part_f.py write their rows through it; their reports are rebuilt from these files
when a part did not return.

    log = RowLog(path)
    log.append({"name": "fused AdamW", "median_ms": 1.9})
    rows = read_rows(path)              # every whole line; a line cut by a kill is left out
    latest = latest_by(rows, "name")    # a row written again as it grew: its last version
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any


class RowLog:
    """Appends rows to `path` (created with its directory)."""

    def __init__(self, path: str | os.PathLike):
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)

    def append(self, row: dict[str, Any]) -> None:
        line = json.dumps(row, default=str) + "\n"
        with open(self.path, "a") as f:
            f.write(line)
            f.flush()
            os.fsync(f.fileno())


def read_rows(path: str | os.PathLike) -> list[dict[str, Any]]:
    """The rows of `path` in order (none when it does not exist); a last line cut short is skipped."""
    path = Path(path)
    if not path.is_file():
        return []
    rows = []
    for line in path.read_text(errors="replace").splitlines():
        try:
            rows.append(json.loads(line))
        except json.JSONDecodeError:
            continue
    return rows


def latest_by(rows: list[dict[str, Any]], key: str) -> list[dict[str, Any]]:
    """The last row of each value of `key`, in the order each value first appeared."""
    out: dict[Any, dict[str, Any]] = {}
    for row in rows:
        out[row.get(key)] = row
    return list(out.values())
