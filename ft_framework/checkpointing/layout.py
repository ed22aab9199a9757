"""The one checkpoint layout of every strategy, written by every rank through
torch.distributed.checkpoint (DCP), readable under any strategy and any number of ranks.

What is stored, per model parameter ``name`` (its name in the unwrapped model's
``named_parameters()``), as a 1-D tensor of the parameter's full flattened size::

    param/<name>/master       the fp32 master weights (the parameter itself where there is no master)
    param/<name>/exp_avg      every optimizer state tensor of the parameter's size, under its
    param/<name>/exp_avg_sq   optimizer-state key (anchor = theta*, in its own dtype)
    param/<name>/anchor
    param/<name>/delta        the compact state's theta - theta*, where the run kept one (not under
                              DeepSpeed, whose fp32 masters are the master)
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
(a saved chunk is at most one parameter) during a save or a load; no rank gathers anything. A value
the live state does not hold (``Fragment.form``: the offload's fp32 master theta* + delta) is formed
when the writer reaches it and freed once written, one at a time (dcp_io.py).

What is saved comes from one object (``fragments.ShardedCheckpointable``, every member required):
``fragments()`` (views into the live tensors, used for saving *and* as load targets),
``params()``, ``anchored_names()``, ``prepare_load()`` (create lazy state so every target exists),
``after_load()`` (refresh copies of the masters, e.g. the 16-bit weights), ``extra_state()`` /
``load_extra_state()``, ``model()`` and ``info()``. A strategy returns it from
``Strategy.checkpointable()``.
"""

from __future__ import annotations

import logging
import math
from pathlib import Path
from typing import Any, Iterable, Mapping

import torch

from ft_framework.optim.base import check_loaded_anchors
from ft_framework.checkpointing.dcp_io import (CheckpointReadError, _failure, _no_dist, _own_storage, _planners,
                                              _quiet_dcp, save_state)
from ft_framework.checkpointing.dcp_read import check_claimed_bytes, checkpoint_reader
from ft_framework.checkpointing.fragments import (ANCHOR, BUFFER_PREFIX, DELTA, EXTRA_PREFIX, MASTER, Fragment,
                                                  ParamInfo, ShardedCheckpointable, buffer_key, checkpoint_fields,
                                                  fragment_key, param_key)
from ft_framework.checkpointing.manifest import CheckpointFormatError, read_manifest, write_manifest

logger = logging.getLogger(__name__)

__all__ = ["check_against_model", "load_sharded", "read_buffers", "read_fields", "save_sharded"]


# ---- save ---------------------------------------------------------------------------------------
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


def save_sharded(directory: Path, source: ShardedCheckpointable, *, tokenizer: Any = None,
                 buffers: list[tuple[str, torch.Tensor]] | None = None) -> None:
    """Every rank writes its fragments into `directory` (one DCP save); rank 0 also writes the
    manifest, persistent buffers (`buffers`, or the model's), the extra state and the model files
    (with `tokenizer`) for export. Collective: every rank calls it."""
    import torch.distributed.checkpoint as dcp

    directory = Path(directory)
    is_main = source.rank == 0
    params = {p.name: p for p in source.params()}
    state: dict[str, Any] = {}
    ranges: dict[str, tuple[str, int, int]] = {}
    formed: dict[str, Any] = {}  # values made as the writer reaches them (Fragment.form)
    for frag in source.fragments():
        if not frag.write or (frag.tensor.dim() > 0 and frag.tensor.numel() == 0):
            continue
        key = param_key(frag.name, frag.field)
        if frag.tensor.dim() == 0:
            if key in state:
                raise RuntimeError(f"two values of {key} on rank {source.rank}: a strategy writes a step once")
            state[key] = frag.tensor.detach()
            continue
        skey = fragment_key(key, frag.offset)
        if skey in state:
            raise RuntimeError(f"two fragments of {key} at offset {frag.offset} on rank {source.rank}")
        state[skey] = _own_storage(frag.tensor.detach())
        ranges[skey] = (key, int(frag.offset), params[frag.name].numel)
        if frag.form is not None:
            formed[skey] = frag.formed
    model = source.model()
    if is_main:
        for name, buf in (buffers if buffers is not None else _buffers(model)):
            state[buffer_key(name)] = buf.detach()
        extra = source.extra_state()
        if extra is not None:
            state[EXTRA_PREFIX + source.name] = extra
        directory.mkdir(parents=True, exist_ok=True)
        # Before the DCP save, whose last step (the coordinator writing .metadata) every rank
        # waits for: when save_sharded returns on any rank, the whole checkpoint is there.
        info = {"strategy": source.name, "world_size": source.world_size, "torch": torch.__version__}
        info.update(source.info())
        write_manifest(directory, list(params.values()), info, model, tokenizer)
    try:
        with _quiet_dcp():
            save_state(directory, state, ranges, formed, no_dist=_no_dist(source))
    except dcp.api.CheckpointException as exc:  # a BaseException: make it an ordinary error
        raise RuntimeError(f"saving the checkpoint into {directory} failed ({_failure(exc)})") from exc


# ---- load ---------------------------------------------------------------------------------------
def check_against_model(directory: Path, manifest: dict[str, Any], metadata, params: list[ParamInfo],
                        anchored: set[str]) -> None:
    """Everything that can make a checkpoint unfit, checked from global facts (the manifest, DCP's
    metadata, this model's parameters, the names this run anchors) so every rank raises the same
    error before the collective load."""
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


def load_sharded(directory: Path, target: ShardedCheckpointable) -> dict[str, Any]:
    """Fills this rank's fragments (the strategy's live state) from a checkpoint saved under any
    strategy and world size; returns the manifest. Collective: every rank calls it."""
    import torch.distributed.checkpoint as dcp

    directory = Path(directory)
    manifest = read_manifest(directory)
    reader = checkpoint_reader(directory)
    metadata = reader.read_metadata()  # as data; a refusal or a damaged file is one line
    params = target.params()
    check_against_model(directory, manifest, metadata, params, target.anchored_names())
    target.prepare_load()
    available = metadata.state_dict_metadata
    state: dict[str, Any] = {}
    targets: dict[str, tuple[str, int]] = {}
    fragments = [f.with_value() for f in target.fragments()]  # a formed value's target: a tensor of its own
    derived = _delta_conversion(directory, checkpoint_fields(metadata), fragments, target.rank)
    # A step shared by a flat partition (ZeRO) is the target of every parameter in it: each key
    # loads into it in turn, and they all hold the same count.
    for frag in fragments:
        key = param_key(frag.name, frag.field)
        if key not in available:
            continue  # a moment or step the saving run never created (no gradient yet): stays zero
        if frag.tensor.dim() == 0:
            state[key] = frag.tensor
            continue
        if frag.tensor.numel() == 0:
            continue
        md = available[key]
        if frag.field != ANCHOR and md.properties.dtype == torch.float32 and frag.tensor.dtype == torch.bfloat16:
            # e.g. fp32 moments into the compact state (optimizer.state_dtype bfloat16): the load would round
            raise CheckpointFormatError(f"checkpoint {directory}: {key} was saved in float32, this run keeps it in "
                                        "bfloat16 (optimizer.state_dtype); the conversion is not exact, so resuming "
                                        "is refused: resume with the saving run's optimizer.state_dtype float32")
        if frag.offset + frag.tensor.numel() > math.prod(md.size):
            raise CheckpointFormatError(f"checkpoint {directory}: {key} has {math.prod(md.size)} elements, "
                                        f"this rank needs [{frag.offset}, {frag.offset + frag.tensor.numel()})")
        skey = fragment_key(key, frag.offset)
        state[skey] = frag.tensor
        targets[skey] = (key, int(frag.offset))
    for name, buf in _buffers(target.model()):
        if buffer_key(name) in available:
            state[buffer_key(name)] = buf.detach()
    extra_key = EXTRA_PREFIX + target.name
    wants_extra = extra_key in available
    if wants_extra:
        state[extra_key] = None
    _, load_planner = _planners()
    try:
        with _quiet_dcp():
            dcp.load(state, storage_reader=reader, planner=load_planner(targets), no_dist=_no_dist(target))
    except dcp.api.CheckpointException as exc:  # a BaseException; anything else: a collective failed
        raise CheckpointReadError(f"checkpoint {directory} cannot be read ({_failure(exc)}); resume from an earlier "
                           "checkpoint") from exc
    by_place = {(f.name, f.field, f.offset): f.tensor for f in fragments}
    for frag in derived:  # before after_load, which may refresh copies of the masters
        master, anchor = by_place[(frag.name, MASTER, frag.offset)], by_place[(frag.name, ANCHOR, frag.offset)]
        frag.tensor.copy_(master.float() - anchor.float())
    target.after_load()
    if wants_extra and state[extra_key] is not None:
        target.load_extra_state(state[extra_key])
    return manifest


def _delta_conversion(directory: Path, saved: Mapping[str, Mapping[str, Any]], fragments: list[Fragment],
                      rank: int) -> list[Fragment]:
    """The compact state across its two masters (optim/compact.py), said once by rank 0. A run that
    keeps delta = theta - theta* (single, DDP, FSDP2) resuming a checkpoint saved without one
    (DeepSpeed keeps the fp32 masters itself) gets delta = master - theta*: returned, the delta
    fragments to fill after the load. A run without delta resuming one saved with it takes the
    saved masters, theta* + delta rounded once."""
    wanted = [f for f in fragments if f.field == DELTA]
    missing = [f for f in wanted if DELTA not in saved.get(f.name, {})]
    if missing and rank == 0:
        logger.info("checkpoint %s holds no delta (its run's fp32 masters were DeepSpeed's): delta = master - "
                    "theta*, exact where the two lie within a factor of 2 of each other, else rounded once", directory)
    if not wanted and rank == 0 and any(DELTA in fields for fields in saved.values()):
        logger.info("checkpoint %s holds delta = theta - theta*; this run keeps its fp32 masters in the parameters "
                    "(DeepSpeed): it resumes from the saved masters, theta* + delta rounded once", directory)
    return missing


def read_fields(directory: Path, fields: Iterable[str] | None = None,
                names: Iterable[str] | None = None) -> dict[str, dict[str, torch.Tensor]]:
    """{parameter name: {field: full tensor in the parameter's shape}} of a checkpoint, read in
    this process with no training world (for tools and tests: it holds everything it returns;
    ask for the fields and names you need)."""
    import torch.distributed.checkpoint as dcp

    directory = Path(directory)
    manifest = read_manifest(directory)
    reader = checkpoint_reader(directory)
    metadata = reader.read_metadata()
    check_claimed_bytes(metadata, directory)  # before a tensor of a claimed size is allocated
    saved = checkpoint_fields(metadata)
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

    reader = checkpoint_reader(directory)
    metadata = reader.read_metadata()
    check_claimed_bytes(metadata, directory)  # before a tensor of a claimed size is allocated
    available = metadata.state_dict_metadata
    state = {key: torch.empty(tuple(md.size), dtype=md.properties.dtype)
             for key, md in available.items() if key.startswith(BUFFER_PREFIX)}
    if state:
        _, load_planner = _planners()
        with _quiet_dcp():
            dcp.load(state, storage_reader=reader, planner=load_planner({}), no_dist=True)
    return {key[len(BUFFER_PREFIX):]: value for key, value in state.items()}
