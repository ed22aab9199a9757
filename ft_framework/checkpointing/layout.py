"""The one checkpoint layout of every strategy, written by every rank through
torch.distributed.checkpoint (DCP), readable under any strategy and any number of ranks.

What is stored, per model parameter ``name`` (its name in the unwrapped model's
``named_parameters()``), as a 1-D tensor of the parameter's full flattened size::

    param/<name>/master       the fp32 master weights (the parameter itself where there is no master)
    param/<name>/exp_avg      every optimizer state tensor of the parameter's size, under its
    param/<name>/exp_avg_sq   optimizer-state key (anchor = theta*, in its own dtype)
    param/<name>/anchor
    param/<name>/step         0-d: the parameter's step count
    buffer/<name>             persistent buffers, whole (rank 0)
    extra/<strategy name>     small picklable engine state (a loss scaler), rank 0

and a JSON manifest (MANIFEST_FILE) with each parameter's shape and dtype, the saving world, and
the model's class and config (plus the tokenizer, under MODEL_SUBDIR) so a checkpoint exports to a
Hugging Face model with no training world (ft-export).

Each rank contributes *fragments*: contiguous ranges of a parameter's flattened value, each
with its offset (ZeRO-1/2: the ranges a flat fp32 partition holds; ZeRO-3: a parameter's
partition; FSDP2: the local piece of a Shard(0) DTensor; single/DDP: whole tensors from rank 0).
DCP records them as chunks of one 1-D tensor per key (the chunk list in its .metadata is the index
of who wrote what), and checks at save time that the chunks of every key cover it exactly once.
Keys do not depend on how the state was partitioned, so any other layout reads them: a loading rank
names the ranges *it* needs (its own fragments under its strategy) and DCP reads only the saved
chunks that overlap them, one saved chunk at a time.

Memory: saving clones one fragment at a time to write it; loading reads one saved chunk at a time
into the live state. Besides its own shard, a rank holds at most about one parameter's worth
(a saved chunk is at most one parameter) during a save or a load; no rank gathers anything.

The protocol a strategy implements (see ``ShardedCheckpointable``): ``checkpoint_fragments()``
(views into its live tensors, used for saving *and* as load targets), ``checkpoint_params()``,
``anchored_parameter_names()``, and the optional hooks ``prepare_checkpoint_load()`` (create
lazy state so every target exists), ``after_checkpoint_load()`` (refresh copies of the masters,
e.g. the 16-bit weights) and ``checkpoint_extra_state()`` / ``load_checkpoint_extra_state()``.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterable, Mapping, Protocol

import torch

from ..errors import UserError

FORMAT = "ft_framework.sharded_checkpoint/1"
MANIFEST_FILE = "ft_checkpoint.json"
MODEL_SUBDIR = "model"           # config.json (+ tokenizer files) of the model, for export
MASTER = "master"
STEP = "step"
ANCHOR = "anchor"
PARAM_PREFIX = "param/"
BUFFER_PREFIX = "buffer/"
EXTRA_PREFIX = "extra/"

__all__ = ["ANCHOR", "FORMAT", "Fragment", "MANIFEST_FILE", "MASTER", "MODEL_SUBDIR", "STEP",
           "CheckpointFormatError", "ParamInfo", "ShardedCheckpointable", "buffer_key", "checkpoint_fields",
           "load_sharded", "param_key", "parse_param_key", "read_buffers", "read_fields", "read_manifest", "save_sharded",
           "whole_tensor_fragments", "dtensor_fragments", "param_info"]


class CheckpointFormatError(UserError):
    """The directory is not a checkpoint of this layout, or does not fit this model/optimizer."""


@dataclass
class Fragment:
    """A contiguous range of one parameter's flattened full value (or its 0-d step) on this rank.

    `tensor` is a 1-D view into the live state (0-d for ``step``): saving writes it, loading
    copies into it. `write` is False for replicated copies that another rank writes (DDP, ZeRO
    stage 0, a step shared by a flat partition), which still load here."""

    name: str
    field: str
    tensor: torch.Tensor
    offset: int = 0
    write: bool = True


@dataclass(frozen=True)
class ParamInfo:
    name: str
    shape: tuple[int, ...]
    dtype: torch.dtype

    @property
    def numel(self) -> int:
        return math.prod(self.shape)


class ShardedCheckpointable(Protocol):
    """What save_sharded / load_sharded need from a strategy (Strategy implements it)."""

    name: str

    @property
    def rank(self) -> int: ...

    @property
    def world_size(self) -> int: ...

    def checkpoint_params(self) -> list[ParamInfo]: ...

    def checkpoint_fragments(self) -> list[Fragment]: ...

    def anchored_parameter_names(self) -> set[str]: ...


# ---- keys ---------------------------------------------------------------------------------------
def param_key(name: str, field: str) -> str:
    return f"{PARAM_PREFIX}{name}/{field}"


def parse_param_key(key: str) -> tuple[str, str] | None:
    """(parameter name, field) of a param/ key, None for other keys."""
    if not key.startswith(PARAM_PREFIX):
        return None
    name, _, field = key[len(PARAM_PREFIX):].rpartition("/")
    return name, field


def fragment_key(key: str, offset: int) -> str:
    """The state-dict key of one fragment of `key` (a rank may hold several); DCP stores it under
    `key`, as the chunk at `offset`."""
    return f"{key}@{offset}"


def buffer_key(name: str) -> str:
    return f"{BUFFER_PREFIX}{name}"


def checkpoint_fields(metadata) -> dict[str, dict[str, Any]]:
    """{parameter name: {field: storage metadata}} of a DCP checkpoint's metadata."""
    out: dict[str, dict[str, Any]] = {}
    for key, md in metadata.state_dict_metadata.items():
        parsed = parse_param_key(key)
        if parsed:
            out.setdefault(parsed[0], {})[parsed[1]] = md
    return out


# ---- helpers strategies use to describe their tensors ----------------------------------------
def param_info(name: str, p: torch.Tensor) -> ParamInfo:
    """Full shape of a parameter: a DTensor's global shape, a ZeRO-3 parameter's ds_shape."""
    shape = tuple(getattr(p, "ds_shape", None) or p.shape)
    return ParamInfo(name, tuple(int(s) for s in shape), p.dtype)


def _flat_view(t: torch.Tensor, what: str) -> torch.Tensor:
    """A 1-D view sharing t's memory (loading writes through it)."""
    t = t.detach()
    if t.dim() == 0:
        return t
    if not t.is_contiguous():
        raise RuntimeError(f"{what} is not contiguous: a checkpoint cannot be loaded into it in place")
    return t.view(-1)


def _state_fields(state: Mapping[str, Any], numel: int) -> Iterable[tuple[str, torch.Tensor]]:
    """The optimizer-state entries that are per-element (same numel) or the 0-d step."""
    for field, value in state.items():
        if not isinstance(value, torch.Tensor):
            continue
        if field == STEP or (value.dim() > 0 and value.numel() == numel):
            yield field, value


def whole_tensor_fragments(named_params: Iterable[tuple[str, torch.Tensor]], optimizer, write: bool) -> list[Fragment]:
    """Fragments of replicated, whole tensors (single device, DDP, ZeRO stage 0 in fp32): each
    parameter and its optimizer state, at offset 0; `write` on the one rank that writes them."""
    out = []
    for name, p in named_params:
        out.append(Fragment(name, MASTER, _flat_view(p, f"parameter {name}"), 0, write))
        state = optimizer.state.get(p, {}) if optimizer is not None else {}
        for field, value in _state_fields(state, p.numel()):
            out.append(Fragment(name, field, _flat_view(value, f"{field} of {name}"), 0, write))
    return out


def _dtensor_range(t) -> tuple[torch.Tensor, int, bool]:
    """(1-D local view, offset into the flattened full tensor, whether this rank writes it) of a
    DTensor sharded on dim 0 (FSDP2) or replicated."""
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    local = t.to_local()
    placements = tuple(t.placements)
    if all(isinstance(pl, Replicate) for pl in placements):
        coordinate = t.device_mesh.get_coordinate() or [0]
        return _flat_view(local, "a replicated DTensor"), 0, all(c == 0 for c in coordinate)
    if not all(isinstance(pl, Shard) and pl.dim == 0 for pl in placements if not isinstance(pl, Replicate)):
        raise NotImplementedError(f"checkpoint fragments of DTensor placements {placements}: only Shard(0) "
                                  "and Replicate are contiguous flattened ranges")
    _, global_offset = compute_local_shape_and_global_offset(t.shape, t.device_mesh, t.placements)
    row = math.prod(t.shape[1:]) if t.dim() > 1 else 1
    replicated_coords = [c for c, pl in zip(t.device_mesh.get_coordinate() or [], placements)
                         if isinstance(pl, Replicate)]
    return _flat_view(local, "a DTensor shard"), int(global_offset[0]) * row, all(c == 0 for c in replicated_coords)


def dtensor_fragments(named_params: Iterable[tuple[str, torch.Tensor]], optimizer, is_main: bool) -> list[Fragment]:
    """Fragments of DTensor parameters and their DTensor optimizer state (FSDP2): each rank its
    local shard; plain (0-d) state like step is written by rank 0 and loaded everywhere."""
    out = []
    for name, p in named_params:
        if not hasattr(p, "to_local"):  # a parameter FSDP left alone: replicated on every rank
            out.extend(whole_tensor_fragments([(name, p)], optimizer, is_main))
            continue
        view, offset, write = _dtensor_range(p)
        out.append(Fragment(name, MASTER, view, offset, write))
        for field, value in _state_fields(optimizer.state.get(p, {}), p.numel()):
            if hasattr(value, "to_local"):
                v, off, w = _dtensor_range(value)
                out.append(Fragment(name, field, v, off, w))
            else:
                out.append(Fragment(name, field, _flat_view(value, f"{field} of {name}"), 0, is_main))
    return out


# ---- the manifest -----------------------------------------------------------------------------
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
    from .legacy import legacy_format_error

    directory = Path(directory)
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

        def __init__(self, ranges: dict[str, tuple[str, int, int]]):
            super().__init__(flatten_state_dict=False, flatten_sharded_tensors=False)
            self.ranges = ranges
            self.by_chunk: dict[tuple[str, int], torch.Tensor] = {}

        def create_local_plan(self) -> SavePlan:
            items = []
            for key, value in self.state_dict.items():
                if key in self.ranges:
                    fqn, offset, total = self.ranges[key]
                    self.by_chunk[(fqn, offset)] = value
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
            return self.by_chunk[(index.fqn, index.offset[0])]

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

    return FragmentSavePlanner, FragmentLoadPlanner


def _no_dist(strategy) -> bool:
    import torch.distributed as dist

    return strategy.world_size == 1 or not (dist.is_available() and dist.is_initialized())


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


# ---- save ---------------------------------------------------------------------------------------
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


def _buffers(model: torch.nn.Module | None) -> list[tuple[str, torch.Tensor]]:
    """Persistent buffers (those in the state dict), by name."""
    if model is None:
        return []
    out = []
    for module_name, module in model.named_modules():
        for name, buf in module.named_buffers(recurse=False):
            if buf is not None and name not in module._non_persistent_buffers_set:
                out.append((f"{module_name}.{name}" if module_name else name, buf))
    return out


def save_sharded(directory: Path, strategy, *, model: torch.nn.Module | None = None, tokenizer: Any = None,
                 buffers: list[tuple[str, torch.Tensor]] | None = None, saved_by: dict[str, Any] | None = None) -> None:
    """Every rank writes its fragments into `directory` (one DCP save); rank 0 also writes the
    manifest, persistent buffers, the strategy's extra state and the model files for export.
    Collective: every rank calls it."""
    import torch.distributed.checkpoint as dcp

    directory = Path(directory)
    is_main = strategy.rank == 0
    params = {p.name: p for p in strategy.checkpoint_params()}
    state: dict[str, Any] = {}
    ranges: dict[str, tuple[str, int, int]] = {}
    for frag in strategy.checkpoint_fragments():
        if not frag.write or (frag.tensor.dim() > 0 and frag.tensor.numel() == 0):
            continue
        key = param_key(frag.name, frag.field)
        if frag.tensor.dim() == 0:
            if key in state:
                raise RuntimeError(f"two values of {key} on rank {strategy.rank}: a strategy writes a step once")
            state[key] = frag.tensor.detach()
            continue
        skey = fragment_key(key, frag.offset)
        if skey in state:
            raise RuntimeError(f"two fragments of {key} at offset {frag.offset} on rank {strategy.rank}")
        state[skey] = _own_storage(frag.tensor.detach())
        ranges[skey] = (key, int(frag.offset), params[frag.name].numel)
    if model is None and hasattr(strategy, "unwrapped_model"):
        model = strategy.unwrapped_model()
    if is_main:
        for name, buf in (buffers if buffers is not None else _buffers(model)):
            state[buffer_key(name)] = buf.detach()
        extra = strategy.checkpoint_extra_state() if hasattr(strategy, "checkpoint_extra_state") else None
        if extra is not None:
            state[EXTRA_PREFIX + strategy.name] = extra
        directory.mkdir(parents=True, exist_ok=True)
        # Before the DCP save, whose last step (the coordinator writing .metadata) every rank
        # waits for: when save_sharded returns on any rank, the whole checkpoint is there.
        info = {"strategy": strategy.name, "world_size": strategy.world_size, "torch": torch.__version__}
        info.update(saved_by or {})
        write_manifest(directory, list(params.values()), info, model, tokenizer)
    save_planner, _ = _planners()
    try:
        with _quiet_dcp():
            dcp.save(state, storage_writer=dcp.FileSystemWriter(str(directory), single_file_per_rank=True,
                                                                thread_count=1),
                     planner=save_planner(ranges), no_dist=_no_dist(strategy))
    except dcp.api.CheckpointException as exc:  # a BaseException: make it an ordinary error
        raise RuntimeError(f"saving the checkpoint into {directory} failed ({_failure(exc)})") from exc


# ---- load ---------------------------------------------------------------------------------------
def check_against_model(directory: Path, manifest: dict[str, Any], metadata, params: list[ParamInfo],
                        anchored: set[str]) -> None:
    """Everything that can make a checkpoint unfit, checked from global facts (the manifest, DCP's
    metadata, this model's parameters, the names this run anchors) so every rank raises the same
    error before the collective load."""
    from ..optim.base import check_loaded_anchors

    saved = manifest["params"]
    fields = checkpoint_fields(metadata)
    names = [p.name for p in params]
    missing = [n for n in names if n not in saved or MASTER not in fields.get(n, {})]
    if missing:
        raise CheckpointFormatError(f"checkpoint {directory} lacks parameters {missing[:5]} "
                                    f"({len(missing)} of {len(names)}): it belongs to another model")
    unknown = sorted(set(saved) - set(names))
    if unknown:
        raise CheckpointFormatError(f"checkpoint {directory} has parameters this model lacks: {unknown[:5]}; "
                                    "it belongs to another model")
    for p in params:
        if tuple(saved[p.name]["shape"]) != p.shape:
            raise CheckpointFormatError(f"checkpoint {directory}: parameter {p.name!r} has shape "
                                        f"{tuple(saved[p.name]['shape'])}, the model {p.shape}: another model")

    def saved_anchor_shape(p: ParamInfo):
        md = fields[p.name].get(ANCHOR)
        if md is None:
            return None
        numel = math.prod(md.size)
        return p.shape if numel == p.numel else tuple(md.size)

    check_loaded_anchors(f"checkpoint {directory}", (
        (p.name, saved_anchor_shape(p), p.shape, p.name in anchored) for p in params
        if p.name in anchored or ANCHOR in fields[p.name]))


def load_sharded(directory: Path, strategy, *, model: torch.nn.Module | None = None) -> dict[str, Any]:
    """Fills this rank's fragments (the strategy's live state) from a checkpoint saved under any
    strategy and world size; returns the manifest. Collective: every rank calls it."""
    import torch.distributed.checkpoint as dcp

    directory = Path(directory)
    manifest = read_manifest(directory)
    reader = dcp.FileSystemReader(str(directory))
    try:
        metadata = reader.read_metadata()
    except Exception as exc:
        raise CheckpointFormatError(f"checkpoint {directory} cannot be read ({exc}); "
                                    "resume from an earlier checkpoint") from exc
    params = strategy.checkpoint_params()
    check_against_model(directory, manifest, metadata, params, strategy.anchored_parameter_names())
    if hasattr(strategy, "prepare_checkpoint_load"):
        strategy.prepare_checkpoint_load()
    available = metadata.state_dict_metadata
    state: dict[str, Any] = {}
    targets: dict[str, tuple[str, int]] = {}
    # A step shared by a flat partition (ZeRO) is the target of every parameter in it: each key
    # loads into it in turn, and they all hold the same count.
    for frag in strategy.checkpoint_fragments():
        key = param_key(frag.name, frag.field)
        if key not in available:
            continue  # a moment or step the saving run never created (no gradient yet): stays zero
        if frag.tensor.dim() == 0:
            state[key] = frag.tensor
            continue
        if frag.tensor.numel() == 0:
            continue
        md = available[key]
        if frag.offset + frag.tensor.numel() > math.prod(md.size):
            raise CheckpointFormatError(f"checkpoint {directory}: {key} has {math.prod(md.size)} elements, "
                                        f"this rank needs [{frag.offset}, {frag.offset + frag.tensor.numel()})")
        skey = fragment_key(key, frag.offset)
        state[skey] = frag.tensor
        targets[skey] = (key, int(frag.offset))
    if model is None and hasattr(strategy, "unwrapped_model"):
        model = strategy.unwrapped_model()
    for name, buf in _buffers(model):
        if buffer_key(name) in available:
            state[buffer_key(name)] = buf.detach()
    extra_key = EXTRA_PREFIX + getattr(strategy, "name", "")
    wants_extra = hasattr(strategy, "load_checkpoint_extra_state") and extra_key in available
    if wants_extra:
        state[extra_key] = None
    _, load_planner = _planners()
    try:
        with _quiet_dcp():
            dcp.load(state, storage_reader=reader, planner=load_planner(targets), no_dist=_no_dist(strategy))
    except (Exception, dcp.api.CheckpointException) as exc:  # DCP's is a BaseException
        raise RuntimeError(f"checkpoint {directory} cannot be read ({_failure(exc)}); resume from an earlier "
                           "checkpoint") from exc
    if hasattr(strategy, "after_checkpoint_load"):
        strategy.after_checkpoint_load()
    if wants_extra and state[extra_key] is not None:
        strategy.load_checkpoint_extra_state(state[extra_key])
    return manifest


def read_fields(directory: Path, fields: Iterable[str] | None = None,
                names: Iterable[str] | None = None) -> dict[str, dict[str, torch.Tensor]]:
    """{parameter name: {field: full tensor in the parameter's shape}} of a checkpoint, read in
    this process with no training world (for tools and tests: it holds everything it returns;
    ask for the fields and names you need)."""
    import torch.distributed.checkpoint as dcp

    directory = Path(directory)
    manifest = read_manifest(directory)
    reader = dcp.FileSystemReader(str(directory))
    saved = checkpoint_fields(reader.read_metadata())
    wanted_fields = set(fields) if fields is not None else None
    wanted_names = set(names) if names is not None else None
    out: dict[str, dict[str, torch.Tensor]] = {}
    state: dict[str, torch.Tensor] = {}
    targets: dict[str, tuple[str, int]] = {}
    for name, by_field in saved.items():
        if wanted_names is not None and name not in wanted_names:
            continue
        shape = tuple(manifest["params"].get(name, {}).get("shape", ()))
        for field, md in by_field.items():
            if wanted_fields is not None and field not in wanted_fields:
                continue
            value = torch.empty(tuple(md.size), dtype=md.properties.dtype)
            key = param_key(name, field)
            if value.dim() == 0:
                state[key] = value
            else:
                state[fragment_key(key, 0)] = value
                targets[fragment_key(key, 0)] = (key, 0)
                if math.prod(shape) == value.numel():
                    value = value.view(shape)
            out.setdefault(name, {})[field] = value
    _, load_planner = _planners()
    with _quiet_dcp():
        dcp.load(state, storage_reader=reader, planner=load_planner(targets), no_dist=True)
    # 0-d values were replaced by the loaded ones.
    for name, by_field in out.items():
        for field, value in by_field.items():
            if value.dim() == 0:
                by_field[field] = state[param_key(name, field)]
    return out


def read_buffers(directory: Path) -> dict[str, torch.Tensor]:
    """The persistent buffers a checkpoint holds (model state besides the parameters), by name."""
    import torch.distributed.checkpoint as dcp

    reader = dcp.FileSystemReader(str(directory))
    available = reader.read_metadata().state_dict_metadata
    state = {key: torch.empty(tuple(md.size), dtype=md.properties.dtype)
             for key, md in available.items() if key.startswith(BUFFER_PREFIX)}
    if state:
        _, load_planner = _planners()
        with _quiet_dcp():
            dcp.load(state, storage_reader=reader, planner=load_planner({}), no_dist=True)
    return {key[len(BUFFER_PREFIX):]: value for key, value in state.items()}
