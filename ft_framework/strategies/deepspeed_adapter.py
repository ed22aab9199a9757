"""The one module that knows DeepSpeed's internals: how ZeRO lays a parameter's fp32 master
weights and optimizer state out over the ranks' flat partitions.

ZeRO flattens each param group into one fp32 tensor and gives every rank a partition of it; the
wrapped optimizer's state (exp_avg, ..., our ``anchor``) is keyed by that partition. The state maps
below name, for checkpoints, this rank's *fragments* of every parameter (``fragments``: the ranges
of the flat partitions a parameter occupies, with their offsets in the flattened parameter; no
communication), refresh what derives from the fp32 masters after a load (``after_load``), read and
write the *full* value of one parameter's state under any key ("fp32" = the master weights) with a
collective across the data-parallel group (telemetry, tests), and place theta* so that each rank
holds only its own part (total/world_size elements).

DeepSpeed's public helpers (deepspeed.utils.safe_get/set_full_*) are used where they work:
- the fp32 master weights, at stages 1/2 (get and set) and 3 (get);
- optimizer state at stage 3 (get).
Where they do not, this module reads the layout itself, and it is the only one that does (a test
greps the package for the private names):
- stages 1/2, optimizer state: DeepSpeed links a parameter to its optimizer-state fragments only
  after the first optimizer step (lazily), but anchors are placed at setup and state is loaded
  before any step, so the fragment addresses of ``_hp_mapping`` are used directly;
- stage 3, set: ``set_full_hp_param`` asserts the unpadded size and then slices at
  partition_numel * rank, past the end of a padded last partition (37 elements on 2 ranks are
  stored as 2 x 19), so the value is padded and copied into the partition view here;
- checkpoint fragments: the fragment addresses of ``_hp_mapping`` (stages 1/2), stage 3's
  ``grad_position`` and partition rank, a frozen parameter's own partition ``ds_tensor``, and
  DeepSpeed's routines that copy loaded masters into the 16-bit weights (``update_lp_params``,
  ``_reassign_or_swap_out_partitioned_parameters``); the engine's step counters and loss scaler.

Importing this module checks the DeepSpeed version against SUPPORTED_DEEPSPEED.
"""

from __future__ import annotations

import contextlib
import os
import re
import sys
from pathlib import Path

import torch


@contextlib.contextmanager
def _unimportable(module: str):
    """`import module` raises ImportError inside the block, unless `module` is imported already;
    afterwards it imports as usual."""
    hidden = module not in sys.modules
    if hidden:
        sys.modules[module] = None  # the import system's "not importable" marker
    try:
        yield
    finally:
        if hidden and sys.modules.get(module, 0) is None:
            del sys.modules[module]


# DeepSpeed's autotuner (deepspeed/autotuning/autotuner.py) imports mlflow at import time whenever
# it is installed, to log its own autotuning experiments (`deepspeed --autotuning`, which no run of
# ours starts): 1.1 s of CPU and 117 MB of RAM in every rank. Hidden from it while deepspeed is
# imported; our MLflow tracking (run/tracking.py) imports mlflow afterwards as usual.
with _unimportable("mlflow"):
    import deepspeed
from deepspeed.utils import safe_get_full_fp32_param, safe_get_full_optimizer_state, safe_set_full_fp32_param  # noqa: E402

from ft_framework.distributed import collectives  # noqa: E402
from ft_framework.checkpointing.fragments import MASTER as CKPT_MASTER  # noqa: E402
from ft_framework.checkpointing.fragments import STEP, Fragment, whole_tensor_fragments  # noqa: E402
from ft_framework.optim.compact import element_offsets  # noqa: E402

MASTER = "fp32"
# Lower bound: the ZeRO-3 partition accessor takes release_swap_buffers since DeepSpeed's NVMe
# set/get work (early 2025), first released before 0.17. Upper bound: ZeRO's internal layout
# changes between minor releases without notice; 0.19.8 is the release the tests run against.
SUPPORTED_DEEPSPEED = ((0, 17), (0, 20))


def _version_tuple(version: str) -> tuple[int, int]:
    match = re.match(r"(\d+)\.(\d+)", version)
    if not match:
        raise RuntimeError(f"cannot read the DeepSpeed version {version!r}")
    return int(match.group(1)), int(match.group(2))


def check_deepspeed_version(version: str) -> None:
    """Raises with a one-line instruction when `version` is outside SUPPORTED_DEEPSPEED."""
    (lo_major, lo_minor), (hi_major, hi_minor) = SUPPORTED_DEEPSPEED
    wanted = f">={lo_major}.{lo_minor},<{hi_major}.{hi_minor}"
    if not (lo_major, lo_minor) <= _version_tuple(version) < (hi_major, hi_minor):
        raise RuntimeError(f"ft_framework's DeepSpeed strategy supports deepspeed{wanted} (it reads ZeRO's "
                           f"partition layout), found {version}: pip install 'deepspeed{wanted}'")


check_deepspeed_version(deepspeed.__version__)

# DeepSpeed's CPU all-reduce (ops/csrc/cpu/comm/shm.cpp, the supported releases) creates one
# shared-memory segment per rank when every rank is on this machine (LOCAL_SIZE == world size),
# named from the user id, MASTER_ADDR, MASTER_PORT and the rank, and never unlinks it: each run
# left 66 MB of RAM per rank in /dev/shm until the machine restarted.
SHM_DIR = Path("/dev/shm")


def shm_allreduce_segment(rank: int) -> Path:
    """The /dev/shm segment DeepSpeed's CPU all-reduce made for `rank` of this run's group."""
    addr, port = os.environ.get("MASTER_ADDR", ""), os.environ.get("MASTER_PORT", "")
    return SHM_DIR / f"deepspeed_allreduce_buffer_{os.getuid()}_{addr}_{port}_{rank}"


def shm_allreduce_segments_of_this_user(port: int | None = None) -> list[Path]:
    """Every such segment this user has in /dev/shm, of any run (a killed rank leaves its own), or
    of the runs whose MASTER_PORT is `port`."""
    pattern = "*" if port is None else f"*_{port}_*"
    return sorted(SHM_DIR.glob(f"deepspeed_allreduce_buffer_{os.getuid()}_{pattern}"))


def remove_shm_allreduce_segment(rank: int) -> None:
    """Unlinks `rank`'s segment, if there is one. Call it only after a collective of the group
    has completed (every rank has then mapped every segment: a rank still starting would otherwise
    wait for it forever); the mappings stay valid until the processes exit."""
    try:
        shm_allreduce_segment(rank).unlink()
    except FileNotFoundError:
        pass


def full_shape(p: torch.Tensor) -> tuple[int, ...]:
    """The parameter's full shape (ZeRO-3 replaces p's storage with an empty placeholder)."""
    return tuple(getattr(p, "ds_shape", p.shape))


class Zero12StateMap:
    """ZeRO stage 1/2 (and DeepSpeed's BF16 optimizer): parameters carry ``_hp_mapping``."""

    def __init__(self, zero_optimizer, base_optimizer):
        self.base = base_optimizer
        if hasattr(zero_optimizer, "single_partition_of_fp32_groups"):
            groups, flats = zero_optimizer.bit16_groups, zero_optimizer.single_partition_of_fp32_groups
        else:  # BF16_Optimizer
            groups, flats = zero_optimizer.bf16_groups, zero_optimizer.fp32_groups_flat_partition
        self.zero = zero_optimizer
        self.groups = [list(g) for g in groups]
        self.flats = list(flats)
        self._flat_of = {id(p): flat for g, flat in zip(self.groups, self.flats) for p in g}

    def partitions(self) -> list[tuple[list[torch.Tensor], torch.Tensor]]:
        return list(zip(self.groups, self.flats))

    def set_full(self, p, key: str, full: torch.Tensor) -> None:
        if key == MASTER:
            safe_set_full_fp32_param(p, full.detach().float())
            # Every rank holds the full 16/32-bit model parameter at stages 1/2.
            p.data.copy_(full.detach().view_as(p).to(p.device, p.dtype))
            return
        mapping = p._hp_mapping
        if mapping is not None:
            hp, lp = mapping.hp_fragment_address, mapping.lp_fragment_address
            source = full.detach().flatten().narrow(0, lp.start, lp.numel)
            target = self.base.state[self._flat_of[id(p)]][key]
            target.narrow(0, hp.start, hp.numel).copy_(source.to(target.device, target.dtype))

    def get_full(self, p, key: str) -> torch.Tensor:
        if key == MASTER:
            return safe_get_full_fp32_param(p).float().view(p.shape).cpu()
        target = self.base.state[self._flat_of[id(p)]][key]
        buffer = torch.zeros(p.numel(), dtype=torch.float32, device=target.device)
        mapping = p._hp_mapping
        if mapping is not None:
            hp, lp = mapping.hp_fragment_address, mapping.lp_fragment_address
            buffer.narrow(0, lp.start, lp.numel).copy_(target.narrow(0, hp.start, hp.numel))
        # Each rank fills its fragment, zeros elsewhere: the sum is the full value.
        collectives.all_reduce_(buffer, group=p._dp_group)
        return buffer.view(p.shape).cpu()

    def index_bases(self) -> list[tuple[torch.Tensor, int]]:
        """(flat partition, the global element index of its element 0) for the compact state's
        stochastic rounding (optim/compact.py): the model's parameters are numbered one after the
        other in param-group order, as one process numbers them (ZeRO keeps the groups and their
        order), and each partition is a contiguous range of its flattened group, so one base serves
        all its elements. Raises when a partition is not such a range (a DeepSpeed that reorders a
        group, round_robin_gradients): its elements would round with other elements' bits."""
        offsets = element_offsets(p for params in self.groups for p in params)
        end = sum(p.numel() for params in self.groups for p in params)
        out = []
        for params, flat in self.partitions():
            bases = {offsets[id(p)] + p._hp_mapping.lp_fragment_address.start - p._hp_mapping.hp_fragment_address.start
                     for p in params if p._hp_mapping is not None}
            if len(bases) > 1:
                raise ValueError("optimizer.state_dtype bfloat16 under DeepSpeed needs each ZeRO partition to hold its "
                                 "group's parameters in order (their global element indices key the rounding); this "
                                 "engine's do not (zero_optimization.round_robin_gradients?): set it false, or use "
                                 "optimizer.state_dtype float32")
            # A partition of padding alone: no element of it is real, any base serves.
            out.append((flat, bases.pop() if bases else end))
        return out

    def real_slices(self):
        """(flat partition, start, numel) of every real (not padding) element range on this rank."""
        for params, flat in self.partitions():
            for p in params:
                if p._hp_mapping is not None:
                    hp = p._hp_mapping.hp_fragment_address
                    yield flat, hp.start, hp.numel

    def fragments(self, named_params, is_main: bool) -> list[Fragment]:
        """Checkpoint fragments: each parameter's range of this rank's flat partition (its fragment
        address: where in the flat partition, and where in the flattened parameter), for the master
        and every state tensor of the partition; the partition's step from the rank holding the
        parameter's first element. Parameters outside the optimizer (frozen) are whole on every
        rank and written by rank 0."""
        names = {id(p): n for n, p in named_params}
        out: list[Fragment] = []
        for params, flat in self.partitions():
            state = self.base.state.get(flat, {})
            for p in params:
                mapping = p._hp_mapping
                if mapping is None:  # no element of p on this rank
                    continue
                hp, lp = mapping.hp_fragment_address, mapping.lp_fragment_address
                out.append(Fragment(names[id(p)], CKPT_MASTER, flat.narrow(0, hp.start, hp.numel), lp.start))
                for field, value in state.items():
                    if field == STEP:
                        out.append(Fragment(names[id(p)], STEP, value, 0, lp.start == 0))
                    elif value.dim() == 1 and value.numel() == flat.numel():
                        out.append(Fragment(names[id(p)], field, value.narrow(0, hp.start, hp.numel), lp.start))
        held = {id(p) for params in self.groups for p in params}
        out.extend(whole_tensor_fragments([(n, p) for n, p in named_params if id(p) not in held], None, is_main))
        return out

    def after_load(self) -> None:
        """The 16/32-bit model parameters every rank holds at stages 1/2 are copies of the fp32
        masters: copy each rank's partition and all-gather them (DeepSpeed's own routine)."""
        self.zero.update_lp_params()

    def after_master_update(self) -> None:
        pass


class Zero3StateMap:
    """ZeRO stage 3: parameters carry ``ds_id``; the optimizer maps them to sub-group partitions."""

    def __init__(self, zero_optimizer, base_optimizer):
        self.zero = zero_optimizer
        self.base = base_optimizer
        self.groups = [list(g) for g in zero_optimizer.fp16_groups]
        self.flats = list(zero_optimizer.fp32_partitioned_groups_flat)

    def partitions(self):
        return list(zip(self.groups, self.flats))

    def set_full(self, p, key: str, full: torch.Tensor) -> None:
        # Not DeepSpeed's set_full_hp_param (see the module docstring): the same copy, padded.
        view, _ = self.zero._get_fp32_opt_state_partition(p, release_swap_buffers=False,
                                                           optim_state_key=None if key == MASTER else key)
        rank = self.zero._get_param_partition_rank(p)
        flat = full.detach().flatten().float()
        end = view.numel() * (rank + 1)
        if end > flat.numel():
            flat = torch.cat([flat, flat.new_zeros(end - flat.numel())])
        view.data.copy_(flat.narrow(0, view.numel() * rank, view.numel()).to(view.device, view.dtype))

    def get_full(self, p, key: str) -> torch.Tensor:
        value = safe_get_full_fp32_param(p) if key == MASTER else safe_get_full_optimizer_state(p, key)
        return value.float().view(full_shape(p)).cpu()

    def index_bases(self) -> list[tuple[torch.Tensor, int]]:
        raise ValueError("optimizer.state_dtype bfloat16 is not built for DeepSpeed ZeRO-3 (its sub-group "
                         "partitions are not numbered); valid: deepspeed.zero_stage 0, 1 or 2, or strategy.name fsdp")

    def real_slices(self):
        for params, flat in self.partitions():
            for p in params:
                _group, offset, numel = self.zero.grad_position[self.zero.get_param_id(p)]
                rank = self.zero._get_param_partition_rank(p)
                # The last rank's partition of a parameter ends in padding.
                real = max(0, min(numel, p.ds_numel - numel * rank))
                if real:
                    yield flat, offset, real

    def fragments(self, named_params, is_main: bool) -> list[Fragment]:
        """Checkpoint fragments: each parameter's partition (partition_numel * rank onwards in the
        flattened parameter, padding left out), for the master and every state tensor of the
        sub-group; the step from the rank holding the first partition. A parameter outside the
        optimizer (frozen) contributes its own partition of the model weights (ds_tensor)."""
        names = {id(p): n for n, p in named_params}
        out: list[Fragment] = []
        held = set()
        for params, flat in self.partitions():
            state = self.base.state.get(flat, {})
            for p in params:
                held.add(id(p))
                _group, start, numel = self.zero.grad_position[self.zero.get_param_id(p)]
                rank = self.zero._get_param_partition_rank(p)
                real = max(0, min(numel, p.ds_numel - numel * rank))
                if not real:
                    continue
                offset = numel * rank
                out.append(Fragment(names[id(p)], CKPT_MASTER, flat.narrow(0, start, real), offset))
                for field, value in state.items():
                    if field == STEP:
                        out.append(Fragment(names[id(p)], STEP, value, 0, offset == 0))
                    elif value.dim() == 1 and value.numel() == flat.numel():
                        out.append(Fragment(names[id(p)], field, value.narrow(0, start, real), offset))
        for name, p in named_params:
            if id(p) in held:
                continue
            numel = p.ds_tensor.numel()
            rank = self.zero._get_param_partition_rank(p)
            real = max(0, min(numel, p.ds_numel - numel * rank))
            if real:
                out.append(Fragment(name, CKPT_MASTER, p.ds_tensor.view(-1).narrow(0, 0, real), numel * rank))
        return out

    def after_load(self) -> None:
        self.after_master_update()

    def after_master_update(self) -> None:
        # The 16/32-bit partitions the forward pass gathers are copies of the fp32 masters.
        for sub_group in range(len(self.flats)):
            self.zero._reassign_or_swap_out_partitioned_parameters(sub_group)


class NoZeroStateMap:
    """Stage 0 in fp32: the optimizer holds the model's own parameters; nothing is partitioned."""

    def __init__(self, base_optimizer, params):
        self.base = base_optimizer
        self.params = list(params)

    def partitions(self):
        return [([p], p) for p in self.params]

    def set_full(self, p, key, full):
        target = p.data if key == MASTER else self.base.state[p][key]
        target.copy_(full.detach().view_as(target).to(target.device, target.dtype))

    def get_full(self, p, key):
        return (p.detach() if key == MASTER else self.base.state[p][key]).float().cpu().clone()

    def index_bases(self) -> list[tuple[torch.Tensor, int]]:
        """Nothing to give: the optimizer holds the model's own parameters and numbers them itself."""
        return []

    def real_slices(self):
        for p in self.params:
            yield p, 0, p.numel()

    def fragments(self, named_params, is_main: bool) -> list[Fragment]:
        """Whole tensors, the same on every rank: rank 0 writes them, every rank loads them."""
        return whole_tensor_fragments(named_params, self.base, is_main)

    def after_load(self) -> None:
        pass

    def after_master_update(self) -> None:
        pass


_LOSS_SCALER_FIELDS = ("cur_scale", "cur_iter", "last_overflow_iter", "cur_hysteresis")
_ENGINE_COUNTERS = ("global_steps", "global_samples", "skipped_steps")


def engine_extra_state(engine) -> dict:
    """The engine's step counters and (fp16) loss-scaler state, for a checkpoint."""
    state = {k: getattr(engine, k) for k in _ENGINE_COUNTERS if hasattr(engine, k)}
    scaler = getattr(engine.optimizer, "loss_scaler", None)
    if scaler is not None:
        state["loss_scaler"] = {k: getattr(scaler, k) for k in _LOSS_SCALER_FIELDS if hasattr(scaler, k)}
    return state


def load_engine_extra_state(engine, state) -> None:
    for key in _ENGINE_COUNTERS:
        if key in (state or {}) and hasattr(engine, key):
            setattr(engine, key, state[key])
    scaler = getattr(engine.optimizer, "loss_scaler", None)
    if scaler is not None and state and "loss_scaler" in state:
        for key, value in state["loss_scaler"].items():
            if hasattr(scaler, key):
                setattr(scaler, key, value)


def state_map_for(engine, base_optimizer, model_params):
    """The map matching how this engine holds the optimizer's tensors."""
    zero = engine.optimizer
    if hasattr(zero, "fp32_partitioned_groups_flat"):
        return Zero3StateMap(zero, base_optimizer)
    if hasattr(zero, "single_partition_of_fp32_groups") or hasattr(zero, "fp32_groups_flat_partition"):
        return Zero12StateMap(zero, base_optimizer)
    return NoZeroStateMap(base_optimizer, model_params)
