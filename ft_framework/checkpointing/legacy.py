"""Checkpoints in the formats before the sharded layout, and their one-time converter.

Before it, each engine had its own format:

- DeepSpeed: DeepSpeed's native checkpoint (``deepspeed/``) plus ``consolidated_optimizer.pt``
  (every parameter's fp32 master, moments and anchor, gathered on rank 0) and ``deepspeed_meta.json``;
- FSDP: torch.distributed.checkpoint files of ``get_state_dict`` plus ``fsdp_checkpoint.json``;
- single / DDP: ``model.pt`` and ``optimizer.pt``.

Loading one of them fails with an error naming the converter:

    python -m ft_framework.checkpointing.legacy OLD_CHECKPOINT_DIR NEW_CHECKPOINT_DIR

which runs in one process, without a training world, and writes the sharded layout (trainer state
and COMPLETE marker copied), so the run resumes from NEW_CHECKPOINT_DIR under any strategy. It
holds the old checkpoint's full state in memory once (the old formats were written that way).
"""

from __future__ import annotations

import argparse
import pickle
import sys
from pathlib import Path

import torch

from ft_framework.run.files import COMPLETE_MARKER, TRAINER_STATE_FILE
from ft_framework.user_files import open_binary, read_bytes, refused_entries
from ft_framework.checkpointing.dcp_read import read_whole_checkpoint
from ft_framework.checkpointing.fragments import MASTER, STEP, Fragment, ParamInfo
from ft_framework.checkpointing.layout import save_sharded
from ft_framework.checkpointing.manifest import CheckpointFormatError
from ft_framework.checkpointing.old_formats import (CONVERTER, DEEPSPEED_CONSOLIDATED, SINGLE_MODEL, SINGLE_OPTIMIZER,
                                                    legacy_kind)

# Copied along: the trainer's state and the completeness marker.
CARRIED_FILES = (TRAINER_STATE_FILE, COMPLETE_MARKER)


# ---- reading the old formats (full state, one process) -------------------------------------------
def _load(directory: Path, name: str):
    """A torch file of the old checkpoint, read as data (weights_only) from a regular file inside it
    (user_files.py: never a link leading out, never a named pipe)."""
    with open_binary(directory / name, root=directory, entry="the old checkpoint's file") as f:
        return torch.load(f, map_location="cpu", weights_only=True)


def _read_deepspeed(directory: Path) -> tuple[dict, dict]:
    saved = _load(directory, DEEPSPEED_CONSOLIDATED)
    if saved.get("format") != "ft_framework.consolidated_optimizer/1":
        raise ValueError(f"{directory / DEEPSPEED_CONSOLIDATED} is not an ft_framework consolidated optimizer file")
    step = torch.tensor(float(saved["step"]))
    params = {}
    for name, entry in saved["params"].items():
        fields = {("master" if k == "fp32" else k): v for k, v in entry.items()}
        if "exp_avg" in fields:
            fields[STEP] = step.clone()
        params[name] = fields
    return params, {}


def _read_fsdp(directory: Path) -> tuple[dict, dict]:
    state = read_whole_checkpoint(directory)  # .metadata and non-tensor entries read as data
    model, optim = state["model"], state.get("optimizer", {}).get("state", {})
    # Entries with optimizer state are the (trained) parameters; the rest of the model state are
    # buffers (a frozen parameter would land there too: the old format does not tell them apart).
    params = {name: {MASTER: value} for name, value in model.items() if name in optim}
    buffers = {name: value for name, value in model.items() if name not in optim}
    for name, entry in optim.items():
        params[name].update({k: v for k, v in entry.items() if isinstance(v, torch.Tensor)})
    return params, buffers


def _read_single(directory: Path) -> tuple[dict, dict]:
    model = _load(directory, SINGLE_MODEL)
    try:  # data only: a pickle of anything but tensors, containers and numbers is refused, never run
        optim = _load(directory, SINGLE_OPTIMIZER)["optimizer"]
    except pickle.UnpicklingError as exc:
        raise ValueError(f"{directory / SINGLE_OPTIMIZER} holds objects besides tensors and plain data, which are "
                         "never unpickled (they could run code)") from exc
    by_index = {}
    for group in optim["param_groups"]:
        names = group.get("param_names")
        if names is None:
            raise ValueError(f"{directory / SINGLE_OPTIMIZER} has param groups without param_names: the "
                             "optimizer state cannot be matched to parameter names")
        by_index.update(dict(zip(group["params"], names)))
    params = {name: {MASTER: value} for name, value in model.items() if name in set(by_index.values())}
    buffers = {name: value for name, value in model.items() if name not in params}
    for index, entry in optim["state"].items():
        params[by_index[index]].update({k: v for k, v in entry.items() if isinstance(v, torch.Tensor)})
    return params, buffers


class _WholeState:
    """A one-process 'strategy' whose fragments are whole tensors: what the converter saves."""

    name = "converted"
    rank = 0
    world_size = 1

    def __init__(self, values: dict[str, dict[str, torch.Tensor]], kind: str):
        self.values = values
        self.kind = kind

    def model(self) -> None:
        return None  # the converter passes the buffers it read; the model files are copied

    def params(self) -> list[ParamInfo]:
        return [ParamInfo(n, tuple(f[MASTER].shape), f[MASTER].dtype) for n, f in self.values.items()]

    def fragments(self) -> list[Fragment]:
        out = []
        for name, fields in self.values.items():
            for field, value in fields.items():
                t = value.detach().contiguous()
                out.append(Fragment(name, field, t if t.dim() == 0 else t.view(-1), 0, True))
        return out

    def anchored_names(self) -> set[str]:
        return {n for n, f in self.values.items() if "anchor" in f}

    def prepare_load(self) -> None:
        raise TypeError("the converter's state is written, never loaded into")

    def after_load(self) -> None:
        raise TypeError("the converter's state is written, never loaded into")

    def extra_state(self) -> None:
        return None

    def load_extra_state(self, state) -> None:
        raise TypeError("the converter's state is written, never loaded into")

    def info(self) -> dict[str, str]:
        return {"converted_from": self.kind}


def convert(old: Path, new: Path) -> Path:
    """Writes the old-format checkpoint `old` in the sharded layout into `new` (one process)."""
    old, new = Path(old), Path(new)
    refused = refused_entries(old) if old.is_dir() else []  # before anything in it is opened
    if refused:
        raise CheckpointFormatError(f"checkpoint {old}: {refused[0]}")
    kind = legacy_kind(old)
    if kind is None:
        raise ValueError(f"{old} is not a checkpoint in an old ft_framework format")
    params, buffers = {"deepspeed": _read_deepspeed, "fsdp": _read_fsdp, "single": _read_single}[kind](old)
    if new.exists() and any(new.iterdir()):
        raise FileExistsError(f"{new} exists and is not empty")
    new.mkdir(parents=True, exist_ok=True)
    save_sharded(new, _WholeState(params, kind), buffers=list(buffers.items()))
    for name in CARRIED_FILES:  # read as a regular file inside `old`, written as a new file
        if (old / name).is_file():
            (new / name).write_bytes(read_bytes(old / name, root=old, limit=None, entry="the old checkpoint's file"))
    return new


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog=CONVERTER, description="Convert a checkpoint of an old ft_framework "
                                     "format (DeepSpeed native + consolidated, FSDP, single/DDP) to the sharded "
                                     "layout that resumes under any strategy and world size.")
    parser.add_argument("old", type=Path)
    parser.add_argument("new", type=Path)
    args = parser.parse_args(argv)
    try:
        convert(args.old, args.new)
    except (ValueError, FileExistsError, FileNotFoundError) as exc:
        print(f"{parser.prog}: {exc}", file=sys.stderr)
        return 2
    print(f"wrote {args.new}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
