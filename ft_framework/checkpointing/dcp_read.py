"""torch.distributed.checkpoint's files read as data, never as code.

DCP's own FileSystemReader unpickles a checkpoint's `.metadata` (its index of the saved chunks)
with Python's `pickle`, unrestricted, and its default load planner unpickles non-tensor entries
with `torch.load(weights_only=False)`: a planted file would run code on whoever opens it. Here:

- `checkpoint_reader`: DCP's FileSystemReader, `.metadata` read through an unpickler whose
  `find_class` resolves only the globals of DCP's metadata classes (an explicit allow-list of
  (module, name) pairs mapped to the objects themselves: nothing is imported or looked up by a
  name from the file); any other global is refused in one line naming it, and so is a BUILD on
  anything but an instance of an allowed class (a BUILD on the class itself would rewrite it for
  the whole process). Every file it opens (`.metadata`, each data file) is opened through
  user_files: a regular file inside the checkpoint, never a named pipe. The result must be a
  `Metadata` whose data files are plain file names inside the checkpoint directory, each resolved
  by `path_containment.resolve_inside` (a symlink leading out is refused before DCP opens it), as
  is `.metadata` itself.
- `read_bytes_as_data`: a non-tensor entry through `torch.load(weights_only=True)`.
- `read_whole_checkpoint`: every entry of a DCP checkpoint (the old FSDP format), through both.

Every reader of a checkpoint (resume, `resume_from: auto`, ft-export, ft-interpolate, the legacy
converter) opens it through this module. The allow-list is `pickle.Unpickler.find_class`, public
Python; the objects it admits include torch's private `_StorageInfo`, `_MEM_FORMAT_ENCODING` and
`serialization._get_layout` (what DCP pickles), and the whole-checkpoint read uses torch's private
`_EmptyStateDictLoadPlanner`, `_load_state_dict` and `set_element`: all looked up in
`_torch_internals`, which says in one line which one a torch version lacks (checked: torch 2.13).
"""

from __future__ import annotations

import contextlib
import functools
import importlib
import io
import math
import pathlib
import pickle
import re
from pathlib import Path
from typing import Any

import torch

from ft_framework.checkpointing.manifest import CheckpointFormatError
from ft_framework.errors import UserError, quoted, shortened
from ft_framework.path_containment import NameOutsideError, resolve_inside
from ft_framework.user_files import MissingFile, file_size, open_binary, read_bytes

__all__ = ["DCP_METADATA", "check_claimed_bytes", "checkpoint_reader", "read_bytes_as_data", "read_metadata",
           "read_whole_checkpoint"]

DCP_METADATA = ".metadata"  # the file torch.distributed.checkpoint indexes a checkpoint's chunks in
CHECKED_TORCH = "2.13"      # the torch version whose private names below were read and checked
# The most bytes a `.metadata` may hold: a saved chunk's entry is about 100 bytes, so this is about
# 2.5 million chunks (a model of 400 tensors in 5 fields saved by 1,000 ranks has 2 million). Python's
# own unpickler, which reads it (see _MetadataUnpickler), reads about 6 MB/s on a 2-core Xeon.
METADATA_LIMIT = 256 << 20


def _import(module: str, name: str) -> Any:
    try:
        return getattr(importlib.import_module(module), name)
    except (ImportError, AttributeError) as exc:
        raise RuntimeError(f"torch {torch.__version__} has no {module}.{name}, which ft_framework reads "
                           f"checkpoints with (checked against torch {CHECKED_TORCH}): install torch=={CHECKED_TORCH}.*"
                           ) from exc


@functools.cache
def _torch_internals() -> dict[str, Any]:
    """The private names of torch this module uses, looked up once."""
    names = {"_StorageInfo": "torch.distributed.checkpoint.filesystem",
             "_MEM_FORMAT_ENCODING": "torch.distributed.checkpoint.metadata",
             "_get_layout": "torch.serialization",
             "_EmptyStateDictLoadPlanner": "torch.distributed.checkpoint.default_planner",
             "_load_state_dict": "torch.distributed.checkpoint.state_dict_loader",
             "set_element": "torch.distributed.checkpoint._traverse"}
    return {name: _import(module, name) for name, module in names.items()}


@functools.cache
def _metadata_globals() -> dict[tuple[str, str], Any]:
    """(module, name) → object: every global a `.metadata` written by DCP refers to, and nothing else."""
    from torch.distributed.checkpoint import metadata as md

    internals = _torch_internals()
    classes = [md.Metadata, md.TensorStorageMetadata, md.BytesStorageMetadata, md.ChunkStorageMetadata,
               md.TensorProperties, md.MetadataIndex, md.StorageMeta, internals["_MEM_FORMAT_ENCODING"],
               internals["_StorageInfo"], torch.Size]
    allowed: dict[tuple[str, str], Any] = {(c.__module__, c.__qualname__): c for c in classes}
    allowed[("torch.serialization", "_get_layout")] = internals["_get_layout"]  # a layout from its name
    allowed.update({("torch", name): value for name, value in vars(torch).items() if isinstance(value, torch.dtype)})
    # StorageMeta.checkpoint_id: the saving directory as a path (pathlib's module differs across Pythons).
    for module in ("pathlib", "pathlib._local"):
        allowed[(module, "PosixPath")] = allowed[(module, "PurePosixPath")] = pathlib.PurePosixPath
        allowed[(module, "WindowsPath")] = allowed[(module, "PureWindowsPath")] = pathlib.PureWindowsPath
    return allowed


class _RefusedGlobal(pickle.UnpicklingError):
    def __init__(self, module: str, name: str):
        super().__init__(f"{module}.{name}")
        self.qualified = f"{module}.{name}"


class _RefusedBuild(pickle.UnpicklingError):
    """A BUILD (or an append, or an item set) on what is not a plain instance of an allowed class."""

    def __init__(self, opcode: str, target: Any):
        kind = type(target)
        name = f"{kind.__module__}.{kind.__qualname__}"
        what = f"the class {target.__module__}.{target.__qualname__}" if isinstance(target, type) else (
            f"a {name}" if not callable(target) else f"the callable {getattr(target, '__qualname__', name)}")
        super().__init__(f"{opcode} on {what}")
        self.opcode, self.what = opcode, what


@functools.cache
def _built_classes() -> frozenset[type]:
    """The classes whose instances a `.metadata` may set the state of (BUILD): the allowed classes."""
    return frozenset(v for v in _metadata_globals().values() if isinstance(v, type))


class _MetadataUnpickler(pickle._Unpickler):
    """Resolves only the allow-listed globals, refusing any other before it is imported or called;
    and sets state (BUILD) only on an instance of an allowed class, items only on a list, dict or
    set, as torch's weights-only unpickler does. A BUILD on an allowed class itself (not an
    instance) would rewrite that class for the rest of the process (`PurePosixPath.name`, say,
    making every later containment check void), so it is refused before anything changes. The pure
    Python unpickler, whose opcodes can be overridden (the C one's cannot): a `.metadata` is small."""

    dispatch = dict(pickle._Unpickler.dispatch)

    def find_class(self, module: str, name: str) -> Any:
        found = _metadata_globals().get((module, name))
        if found is None:
            raise _RefusedGlobal(module, name)
        return found

    def load_build(self) -> None:
        state, target = self.stack[-1], self.stack[-2]
        if type(target) not in _built_classes():
            raise _RefusedBuild("BUILD", target)
        if hasattr(target, "__setstate__"):  # TensorProperties: its own __setstate__ checks its tuple
            self.stack.pop()
            target.__setstate__(state)
            return
        if not isinstance(state, dict) or not all(isinstance(k, str) for k in state):
            raise _RefusedBuild("BUILD with slot state", target)
        self.stack.pop()
        target.__dict__.update(state)

    def _into(self, opcode: str, kinds: tuple[type, ...], target: Any) -> None:
        if type(target) not in kinds:
            raise _RefusedBuild(opcode, target)

    def load_append(self) -> None:
        self._into("APPEND", (list,), self.stack[-2])
        super().load_append()

    def load_appends(self) -> None:
        self._into("APPENDS", (list,), self.metastack[-1][-1])
        super().load_appends()

    def load_setitem(self) -> None:
        self._into("SETITEM", (dict,), self.stack[-3])
        super().load_setitem()

    def load_setitems(self) -> None:
        self._into("SETITEMS", (dict,), self.metastack[-1][-1])
        super().load_setitems()

    def load_additems(self) -> None:
        self._into("ADDITEMS", (set,), self.metastack[-1][-1])
        super().load_additems()

    dispatch[pickle.BUILD[0]] = load_build
    dispatch[pickle.APPEND[0]] = load_append
    dispatch[pickle.APPENDS[0]] = load_appends
    dispatch[pickle.SETITEM[0]] = load_setitem
    dispatch[pickle.SETITEMS[0]] = load_setitems
    dispatch[pickle.ADDITEMS[0]] = load_additems


def _checked(metadata: Any, path: Path) -> Any:
    """`metadata` when it is DCP's Metadata with plain data files beside `path`, each a regular file,
    and tensor sizes that are sizes; else a one-line refusal."""
    from torch.distributed.checkpoint.metadata import BytesStorageMetadata, Metadata, TensorStorageMetadata

    storage_info = _torch_internals()["_StorageInfo"]
    problem = None
    if not isinstance(metadata, Metadata):
        problem = f"holds a {type(metadata).__name__}, not DCP's Metadata"
    elif not isinstance(metadata.state_dict_metadata, dict) or not all(
            isinstance(v, (TensorStorageMetadata, BytesStorageMetadata)) for v in metadata.state_dict_metadata.values()):
        problem = "has entries that are neither tensors nor bytes"
    elif not isinstance(metadata.storage_data, dict) or not all(
            isinstance(v, storage_info) and isinstance(v.relative_path, str)
            and v.relative_path not in ("", ".", "..") and Path(v.relative_path).name == v.relative_path
            for v in metadata.storage_data.values()):
        problem = "names data files outside the checkpoint directory"
    elif _claimed_tensor_bytes(metadata.state_dict_metadata) is None:
        problem = "gives a tensor a size that is no list of non-negative numbers, or a dtype that is not torch's"
    if problem is not None:
        raise _refusal(path, problem)
    for relative_path in sorted({v.relative_path for v in metadata.storage_data.values()}):
        _data_file_size(path.parent, relative_path, path)
    return metadata


def _data_file_size(directory: Path, relative_path: str, index: Path) -> int:
    """The size of a data file `index` names, once it is a regular file inside `directory`."""
    data_file = _inside(directory, relative_path, f"{index.name}'s data file")  # a symlink to elsewhere: refused
    try:
        return file_size(data_file, root=directory, entry=f"{index.name}'s data file")
    except MissingFile:
        raise _refusal(index, f"names the data file {quoted(relative_path)}, which is missing") from None
    except UserError as exc:  # a named pipe, a device: never opened for reading
        raise CheckpointFormatError(f"checkpoint {directory}: {exc}; resume from an earlier checkpoint") from exc


def check_claimed_bytes(metadata: Any, directory: Path) -> None:
    """Refuses (one line) a Metadata whose tensors hold more bytes than its data files: called before
    a reader allocates tensors of the sizes it claims (a 128 TiB claim in a planted `.metadata` is
    refused here, not met by the allocator)."""
    directory = Path(directory)
    claimed = _claimed_tensor_bytes(metadata.state_dict_metadata)
    stored = sum(_data_file_size(directory, name, directory / DCP_METADATA)
                 for name in sorted({v.relative_path for v in metadata.storage_data.values()}))
    if claimed > stored:
        raise CheckpointFormatError(f"checkpoint {directory}: {DCP_METADATA} claims {claimed} bytes of tensors, but its "
                                    f"data files hold {stored} bytes (truncated, or tampered with): refused before "
                                    "anything of that size is allocated; resume from an earlier checkpoint")


def _claimed_tensor_bytes(entries: dict[str, Any]) -> int | None:
    """The bytes of every tensor `entries` describes (their sizes times their dtypes' widths), or
    None when a size or dtype is no size or dtype."""
    total = 0
    for md in entries.values():
        size = getattr(md, "size", None)
        if size is None:  # bytes, not a tensor
            continue
        dtype = getattr(getattr(md, "properties", None), "dtype", None)
        if not isinstance(dtype, torch.dtype) or not isinstance(size, (tuple, list)) or not all(
                type(n) is int and n >= 0 for n in size):
            return None
        total += math.prod(size) * dtype.itemsize
    return total


def _refusal(path: Path, problem: str) -> CheckpointFormatError:
    return CheckpointFormatError(f"checkpoint {path.parent}: {path.name} {problem}: it was not written by "
                                 "torch.distributed.checkpoint, or it was tampered with; resume from an earlier "
                                 "checkpoint")


def _inside(directory: Path, name: str, entry: str) -> Path:
    try:
        return resolve_inside(directory, name, entry=entry)
    except NameOutsideError as exc:
        raise CheckpointFormatError(f"checkpoint {directory}: {exc}; resume from an earlier checkpoint") from exc


def read_metadata(path: Path) -> Any:
    """DCP's Metadata from the file `path`, read as data; CheckpointFormatError (one line) for a file
    that names anything but DCP's metadata classes, is no regular file inside its directory, is
    larger than METADATA_LIMIT, or cannot be read."""
    path = _inside(Path(path).parent, Path(path).name, "DCP's index")
    try:
        data = read_bytes(path, root=path.parent, limit=METADATA_LIMIT, entry="DCP's index")
    except MissingFile as exc:
        raise CheckpointFormatError(f"checkpoint {path.parent} has no {path.name}: it is incomplete or not a "
                                    "checkpoint") from exc
    except UserError as exc:
        raise CheckpointFormatError(f"checkpoint {path.parent}: {exc}; resume from an earlier checkpoint") from exc
    try:
        metadata = _MetadataUnpickler(io.BytesIO(data)).load()
    except _RefusedGlobal as exc:
        raise CheckpointFormatError(
            f"checkpoint {path.parent}: {path.name} refers to {exc.qualified}, which is not one of "
            "torch.distributed.checkpoint's metadata classes; it is never unpickled (it could run code): the file "
            "was not written by torch.distributed.checkpoint, or it was tampered with; resume from an earlier "
            "checkpoint") from exc
    except _RefusedBuild as exc:
        raise CheckpointFormatError(
            f"checkpoint {path.parent}: {path.name} sets the state of {exc.what} ({exc.opcode}), which is not an "
            "instance of torch.distributed.checkpoint's metadata classes; refused before anything was changed (it "
            "could rewrite a class for the whole process): the file was not written by torch.distributed.checkpoint, "
            "or it was tampered with; resume from an earlier checkpoint") from exc
    except RecursionError as exc:
        raise _refusal(path, "nests its objects too deep to read") from exc
    except Exception as exc:  # truncated or corrupted: pickle raises many kinds
        raise CheckpointFormatError(f"checkpoint {path.parent}: {path.name} cannot be read "
                                    f"({type(exc).__name__}: {shortened(str(exc))}); resume from an earlier "
                                    "checkpoint") from exc
    return _checked(metadata, path)


class _ContainedFileSystem:
    """DCP's FileSystem with every stream it reads opened through user_files: a regular file inside
    the checkpoint directory, never a named pipe or a link leading out (checked on the descriptor)."""

    def __init__(self, root: Path):
        from torch.distributed.checkpoint.filesystem import FileSystem

        self.root = Path(root)
        self._fs = FileSystem()

    def __getattr__(self, name: str) -> Any:
        return getattr(self._fs, name)

    @contextlib.contextmanager
    def create_stream(self, path: str | Path, mode: str):
        if mode != "rb":
            raise ValueError(f"a checkpoint is only read here, not opened with mode {mode!r}")
        try:
            stream = open_binary(Path(path), root=self.root, entry="a data file")
        except UserError as exc:
            raise CheckpointFormatError(f"checkpoint {self.root}: {exc}") from exc
        with stream:
            yield stream


@functools.cache
def _reader_class():
    """SafeFileSystemReader (built on first use: torch.distributed.checkpoint is slow to import)."""
    from torch.distributed.checkpoint import FileSystemReader
    from torch.distributed.checkpoint.metadata import StorageMeta

    class SafeFileSystemReader(FileSystemReader):
        """DCP's file reader with `.metadata` read as data (`read_metadata` of this module), and every
        data file opened as a regular file inside the checkpoint (`_ContainedFileSystem`)."""

        def __init__(self, path: str) -> None:
            super().__init__(path)
            self.fs = _ContainedFileSystem(Path(self.path))

        def read_metadata(self, *args: Any, **kwargs: Any):
            rank = kwargs.get("rank")
            name = DCP_METADATA if rank is None else f"__{rank}{DCP_METADATA}"
            metadata = read_metadata(Path(self.path) / name)
            if getattr(metadata, "storage_meta", None) is None:
                metadata.storage_meta = StorageMeta()
            metadata.storage_meta.load_id = self.load_id  # as DCP's own reader does
            return metadata

    return SafeFileSystemReader


def checkpoint_reader(directory: str | Path):
    """The reader every checkpoint read goes through: DCP's FileSystemReader, `.metadata` read as data."""
    return _reader_class()(str(directory))


def read_bytes_as_data(value: io.BytesIO) -> Any:
    """A non-tensor entry (DCP's BYTE_IO: a torch.save of it), read as data: tensors, containers,
    numbers and strings. DCP's own planner uses weights_only=False, which could run code."""
    try:
        return torch.load(value, weights_only=True)
    except pickle.UnpicklingError as exc:
        found = re.search(r"GLOBAL ([\w.]+)", str(exc))  # only to name it: the refusal is torch's
        raise CheckpointFormatError(f"an entry holds {found.group(1) if found else 'objects'} besides tensors and "
                                    "plain data, which are never unpickled (they could run code)") from exc


def read_whole_checkpoint(directory: Path) -> dict[str, Any]:
    """Every entry of the DCP checkpoint in `directory`, nested as it was saved (one process; it
    holds everything it returns): what the converter and ft-interpolate need of the old FSDP format."""
    internals = _torch_internals()

    class WholeLoadPlanner(internals["_EmptyStateDictLoadPlanner"]):
        def load_bytes(self, read_item, value):
            data = read_bytes_as_data(value)
            if self.flatten_state_dict:
                internals["set_element"](self.original_state_dict, self.mappings[read_item.dest_index.fqn], data)
            else:
                self.state_dict[read_item.dest_index.fqn] = data

    from torch.distributed.checkpoint.api import CheckpointException

    reader = checkpoint_reader(directory)
    # A refusal in one line here, not wrapped in DCP's per-rank exception; and no tensor is allocated
    # (DCP's planner allocates each one the index claims) before the data files are known to hold them.
    check_claimed_bytes(reader.read_metadata(), directory)
    state: dict[str, Any] = {}
    try:
        internals["_load_state_dict"](state, storage_reader=reader, planner=WholeLoadPlanner(), no_dist=True)
    except CheckpointException as exc:  # one process: one failure, whose text DCP buries in a traceback
        inner = next(iter(exc.failures.values()), exc)
        inner = inner[0] if isinstance(inner, tuple) else inner
        if isinstance(inner, CheckpointFormatError):  # an entry refused as code: its line says so
            raise CheckpointFormatError(f"checkpoint {directory}: {inner}") from exc
        said = str(inner).strip().splitlines()[0] if str(inner).strip() else ""
        raise CheckpointFormatError(f"checkpoint {directory} cannot be read ({type(inner).__name__}: {said})") from exc
    return state
