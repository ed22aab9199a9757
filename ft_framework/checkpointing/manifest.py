"""The checkpoint's manifest (MANIFEST_FILE): each parameter's shape and dtype, the saving world,
and the model's class and config (plus the tokenizer, under MODEL_SUBDIR) so that a checkpoint
exports to a Hugging Face model with no training world."""

from __future__ import annotations

import json
import mmap
import os
from pathlib import Path
from typing import Any

import torch
import xxhash

from ft_framework.errors import UserError
from ft_framework.path_containment import NameOutsideError, links_leading_out, resolve_inside
from ft_framework.checkpointing.fragments import ParamInfo
from ft_framework.checkpointing.old_formats import legacy_format_error

FORMAT = "ft_framework.sharded_checkpoint/1"
MANIFEST_FILE = "ft_checkpoint.json"
MODEL_SUBDIR = "model"           # config.json (+ tokenizer files) of the model, for export

__all__ = ["FORMAT", "MANIFEST_FILE", "MODEL_SUBDIR", "CheckpointFormatError", "check_files", "describe_model",
           "file_records", "read_manifest", "record_files", "write_manifest"]

DIGEST = "xxh3_64"  # the checksum of each file the manifest records
_WINDOW = 64 << 20  # bytes mapped at a time while checksumming (a multiple of the page size)


class CheckpointFormatError(UserError):
    """The directory is not a checkpoint of this layout, or does not fit this model/optimizer."""


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def write_manifest(directory: Path, params: list[ParamInfo], saved_by: dict[str, Any],
                   model: torch.nn.Module | None, tokenizer: Any = None) -> None:
    """Rank 0: the manifest, and the model's config (+ tokenizer) for export."""
    model_entry: dict[str, Any] | None = None
    if model is not None:
        model_entry = describe_model(model)
        config = getattr(model, "config", None)
        if config is not None and hasattr(config, "save_pretrained"):
            (directory / MODEL_SUBDIR).mkdir(exist_ok=True)
            config.save_pretrained(directory / MODEL_SUBDIR)
            model_entry["config"] = f"{MODEL_SUBDIR}/config.json"
    if tokenizer is not None:
        (directory / MODEL_SUBDIR).mkdir(exist_ok=True)
        tokenizer.save_pretrained(directory / MODEL_SUBDIR)
    manifest = {
        "format": FORMAT,
        "saved_by": saved_by,
        "params": {p.name: {"shape": list(p.shape), "dtype": _dtype_name(p.dtype)} for p in params},
        "model": model_entry,
        "tokenizer": f"{MODEL_SUBDIR}/" if tokenizer is not None else None,
    }
    tmp = directory / (MANIFEST_FILE + ".tmp")
    tmp.write_text(json.dumps(manifest, indent=1))
    os.replace(tmp, directory / MANIFEST_FILE)


def describe_model(model: torch.nn.Module) -> dict[str, Any]:
    """How export rebuilds the module: its class, and (a LoRA model) the peft adapter config."""
    entry: dict[str, Any] = {}
    base = model
    peft_config = getattr(model, "peft_config", None)
    if peft_config and hasattr(model, "get_base_model"):
        base = model.get_base_model()
        adapter = getattr(model, "active_adapter", "default")
        entry["peft"] = {"adapter": adapter, "config": _jsonable(peft_config[adapter].to_dict())}
    entry["class"] = _importable_class(type(base))
    return entry


def _importable_class(cls: type) -> str:
    """module:qualname of the model's own class. FSDP2 swaps a module's class for a generated
    subclass (FSDP<Name>) that cannot be imported: the first importable class of the MRO is it."""
    import importlib

    for candidate in cls.__mro__:
        if not issubclass(candidate, torch.nn.Module) or candidate.__module__.startswith("torch.distributed"):
            continue
        try:
            obj = importlib.import_module(candidate.__module__)
            for part in candidate.__qualname__.split("."):
                obj = getattr(obj, part)
        except (ImportError, AttributeError):
            continue
        if obj is candidate:
            return f"{candidate.__module__}:{candidate.__qualname__}"
    raise TypeError(f"no importable class in the MRO of {cls}")


def _jsonable(obj: Any) -> Any:
    if isinstance(obj, dict):
        return {str(k): _jsonable(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple, set)):
        return [_jsonable(v) for v in obj]
    if obj is None or isinstance(obj, (str, int, float, bool)):
        return obj
    return str(obj)


def read_manifest(directory: Path) -> dict[str, Any]:
    """The manifest, or a CheckpointFormatError saying what the directory is instead."""
    directory = Path(directory)
    escaped = links_leading_out(directory)  # before anything in it is opened (the manifest included)
    if escaped:
        raise CheckpointFormatError(f"checkpoint {directory}: {escaped[0]}")
    path = directory / MANIFEST_FILE
    if not path.is_file():
        legacy = legacy_format_error(directory)
        if legacy:
            raise CheckpointFormatError(legacy)
        raise CheckpointFormatError(f"{directory} is not an ft_framework checkpoint (no {MANIFEST_FILE})")
    try:
        manifest = json.loads(path.read_text())
    except (OSError, ValueError) as exc:
        raise CheckpointFormatError(f"checkpoint {directory}: {MANIFEST_FILE} cannot be read ({exc}); "
                                    "resume from an earlier checkpoint") from exc
    if manifest.get("format") != FORMAT:
        raise CheckpointFormatError(f"checkpoint {directory} has format {manifest.get('format')!r}; this "
                                    f"version of ft_framework reads {FORMAT!r}")
    return manifest


# ---- each file's size and checksum ----------------------------------------------------------------
def _digest(path: Path) -> str:
    """xxh3_64 of the file's bytes, read through populated read-only mappings of _WINDOW bytes at a
    time: no copy into Python buffers, and at most one window mapped (crc32 over read() chunks ran
    at 2-3 GB/s and cost about a fifth of a BERT-base save; docs/benchmarks.md)."""
    digest = xxhash.xxh3_64()
    with open(path, "rb") as f:
        size = os.fstat(f.fileno()).st_size
        for offset in range(0, size, _WINDOW):
            with mmap.mmap(f.fileno(), min(_WINDOW, size - offset), offset=offset, prot=mmap.PROT_READ,
                           flags=mmap.MAP_SHARED | getattr(mmap, "MAP_POPULATE", 0)) as window:
                digest.update(window)
    return digest.hexdigest()


def _listed(directory: Path) -> list[str]:
    """Every file of the checkpoint but the manifest itself, as paths relative to `directory`."""
    return sorted(str(p.relative_to(directory)) for p in directory.rglob("*")
                  if p.is_file() and p.name not in (MANIFEST_FILE, MANIFEST_FILE + ".tmp"))


def file_records(directory: Path, rank: int = 0, world_size: int = 1) -> dict[str, dict[str, Any]]:
    """{relative path: {"size", DIGEST}} of this rank's share of the checkpoint's files (every
    world_size-th file, largest first, so that the ranks hash about as many bytes each)."""
    directory = Path(directory)
    names = sorted(_listed(directory), key=lambda n: (-(directory / n).stat().st_size, n))
    return {name: {"size": (directory / name).stat().st_size, DIGEST: _digest(directory / name)}
            for name in names[rank::world_size]}


def record_files(directory: Path, records: dict[str, dict[str, Any]]) -> None:
    """Rank 0: adds every file's size and checksum (`records`, gathered from the ranks) to the manifest."""
    path = Path(directory) / MANIFEST_FILE
    manifest = json.loads(path.read_text())
    manifest["files"] = dict(sorted(records.items()))
    tmp = path.with_name(MANIFEST_FILE + ".tmp")
    tmp.write_text(json.dumps(manifest, indent=1))
    os.replace(tmp, path)


def check_files(directory: Path, *, checksums: bool = False) -> list[str]:
    """What is wrong with the checkpoint's files, one entry per damaged file (empty: intact): a file
    missing, of another size than the manifest records, or (`checksums`) whose bytes changed; a
    symlink leading out of the directory, or a recorded name that does (path_containment.py), before
    anything is sized, hashed or opened. A checkpoint whose manifest records no files (converted
    from an old format) passes."""
    directory = Path(directory)
    escaped = links_leading_out(directory)
    if escaped:
        return escaped
    if not (directory / MANIFEST_FILE).is_file():  # not this layout: its reader says what it is
        return []
    try:
        manifest = json.loads((directory / MANIFEST_FILE).read_text())
    except (OSError, ValueError) as exc:
        return [f"{directory / MANIFEST_FILE} cannot be read ({type(exc).__name__})"]
    problems = []
    files = manifest.get("files") or {}
    if not isinstance(files, dict):
        return [f"{directory / MANIFEST_FILE}: its files entry is not a mapping of names to sizes"]
    for name, want in files.items():
        try:
            path = resolve_inside(directory, name, entry=f"{MANIFEST_FILE}'s file")
        except NameOutsideError as exc:
            problems.append(str(exc))
            continue
        if not isinstance(want, dict) or not isinstance(want.get("size"), int):
            problems.append(f"{directory / MANIFEST_FILE}: the entry of {name} records no size")
            continue
        if not path.is_file():
            problems.append(f"{path} is missing")
            continue
        size = path.stat().st_size
        if size != want["size"]:
            problems.append(f"{path} has {size} bytes, the manifest records {want['size']} (truncated or replaced)")
        elif checksums and DIGEST in want and (got := _digest(path)) != want[DIGEST]:
            problems.append(f"{path} has changed since it was saved ({DIGEST} {got}, the manifest records "
                            f"{want[DIGEST]})")
    return problems
