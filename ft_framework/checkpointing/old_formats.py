"""The checkpoint formats before the sharded layout: their file names and how to recognize one.

Reading and converting them is legacy.py's job (`python -m ft_framework.checkpointing.legacy`); this
module only names the format a directory is in, so that reading a manifest can say "old format,
convert it with ..." instead of "not a checkpoint".
"""

from __future__ import annotations

from pathlib import Path

__all__ = ["CONVERTER", "DEEPSPEED_CONSOLIDATED", "DEEPSPEED_META", "FSDP_INFO", "SINGLE_MODEL", "SINGLE_OPTIMIZER",
           "legacy_format_error", "legacy_kind"]

DEEPSPEED_META = "deepspeed_meta.json"
DEEPSPEED_CONSOLIDATED = "consolidated_optimizer.pt"
FSDP_INFO = "fsdp_checkpoint.json"
SINGLE_MODEL = "model.pt"
SINGLE_OPTIMIZER = "optimizer.pt"
CONVERTER = "python -m ft_framework.checkpointing.legacy"


def legacy_kind(directory: Path) -> str | None:
    directory = Path(directory)
    if (directory / DEEPSPEED_META).is_file() or (directory / DEEPSPEED_CONSOLIDATED).is_file():
        return "deepspeed"
    if (directory / FSDP_INFO).is_file():
        return "fsdp"
    if (directory / SINGLE_MODEL).is_file() and (directory / SINGLE_OPTIMIZER).is_file():
        return "single"
    return None


def legacy_format_error(directory: Path) -> str | None:
    """The message for a checkpoint in an old format (None when it is not one)."""
    kind = legacy_kind(directory)
    if kind is None:
        return None
    return (f"checkpoint {directory} is in the old {kind} format (before the sharded layout); convert it "
            f"once with `{CONVERTER} {directory} NEW_DIR` and resume from NEW_DIR (any strategy, any "
            "number of ranks)")
