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

from ft_framework.errors import UserError, quoted
from ft_framework.path_containment import NameOutsideError, resolve_inside
from ft_framework.user_files import MissingFile, file_size, open_binary, read_json, refused_entries
from ft_framework.checkpointing.fragments import ParamInfo
from ft_framework.checkpointing.old_formats import legacy_format_error

FORMAT = "ft_framework.sharded_checkpoint/1"
MANIFEST_FILE = "ft_checkpoint.json"
MODEL_SUBDIR = "model"           # config.json (+ tokenizer files) of the model, for export

__all__ = ["FORMAT", "MANIFEST_FILE", "MODEL_SUBDIR", "CheckpointFormatError", "check_files", "describe_model",
           "file_records", "MAX_RECORDED_FILES", "read_manifest", "record_files", "write_manifest"]

DIGEST = "xxh3_64"  # the checksum of each file the manifest records
# The most files a manifest may record: a checkpoint holds a data file per saving rank and a dozen
# others, so this is 65,000 ranks. Each recorded file costs a containment walk and a stat (about 90
# microseconds: the bound keeps a planted manifest's check under 6 seconds).
MAX_RECORDED_FILES = 65_536
MAX_LISTED_PROBLEMS = 5  # the damaged files an error names one by one (then "and N more")
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
    """The manifest, or a CheckpointFormatError saying what the directory is instead. Nothing in the
    directory is opened before `refused_entries` passes it (no symlink leading out, no named pipe or
    device anywhere in it), and the manifest itself is read through user_files (a regular file of at
    most WHOLE_FILE_LIMIT bytes, a JSON object nested at most NESTING_LIMIT deep)."""
    directory = Path(directory)
    escaped = refused_entries(directory)  # before anything in it is opened (the manifest included)
    if escaped:
        raise CheckpointFormatError(f"checkpoint {directory}: {escaped[0]}")
    path = directory / MANIFEST_FILE
    if not path.is_file():
        legacy = legacy_format_error(directory)
        if legacy:
            raise CheckpointFormatError(legacy)
        raise CheckpointFormatError(f"{directory} is not an ft_framework checkpoint (no {MANIFEST_FILE})")
    try:
        manifest = read_json(path, root=directory, entry="the manifest")
    except UserError as exc:
        raise CheckpointFormatError(f"checkpoint {directory}: {MANIFEST_FILE} cannot be read ({exc}); "
                                    "resume from an earlier checkpoint") from exc
    if manifest.get("format") != FORMAT:
        raise CheckpointFormatError(f"checkpoint {directory} has format {quoted(manifest.get('format'))}; this "
                                    f"version of ft_framework reads {FORMAT!r}")
    problem = _shape_problem(manifest)
    if problem:
        raise CheckpointFormatError(f"checkpoint {directory}: {MANIFEST_FILE} {problem}: it was not written by "
                                    "ft_framework, or it was tampered with; resume from an earlier checkpoint")
    return manifest


def _shape_problem(manifest: dict[str, Any]) -> str | None:
    """What in a manifest of this format is not what ft_framework writes (None: nothing)."""
    params = manifest.get("params")
    if not isinstance(params, dict) or not all(
            isinstance(entry, dict) and isinstance(entry.get("shape"), list)
            and all(type(n) is int and n >= 0 for n in entry["shape"]) and isinstance(entry.get("dtype"), str)
            for entry in params.values()):
        return "has no params entry mapping each parameter to its shape and dtype"
    if not isinstance(manifest.get("files") or {}, dict):
        return "has a files entry that is not a mapping of names to sizes"
    if not isinstance(manifest.get("model") or {}, dict) or not isinstance(manifest.get("saved_by") or {}, dict):
        return "has a model or saved_by entry that is not a mapping"
    return None


# ---- each file's size and checksum ----------------------------------------------------------------
def _digest(path: Path, root: Path | None = None) -> str:
    """xxh3_64 of the file's bytes, read through populated read-only mappings of _WINDOW bytes at a
    time: no copy into Python buffers, and at most one window mapped (crc32 over read() chunks ran
    at 2-3 GB/s and cost about a fifth of a BERT-base save; docs/benchmarks.md). `root`: the
    checkpoint a file read back from it must be a regular file inside (user_files.py)."""
    digest = xxhash.xxh3_64()
    with open_binary(path, root=root) if root is not None else open(path, "rb") as f:
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
    symlink leading out of the directory, a named pipe or device in it, or a recorded name that
    leads out (path_containment.py), before anything is sized, hashed or opened. A checkpoint whose
    manifest records no files (converted from an old format) passes. At most MAX_LISTED_PROBLEMS
    entries and one saying how many more; a manifest recording more than MAX_RECORDED_FILES files
    is refused before any of them is looked at."""
    directory = Path(directory)
    escaped = refused_entries(directory)
    if escaped:
        return _bounded(escaped)
    if not (directory / MANIFEST_FILE).is_file():  # not this layout: its reader says what it is
        return []
    try:
        manifest = read_json(directory / MANIFEST_FILE, root=directory, entry="the manifest")
    except UserError as exc:
        return [str(exc)]
    problems = []
    files = manifest.get("files") or {}
    if not isinstance(files, dict):
        return [f"{directory / MANIFEST_FILE}: its files entry is not a mapping of names to sizes"]
    if len(files) > MAX_RECORDED_FILES:
        return [f"{directory / MANIFEST_FILE} records {len(files)} files, more than the {MAX_RECORDED_FILES} a "
                "checkpoint of ft_framework holds: not checked (it was not written by ft_framework, or it was "
                "tampered with)"]
    for name, want in files.items():
        try:
            path = resolve_inside(directory, name, entry=f"{MANIFEST_FILE}'s file")
        except NameOutsideError as exc:
            problems.append(str(exc))
            continue
        if not isinstance(want, dict) or type(want.get("size")) is not int:
            problems.append(f"{directory / MANIFEST_FILE}: the entry of {quoted(name)} records no size")
            continue
        try:
            size = file_size(path, root=directory, entry=f"{MANIFEST_FILE}'s file")
        except MissingFile:
            problems.append(f"{path} is missing")
            continue
        except UserError as exc:  # a named pipe or a device put there after the walk above
            problems.append(str(exc))
            continue
        if size != want["size"]:
            problems.append(f"{path} has {size} bytes, the manifest records {want['size']} (truncated or replaced)")
        elif checksums and DIGEST in want and (got := _digest(path, root=directory)) != want[DIGEST]:
            problems.append(f"{path} has changed since it was saved ({DIGEST} {got}, the manifest records "
                            f"{quoted(want[DIGEST])})")
    return _bounded(problems)


def _bounded(problems: list[str]) -> list[str]:
    """The first MAX_LISTED_PROBLEMS of `problems`, and one entry saying how many more there are."""
    if len(problems) <= MAX_LISTED_PROBLEMS:
        return problems
    return problems[:MAX_LISTED_PROBLEMS] + [f"and {len(problems) - MAX_LISTED_PROBLEMS} more"]
