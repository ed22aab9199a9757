"""What a checkpoint stores, named independently of how the state was partitioned: the fragments a
rank contributes (contiguous ranges of a parameter's flattened value, each with its offset), the
keys they are stored under, the protocol a strategy implements to list them, and the builders of
fragments for whole tensors (single device, DDP, ZeRO stage 0) and DTensors (FSDP2).
See layout.py for the layout as a whole."""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from typing import Any, Callable, Iterable, Mapping, Protocol

import torch

MASTER = "master"
STEP = "step"
ANCHOR = "anchor"
# The compact state's fp32 delta = theta - theta* (optim/compact.py), where the optimizer keeps it.
DELTA = "delta"
PARAM_PREFIX = "param/"
BUFFER_PREFIX = "buffer/"
EXTRA_PREFIX = "extra/"

__all__ = ["ANCHOR", "BUFFER_PREFIX", "DELTA", "EXTRA_PREFIX", "MASTER", "PARAM_PREFIX", "STEP", "Fragment", "ParamInfo",
           "ShardedCheckpointable", "buffer_key", "checkpoint_fields", "dtensor_fragments", "dtensor_shard_offset",
           "formed_fragment", "fragment_key", "param_info", "param_key", "parse_param_key", "whole_tensor_fragments"]


@dataclass
class Fragment:
    """A contiguous range of one parameter's flattened full value (or its 0-d step) on this rank.

    `tensor` is a 1-D view into the live state (0-d for ``step``): saving writes it, loading
    copies into it. `write` is False for replicated copies that another rank writes (DDP, ZeRO
    stage 0, a step shared by a flat partition), which still load here.

    `form`, where set, makes a value the live state does not hold (the fp32 master theta* + delta
    of the offload's bf16 weight form): it fills a new 1-D host tensor with it. `tensor` is then
    on the meta device (the value's size and dtype only); a save forms the value when its writer
    reaches the fragment and frees it once written (checkpointing/dcp_io.py), so that it holds
    one such value at a time, not every one (see `formed_fragment`)."""

    name: str
    field: str
    tensor: torch.Tensor
    offset: int = 0
    write: bool = True
    form: Callable[[torch.Tensor], None] | None = None

    def formed(self) -> torch.Tensor:
        """The value this fragment saves: its live view, or a new host tensor `form` filled."""
        if self.form is None:
            return self.tensor
        out = torch.empty(self.tensor.shape, dtype=self.tensor.dtype)
        self.form(out)
        return out

    def with_value(self) -> "Fragment":
        """This fragment with a tensor holding its value: itself, or a formed one's value in a
        tensor of its own (a load's target for it: what is loaded there is read, then dropped)."""
        return self if self.form is None else replace(self, tensor=self.formed(), form=None)


def formed_fragment(name: str, field: str, numel: int, dtype: torch.dtype, form: Callable[[torch.Tensor], None],
                    offset: int = 0, write: bool = True) -> Fragment:
    """A fragment of `numel` elements of `dtype` whose value `form` makes when it is saved (it
    fills the new 1-D host tensor it is given), instead of a view into the live state."""
    return Fragment(name, field, torch.empty(numel, dtype=dtype, device="meta"), offset, write, form)


@dataclass(frozen=True)
class ParamInfo:
    name: str
    shape: tuple[int, ...]
    dtype: torch.dtype

    @property
    def numel(self) -> int:
        return math.prod(self.shape)


class ShardedCheckpointable(Protocol):
    """What save_sharded / load_sharded need, all of it required: a strategy returns one from
    ``Strategy.checkpointable()`` (ft_framework.strategies.checkpointable); the old-format
    converter has its own."""

    @property
    def name(self) -> str:
        """The saving strategy's name: its extra state is restored only under the same one."""

    @property
    def rank(self) -> int: ...

    @property
    def world_size(self) -> int: ...

    def model(self) -> Any:
        """The unwrapped model (persistent buffers, config for export), or None."""

    def params(self) -> list[ParamInfo]:
        """Every model parameter's name, full shape and dtype, the same on every rank."""

    def fragments(self) -> list[Fragment]:
        """This rank's views into its live state: what a save writes and a load fills."""

    def anchored_names(self) -> set[str]:
        """The parameters this run anchors (a load checks the checkpoint's anchors against them)."""

    def prepare_load(self) -> None:
        """Creates lazy state (step, moments) so that every load target exists."""

    def after_load(self) -> None:
        """Refreshes what derives from the loaded masters (16-bit copies, device weights)."""

    def extra_state(self) -> Any:
        """Small state that is not per parameter (a loss scaler, engine counters), or None."""

    def load_extra_state(self, state: Any) -> None: ...

    def info(self) -> dict[str, Any]:
        """What the manifest records about the saving run."""


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


def dtensor_shard_offset(t) -> int:
    """Where the local piece of DTensor `t` starts in t's flattened full value: the offset of its
    first row times the row's size for a shard on dim 0 (FSDP2, torch.chunk's split: the last ranks
    may hold fewer rows or none), 0 where t is replicated. Checkpoint fragments and the compact
    state's global element index (FSDPStrategy) both read it here."""
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    placements = tuple(t.placements)
    if all(isinstance(pl, Replicate) for pl in placements):
        return 0
    if not all(isinstance(pl, Shard) and pl.dim == 0 for pl in placements if not isinstance(pl, Replicate)):
        raise NotImplementedError(f"DTensor placements {placements}: only Shard(0) and Replicate pieces are "
                                  "contiguous ranges of the flattened tensor")
    _, global_offset = compute_local_shape_and_global_offset(t.shape, t.device_mesh, t.placements)
    row = math.prod(t.shape[1:]) if t.dim() > 1 else 1
    return int(global_offset[0]) * row


def _dtensor_range(t) -> tuple[torch.Tensor, int, bool]:
    """(1-D local view, offset into the flattened full tensor, whether this rank writes it) of a
    DTensor sharded on dim 0 (FSDP2) or replicated."""
    from torch.distributed.tensor import Replicate

    local = t.to_local()
    offset = dtensor_shard_offset(t)
    replicated_coords = [c for c, pl in zip(t.device_mesh.get_coordinate() or [0] * len(t.placements), t.placements)
                         if isinstance(pl, Replicate)]
    return _flat_view(local, "a DTensor piece"), offset, all(c == 0 for c in replicated_coords)


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
