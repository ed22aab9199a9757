"""Atomic checkpoint directories with a `latest` pointer.

A checkpoint is written into a hidden `.step_N.partial` directory, completed with a COMPLETE
marker, renamed into place, and only then named in `latest`. A crash at any point of a save
therefore leaves the previous checkpoint intact and still marked as the latest.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path
from typing import Any, Callable

import torch

from ft_framework.errors import UserError
from ft_framework.run.files import (BEST_DIR, BEST_MODEL_FILE, CHECKPOINT_PREFIX, COMPLETE_MARKER, LATEST_FILE,
                        TRAINER_STATE_FILE, checkpoint_name)


def _write_atomic(path: Path, text: str) -> None:
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(text)
    os.replace(tmp, path)


class CheckpointError(UserError, RuntimeError):
    """A checkpoint cannot be found or is incomplete; the message says what to do (a user error:
    one line, exit code 2; still a RuntimeError for callers that catch one)."""


class CheckpointManager:
    def __init__(self, root: Path, keep_last: int = 1, is_main_process: bool = True,
                 barrier: Callable[[], None] = lambda: None):
        self.root = Path(root)
        self.keep_last = keep_last
        self.is_main = is_main_process
        self.barrier = barrier

    @staticmethod
    def name_for(step: int) -> str:
        return checkpoint_name(step)

    def save(self, step: int, strategy, trainer_state: dict[str, Any]) -> Path:
        """Saves strategy state (every rank writes its part) and the trainer's state, atomically."""
        name = self.name_for(step)
        partial, final = self.root / f".{name}.partial", self.root / name
        if self.is_main:
            self.root.mkdir(parents=True, exist_ok=True)
            shutil.rmtree(partial, ignore_errors=True)
            partial.mkdir()
        self.barrier()
        strategy.save_checkpoint(partial)
        self.barrier()
        if self.is_main:
            torch.save(trainer_state, partial / TRAINER_STATE_FILE)
            (partial / COMPLETE_MARKER).write_text(json.dumps({"step": step}))
            if final.exists():
                shutil.rmtree(final)
            os.replace(partial, final)
            _write_atomic(self.root / LATEST_FILE, name)
            self._prune(keep=name)
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
        pointer = self.root / LATEST_FILE
        if not pointer.is_file():
            return None
        return self.root / pointer.read_text().strip()

    def latest_complete(self) -> Path | None:
        """checkpoint.resume_from 'auto': the newest complete checkpoint (the `latest` pointer's,
        else the highest step with its COMPLETE marker), or None when there is none yet."""
        pointed = self.latest()
        steps = sorted(self.root.glob(f"{CHECKPOINT_PREFIX}*"), reverse=True) if self.root.is_dir() else []
        for directory in ([pointed] if pointed is not None else []) + steps:
            if (directory / COMPLETE_MARKER).is_file() and (directory / TRAINER_STATE_FILE).is_file():
                return directory
        return None

    def resolve(self, where: str) -> Path:
        """The checkpoint directory for checkpoint.resume_from ('latest' or a path), verified."""
        if where == "latest":
            directory = self.latest()
            if directory is None:
                raise CheckpointError(f"checkpoint.resume_from is 'latest' but {self.root} holds no checkpoint; "
                                      "start without resume_from, or point it at a checkpoint directory")
        else:
            directory = Path(where)
        if not directory.is_dir():
            raise CheckpointError(f"checkpoint.resume_from: {directory} is not a complete checkpoint: it does not "
                                  "exist; use 'latest' (the newest checkpoint in logging.output_dir) or a checkpoint "
                                  "directory")
        if not (directory / COMPLETE_MARKER).is_file():
            raise CheckpointError(f"{directory} is not a complete checkpoint (no {COMPLETE_MARKER} marker: "
                                  "the save was interrupted, or this is not a checkpoint directory)")
        if not (directory / TRAINER_STATE_FILE).is_file():
            raise CheckpointError(f"checkpoint {directory} lacks {TRAINER_STATE_FILE}")
        return directory

    def save_best(self, strategy) -> None:
        """Keeps the model weights of the best evaluation so far in <output_dir>/best/model.pt
        (the checkpoints' root is <output_dir>/checkpoints)."""
        model = strategy.consolidated_model()
        if self.is_main:
            best = self.root.parent / BEST_DIR
            best.mkdir(parents=True, exist_ok=True)
            tmp = best / (BEST_MODEL_FILE + ".tmp")
            torch.save(model.state_dict(), tmp)
            os.replace(tmp, best / BEST_MODEL_FILE)
