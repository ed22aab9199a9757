"""The output-directory guard: a fresh run never writes into a directory that holds another run's files.

A run's own files (results.json, metrics.jsonl, tensorboard/, checkpoints/, best/) in
``logging.output_dir`` mean a previous run lives there. A fresh run into it would append to its
metrics.jsonl and mix two runs in one report, so it is refused with what to do instead: resume it
(``checkpoint.resume_from=latest``), choose another ``logging.output_dir``, or set
``logging.overwrite=true``, which moves the old files aside into ``overwritten-<timestamp>/`` (never
deletes them). Files others keep there (a sweep's config.yaml, status.json, log.txt) do not count.

    moved_to = guard_output_dir(cfg.logging.output_dir, overwrite=cfg.logging.overwrite)
"""

from __future__ import annotations

import datetime as _dt
import os
from pathlib import Path

from ft_framework.errors import UserError
from ft_framework.run.files import (CHECKPOINT_PREFIX, CHECKPOINTS_DIR, COMPLETE_MARKER, LATEST_FILE,
                                    METRICS_FILE, MOVED_ASIDE_PREFIX, RESULTS_FILE, TENSORBOARD_DIR)
from ft_framework.user_files import make_writable_directory

__all__ = ["OutputDirInUse", "OutputDirUnusable", "check_output_dir_usable", "guard_output_dir", "previous_run_files"]

# Everything a run writes into its output directory; moved aside together on overwrite.
_RUN_ENTRIES = (RESULTS_FILE, METRICS_FILE, TENSORBOARD_DIR, CHECKPOINTS_DIR)


class OutputDirInUse(UserError):
    """A fresh run was pointed at a directory holding a previous run's files."""


class OutputDirUnusable(UserError):
    """logging.output_dir is a file, or cannot be created or written to."""


def check_output_dir_usable(directory: str | Path) -> None:
    """Creates `directory` (with its parents) and checks that this process can write into it; a
    file in its place or a permission refused is one line naming the path (user_files.py's rule)."""
    try:
        make_writable_directory(directory, key="logging.output_dir")
    except UserError as exc:
        raise OutputDirUnusable(str(exc)) from exc.__cause__


def _non_empty(path: Path) -> bool:
    if path.is_dir():
        return any(path.iterdir())
    return path.is_file() and path.stat().st_size > 0


def previous_run_files(directory: str | Path) -> list[str]:
    """Names of the entries of `directory` that show a previous run: its results, logs, TensorBoard
    events, or a complete checkpoint (partial saves and a lone best/ model do not count)."""
    root = Path(directory)
    found = [name for name in (RESULTS_FILE, METRICS_FILE, TENSORBOARD_DIR) if _non_empty(root / name)]
    checkpoints = root / CHECKPOINTS_DIR
    if (checkpoints / LATEST_FILE).is_file() or any(
            (p / COMPLETE_MARKER).is_file() for p in checkpoints.glob(f"{CHECKPOINT_PREFIX}*")):
        found.append(CHECKPOINTS_DIR + "/")
    return found


def guard_output_dir(directory: str | Path, *, overwrite: bool) -> Path | None:
    """Checks that a fresh run may write into `directory`. With `overwrite`, moves a previous run's
    files into ``directory/overwritten-<timestamp>/`` and returns that path; without it, raises
    :class:`OutputDirInUse`. Returns None when the directory holds no previous run."""
    root = Path(directory)
    found = previous_run_files(root)
    if not found:
        return None
    if not overwrite:
        raise OutputDirInUse(
            f"logging.output_dir {str(root)!r} holds a previous run ({', '.join(found)}); resume it with "
            "checkpoint.resume_from=latest, choose another logging.output_dir, or set logging.overwrite=true "
            f"to move its files aside into {root}/{MOVED_ASIDE_PREFIX}<timestamp>/")
    stamp = _dt.datetime.now().strftime("%Y%m%d-%H%M%S")
    aside = root / f"{MOVED_ASIDE_PREFIX}{stamp}"
    n = 1
    while aside.exists():
        n += 1
        aside = root / f"{MOVED_ASIDE_PREFIX}{stamp}-{n}"
    aside.mkdir(parents=True)
    for name in _RUN_ENTRIES:
        if (root / name).exists():
            os.replace(root / name, aside / name)
    return aside
