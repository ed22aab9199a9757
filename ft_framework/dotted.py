"""Dotted keys for nested mappings: the one place configs become flat `a.b.c` keys.

A bottom module (it imports nothing from ft_framework) so that the run's fingerprint, the ranks'
config agreement and the trackers can flatten a config without importing the config package.
"""

from __future__ import annotations

from typing import Any


def flatten_dotted(data: Any, prefix: str = "") -> dict[str, Any]:
    """The inverse of nest_dotted: {"optimizer": {"hparams": {"lr": 1e-4}}} -> {"optimizer.hparams.lr": 1e-4}.
    Lists and empty mappings stay values; used wherever configs are compared or logged key by key."""
    if isinstance(data, dict) and data:
        out: dict[str, Any] = {}
        for key, value in data.items():
            out.update(flatten_dotted(value, f"{prefix}{key}."))
        return out
    return {prefix[:-1]: data} if prefix else {}
