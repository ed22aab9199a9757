"""What a run decides before it loads anything, and the random state it carries across a resume.

- `check_start`: a resume must name a readable checkpoint trained with this config (fingerprint.py);
  `checkpoint.resume_from: auto` picks the latest complete checkpoint or starts fresh; a fresh run
  must not mix its files with a previous run's (output_dir.py). Every rank reaches the same verdict.
- `check_resume_data`: once the data is read, a resume must read the data its checkpoint trained on
  (the content ids of its files, fingerprint.py: check_data_content).
- `capture_rng` / `restore_rng`: each rank's CPU and CUDA generator states, so a resumed run draws
  the same dropout masks and data order as an uninterrupted one, on every rank.
"""

from __future__ import annotations

import logging
import pickle
import random
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch

from ft_framework.checkpointing.manager import CheckpointError, CheckpointManager
from ft_framework.errors import UserError
from ft_framework.run.failures import same_on_every_rank
from ft_framework.config.schema import schema_default
from ft_framework.run.fingerprint import check_allow_list, check_data_content, check_resume, config_record
from ft_framework.run.output_dir import OutputDirInUse, guard_output_dir
from ft_framework.run.files import TRAINER_STATE_FILE, RunPaths

logger = logging.getLogger(__name__)


@dataclass
class ResumePoint:
    """The checkpoint a run continues from, its saved trainer state, and the config changes accepted."""

    directory: Path
    saved: dict[str, Any]
    config_changes: list[dict[str, Any]] = field(default_factory=list)


def check_start(cfg, strategy, paths: RunPaths) -> ResumePoint | None:
    """A resume: the checkpoint after checking that it exists, can be read, and was trained with this
    config. A fresh run (None): after the output-directory guard."""
    where = cfg.checkpoint.resume_from
    if where == "auto":
        where = auto_resume_point(strategy, paths)
        if where is None:
            # What a restarted job wants: a fresh start, the earlier attempt's files moved aside.
            guard_output_dir_on_every_rank(strategy, paths.root, overwrite=True)
            return None
    if not where:
        guard_output_dir_on_every_rank(strategy, paths.root, overwrite=cfg.logging.overwrite)
        return None
    try:
        directory = CheckpointManager(paths.checkpoints).resolve(where)
    except CheckpointError as exc:  # no checkpoint there, or an incomplete one
        raise same_on_every_rank(UserError(str(exc))) from exc
    try:
        saved = load_trainer_state(directory / TRAINER_STATE_FILE)
        step = int(saved["train_state"]["step"])
    except CheckpointError as exc:  # a pickle that is not data: never unpickled
        raise same_on_every_rank(exc) from exc
    except Exception as exc:  # truncated, corrupted, or not ours
        raise same_on_every_rank(UserError(
            f"checkpoint {directory} cannot be read ({TRAINER_STATE_FILE}: {exc}); resume from an earlier "
            "checkpoint (checkpoint.resume_from=<its directory>) or start fresh")) from exc
    record = saved.get("config_record")
    if record is None:
        logger.warning("checkpoint %s records no config (written before config fingerprints): its config "
                       "cannot be compared with this one", directory)
        return ResumePoint(directory, saved)
    allowed = list(cfg.checkpoint.allow_config_change or [])
    check_allow_list(allowed, cfg.to_dict())
    try:
        changes = check_resume(record, config_record(cfg.to_dict(), strategy.world_size), step=step,
                               allowed_by_user=allowed, where=str(directory), default_of=schema_default)
    except UserError as exc:
        raise same_on_every_rank(exc)
    return ResumePoint(directory, saved, changes)


def check_resume_data(cfg, point: ResumePoint | None, content: dict[str, str]) -> dict[str, str]:
    """The content ids the run records ({config key: content id}, the task kind's `data_content` of
    the data it read): a fresh run's as read; a resume's after checking them against its checkpoint's
    (a refusal is one line on every rank), the changes that pass added to the point's config changes."""
    if point is None:
        return dict(content)
    try:
        recorded, changes = check_data_content(point.saved.get("config_record"), content, cfg.to_dict(),
                                               step=int(point.saved["train_state"]["step"]),
                                               allowed_by_user=cfg.checkpoint.allow_config_change or [],
                                               where=str(point.directory))
    except UserError as exc:
        raise same_on_every_rank(exc) from None
    point.config_changes.extend(changes)
    return recorded


def auto_resume_point(strategy, paths: RunPaths) -> str | None:
    """checkpoint.resume_from 'auto': the latest complete checkpoint, or None (a fresh start).
    Every rank must see the same one: the output directory is on a file system all nodes share."""
    found = CheckpointManager(paths.checkpoints).latest_complete()
    seen = strategy.gather_objects(None if found is None else found.name)
    if len(set(seen)) > 1:
        listed = ", ".join(f"rank {r}: {name or 'none'}" for r, name in enumerate(seen))
        raise UserError(f"checkpoint.resume_from=auto: the ranks see different checkpoints in "
                        f"{paths.checkpoints} ({listed}); logging.output_dir must be on a file system "
                        "every node shares")
    if found is None:
        logger.info("checkpoint.resume_from=auto: no complete checkpoint in %s, starting fresh", paths.checkpoints)
        return None
    logger.info("checkpoint.resume_from=auto: resuming from %s", found)
    return str(found)


def guard_output_dir_on_every_rank(strategy, output_dir: Path, *, overwrite: bool) -> None:
    """Rank 0 checks (and with overwrite moves aside) a previous run's files; every rank gets its verdict."""
    refused = None
    if strategy.is_main_process:
        try:
            moved = guard_output_dir(output_dir, overwrite=overwrite)
        except OutputDirInUse as exc:
            refused = str(exc)
        else:
            if moved is not None:
                logger.warning("logging.overwrite: moved the previous run's files into %s", moved)
    refused = strategy.gather_objects(refused)[0]  # rank 0's verdict
    if refused is not None:
        raise same_on_every_rank(OutputDirInUse(refused))


def capture_rng(strategy) -> dict[str, Any]:
    """This process's generator states, and every rank's (collective), for the checkpoint rank 0 writes."""
    rng = {"torch": torch.get_rng_state(), "numpy": _numpy_state(), "python": random.getstate(),
           # Each rank's own device: get_rng_state_all on rank 0 would hand every rank rank 0's view,
           # where the other ranks' devices never advanced.
           "cuda": (strategy.gather_objects(torch.cuda.get_rng_state(strategy.device))
                    if strategy.device.type == "cuda" else None)}
    if strategy.world_size > 1:
        # The ranks' CPU streams differ too: rank 0's alone would give every rank rank 0's dropout
        # masks after a resume.
        rng["per_rank"] = strategy.gather_objects({"torch": rng["torch"], "numpy": rng["numpy"],
                                                   "python": rng["python"]})
    return rng


def restore_rng(rng: dict[str, Any], strategy) -> None:
    """Sets this rank's generators from a checkpoint's `capture_rng` record."""
    host = rng
    per_rank = rng.get("per_rank")
    if per_rank and len(per_rank) == strategy.world_size:
        # Each rank continues its own stream; on another number of ranks every rank takes rank 0's.
        host = per_rank[strategy.rank]
    torch.set_rng_state(host["torch"])
    cuda_states = rng.get("cuda")
    if strategy.device.type == "cuda" and cuda_states:
        torch.cuda.set_rng_state(cuda_states[strategy.rank % len(cuda_states)], strategy.device)
    numpy_state = host["numpy"]
    if isinstance(numpy_state, dict):  # the form capture_rng writes (tensors and numbers: no pickle)
        numpy_state = (numpy_state["kind"], numpy_state["keys"].numpy().astype(np.uint32), numpy_state["pos"],
                       numpy_state["has_gauss"], numpy_state["cached_gaussian"])
    np.random.set_state(numpy_state)
    python_state = host["python"]
    random.setstate((python_state[0], tuple(python_state[1]), python_state[2]))


def _numpy_state() -> dict[str, Any]:
    """numpy's global generator state as a tensor and numbers, which torch.load reads with
    weights_only=True (an ndarray would need unpickling)."""
    kind, keys, pos, has_gauss, cached = np.random.get_state()
    return {"kind": str(kind), "keys": torch.from_numpy(keys.astype(np.int64)), "pos": int(pos),
            "has_gauss": int(has_gauss), "cached_gaussian": float(cached)}


def load_trainer_state(path: Path) -> dict[str, Any]:
    """A checkpoint's trainer state, read as data: torch.load with weights_only=True admits tensors,
    containers, numbers and strings; anything else (a pickle that would run code, or the numpy
    arrays of trainer states written before the RNG states were stored as tensors) is refused with
    a CheckpointError naming the file."""
    try:
        return torch.load(path, map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as exc:
        found = re.search(r"GLOBAL ([\w.]+)", str(exc))
        raise CheckpointError(
            f"{path} holds {found.group(1) if found else 'objects'} besides tensors and plain data, which are never "
            "unpickled (they could run code): it was not written by this version of ft_framework (a checkpoint "
            "of an earlier version resumes with that version) or it was tampered with") from exc
