"""What the checkpoint layout needs of torch.distributed.checkpoint (DCP): the planners that write
and read fragments as chunks of one 1-D tensor per key, tensors handed to DCP's writer without a
copy, values formed only when the writer reaches them (one alive at a time), DCP's one-process
warnings silenced, and its failures as one line per rank."""

from __future__ import annotations

import contextlib
import warnings
from pathlib import Path
from typing import Any, Callable

import torch

from ft_framework.checkpointing.dcp_read import read_bytes_as_data

# The torch releases whose DCP writer was read and tested to write each value before it resolves
# the next under file_writer's settings (one thread, no copy-ahead: its _SerialCpuLoader), which
# freeing a formed value once the next is asked for relies on. Under any other torch a save forms
# every value before DCP starts (4 B per anchored parameter for the offload's masters, as before).
STREAMED_FORMS_TORCH = ((2, 13), (2, 13))

# Threads of a rank's checkpoint writer (DCP's FileSystemWriter thread_count): one, writing the
# rank's one file. With it, values formed for a save (Fragment.form) are alive one at a time:
# the memory plan's row for them is this many of the largest parameter.
WRITER_THREADS = 1


# ---- DCP planners -----------------------------------------------------------------------------
def _planners():
    """The save and load planners (imported lazily: torch.distributed.checkpoint is heavy)."""
    from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner, DefaultSavePlanner
    from torch.distributed.checkpoint.metadata import ChunkStorageMetadata, MetadataIndex, TensorProperties
    from torch.distributed.checkpoint.planner import (LoadPlan, SavePlan, TensorWriteData, WriteItem,
                                                      WriteItemType)
    from torch.distributed.checkpoint.planner_helpers import (_create_read_items, _create_write_items,
                                                              create_read_items_for_chunk_list)

    class FragmentSavePlanner(DefaultSavePlanner):
        """Writes each fragment as the chunk [offset, offset + n) of the 1-D tensor `fqn` of the
        parameter's full size; everything else (0-d steps, buffers, bytes) as DCP does.

        `ranges` maps the state-dict key of a fragment (fragment_key) to (fqn, offset, full numel);
        a rank may hold several fragments of one fqn."""

        def __init__(self, ranges: dict[str, tuple[str, int, int]],
                     formed: dict[str, Callable[[], torch.Tensor]] | None = None):
            super().__init__(flatten_state_dict=False, flatten_sharded_tensors=False)
            self.ranges = ranges
            # Fragments whose value is made when the writer reaches them (Fragment.formed); their
            # state-dict value is a meta tensor of its size and dtype.
            self.formed = formed or {}
            self.by_chunk: dict[tuple[str, int], torch.Tensor] = {}
            self.forms: dict[tuple[str, int], Callable[[], torch.Tensor]] = {}
            self.alive: list[torch.Tensor] = []  # formed values handed to the writer, not yet freed

        def create_local_plan(self) -> SavePlan:
            items = []
            for key, value in self.state_dict.items():
                if key in self.ranges:
                    fqn, offset, total = self.ranges[key]
                    self.by_chunk[(fqn, offset)] = value
                    if key in self.formed:
                        self.forms[(fqn, offset)] = self.formed[key]
                    items.append(WriteItem(
                        index=MetadataIndex(fqn, torch.Size([offset])), type=WriteItemType.SHARD,
                        tensor_data=TensorWriteData(
                            chunk=ChunkStorageMetadata(offsets=torch.Size([offset]), sizes=value.size()),
                            properties=TensorProperties.create_from_tensor(value), size=torch.Size([total]))))
                else:
                    items.extend(_create_write_items(key, value))
            self.plan = SavePlan(items)
            return self.plan

        def lookup_object(self, index):
            if index.fqn in self.state_dict:
                return self.state_dict[index.fqn]
            chunk = (index.fqn, index.offset[0])
            form = self.forms.get(chunk)
            if form is None:
                return self.by_chunk[chunk]
            # The writer (one thread, no copy-ahead: file_writer) writes each value before it
            # resolves the next, and keeps every written tensor until its file is closed: the
            # value formed before this one is written, and its memory is freed here.
            self.free_formed()
            value = form()
            self.alive.append(value)
            return value

        def free_formed(self) -> None:
            # The storage itself is emptied: the writer holds its own alias of each value (a
            # detached view) until the file is closed, so dropping ours would free nothing.
            for value in self.alive:
                value.untyped_storage().resize_(0)
            self.alive = []

    class FragmentLoadPlanner(DefaultLoadPlanner):
        """Reads into each fragment target the range [offset, offset + n) of its fqn: only the
        saved chunks that overlap it, whoever wrote them. `targets` maps the state-dict key of a
        fragment to (fqn, offset); other keys load as DCP does."""

        def __init__(self, targets: dict[str, tuple[str, int]]):
            super().__init__(flatten_state_dict=False, flatten_sharded_tensors=False)
            self.targets = targets
            self.by_chunk: dict[tuple[str, int], torch.Tensor] = {}

        def create_local_plan(self) -> LoadPlan:
            items = []
            for key, target in self.state_dict.items():
                if key in self.targets:
                    fqn, offset = self.targets[key]
                    self.by_chunk[(fqn, offset)] = target
                    chunk = ChunkStorageMetadata(offsets=torch.Size([offset]), sizes=target.size())
                    items.extend(create_read_items_for_chunk_list(fqn, self.metadata.state_dict_metadata[fqn], [chunk]))
                else:
                    items.extend(_create_read_items(key, self.metadata.state_dict_metadata[key], target))
            return LoadPlan(items)

        def lookup_tensor(self, index):
            if index.fqn in self.state_dict:
                return self.state_dict[index.fqn]
            return self.by_chunk[(index.fqn, index.offset[0])]

        def load_bytes(self, read_item, value):
            # DCP's own planner unpickles a non-tensor entry with weights_only=False: code could
            # run. Ours are plain data (a loss scaler's numbers), read as data only.
            self.state_dict[read_item.dest_index.fqn] = read_bytes_as_data(value)

    return FragmentSavePlanner, FragmentLoadPlanner


def file_writer(directory: Path, *, formed: bool):
    """DCP's file writer for the layout: one file per rank, WRITER_THREADS threads. With `formed`
    values (Fragment.form) it copies nothing ahead (per_thread_copy_ahead 0, which on a machine
    with CUDA would otherwise resolve about 10 MB of values before writing them): each value is
    then written before the next is resolved, which lets the planner free it."""
    import torch.distributed.checkpoint as dcp

    ahead = {"per_thread_copy_ahead": 0} if formed else {}
    return dcp.FileSystemWriter(str(directory), single_file_per_rank=True, thread_count=WRITER_THREADS, **ahead)


def save_state(directory: Path, state: dict[str, Any], ranges: dict[str, tuple[str, int, int]],
               formed: dict[str, Callable[[], torch.Tensor]], *, no_dist: bool) -> None:
    """One DCP save of `state` into `directory`: fragments by `ranges` (FragmentSavePlanner), the
    values of `formed` made as the writer reaches them and freed once written, so that the save
    holds WRITER_THREADS of them at a time (under STREAMED_FORMS_TORCH; under another torch, all
    formed first). Raises DCP's CheckpointException as DCP does."""
    import torch.distributed.checkpoint as dcp

    if formed and not streams_formed_values():
        state = {key: formed[key]() if key in formed else value for key, value in state.items()}
        formed = {}
    save_planner, _ = _planners()
    planner = save_planner(ranges, formed)
    try:
        dcp.save(state, storage_writer=file_writer(directory, formed=bool(formed)), planner=planner, no_dist=no_dist)
    finally:
        planner.free_formed()


def streams_formed_values() -> bool:
    """Whether this torch is one whose writer forms values one at a time (STREAMED_FORMS_TORCH)."""
    low, high = STREAMED_FORMS_TORCH
    return low <= tuple(int(x) for x in torch.__version__.split("+")[0].split(".")[:2]) <= high


def _no_dist(strategy) -> bool:
    import torch.distributed as dist

    return strategy.world_size == 1 or not (dist.is_available() and dist.is_initialized())


class CheckpointReadError(RuntimeError):
    """A checkpoint's data files could not be read (DCP reported each failed rank's error); the
    message names the checkpoint and is one line. Raised alike on every rank."""


def _failure(exc: BaseException) -> str:
    """One line per failed rank of DCP's CheckpointException (whose own text holds tracebacks)."""
    failures = getattr(exc, "failures", None)
    if not isinstance(failures, dict):
        return f"{type(exc).__name__}: {exc}"
    parts = []
    for rank, failure in sorted(failures.items()):
        inner = failure[0] if isinstance(failure, tuple) else failure
        parts.append(f"rank {rank}: {type(inner).__name__}: {inner}".rstrip(": "))
    return "; ".join(parts)


@contextlib.contextmanager
def _quiet_dcp():
    """DCP warns on every one-process save/load that it assumes one process: that is the intent."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        yield


_NUMPY_STAND_IN = {torch.bfloat16: torch.int16}  # dtypes numpy lacks, viewed as one of its size


def _own_storage(t: torch.Tensor) -> torch.Tensor:
    """The same memory as a tensor whose storage is exactly its bytes.

    DCP's file writer clones a tensor that views a larger storage (a fragment of a flat ZeRO
    partition, a padded FSDP shard) so as not to write the whole storage, and keeps every written
    tensor until the rank's file is closed: without this, a rank would hold its whole state twice
    during a save. A CPU view re-wrapped through numpy owns exactly its range, so nothing is
    cloned. (Device tensors are copied to the host by DCP in any case: at most the rank's shard.)"""
    if t.device.type != "cpu" or t.dim() != 1 or not t.is_contiguous() or \
            t.untyped_storage().nbytes() == t.nbytes:
        return t
    stand_in = _NUMPY_STAND_IN.get(t.dtype)
    try:
        array = (t.view(stand_in) if stand_in is not None else t).numpy()
    except (TypeError, RuntimeError):  # a dtype numpy cannot hold: DCP clones it
        return t
    out = torch.from_numpy(array)
    return out.view(t.dtype) if stand_in is not None else out

