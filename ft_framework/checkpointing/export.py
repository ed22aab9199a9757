"""A Hugging Face model (save_pretrained, with the tokenizer) from a sharded checkpoint, in one
process and without a training world: `ft-export CHECKPOINT OUT_DIR` (cli.py parses its arguments).

The checkpoint carries what export needs: the model's class and config (MODEL_SUBDIR/config.json),
the tokenizer files, and (a LoRA model) the adapter config. The model is built on the meta device,
materialized once on the CPU, and its parameters are read from the checkpoint's fp32 masters one
saved chunk at a time (no optimizer state is read). Memory: the model's fp32 weights plus one
parameter. The trainer's `checkpoint.export_dir` (and so every export a sweep makes) goes through
the same function.

An export is never half-written at its path: it is written into a temporary sibling of its own
(`.<name>.export-partial-<random>`) and renamed into place, so a kill at any moment leaves either the
complete export or the previous one at OUT_DIR (an export it replaces is first renamed aside to
`.<name>.export-replaced`, removed once the new one is in place, put back by the next export when a
kill came between the two renames), and two exports into one OUT_DIR never mix (write_atomically).
A later export removes what a killed one left beside OUT_DIR. An existing export is never silently overwritten: each export records
where it came from (EXPORT_RECORD: the checkpoint and the run's output directory), and a directory
that is there already is replaced only by the same run's export (a resumed or re-run run exporting
its final weights again: `replace="same run"`, the trainer's), or when asked (`replace="always"`,
`ft-export --overwrite`); otherwise the export is refused in one line before anything is read.
An empty directory is no export and is replaced.
"""

from __future__ import annotations

import contextlib
import fcntl
import glob
import importlib
import json
import logging
import os
import secrets
import shutil
from pathlib import Path
from typing import Any, Callable, Iterator, Literal

import torch
from torch import nn

from ft_framework.errors import UserError, quoted, shortened
from ft_framework.models.lora import save_model
from ft_framework.checkpointing.dcp_io import _planners, _quiet_dcp
from ft_framework.checkpointing.dcp_read import checkpoint_reader
from ft_framework.checkpointing.fragments import MASTER, buffer_key, fragment_key, param_key
from ft_framework.checkpointing.manifest import MODEL_SUBDIR, CheckpointFormatError, check_files, read_manifest
from ft_framework.run.files import CHECKPOINTS_DIR, EXPORT_SCRATCH_DIR
from ft_framework.user_files import NO_REMOTE_CODE, read_json

logger = logging.getLogger(__name__)

__all__ = ["EXPORT_RECORD", "ExportExistsError", "Replace", "build_model", "check_run_export_dir", "export_pretrained",
           "load_model_weights", "verify_checkpoint", "write_atomically"]

EXPORT_RECORD = "ft_export.json"  # in every export: the checkpoint and the run it was exported from
EXPORT_FORMAT = "ft_framework.export/1"
PARTIAL_SUFFIX = ".export-partial"    # .<name> + this: the export being written, renamed into place when done
REPLACED_SUFFIX = ".export-replaced"  # .<name> + this: the export it replaces, removed once the new one is there
# When a directory exists at the export's path: "never" replace it, replace it when it is an export of
# the "same run" (its EXPORT_RECORD names the same run directory), or "always".
Replace = Literal["never", "same run", "always"]


class ExportExistsError(CheckpointFormatError):
    """The export's path holds something the export may not replace; the message says what to do."""


# A checkpoint names its model's class as data; only these packages' classes are imported from it
# (a manifest could otherwise name any module, and importing a module runs its code). A class given
# on the command line (--model-class) is the user's own choice and may come from anywhere.
MANIFEST_CLASS_PACKAGES = ("transformers", "peft")


def _import(path: str, *, from_manifest: bool, checkpoint_dir: Path) -> Any:
    module, _, name = path.partition(":")
    if from_manifest and module.split(".")[0] not in MANIFEST_CLASS_PACKAGES:
        raise CheckpointFormatError(
            f"checkpoint {checkpoint_dir} names the model class {path!r}, outside "
            f"{', '.join(MANIFEST_CLASS_PACKAGES)}: not imported (importing a module runs its code); if you trust "
            "it, pass --model-class with that class yourself")
    obj = importlib.import_module(module)
    for part in name.split("."):
        obj = getattr(obj, part)
    if not isinstance(obj, type) or not (issubclass(obj, nn.Module) or obj.__name__.startswith("Auto")):
        raise CheckpointFormatError(f"model class {path!r} (checkpoint {checkpoint_dir}) is not a torch module")
    return obj


def _model_config(auto_config: Any, config_path: Path, checkpoint_dir: Path) -> Any:
    """The model's config from `config_path`, read by transformers without running a model's own code
    (NO_REMOTE_CODE); what transformers refuses there is one line."""
    try:
        return auto_config.from_pretrained(config_path, **NO_REMOTE_CODE)
    except (OSError, ValueError) as exc:
        try:
            custom = "auto_map" in read_json(Path(config_path) / "config.json")
        except UserError:
            custom = False
        why = ("names a model's own code (auto_map) for a model type transformers does not ship; ft_framework never "
               "runs it (trust_remote_code=False)") if custom else (
            f"cannot be read by transformers ({shortened(str(exc))})")
        raise CheckpointFormatError(f"checkpoint {checkpoint_dir}: the model config {config_path}/config.json {why}; "
                                    "pass --config-dir with a config of a model transformers ships") from exc


def build_model(checkpoint_dir: Path, manifest: dict[str, Any] | None = None, *,
                config_dir: Path | None = None, model_class: str | None = None) -> nn.Module:
    """The checkpoint's model with uninitialized (empty) CPU weights: its class and config, and the
    LoRA adapters when it had them. `config_dir` / `model_class` stand in for a checkpoint without
    model files (one converted from an old format)."""
    from transformers import AutoConfig

    checkpoint_dir = Path(checkpoint_dir)
    manifest = manifest or read_manifest(checkpoint_dir)
    entry = manifest.get("model") or {}
    config_path = Path(config_dir) if config_dir else (checkpoint_dir / MODEL_SUBDIR if entry.get("config") else None)
    class_path = model_class or entry.get("class")
    if config_path is None or class_path is None:
        raise CheckpointFormatError(
            f"checkpoint {checkpoint_dir} holds no model files (it was converted from an old format, or saved "
            "without a model): resume training from it and export a later checkpoint, or pass --config-dir "
            "(a directory with the model's config.json) and --model-class (e.g. "
            "transformers:AutoModelForSequenceClassification)")
    config = _model_config(AutoConfig, config_path, checkpoint_dir)
    cls = _import(class_path, from_manifest=model_class is None, checkpoint_dir=checkpoint_dir)
    with torch.device("meta"):
        # An Auto class builds through from_config; a model class from its config.
        model = cls.from_config(config) if cls.__name__.startswith("Auto") else cls(config)
        peft_entry = entry.get("peft")
        if peft_entry:
            from peft import get_peft_config, get_peft_model

            model = get_peft_model(model, get_peft_config(dict(peft_entry["config"])),
                                   adapter_name=peft_entry.get("adapter", "default"))
    model = model.to_empty(device="cpu")
    if hasattr(model, "tie_weights"):
        model.tie_weights()
    # Non-persistent buffers (position ids, Mixout targets) are neither saved nor exported: zero them
    # rather than leave uninitialized memory behind.
    for buf in model.buffers():
        buf.zero_()
    return model.eval()


@torch.no_grad()
def load_model_weights(model: nn.Module, checkpoint_dir: Path) -> nn.Module:
    """Reads every parameter's master (and the persistent buffers) into `model`, in place, one
    saved chunk at a time, in one process."""
    import torch.distributed.checkpoint as dcp

    reader = checkpoint_reader(checkpoint_dir)
    available = reader.read_metadata().state_dict_metadata
    state: dict[str, torch.Tensor] = {}
    targets: dict[str, tuple[str, int]] = {}
    for name, p in model.named_parameters():
        key = param_key(name, MASTER)
        if key not in available:
            raise CheckpointFormatError(f"checkpoint {checkpoint_dir} has no {name!r}: it belongs to another model")
        state[fragment_key(key, 0)] = p.detach().view(-1)
        targets[fragment_key(key, 0)] = (key, 0)
    for name, buf in model.state_dict(keep_vars=True).items():
        if buffer_key(name) in available and isinstance(buf, torch.Tensor) and not isinstance(buf, nn.Parameter):
            state[buffer_key(name)] = buf.detach()
    _, load_planner = _planners()
    with _quiet_dcp():
        dcp.load(state, storage_reader=reader, planner=load_planner(targets), no_dist=True)
    return model


def _run_dir_of(checkpoint_dir: Path) -> Path:
    """The output directory of the run a checkpoint belongs to (checkpoints/step_N, checkpoints/best,
    the trainer's export scratch), else the checkpoint directory itself."""
    checkpoint_dir = Path(os.path.realpath(checkpoint_dir))
    if checkpoint_dir.parent.name == CHECKPOINTS_DIR:
        return checkpoint_dir.parent.parent
    if checkpoint_dir.name == EXPORT_SCRATCH_DIR:
        return checkpoint_dir.parent
    return checkpoint_dir


def _check_replaceable(out_dir: Path, run_dir: Path, replace: Replace) -> None:
    """Refuses (one line) when `out_dir` holds something the export may not replace."""
    if not out_dir.exists() and not out_dir.is_symlink():
        return
    if not out_dir.is_dir():
        raise ExportExistsError(f"export directory {out_dir} exists and is not a directory; choose another one")
    if replace == "always" or not any(out_dir.iterdir()):
        return
    try:  # a regular file inside the export, a JSON object (user_files.py)
        record = read_json(out_dir / EXPORT_RECORD, root=out_dir, entry="the export record")
        previous_run = record.get("run") if isinstance(record.get("run"), str) else None
    except UserError:
        previous_run = None
    if replace == "same run" and previous_run == str(run_dir):
        return
    if previous_run is not None and not previous_run.isprintable():
        previous_run = quoted(previous_run)
    what = (f"holds an export of {previous_run}" if previous_run else
            f"holds files that are not an ft_framework export ({EXPORT_RECORD} missing or unreadable)")
    remedy = ("pass --overwrite to replace it, or choose another output directory" if replace == "never" else
              "choose another checkpoint.export_dir or remove it; the final weights stay in the run's checkpoint "
              "(ft-export writes them from it)")
    raise ExportExistsError(f"export directory {out_dir} {what}: it is not overwritten; {remedy}")


def check_run_export_dir(out_dir: Path, run_dir: Path) -> None:
    """A run's checkpoint.export_dir, checked at its start by the rule its export applies at its end
    (replace="same run"): refused in one line when it holds another run's export or other files,
    so that a run does not train for hours to be refused its export."""
    _check_replaceable(Path(out_dir), Path(os.path.realpath(run_dir)), "same run")


@contextlib.contextmanager
def _held(path: Path, *, blocking: bool = True) -> Iterator[bool | None]:
    """An exclusive flock on the directory `path` while the block runs. Yields True when taken, False
    when another process holds it (`blocking` False), None when the file system has no flock on a
    directory (NFS): then nothing is held, and the rule is the old one, one writer at a time."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    except FileNotFoundError:
        yield None
        return
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | (0 if blocking else fcntl.LOCK_NB))
            taken: bool | None = True
        except BlockingIOError:
            taken = False
        except OSError:
            taken = None
        yield taken
    finally:
        os.close(fd)


def _tidy(out_dir: Path, replaced: Path, mine: Path | None = None) -> None:
    """What a killed export left beside `out_dir` (under the lock of its parent): an export renamed
    aside goes back when nothing took its place (a kill between the two renames; the new one is
    then a leftover), else it goes; every partial export whose writer is gone goes (its flock is free)."""
    if replaced.exists() or replaced.is_symlink():
        if out_dir.exists() or out_dir.is_symlink():
            shutil.rmtree(replaced, ignore_errors=True)
        else:
            os.rename(replaced, out_dir)
    for leftover in sorted(out_dir.parent.glob(f".{glob.escape(out_dir.name)}{PARTIAL_SUFFIX}*")):
        if leftover == mine:
            continue
        with _held(leftover, blocking=False) as taken:
            if taken is not False:  # its writer is gone (or the file system cannot tell: as before, removed)
                shutil.rmtree(leftover, ignore_errors=True)


def write_atomically(out_dir: Path, write: Callable[[Path], None], check: Callable[[], None] | None = None) -> Path:
    """Calls `write(directory)` on a temporary sibling of `out_dir` of its own, then renames it into
    place: a kill at any moment leaves at `out_dir` the previous directory or the new one; one killed
    between the two renames of a replacement leaves the previous one aside, and the next call puts it
    back. Never a partial one, and never two writers' files mixed: each writes its own sibling
    (`.<name>.export-partial-<random>`, flock'ed while it is written, so that a later call removes it
    only when its writer is gone), and the renames run under an flock of the parent directory, where
    `check()` runs again (it may refuse: then nothing is renamed), so that it judges what is at
    `out_dir` at the moment it is replaced."""
    out_dir = Path(out_dir)
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    replaced = out_dir.with_name(f".{out_dir.name}{REPLACED_SUFFIX}")
    partial = out_dir.with_name(f".{out_dir.name}{PARTIAL_SUFFIX}-{secrets.token_hex(8)}")
    with contextlib.ExitStack() as alive:
        with _held(out_dir.parent):  # made and flock'ed at once: no other call's tidying can take it meanwhile
            _tidy(out_dir, replaced)
            partial.mkdir()
            alive.enter_context(_held(partial, blocking=False))  # held while this writer lives
        try:
            write(partial)
            with _held(out_dir.parent):
                _tidy(out_dir, replaced, mine=partial)
                if check is not None:
                    check()
                if out_dir.exists() or out_dir.is_symlink():
                    os.rename(out_dir, replaced)
                os.rename(partial, out_dir)
                shutil.rmtree(replaced, ignore_errors=True)
        except BaseException:
            shutil.rmtree(partial, ignore_errors=True)
            raise
    return out_dir


def export_pretrained(checkpoint_dir: Path, out_dir: Path, *, tokenizer: Any = None,
                      config_dir: Path | None = None, model_class: str | None = None,
                      replace: Replace = "same run") -> Path:
    """Writes the checkpoint's model to `out_dir` with save_pretrained, and its tokenizer (the one
    stored in the checkpoint unless `tokenizer` is given), through a temporary sibling renamed into
    place; `replace` says when a directory already at `out_dir` may be replaced (module docstring).
    A LoRA model is written merged, its adapter under adapter/ (ft_framework.models.lora.save_model).
    A run's best model is the checkpoint checkpoints/best."""
    checkpoint_dir, out_dir = Path(checkpoint_dir), Path(out_dir)
    run_dir = _run_dir_of(checkpoint_dir)
    _check_replaceable(out_dir, run_dir, replace)  # before anything is read (and again at the rename)
    manifest = read_manifest(checkpoint_dir)
    damaged = check_files(checkpoint_dir)  # the sizes the manifest records (--verify: the checksums too)
    if damaged:
        raise CheckpointFormatError(f"checkpoint {checkpoint_dir} is damaged: {'; '.join(damaged)}")
    model = build_model(checkpoint_dir, manifest, config_dir=config_dir, model_class=model_class)
    load_model_weights(model, checkpoint_dir)
    if tokenizer is None and manifest.get("tokenizer"):
        from transformers import AutoTokenizer

        tokenizer = AutoTokenizer.from_pretrained(checkpoint_dir / MODEL_SUBDIR, **NO_REMOTE_CODE)
    record = {"format": EXPORT_FORMAT, "checkpoint": os.path.realpath(checkpoint_dir), "run": str(run_dir)}

    def write(directory: Path) -> None:
        save_model(model, directory, tokenizer)
        (directory / EXPORT_RECORD).write_text(json.dumps(record, indent=1))

    write_atomically(out_dir, write, check=lambda: _check_replaceable(out_dir, run_dir, replace))
    logger.info("exported %s to %s", checkpoint_dir, out_dir)
    return out_dir


def verify_checkpoint(checkpoint_dir: Path) -> int:
    """Checks every file of the checkpoint against the size and checksum its manifest records;
    returns how many files were checked, or raises CheckpointFormatError naming the damaged ones."""
    checkpoint_dir = Path(checkpoint_dir)
    manifest = read_manifest(checkpoint_dir)
    damaged = check_files(checkpoint_dir, checksums=True)
    if damaged:
        raise CheckpointFormatError(f"checkpoint {checkpoint_dir} is damaged: {'; '.join(damaged)}")
    return len(manifest.get("files") or {})
