"""Atomic checkpoint directories with a `latest` pointer.

A checkpoint is written into a hidden `.step_N.partial` directory, completed with a COMPLETE
marker, renamed into place, and only then named in `latest`. A crash at any point of a save
therefore leaves the previous checkpoint intact and still marked as the latest.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import shutil
from pathlib import Path
from typing import Any, Callable

import torch

from ft_framework.checkpointing.dcp_read import DCP_METADATA, read_metadata
from ft_framework.checkpointing.manifest import (MANIFEST_FILE, CheckpointFormatError, check_files, file_records,
                                                 record_files)
from ft_framework.errors import UserError, quoted
from ft_framework.path_containment import NameOutsideError, resolve_inside
from ft_framework.user_files import read_text, refused_entries
from ft_framework.run.files import (BEST_CHECKPOINT, CHECKPOINT_PREFIX, CHECKPOINTS_DIR, COMPLETE_MARKER,
                                    LATEST_FILE, TRAINER_STATE_FILE, checkpoint_name)

logger = logging.getLogger(__name__)


# The most bytes of a `latest` pointer: it holds one directory name.
LATEST_LIMIT = 4096


def _write_atomic(path: Path, text: str) -> None:
    tmp = path.with_name(path.name + ".tmp")
    try:
        tmp.write_text(text)
    except OSError:
        tmp.unlink(missing_ok=True)
        raise
    os.replace(tmp, path)


class CheckpointError(UserError, RuntimeError):
    """A checkpoint cannot be found or is incomplete; the message says what to do (a user error:
    one line, exit code 2; still a RuntimeError for callers that catch one)."""


def resolve_latest(path: str | Path) -> Path:
    """The checkpoint directory a user means by `path`: a checkpoint directory itself, the `latest`
    pointer file, a run's checkpoints/ directory, or a run's output directory (the latter three
    through the pointer). The one place the pointer is read; the name it holds must stay inside its
    directory (path_containment.py). Raises CheckpointError naming what is accepted when `path` is
    none of these, or the pointer's name when it leads out."""
    path = Path(path)
    if path.is_file() and path.name == LATEST_FILE:
        pointer = path
    elif (path / LATEST_FILE).is_file():
        pointer = path / LATEST_FILE
    elif (path / CHECKPOINTS_DIR / LATEST_FILE).is_file():
        pointer = path / CHECKPOINTS_DIR / LATEST_FILE
    elif path.is_dir():
        return path  # a checkpoint directory (its readers check its files)
    else:
        raise CheckpointError(
            f"{path} {'does not exist' if not path.exists() else 'is not a checkpoint'}: pass a run's output "
            f"directory, its {CHECKPOINTS_DIR}/ directory, the {CHECKPOINTS_DIR}/{LATEST_FILE} pointer file, or a "
            f"checkpoint directory ({CHECKPOINTS_DIR}/{CHECKPOINT_PREFIX}N)")
    try:  # a regular file inside its directory, and short: it holds one name
        name = read_text(pointer, root=pointer.parent, limit=LATEST_LIMIT, entry=f"the {LATEST_FILE} pointer").strip()
    except UserError as exc:
        raise CheckpointError(f"{exc}; pass a checkpoint directory ({pointer.parent}/{CHECKPOINT_PREFIX}N) "
                              "instead") from exc
    if not name:
        raise CheckpointError(f"{pointer} is empty; pass a checkpoint directory ({pointer.parent}/{CHECKPOINT_PREFIX}N) "
                              "instead")
    try:
        directory = resolve_inside(pointer.parent, name, entry=f"the {LATEST_FILE} pointer's checkpoint")
    except NameOutsideError as exc:
        raise CheckpointError(f"{exc}; pass a checkpoint directory ({pointer.parent}/{CHECKPOINT_PREFIX}N) "
                              "instead") from exc
    if not directory.is_dir():
        raise CheckpointError(f"{pointer} names {quoted(name)}, which is not a directory beside it; pass a checkpoint "
                              f"directory ({pointer.parent}/{CHECKPOINT_PREFIX}N) instead")
    return directory


# A write that failed without an errno (torch's zip writer raises a RuntimeError for a full disk) is
# a full disk when its file system has less than this left: a write that runs out of space fills it.
FULL_DISK_BYTES = 16 << 20


def _metadata_problems(directory: Path) -> list[str]:
    """What reading the checkpoint's DCP index as data refuses (empty: it reads), a missing one or
    one that is no regular file included. A directory of the sharded layout only: an old format's
    reader says what it is."""
    if not (directory / MANIFEST_FILE).is_file():
        return []
    try:
        read_metadata(directory / DCP_METADATA)
    except CheckpointFormatError as exc:
        return [str(exc)]
    return []


def _os_error(exc: BaseException) -> OSError | None:
    """The OSError behind a failed save, wherever it is in the chain: `exc` itself, what it was
    raised from or while handling (torch's writer raises a RuntimeError while handling the
    stream's OSError), or a rank's failure inside DCP's CheckpointException."""
    pending, seen = [exc], set()
    while pending and len(seen) < 32:
        exc = pending.pop(0)
        if exc is None or id(exc) in seen:
            continue
        seen.add(id(exc))
        if isinstance(exc, OSError):
            return exc
        for failure in (getattr(exc, "failures", None) or {}).values():
            pending.append(failure[0] if isinstance(failure, tuple) else failure)
        pending += [exc.__cause__, exc.__context__]
    return None


def _free_bytes(path: Path) -> int | None:
    """Bytes free to this user on the file system holding `path` (or its nearest existing parent)."""
    for candidate in [path, *path.parents]:
        if candidate.exists():
            try:
                return shutil.disk_usage(candidate).free
            except OSError:
                return None
    return None


def _size(n: int) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{n} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return ""


def _save_failure(exc: BaseException, root: Path) -> str | None:
    """Why a save into `root` failed when the file system is the cause (an OSError anywhere in the
    chain, or no errno and a full file system), with the space left; None for anything else."""
    free = _free_bytes(root)
    left = f"{_size(free)} free on the file system of {root}" if free is not None else f"free space of {root} unknown"
    os_error = _os_error(exc)
    if os_error is not None:
        where = f": {os_error.filename}" if os_error.filename else ""
        return f"{os_error.strerror or os_error}{where}; {left}"
    if free is not None and free < FULL_DISK_BYTES:
        return f"the file system is full: {left}"
    return None


class CheckpointManager:
    def __init__(self, root: Path, keep_last: int = 1, is_main_process: bool = True,
                 barrier: Callable[[], None] = lambda: None, tokenizer: Any = None):
        self.root = Path(root)
        # Saved with the model's config in every checkpoint, so that it exports offline (ft-export).
        self.tokenizer = tokenizer
        self.keep_last = keep_last
        self.is_main = is_main_process
        self.barrier = barrier

    @staticmethod
    def name_for(step: int) -> str:
        return checkpoint_name(step)

    def save(self, step: int, strategy, trainer_state: dict[str, Any]) -> Path:
        """Saves strategy state (every rank writes its part) and the trainer's state, atomically,
        then names it in `latest` and prunes the older ones."""
        name = self.name_for(step)
        final = self._write(name, step, strategy, trainer_state)
        if self.is_main:
            with self._failures(name, partial=None):
                _write_atomic(self.root / LATEST_FILE, name)
            self._prune(keep=name)
        self.barrier()
        return final

    def save_best(self, step: int, strategy, trainer_state: dict[str, Any]) -> Path:
        """Keeps the best evaluation's checkpoint in checkpoints/best, in the same sharded layout
        (every rank writes its fragments; no rank gathers the model), replacing the previous best."""
        return self._write(BEST_CHECKPOINT, step, strategy, trainer_state)

    @contextlib.contextmanager
    def _failures(self, name: str, partial: Path | None):
        """A save that the file system fails (a full disk, a quota, a lost mount), whichever layer
        raised it, becomes one line naming the directory and its free space; `partial` is removed
        and the previous checkpoint, still named in `latest`, stays. Any other error is raised as is."""
        try:
            yield
        except (OSError, RuntimeError) as raised:
            why = _save_failure(raised, self.root)
            if why is None:
                raise
            if self.is_main and partial is not None:
                shutil.rmtree(partial, ignore_errors=True)
            previous = self.latest()
            raise CheckpointError(
                f"saving checkpoint {name} into {self.root} failed ({why}); "
                + (f"the previous checkpoint {previous} is intact" if previous else "no earlier checkpoint exists")
                + ". Free space or choose another logging.output_dir, then resume (checkpoint.resume_from=auto)"
            ) from raised

    def _write(self, name: str, step: int, strategy, trainer_state: dict[str, Any]) -> Path:
        """Writes checkpoint `name` through a hidden partial directory and renames it into place."""
        partial, final = self.root / f".{name}.partial", self.root / name
        with self._failures(name, partial):
            if self.is_main:
                self.root.mkdir(parents=True, exist_ok=True)
                shutil.rmtree(partial, ignore_errors=True)
                partial.mkdir()
            self.barrier()
            strategy.save_checkpoint(partial, tokenizer=self.tokenizer)
            self.barrier()
            if self.is_main:
                torch.save(trainer_state, partial / TRAINER_STATE_FILE)
            self.barrier()
            # Each rank checksums its share of the files; rank 0 records them all in the manifest.
            sharded = (partial / MANIFEST_FILE).is_file()
            records = file_records(partial, strategy.rank, strategy.world_size) if sharded else {}
            gathered = strategy.gather_objects(records) if strategy.world_size > 1 else [records]
            if self.is_main and sharded:
                record_files(partial, {k: v for part in gathered for k, v in part.items()})
            if self.is_main:
                (partial / COMPLETE_MARKER).write_text(json.dumps({"step": step}))
                if final.exists():
                    shutil.rmtree(final)
                os.replace(partial, final)
        self.barrier()
        return final

    def _prune(self, keep: str) -> None:
        """Deletes the complete checkpoints before the newest `keep_last`, and older directories an
        interrupted prune left. The COMPLETE marker goes first, so a kill in the middle leaves an
        incomplete directory (never resumed from, deleted by the next prune), never a marker that
        outlives its checkpoint's files."""
        steps = sorted(p for p in self.root.glob(f"{CHECKPOINT_PREFIX}*") if p.is_dir())
        done = [p for p in steps if (p / COMPLETE_MARKER).is_file()]
        kept = {p.name for p in done[-self.keep_last:]} | {keep}
        for old in steps:
            if old.name in kept or old.name > keep:
                continue
            (old / COMPLETE_MARKER).unlink(missing_ok=True)
            shutil.rmtree(old, ignore_errors=True)

    def latest(self) -> Path | None:
        """The checkpoint the `latest` pointer names (None before the first save)."""
        if not (self.root / LATEST_FILE).is_file():
            return None
        try:
            return resolve_latest(self.root / LATEST_FILE)
        except CheckpointError:  # a pointer to a pruned or renamed directory
            return None

    def _leads_out(self, directory: Path) -> list[str]:
        """Why checkpoint `directory` (an entry of the root) must not be opened: the entry itself,
        or a symlink in it, leads out of it (path_containment.py); empty when nothing does."""
        try:
            resolve_inside(self.root, directory.name, entry="the checkpoint directory")
        except NameOutsideError as exc:
            return [str(exc)]
        return refused_entries(directory) if directory.is_dir() else []

    def latest_complete(self) -> Path | None:
        """checkpoint.resume_from 'auto': the newest complete checkpoint (the `latest` pointer's,
        else the highest step with its COMPLETE marker), or None when there is none yet. A pointer or
        a checkpoint that cannot be used is passed over with a warning saying why."""
        pointed = None
        if (self.root / LATEST_FILE).is_file():
            try:
                pointed = resolve_latest(self.root / LATEST_FILE)
            except CheckpointError as exc:  # pruned, renamed, or naming a place outside
                logger.warning("checkpoint.resume_from=auto: not following %s: %s; looking for the newest complete "
                               "checkpoint instead", self.root / LATEST_FILE, exc)
        steps = sorted(self.root.glob(f"{CHECKPOINT_PREFIX}*"), reverse=True) if self.root.is_dir() else []
        for directory in dict.fromkeys(([pointed] if pointed is not None else []) + steps):
            leads_out = self._leads_out(directory)  # before anything in it is looked at
            if leads_out:
                logger.warning("checkpoint.resume_from=auto: skipping %s: %s", directory, "; ".join(leads_out))
                continue
            if (directory / COMPLETE_MARKER).is_file() and (directory / TRAINER_STATE_FILE).is_file():
                # The sizes the manifest records (cheap, and what a crash or a full disk breaks), and DCP's
                # index read as data (a planted one is refused before anything loads it).
                damaged = check_files(directory) or _metadata_problems(directory)
                if damaged:
                    logger.warning("checkpoint.resume_from=auto: skipping %s: %s", directory, "; ".join(damaged))
                    continue
                return directory
        return None

    def resolve(self, where: str) -> Path:
        """The checkpoint directory for checkpoint.resume_from ('latest' or a path), verified."""
        if where == "latest":
            if not (self.root / LATEST_FILE).is_file():
                raise CheckpointError(f"checkpoint.resume_from is 'latest' but {self.root} holds no checkpoint; "
                                      "start without resume_from, or point it at a checkpoint directory")
            directory = resolve_latest(self.root / LATEST_FILE)
        else:
            directory = Path(where)
        if not directory.is_dir():
            raise CheckpointError(f"checkpoint.resume_from: {directory} is not a complete checkpoint: it does not "
                                  "exist; use 'latest' (the newest checkpoint in logging.output_dir) or a checkpoint "
                                  "directory")
        leads_out = refused_entries(directory)  # before anything in it is looked at
        if leads_out:
            raise CheckpointError(f"checkpoint {directory}: {leads_out[0]}; resume from another checkpoint "
                                  "(checkpoint.resume_from=<its directory>, or auto)")
        if not (directory / COMPLETE_MARKER).is_file():
            raise CheckpointError(f"{directory} is not a complete checkpoint (no {COMPLETE_MARKER} marker: "
                                  "the save was interrupted, or this is not a checkpoint directory)")
        if not (directory / TRAINER_STATE_FILE).is_file():
            raise CheckpointError(f"checkpoint {directory} lacks {TRAINER_STATE_FILE}")
        damaged = check_files(directory)
        if damaged:
            raise CheckpointError(f"checkpoint {directory} is damaged: {'; '.join(damaged)}; resume from an earlier "
                                  "checkpoint (checkpoint.resume_from=<its directory>, or auto)")
        refused = _metadata_problems(directory)
        if refused:
            raise CheckpointError(f"{refused[0]} (checkpoint.resume_from=<its directory>, or auto)")
        return directory
