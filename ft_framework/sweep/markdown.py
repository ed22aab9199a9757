"""The report's Markdown cells and tables (report.py's tables and frontier.py's section share them)."""

from __future__ import annotations

import math
from typing import Sequence

__all__ = ["fmt", "md_table"]


def fmt(value: float | None, digits: int = 1) -> str:
    """`value` with `digits` decimals; "–" for a missing or NaN value."""
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return "–"
    return f"{value:.{digits}f}"


def md_table(header: Sequence[str], rows: Sequence[Sequence[str]], align_left: int = 1) -> str:
    """A Markdown table: the first `align_left` columns left-aligned, the rest right-aligned."""
    lines = ["| " + " | ".join(header) + " |",
             "|" + "|".join(":---" if i < align_left else "---:" for i in range(len(header))) + "|"]
    lines += ["| " + " | ".join(str(c) for c in row) + " |" for row in rows]
    return "\n".join(lines)
