"""The token cache: a data set's tokens computed once and kept on disk, so that a resumed run, a second
seed, another run of a sweep or another rank reads them instead of tokenizing again.

An entry is a directory named by the hash of its key: what changes the tokens (the data files' bytes,
or a Hub data set's revision, configuration and split: hub_tables.HubSplit.fingerprint; the tokenizer
with its chat template, the settings that change tokens; the caller says which). It holds flat arrays
of plain numbers, each a raw file, and ``header.json``: the key, each array's dtype, length and xxh3
checksum, and the caller's facts (counts). Nothing in it is code: arrays are read
with np.memmap (never unpickled), the header as JSON.

- One process writes (the caller's main process; the others wait for it at the caller's barrier).
  It writes into a temporary directory beside the entry and renames it into place: a reader sees a
  whole entry or none. A file lock keeps two runs that start together from tokenizing twice.
- The writer's process verifies an existing entry before using it: the header, each array's dtype
  and length, its checksum, and the caller's own checks. A damaged entry is rebuilt with a warning,
  never trusted. The other processes check the header and the sizes only (the writer just checked
  the bytes).
- Every process memory-maps the arrays: the page cache holds one copy for all of them.

Clearing the cache is deleting its directory (or any entry in it) while no run reads it; a killed
writer may leave a ``.tmp-*`` directory behind, which is never read and may be deleted too.
"""

from __future__ import annotations

import errno
import json
import logging
import os
import shutil
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterator, Mapping, Sequence

import numpy as np
import xxhash
from filelock import FileLock

from ft_framework.user_files import MissingFile, UserFileError, open_binary, read_bytes

__all__ = ["CacheEntry", "DEFAULT_CACHE_DIR", "DamagedEntry", "EntryWriter", "FORMAT_VERSION", "HEADER",
           "array_blocks", "content_hash", "entry_name", "open_entry", "prepare_entry", "tokenizer_fingerprint"]

logger = logging.getLogger(__name__)

# Where entries go when the config names no directory (data.token_cache_dir); callers expand the "~".
DEFAULT_CACHE_DIR = Path("~/.cache/ft_framework/tokens")
# The layout of an entry; part of every key, so an entry of another layout is never read.
FORMAT_VERSION = 1
HEADER = "header.json"
# A header is a few hundred bytes; one larger than this is not ours.
_HEADER_LIMIT = 1 << 20
_READ_BLOCK = 8 << 20


class DamagedEntry(Exception):
    """An entry that cannot be trusted (the reason is the message)."""


@dataclass
class CacheEntry:
    """An opened entry: its directory, its arrays (read-only memory maps) and the writer's facts."""

    path: Path
    arrays: dict[str, np.ndarray]
    facts: dict[str, Any]


def content_hash(files: Sequence[Path]) -> str:
    """The xxh3-128 hash of the files' bytes, in order (each file's length first, so that moving bytes
    from one file to the next changes it). A file that is not a regular one is refused in one line."""
    digest = xxhash.xxh3_128()
    for path in files:
        with open_binary(path) as f:
            digest.update(os.fstat(f.fileno()).st_size.to_bytes(8, "little"))
            while block := f.read(_READ_BLOCK):
                digest.update(block)
    return digest.hexdigest()


def tokenizer_fingerprint(tokenizer: Any, chat_template: str | None) -> str:
    """The xxh3-128 hash of everything about ``tokenizer`` that changes the tokens of a text: its
    serialized model (a fast tokenizer's tokenizer.json: vocabulary, merges, normalizer, pre- and
    post-processor, added tokens; a slow one's vocabulary), its class, its special tokens and whether it
    splits them, and the chat template that renders conversations."""
    digest = xxhash.xxh3_128()
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is not None:
        digest.update(backend.to_str().encode("utf-8"))
    else:
        digest.update(json.dumps(sorted(tokenizer.get_vocab().items())).encode("utf-8"))
    facts = {"class": type(tokenizer).__name__, "special_tokens": tokenizer.special_tokens_map,
             "split_special_tokens": getattr(tokenizer, "split_special_tokens", False), "chat_template": chat_template}
    digest.update(json.dumps(facts, sort_keys=True, default=str).encode("utf-8"))
    return digest.hexdigest()


def entry_name(key: Mapping[str, Any]) -> str:
    """The directory name of the entry of ``key`` (plain JSON values): the hash of its JSON."""
    return xxhash.xxh3_128(_canonical(key).encode("utf-8")).hexdigest()


def _canonical(value: Any) -> str:
    return json.dumps(value, sort_keys=True, separators=(",", ":"))


# --------------------------------------------------------------------------------------------------
# Writing
# --------------------------------------------------------------------------------------------------


class EntryWriter:
    """Writes one entry's arrays chunk by chunk into a temporary directory; ``commit`` renames it into
    place. Only a chunk is ever in memory."""

    def __init__(self, cache_dir: Path, name: str, dtypes: Mapping[str, Any]):
        self.final = cache_dir / name
        self.path = cache_dir / f".tmp-{name}-{os.getpid()}-{uuid.uuid4().hex[:8]}"
        self.path.mkdir(parents=True)
        self._dtypes = {key: np.dtype(dtype) for key, dtype in dtypes.items()}
        self._files = {key: open(self.path / key, "wb") for key in self._dtypes}
        self._digests = {key: xxhash.xxh3_64() for key in self._dtypes}
        self._lengths = dict.fromkeys(self._dtypes, 0)

    def append(self, **chunks: np.ndarray) -> None:
        """Appends a chunk to each named array (every array at each call is not required)."""
        for key, chunk in chunks.items():
            data = np.ascontiguousarray(chunk, dtype=self._dtypes[key])
            self._files[key].write(data.data)
            self._digests[key].update(data.data)
            self._lengths[key] += len(data)

    def commit(self, key: Mapping[str, Any], facts: Mapping[str, Any]) -> None:
        """Writes the header, makes the files durable and renames the directory into place. Another
        process that committed the same entry first wins: this copy is discarded."""
        header = {"format": FORMAT_VERSION, "key": key, "facts": dict(facts),
                  "arrays": {name: {"dtype": dtype.str, "length": self._lengths[name],
                                    "xxh3_64": self._digests[name].hexdigest()}
                             for name, dtype in self._dtypes.items()}}
        for f in self._files.values():
            f.flush()
            os.fsync(f.fileno())
            f.close()
        with open(self.path / HEADER, "w", encoding="utf-8") as f:
            f.write(_canonical(header))
            f.flush()
            os.fsync(f.fileno())
        _fsync_directory(self.path)
        try:
            os.rename(self.path, self.final)
        except OSError as exc:
            if exc.errno not in (errno.EEXIST, errno.ENOTEMPTY):
                raise
            shutil.rmtree(self.path, ignore_errors=True)
        _fsync_directory(self.final.parent)

    def abort(self) -> None:
        for f in self._files.values():
            f.close()
        shutil.rmtree(self.path, ignore_errors=True)


def _fsync_directory(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def prepare_entry(cache_dir: Path, key: Mapping[str, Any], dtypes: Mapping[str, Any],
                  build: Callable[[EntryWriter], Mapping[str, Any]],
                  check: Callable[[CacheEntry], None] = lambda entry: None) -> Path:
    """The writer's side: the entry of ``key`` in ``cache_dir``, verified (see open_entry; ``check``
    adds the caller's own checks, raising DamagedEntry), or built by ``build`` (which appends the
    arrays and returns the facts for the header) when there is none or it is damaged."""
    cache_dir.mkdir(parents=True, exist_ok=True)
    name = entry_name(key)
    path = cache_dir / name
    with FileLock(str(cache_dir / f".{name}.lock")):
        if path.exists():
            try:
                check(open_entry(path, key, dtypes, verify=True))
                return path
            except DamagedEntry as exc:
                logger.warning("token cache entry %s is damaged (%s); tokenizing again", path, exc)
                _discard(path)
        writer = EntryWriter(cache_dir, name, dtypes)
        try:
            facts = build(writer)
            writer.commit(key, facts)
        except BaseException:
            writer.abort()
            raise
    check(open_entry(path, key, dtypes, verify=True))
    return path


def _discard(path: Path) -> None:
    """Moves a damaged entry out of the way first (a reader never sees it half deleted), then deletes it."""
    trash = path.with_name(f".trash-{path.name}-{uuid.uuid4().hex[:8]}")
    os.rename(path, trash)
    shutil.rmtree(trash, ignore_errors=True)


# --------------------------------------------------------------------------------------------------
# Reading
# --------------------------------------------------------------------------------------------------


def open_entry(path: Path, key: Mapping[str, Any], dtypes: Mapping[str, Any], *, verify: bool) -> CacheEntry:
    """The entry at ``path``, memory-mapped, after checking that its header is ours and names ``key``
    and the expected arrays and dtypes, and that each file holds exactly its array's bytes; with
    ``verify``, also each array's checksum. Raises DamagedEntry (FileNotFoundError when there is no
    entry)."""
    try:
        header = json.loads(read_bytes(path / HEADER, limit=_HEADER_LIMIT))
    except MissingFile:
        if path.exists():
            raise DamagedEntry("it has no header") from None
        raise FileNotFoundError(path) from None
    except UserFileError as exc:  # not a regular file, or too large to be ours
        raise DamagedEntry(str(exc)) from None
    except (ValueError, UnicodeDecodeError) as exc:
        raise DamagedEntry(f"its header is not JSON ({exc})") from None
    if not isinstance(header, dict) or header.get("format") != FORMAT_VERSION:
        raise DamagedEntry(f"its header is not of format {FORMAT_VERSION}")
    if _canonical(header.get("key")) != _canonical(key):
        raise DamagedEntry("its header names another key")
    described = header.get("arrays")
    if not isinstance(described, dict) or sorted(described) != sorted(dtypes):
        raise DamagedEntry(f"it holds the arrays {sorted(described) if isinstance(described, dict) else described}, "
                           f"expected {sorted(dtypes)}")
    arrays = {}
    for name, dtype in dtypes.items():
        arrays[name] = _array(path / name, np.dtype(dtype), described[name], verify)
    facts = header.get("facts")
    if not isinstance(facts, dict):
        raise DamagedEntry("its header has no facts")
    return CacheEntry(path, arrays, facts)


def array_blocks(entry: CacheEntry, name: str) -> Iterator[np.ndarray]:
    """The array ``name`` of ``entry`` in blocks read from its file, not through its memory map: a
    check that reads every element then leaves no page of it mapped into the process (a mapped page
    counts in the process's RSS until it is unmapped)."""
    dtype = entry.arrays[name].dtype
    with open_binary(entry.path / name) as f:
        while data := f.read(_READ_BLOCK - _READ_BLOCK % dtype.itemsize):
            yield np.frombuffer(data, dtype=dtype)


def _array(path: Path, dtype: np.dtype, described: Any, verify: bool) -> np.ndarray:
    if not isinstance(described, dict) or described.get("dtype") != dtype.str:
        raise DamagedEntry(f"{path.name} is described as {described!r}, expected dtype {dtype.str}")
    length = described.get("length")
    if not isinstance(length, int) or isinstance(length, bool) or length < 0:
        raise DamagedEntry(f"{path.name} has no valid length")
    try:
        with open_binary(path) as f:  # a regular file (a pipe planted here would block a read)
            size = os.fstat(f.fileno()).st_size
            if size != length * dtype.itemsize:
                raise DamagedEntry(f"{path.name} holds {size} bytes, expected {length * dtype.itemsize}")
            if verify:
                digest = xxhash.xxh3_64()
                while block := f.read(_READ_BLOCK):
                    digest.update(block)
                if digest.hexdigest() != described.get("xxh3_64"):
                    raise DamagedEntry(f"{path.name} does not match its checksum")
    except MissingFile:
        raise DamagedEntry(f"{path.name} is missing") from None
    except UserFileError as exc:
        raise DamagedEntry(str(exc)) from None
    if length == 0:  # mmap cannot map an empty file
        return np.zeros(0, dtype=dtype)
    return np.memmap(path, dtype=dtype, mode="r", shape=(length,))
