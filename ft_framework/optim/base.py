"""Common machinery of every optimizer in the registry: anchors (theta*) in optimizer state,
lazy state, the choice of a step program (optim/programs.py: C++ kernel, Triton, torch), telemetry
and checkpoints.

A concrete optimizer only says how its rule maps (group, step, has-anchor) to StepCoefficients.

The anchor protocol, which strategies use instead of reaching into the optimizer:

    opt.anchor_dtype                    # torch.float32, or torch.bfloat16 when asked for
    opt.set_anchor(p, theta_star)       # theta* of parameter p (sharded like p if p is a DTensor)
    opt.init_anchor(flat)               # a zero anchor for a flat partition, filled piece by piece
    opt.init_state(p)                   # step / exp_avg / exp_avg_sq, created if absent
    check_loaded_anchors(source, ...)   # the one check of the anchors a checkpoint brings
"""

from __future__ import annotations

import math
import warnings
from collections import defaultdict
from typing import Any, Iterable

import torch

from ft_framework.distributed import collectives
from ft_framework.optim.coefficients import StepCoefficients
from ft_framework.errors import UserError
from ft_framework.optim.compact import STATE_DTYPES, element_offsets, round_nearest_bf16
from ft_framework.optim.programs import StepProgram, impl_names, resolve_impl, step_program
from ft_framework.optim.torch_step import finite_flags
from ft_framework.optim.validation import PullOvershootWarning, check_ranges, overshoot_message, rule_max_pull

__all__ = ["ANCHOR_DTYPES", "CHILD_MASK", "IMPORTANCE", "AnchoredOptimizer", "PullOvershootWarning",
           "anchored_parameter_names", "check_loaded_anchors", "local_tensor"]

ANCHOR_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}
# Keys a param group may carry besides the optimizer's hyper-parameters.
GROUP_META_KEYS = frozenset({"params", "anchors", "anchored", "child_candidate", "param_names", "group_name",
                             "initial_lr"})
# Child-Tuning's mask (optim/child_tuning.py): optimizer state like the anchor, sharded like p;
# where present, step() multiplies the gradient by it before the rule.
CHILD_MASK = "child_mask"
# The normalised diagonal Fisher F~ of theta* (optim/importance.py): optimizer state like the anchor,
# sharded like p, bf16; where present, the pulls toward theta* weigh each element by it.
IMPORTANCE = "importance"


def local_tensor(t: torch.Tensor) -> torch.Tensor:
    """The rank-local shard of a DTensor (FSDP2), or the tensor itself; element-wise steps run on it."""
    return t.to_local() if hasattr(t, "to_local") else t


def _importance_of(state: dict[str, Any], pulls: bool, required: bool) -> torch.Tensor | None:
    """The step programs' importance (the last element of their rows, optim/programs.py): the local
    F~ of a parameter whose step pulls toward theta*, else None (the unweighted program). A rule
    that `required` it (EWC: without F~ it would silently be L2-SP) refuses to pull without it."""
    importance = state.get(IMPORTANCE) if pulls else None
    if importance is None and pulls and required:
        raise ValueError("this rule pulls toward theta* weighted by the importance F~, and a parameter has theta* but "
                         "no F~: capture it before the first step (optim.importance.capture_importance; in a config, "
                         "optimizer.importance)")
    return None if importance is None else local_tensor(importance)


def anchored_parameter_names(optimizer: torch.optim.Optimizer) -> set[str]:
    """Names of the parameters in `optimizer`'s anchored groups: the split ``build_param_groups``
    made, read from each group's ``anchored`` flag and ``param_names`` (which survive DeepSpeed's
    flattening of a group into partitions)."""
    names: set[str] = set()
    for i, group in enumerate(optimizer.param_groups):
        if group.get("anchored"):
            if "param_names" not in group:
                raise ValueError(f"anchored param group {group.get('group_name', i)!r} has no 'param_names'; build the "
                                 "groups with ft_framework.optim.build_param_groups")
            names.update(group["param_names"])
    return names


def check_loaded_anchors(source: str, entries: Iterable[tuple[str | int, tuple[int, ...] | None,
                                                          tuple[int, ...], bool]]) -> None:
    """The one check of the anchors (theta*) a checkpoint brings, before anything is loaded.

    `entries` holds, per parameter: its name (or index), the shape of its anchor in the checkpoint
    (None when the checkpoint has none), the shape that anchor must have, and whether this
    optimizer anchors the parameter. A missing anchor would silently turn RecAdam into Adam (or
    re-anchor to the current weights), a mis-shaped one means another model: both are errors.
    """
    for name, saved, want, anchored in entries:
        label = repr(name) if isinstance(name, str) else str(name)
        if saved is None:
            if anchored:
                raise ValueError(
                    f"{source} has no anchor (theta*) for parameter {label}, which this optimizer anchors; "
                    "loading it would silently drop the pull toward the pretrained weights. Load a "
                    "checkpoint saved with anchors, or build the optimizer without anchors")
            continue
        if tuple(saved) != tuple(want):
            raise ValueError(f"{source}: anchor (theta*) for parameter {label} has shape {tuple(saved)}, "
                             f"the parameter has {tuple(want)}: wrong or corrupted checkpoint")


# Elements per fp64 chunk of forgetting_sq_sum on CPU (512 KiB: stays in L2).
_FORGETTING_CHUNK = 1 << 16


class AnchoredOptimizer(torch.optim.Optimizer):
    """Base class: Adam-family rule + optional anchors, stepped by one step program (``impl``).

    Param groups may carry ``"anchors"``: a list aligned with ``"params"`` whose entries are the
    pretrained tensors (or None). They are copied into ``state[p]["anchor"]`` and removed from the
    group, so they are partitioned, offloaded and checkpointed like ``exp_avg``. Strategies that
    wrap or partition the parameters build the optimizer without anchors and place them
    afterwards with `set_anchor` / `init_anchor` (Strategy.place_anchors).
    """

    # A rule whose pull means nothing without the importance F~ (EWC) sets this: its step then
    # refuses an anchored parameter that has none (the config refuses such a run earlier).
    needs_importance: bool = False

    def __init__(self, params: Iterable, defaults: dict[str, Any], impl: str = "auto",
                 anchor_dtype: str = "float32", state_dtype: str = "float32", rounding_seed: int = 0):
        if impl not in impl_names():
            raise ValueError(f"unknown impl {impl!r}; valid: {', '.join(impl_names())}")
        if anchor_dtype not in ANCHOR_DTYPES:
            raise ValueError(f"unknown anchor_dtype {anchor_dtype!r}; valid: {', '.join(ANCHOR_DTYPES)}")
        if state_dtype not in STATE_DTYPES:
            raise ValueError(f"unknown state_dtype {state_dtype!r}; valid: {', '.join(STATE_DTYPES)}")
        if state_dtype == "bfloat16" and anchor_dtype != "bfloat16":
            raise ValueError("state_dtype 'bfloat16' keeps theta* in bf16 (the compact state's anchor): pass "
                             "anchor_dtype='bfloat16' too")
        # The compact state (optim/compact.py): bf16 moments, theta* + delta masters, and the seed
        # of the stochastic rounding's key.
        self.state_dtype: torch.dtype = STATE_DTYPES[state_dtype]
        self.compact = state_dtype == "bfloat16"
        self.rounding_seed = int(rounding_seed)
        self._shard_offsets: dict[int, int] = {}  # set_shard_offset
        self._given_index_bases: dict[int, int] = {}  # set_index_base
        # An anchored parameter's compact master: delta = theta - theta* (the default), or the
        # parameter itself where another library owns the fp32 master (keep_masters_in_params).
        self.delta_masters = True
        # The compact state's undo copies (step_tensors' keep_undo), per parameter id: the parameter,
        # the step count they undo, and its old bf16 m and v and old master (delta, or the parameter
        # itself where there is no anchor). Stochastic rounding has no inverse, so a speculative
        # compact step is undone from these: 8 bytes per parameter, kept (and reused) between steps.
        self._undo: dict[int, tuple[torch.Tensor, int, torch.Tensor, torch.Tensor, torch.Tensor]] = {}
        # Parameters of the bf16 weight form (keep_bf16_weight): no fp32 weight, their data the bf16
        # buffer each step writes theta* + delta into.
        self._bf16_weights: set[int] = set()
        if impl != "auto" and (why := step_program(impl).unavailable()) is not None:
            raise RuntimeError(why)  # e.g. the kernel's build instructions
        self._requested_impl = impl
        self.anchor_dtype: torch.dtype = ANCHOR_DTYPES[anchor_dtype]
        self._warned_overshoot: set[int] = set()
        # While set (a Fisher pass, optim/fisher.py), step() and step_tensors() hand it each
        # (tensor, gradient, param group) instead of stepping: it reads each strategy's reduced (and
        # sharded) gradients where they arrive.
        self.gradient_sink = None
        super().__init__(params, defaults)
        self._resolved_impl = self._resolve_impl()

    # ---- construction -------------------------------------------------------------------
    def add_param_group(self, param_group: dict[str, Any]) -> None:
        self._group_index = {}  # _groups_of's cache
        self._index_bases = None  # index_base's cache
        anchors = param_group.pop("anchors", None) if isinstance(param_group, dict) else None
        # Whether the group is anchored is decided here, once, and carried by the group: every
        # placement of theta* (strategies, integrations) and the step read this flag.
        anchored = param_group.setdefault("anchored", anchors is not None)
        if anchors is not None and (not anchored or any(a is None for a in anchors)):
            raise ValueError("a param group's 'anchors' must hold theta* for every one of its parameters (and the "
                             "group must not say 'anchored': False); put parameters without theta* in a group of "
                             "their own")
        unknown = set(param_group) - set(self.defaults) - GROUP_META_KEYS if isinstance(param_group, dict) else set()
        if unknown:
            raise ValueError(
                f"unknown param-group key(s) {sorted(unknown)} for {type(self).__name__}; valid: "
                f"{sorted(set(self.defaults) | GROUP_META_KEYS)}"
            )
        super().add_param_group(param_group)
        group = self.param_groups[-1]
        self.validate_group(group)
        self._warn_if_overshoot(len(self.param_groups) - 1, group, stacklevel=5)
        if anchors is not None:
            params = group["params"]
            if len(anchors) != len(params):
                raise ValueError(f"'anchors' has {len(anchors)} entries but 'params' has {len(params)}")
            for p, a in zip(params, anchors):
                self.set_anchor(p, a)

    def validate_group(self, group: dict[str, Any]) -> None:
        """Checks a group's hyper-parameters (the same ranges the config checks at load)."""
        check_ranges(group)

    def set_anchor(self, p: torch.Tensor, anchor: torch.Tensor, *, copy: bool = True) -> None:
        """Stores theta* for parameter p, on p's device, in the anchor dtype.

        With ``copy=False`` the caller hands the tensor over: it is kept as it is when device and
        dtype already match (a strategy placing the loaded theta* needs no second copy of it). The
        optimizer never writes into an anchor; loading a checkpoint replaces it.

        For a sharded DTensor parameter (FSDP2) a full anchor is sharded like p, locally on each
        rank (every rank holds the full pretrained value while loading, so no communication); the
        local shard is always a new tensor, so the full one can be freed.
        """
        if tuple(anchor.shape) != tuple(p.shape):
            raise ValueError(f"anchor shape {tuple(anchor.shape)} does not match parameter shape {tuple(p.shape)}")
        anchor = anchor.detach()
        if hasattr(p, "device_mesh") and not hasattr(anchor, "device_mesh"):
            from torch.distributed.tensor import distribute_tensor

            shard = distribute_tensor(anchor.to(dtype=self.anchor_dtype), p.device_mesh, p.placements,
                                      src_data_rank=None).to_local()
            # Laid out like p with its shard where p's shard is: FSDP2's CPU offload keeps host
            # shards on a CUDA mesh, and distribute_tensor (and DTensor.from_local) put a shard on
            # the mesh's device; zeros_like keeps p's, as it does for the moments.
            placed = torch.zeros_like(p, dtype=self.anchor_dtype)
            local_tensor(placed).copy_(shard)
            self.state[p]["anchor"] = placed
            return
        self.state[p]["anchor"] = anchor.to(device=p.device, dtype=self.anchor_dtype, copy=copy)

    def init_anchor(self, p: torch.Tensor) -> torch.Tensor:
        """A zero anchor for p (its shape and device, the anchor dtype), stored and returned.

        For a flat partition holding pieces of several parameters (DeepSpeed ZeRO): the strategy
        fills it piece by piece, so each rank only ever holds its own part of theta*.
        """
        anchor = torch.zeros_like(p, dtype=self.anchor_dtype)
        self.state[p]["anchor"] = anchor
        return anchor

    def init_state(self, p: torch.Tensor) -> dict[str, Any]:
        """p's state with step, exp_avg and exp_avg_sq, created (as zeros) where absent; in the
        compact state, an anchored parameter's delta = theta - theta* too.

        State is lazy, because under ZeRO-3 the parameters only exist inside step(); a loader that
        fills a template (torch.distributed.checkpoint) calls this first so every key exists.
        """
        state = self.state[p]
        if "step" not in state:
            state["step"] = torch.tensor(0.0, dtype=torch.float32)
        for key in ("exp_avg", "exp_avg_sq"):
            if key not in state:
                state[key] = torch.zeros_like(p, dtype=self.state_dtype if self.compact else None,
                                              memory_format=torch.preserve_format)
        if self.compact and self.delta_masters and "anchor" in state and "delta" not in state:
            state["delta"] = p.detach().float() - state["anchor"].float()
        return state

    def keep_masters_in_params(self) -> None:
        """For a strategy whose library owns the fp32 master weights (DeepSpeed's flat partitions,
        which it copies into the model after each step): the compact state then keeps no delta, the
        parameter stays the master and the pull reads theta - theta*, rounded once in fp32. Call it
        before any state exists."""
        if any("delta" in state or "exp_avg" in state for state in self.state.values()):
            raise RuntimeError("keep_masters_in_params: the optimizer already holds state; call it before "
                               "the first step and before loading a checkpoint")
        self.delta_masters = False

    def keep_bf16_weight(self, p: torch.Tensor, weight: torch.Tensor) -> None:
        """The bf16 weight form, for the device-lean offload: anchored parameter p of the compact
        state, whose master is delta, keeps no fp32 weight. p's data becomes `weight` (bf16, p's
        shape, on p's device), into which every step writes the new weight theta* + delta rounded to
        bf16 (formed in registers, never stored in fp32); between steps its holder may keep anything
        there (the offload lands the next gradient in it, which the step then reads and overwrites).
        Readers of the weight go through theta* + delta: the forgetting distance reads delta. Call it
        once p's state exists (init_state), after theta* is placed."""
        state = self.state.get(p, {})
        if not (self.compact and self.delta_masters and "delta" in state):
            raise ValueError("keep_bf16_weight: only an anchored parameter of the compact state whose master is delta "
                             "(init_state first) can drop its fp32 weight")
        if weight.dtype != torch.bfloat16 or tuple(weight.shape) != tuple(p.shape) or weight.device != p.device:
            raise ValueError(f"keep_bf16_weight: the weight must be bfloat16 of shape {tuple(p.shape)} on {p.device}, "
                             f"got {weight.dtype} {tuple(weight.shape)} on {weight.device}")
        p.data = weight
        self._bf16_weights.add(id(p))

    def has_bf16_weight(self, p: torch.Tensor) -> bool:
        """Whether p keeps no fp32 weight (keep_bf16_weight): its weight is theta* + delta."""
        return id(p) in self._bf16_weights

    def set_index_base(self, p: torch.Tensor, base: int) -> None:
        """The global element index of p's first element, given whole: for a flat partition whose
        elements come from several parameters (DeepSpeed ZeRO), which only the strategy can read.
        The compact state's rounding keys each element on it as one process would."""
        self._given_index_bases[id(p)] = int(base)

    def set_shard_offset(self, p: torch.Tensor, offset: int) -> None:
        """Where p's local piece starts inside its full parameter, for a sharded p (an FSDP2
        DTensor): the compact state's rounding then keys each element on its index in the full
        model, as one process would."""
        self._shard_offsets[id(p)] = int(offset)

    def index_base(self, p: torch.Tensor) -> int:
        """The global element index of p's first local element: its parameter's place in the
        param-group numbering of the full model (compact.element_offsets) plus its shard offset,
        or the base a strategy gave (set_index_base)."""
        if id(p) in self._given_index_bases:
            return self._given_index_bases[id(p)]
        if id(p) not in self._shard_offsets and local_tensor(p).numel() != p.numel():
            # Numbered from its parameter's base, a shard would take another shard's rounding bits.
            raise ValueError("the compact state's rounding needs the global element index of a sharded parameter's "
                             "local piece: call set_shard_offset on it (FSDPStrategy does, through "
                             "number_local_pieces)")
        if self._index_bases is None:
            self._index_bases = element_offsets(q for g in self.param_groups for q in g["params"])
        return self._index_bases[id(p)] + self._shard_offsets.get(id(p), 0)

    def _resolve_impl(self) -> str:
        """The requested program, or for 'auto' the first that takes every (local) parameter:
        'cpu' for CPU fp32 tensors with the kernel built, 'triton' for CUDA tensors where triton
        imports, else 'torch' (optim/programs.py)."""
        # A bf16-weight parameter is stepped through the bf16 form, which every program takes.
        return resolve_impl(self._requested_impl, [local_tensor(p) for g in self.param_groups for p in g["params"]
                                                   if id(p) not in self._bf16_weights])

    @property
    def impl(self) -> str:
        """The step program in use: 'cpu', 'triton' or 'torch' ('auto' until params are seen)."""
        return self._resolved_impl

    @property
    def _program(self) -> StepProgram:
        if self._resolved_impl == "auto":
            self._resolved_impl = self._resolve_impl()
        return step_program(self._resolved_impl)

    # ---- the rule ------------------------------------------------------------------------
    def coefficients(self, group: dict[str, Any], step: int, has_anchor: bool) -> StepCoefficients:
        raise NotImplementedError

    def group_lambda(self, group: dict[str, Any], step: int) -> float | None:
        """lambda(t) of the group at step t, for optimizers that anneal (None otherwise)."""
        return None

    # ---- step ----------------------------------------------------------------------------
    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        if self.gradient_sink is not None:
            self.gradient_sink([(p, p.grad, group) for group in self.param_groups for p in group["params"]])
            return loss
        if self._requested_impl == "auto":
            # DeepSpeed and FSDP swap in their own (e.g. CPU-offloaded) tensors after construction.
            self._resolved_impl = self._resolve_impl()
        for gi, group in enumerate(self.param_groups):
            buckets: dict[tuple, list] = defaultdict(list)
            # A group's coefficients depend on (step, anchored) only: computed once per pair, not
            # per tensor (a model's hundreds of small tensors made that a cost of its own).
            plans: dict[tuple[int, bool], StepCoefficients] = {}
            steps = []
            for p in group["params"]:
                if p.grad is None:
                    continue
                if p.grad.is_sparse:
                    raise RuntimeError(f"{type(self).__name__} does not support sparse gradients")
                state = self.init_state(p)
                if CHILD_MASK in state:  # before any rule reads the gradient, for both impls
                    local_tensor(p.grad).mul_(local_tensor(state[CHILD_MASK]))
                t = int(state["step"].item()) + 1
                anchor = state.get("anchor")
                if anchor is None and group["anchored"]:
                    raise ValueError(f"{type(self).__name__}: a parameter of the anchored param group "
                                     f"{group.get('group_name', gi)!r} has no theta* (anchor); place theta* after "
                                     "wrapping the model (Strategy.place_anchors, integrations.loops.place_anchors, "
                                     "integrations.transformers.install_callbacks) before the first step")
                plan = (t, anchor is not None)
                if plan not in plans:
                    plans[plan] = self.coefficients(group, t, anchor is not None)
                c = plans[plan]
                with_anchor = anchor is not None and self._reads_anchor(c)
                key = (c, local_tensor(p).device, p.dtype, with_anchor, t if self.compact else None)
                buckets[key].append(p)
                steps.append(state["step"])
            if steps:
                torch._foreach_add_(steps, 1)
            if any(with_anchor for _c, _device, _dtype, with_anchor, _t in buckets):
                # a schedule (or the user) may have raised lr since the group was checked
                self._warn_if_overshoot(gi, group, stacklevel=4)
            for (c, _device, _dtype, with_anchor, t), ps in buckets.items():
                if self.compact:
                    self._apply_compact(ps, [p.grad for p in ps], c, with_anchor, t)
                else:
                    self._apply(ps, c, with_anchor)
        return loss

    def _reads_anchor(self, c: StepCoefficients) -> bool:
        """Whether the step of an anchored parameter with coefficients `c` reads theta*: the rule
        pulls toward it, or the compact state's master is delta (theta* + delta is written whether
        the rule pulls or not)."""
        return c.uses_anchor or (self.compact and self.delta_masters)

    def _apply_compact(self, ps: list[torch.Tensor], grads: list[torch.Tensor], c: StepCoefficients,
                       with_anchor: bool, t: int, num_threads: int | None = None,
                       weights: list[torch.Tensor | None] | None = None) -> None:
        """The compact step of `ps`; where a bf16 weight is wanted (weights[i], or p itself for a
        parameter of the bf16 weight form) through the program's bf16 form."""
        states = [self.state[p] for p in ps]
        grads = [local_tensor(g) for g in grads]
        ms = [local_tensor(s["exp_avg"]) for s in states]
        vs = [local_tensor(s["exp_avg_sq"]) for s in states]
        deltas = [local_tensor(s["delta"]) if with_anchor and self.delta_masters else None for s in states]
        anchors = [local_tensor(s["anchor"]) if with_anchor else None for s in states]
        importances = [_importance_of(s, with_anchor and c.uses_anchor, self.needs_importance) for s in states]
        bases = [self.index_base(p) for p in ps]
        weights = [local_tensor(p) if id(p) in self._bf16_weights else None if weights is None else
                   None if weights[i] is None else local_tensor(weights[i]) for i, p in enumerate(ps)]
        plain, bf16 = [], []
        for p, g, m, v, d, a, base, w, f in zip(ps, grads, ms, vs, deltas, anchors, bases, weights, importances):
            if w is None:
                plain.append((local_tensor(p), g, m, v, d, a, base, f))
            elif d is not None and id(p) not in self._bf16_weights:
                raise ValueError("a bf16 weight for a delta master that keeps its fp32 weight would leave that weight "
                                 "stale: drop it first (keep_bf16_weight)")
            else:
                bf16.append((None if d is not None else local_tensor(p), g, m, v, d, a, base, w, f))
        if plain:
            self._program.step_compact(plain, c, self.rounding_seed, t, num_threads=num_threads)
        if bf16:
            self._program.step_compact_bf16(bf16, c, self.rounding_seed, t, num_threads=num_threads)

    def _apply(self, ps: list[torch.Tensor], c: StepCoefficients, with_anchor: bool) -> None:
        states = [self.state[p] for p in ps]
        params = [local_tensor(p) for p in ps]
        grads = [local_tensor(p.grad) for p in ps]
        ms = [local_tensor(s["exp_avg"]) for s in states]
        vs = [local_tensor(s["exp_avg_sq"]) for s in states]
        anchors = [local_tensor(s["anchor"]) for s in states] if with_anchor else [None] * len(params)
        importances = [_importance_of(s, with_anchor, self.needs_importance) for s in states]
        self._program.step(list(zip(params, grads, ms, vs, anchors, importances)), c)

    # ---- speculative steps, one tensor at a time (the overlapped offload) ------------------
    def _step_plan(self, p: torch.Tensor, group: dict[str, Any], t: int) -> tuple[StepCoefficients, bool]:
        anchor = self.state[p].get("anchor")
        c = self.coefficients(group, t, anchor is not None)
        return c, anchor is not None and c.uses_anchor

    def _groups_of(self, ps: list[torch.Tensor]) -> list[dict[str, Any]]:
        # Cached across calls (the overlapped offload calls this per bucket, many times a step);
        # rebuilt when a tensor is not found as itself (DeepSpeed and FSDP swap tensors in).
        index = self.__dict__.get("_group_index") or {}
        if any(index.get(id(p), (None,))[0] is not p for p in ps):
            index = {id(q): (q, g) for g in self.param_groups for q in g["params"]}
            self._group_index = index
        missing = [i for i, p in enumerate(ps) if index.get(id(p), (None,))[0] is not p]
        if missing:
            raise ValueError(f"{len(missing)} tensor(s) are not parameters of this optimizer")
        return [index[id(p)][1] for p in ps]

    def _tensors(self, p: torch.Tensor, grad: torch.Tensor, with_anchor: bool):
        state = self.state[p]
        return (local_tensor(p), local_tensor(grad), local_tensor(state["exp_avg"]),
                local_tensor(state["exp_avg_sq"]), local_tensor(state["anchor"]) if with_anchor else None,
                _importance_of(state, with_anchor, self.needs_importance))

    @torch.no_grad()
    def step_tensors(self, ps: list[torch.Tensor], grads: list[torch.Tensor] | None = None,
                     num_threads: int | None = None, known_finite: bool = False,
                     keep_undo: bool = False,
                     weights: list[torch.Tensor | None] | None = None) -> list[StepCoefficients | None]:
        """Steps each parameter of `ps` on its own, with `grads` (default: each ``p.grad``), as
        step() would: the same coefficients and arithmetic, so a step split over several calls
        equals one step().

        A tensor whose gradient holds a NaN or an infinity is left untouched (step count
        included): such a step could never be undone. Returns, per tensor, the coefficients its
        step used (what `rollback_tensors` needs), or None where it was left untouched.
        `known_finite`: the caller has checked the gradients already (a finite norm), so the
        kernel's own check, one more pass over each gradient, is skipped.
        `keep_undo`: the step may be rolled back (a speculative step). The fp32 state needs nothing
        for that, except where the pull is weighted by an importance (IMPORTANCE): an element pulled
        onto theta* (min(w * F~, 1) = 1) has no inverse, so such a tensor's m, v and weight are
        copied first, as the compact state copies what its rollback restores.
        `weights` (the compact state only): per tensor a bf16 tensor that receives the new weight
        rounded to nearest even (it may be the tensor's bf16 gradient: read first), or None; a
        parameter of the bf16 weight form (keep_bf16_weight) writes its own data without one.
        """
        grads = [p.grad for p in ps] if grads is None else grads
        if self.gradient_sink is not None:
            self._hand_to_sink(ps, grads, weights)
            return [None] * len(ps)
        if self._resolved_impl == "auto":
            self._resolved_impl = self._resolve_impl()
        if self.compact:
            return self._step_tensors_compact(ps, grads, num_threads, known_finite, keep_undo, weights)
        if weights is not None:
            raise ValueError("step_tensors(weights=...): the bf16 weight form is the compact state's "
                             "(optimizer.state_dtype bfloat16)")
        used: list[StepCoefficients | None] = []
        plans: dict[tuple, tuple[StepCoefficients, bool]] = {}  # per (group, step, anchored) in this call
        # Known-finite steps go in one program call per set of coefficients (after the loop), and
        # their step counts move once those calls succeed.
        batched: dict[tuple, list] = defaultdict(list)
        batched_states = []
        for p, g, group in zip(ps, grads, self._groups_of(ps)):
            if g is None:
                used.append(None)
                continue
            state = self.init_state(p)
            t = int(state["step"].item()) + 1
            key = (id(group), t, "anchor" in state)
            if key not in plans:
                plans[key] = self._step_plan(p, group, t)
                if plans[key][1]:  # as in step(): warn once per group when a pull overshoots
                    self._warn_if_overshoot(next(i for i, q in enumerate(self.param_groups) if q is group), group,
                                            stacklevel=4)
            c, with_anchor = plans[key]
            tensors = self._tensors(p, g, with_anchor)
            if keep_undo and tensors[-1] is not None:  # weighted by F~: restored from copies, not inverted
                self._keep_undo(p, state, t - 1)
            if known_finite:
                batched[key].append(tensors)
                batched_states.append(state)
                used.append(c)
                continue
            ok = self._program.guarded_step(tensors, c, num_threads=num_threads)
            if ok:
                state["step"] += 1
            used.append(c if ok else None)
        for key, tensors in batched.items():
            self._program.step(tensors, plans[key][0], num_threads=num_threads)
        if batched_states:  # as in step(): the counts in one foreach op, not one add per tensor
            torch._foreach_add_([state["step"] for state in batched_states], 1)
        return used

    @torch.no_grad()
    def _hand_to_sink(self, ps: list[torch.Tensor], grads: list[torch.Tensor | None],
                      weights: list[torch.Tensor | None] | None) -> None:
        """step_tensors while a Fisher pass reads the gradients: nothing steps, and a bf16 weight the
        caller asked for (which may hold the gradient: read first) receives the weight as it is, as a
        step would have written it (a parameter of the bf16 weight form: theta* + delta rounded to
        nearest even)."""
        self.gradient_sink(list(zip(ps, grads, self._groups_of(ps))))
        for i, p in enumerate(ps):
            if id(p) in self._bf16_weights:
                state = self.state[p]
                local_tensor(p).copy_(round_nearest_bf16(local_tensor(state["anchor"]).float()
                                                         + local_tensor(state["delta"])))
            elif weights is not None and weights[i] is not None:
                local_tensor(weights[i]).copy_(round_nearest_bf16(local_tensor(p).float()))

    def _step_tensors_compact(self, ps, grads, num_threads, known_finite, keep_undo: bool,
                              weights=None) -> list[StepCoefficients | None]:
        """step_tensors in the compact state: tensor by tensor, a non-finite gradient leaves its
        tensor untouched (as the guarded fp32 step)."""
        used: list[StepCoefficients | None] = []
        weights = [None] * len(ps) if weights is None else weights
        for p, g, group, weight in zip(ps, grads, self._groups_of(ps), weights):
            if g is None or not (known_finite or finite_flags([local_tensor(g)])[0]):
                used.append(None)
                continue
            state = self.init_state(p)
            t = int(state["step"].item()) + 1
            anchored = "anchor" in state
            c = self.coefficients(group, t, anchored)
            if anchored and c.uses_anchor:
                self._warn_if_overshoot(next(i for i, q in enumerate(self.param_groups) if q is group), group,
                                        stacklevel=4)
            if keep_undo:
                self._keep_undo(p, state, t - 1)
            self._apply_compact([p], [g], c, anchored and self._reads_anchor(c), t, num_threads, [weight])
            state["step"] += 1
            used.append(c)
        return used

    def _keep_undo(self, p: torch.Tensor, state: dict[str, Any], step: int) -> None:
        """Copies p's state (m, v and its master: delta, or p itself) before its step `step + 1`, into
        the buffers of an earlier copy: the compact state's, or an importance-weighted fp32 step's."""
        master = state["delta"] if "delta" in state else p
        now = [local_tensor(x) for x in (state["exp_avg"], state["exp_avg_sq"], master)]
        kept = self._undo.get(id(p))
        if kept is None or kept[0] is not p:
            copies = [x.clone() for x in now]
        else:
            copies = list(kept[2:])
            for copy, x in zip(copies, now):
                copy.copy_(x)
        self._undo[id(p)] = (p, step, *copies)

    def _rollback_compact(self, ps: list[torch.Tensor]) -> None:
        """Restores each parameter's compact state from the copies its last step kept, bit for bit:
        the parameter of an anchored tensor is written as anchor + delta, as every step writes it."""
        for p in ps:
            self._restore_undo(p, "compact")

    def _restore_undo(self, p: torch.Tensor, what: str) -> None:
        """Restores p's state from the copies step_tensors(keep_undo=True) kept before its last step,
        bit for bit, and moves its step count back by one."""
        state = self.state[p]
        kept = self._undo.get(id(p))
        if kept is None or kept[0] is not p or kept[1] != int(state["step"].item()) - 1:
            raise RuntimeError(f"rollback_tensors: this {what} step was taken without keep_undo=True, so "
                               "there is nothing to restore it from")
        _, _, m, v, master = kept
        local_tensor(state["exp_avg"]).copy_(m)
        local_tensor(state["exp_avg_sq"]).copy_(v)
        if "delta" in state:
            local_tensor(state["delta"]).copy_(master)
            weight = local_tensor(state["anchor"]).float() + master
            # a bf16-weight parameter: the kernel's rounding of theta* + delta, its NaN too
            local_tensor(p).copy_(round_nearest_bf16(weight) if id(p) in self._bf16_weights else weight)
        else:
            local_tensor(p).copy_(master)
        state["step"] -= 1

    @torch.no_grad()
    def rollback_tensors(self, ps: list[torch.Tensor], grads: list[torch.Tensor] | None,
                         coefficients: list[StepCoefficients], num_threads: int | None = None) -> None:
        """Undoes the last step of each parameter, taken with `grads` and `coefficients` (what
        step_tensors returned). The fp32 state: from the stepped state alone, the inverse element
        program of cpp/step_args.h, exact to a few ulp, with no saved copy (a pull weighted by an
        importance: from the copies step_tensors(keep_undo=True) kept, bit for bit). The compact state: from
        the copies step_tensors(keep_undo=True) kept, bit for bit (stochastic rounding has no
        inverse). The step count goes back by one."""
        if self.compact:
            self._rollback_compact(ps)
            return
        grads = [p.grad for p in ps] if grads is None else grads
        for p, g, c in zip(ps, grads, coefficients):
            state = self.state[p]
            with_anchor = state.get("anchor") is not None and c.uses_anchor
            tensors = self._tensors(p, g, with_anchor)
            if tensors[-1] is not None:  # a pull weighted by F~ may have reached theta*: from the copies
                self._restore_undo(p, "importance-weighted")
                continue
            self._program.inverse(tensors, c, num_threads=num_threads)
            state["step"] -= 1

    def coefficients_changed(self, ps: list[torch.Tensor], used: list[StepCoefficients]) -> bool:
        """Whether the last step of any parameter of `ps`, taken with `used` (what step_tensors
        returned), would have other coefficients now (its group's current hyper-parameters at its
        current step count): a speculative step whose lr changed after it ran must be redone.
        One parameter answers for all of its group that stepped with equal coefficients (a step
        of hundreds of tensors needs one coefficient plan per group, not one per tensor)."""
        sample: dict[tuple, tuple[torch.Tensor, dict[str, Any]]] = {}
        for p, g, c in zip(ps, self._groups_of(ps), used):
            sample.setdefault((id(g), c, "anchor" in self.state[p]), (p, g))
        return any(self._step_plan(p, g, int(self.state[p]["step"].item()))[0] != c
                   for (_, c, _), (p, g) in sample.items())

    def _warn_if_overshoot(self, group_index: int, group: dict[str, Any], stacklevel: int) -> None:
        """Warns once per group when the rule's strongest pull (its `max_pull`, the formula the
        config checks too) removes at least 1 x (theta - theta*) in one step."""
        if group_index in self._warned_overshoot:
            return
        factor = rule_max_pull(type(self), group)
        if factor >= 1.0:
            self._warned_overshoot.add(group_index)
            warnings.warn(overshoot_message(factor, f"{type(self).__name__} param group {group_index}"),
                          PullOvershootWarning, stacklevel=stacklevel)

    # ---- telemetry -----------------------------------------------------------------------
    def group_steps(self) -> list[int]:
        """The step count t of each group (of its first parameter that has taken a step; 0 before).

        Under ZeRO-3 the groups hold no parameters outside step(): the latest step in the state is used.
        """
        latest = max((int(s["step"].item()) for s in self.state.values() if "step" in s), default=0)
        out = []
        for group in self.param_groups:
            if not group["params"]:
                out.append(latest)
                continue
            out.append(next((int(self.state[p]["step"].item()) for p in group["params"]
                             if "step" in self.state.get(p, {})), 0))
        return out

    def current_lambdas(self) -> list[float | None]:
        """lambda(t) per param group at its current step (None where the rule does not anneal)."""
        return [self.group_lambda(g, t) for g, t in zip(self.param_groups, self.group_steps())]

    def forgetting_sq_sum(self) -> torch.Tensor:
        """Sum over this process's anchored elements of (theta - theta*)^2, as a float64 scalar."""
        # Iterates the state, not param_groups: ZeRO-3 empties the groups outside step().
        # fp64 differences (exact for fp32/bf16 inputs), in cache-sized chunks through one buffer on
        # CPU, on one thread: 8-10x faster than whole-tensor .double() copies on an idle machine and
        # 50-100x on a busy one (thousands of small multi-threaded ops), which made logging cost more
        # than the optimizer step (benchmarks/hf_trainer_compare.py).
        threads = torch.get_num_threads()
        torch.set_num_threads(1)
        try:
            return self._forgetting_sq_sum_chunked()
        finally:
            torch.set_num_threads(threads)

    def _forgetting_sq_sum_chunked(self) -> torch.Tensor:
        total = torch.zeros((), dtype=torch.float64)
        buffers: dict[torch.device, torch.Tensor] = {}
        for p, state in self.state.items():
            anchor = state.get("anchor")
            if anchor is None:
                continue
            theta, theta_star = local_tensor(p).detach().reshape(-1), local_tensor(anchor).reshape(-1)
            if id(p) in self._bf16_weights:  # no fp32 weight: theta - theta* is delta, exactly
                theta, theta_star = local_tensor(state["delta"]).reshape(-1), None
            chunk = _FORGETTING_CHUNK if theta.device.type == "cpu" else max(1, theta.numel())
            if theta.device not in buffers or buffers[theta.device].numel() < min(chunk, theta.numel()):
                buffers[theta.device] = torch.empty(min(chunk, theta.numel()), dtype=torch.float64,
                                                    device=theta.device)
            buf = buffers[theta.device]
            for start in range(0, theta.numel(), chunk):
                n = min(chunk, theta.numel() - start)
                diff = buf[:n]
                diff.copy_(theta[start:start + n])
                if theta_star is not None:
                    diff.sub_(theta_star[start:start + n])
                total += torch.dot(diff, diff).cpu()
        return total

    def forgetting_distance(self, reduce_group=None, all_reduce: bool = False) -> float:
        """||theta - theta*||_2 over all anchored parameters.

        With sharded parameters (ZeRO, FSDP) each rank holds a disjoint shard: pass
        ``all_reduce=True`` (and optionally a process group) to sum the shards with one all-reduce.
        Do not all-reduce replicated parameters (plain DDP): that would count them once per rank.
        """
        sq = self.forgetting_sq_sum()
        if all_reduce:
            sq = collectives.all_reduce(sq, group=reduce_group)
        return math.sqrt(float(sq))

    # ---- checkpoints ---------------------------------------------------------------------
    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Loads like torch, keeping anchors in their stored dtype, and refusing to lose them
        (check_loaded_anchors)."""
        saved_groups = state_dict["param_groups"]
        own_params = [p for g in self.param_groups for p in g["params"]]
        saved_ids = [i for g in saved_groups for i in g["params"]]
        if len(saved_ids) != len(own_params):
            raise ValueError(f"checkpoint has {len(saved_ids)} parameters, this optimizer has {len(own_params)}")
        saved_state = state_dict["state"]
        own_anchored = [g["anchored"] for g in self.param_groups]
        # The load must not drop an anchor this optimizer holds (one not placed yet is not lost:
        # Accelerate's prepare round-trips the state before place_anchors).
        check_loaded_anchors("checkpoint", (
            (idx, tuple(saved_state.get(idx, {})["anchor"].shape) if "anchor" in saved_state.get(idx, {}) else None,
             tuple(p.shape), "anchor" in self.state.get(p, {}))
            for idx, p in zip(saved_ids, own_params)))
        anchors = {idx: saved_state[idx]["anchor"] for idx in saved_ids if "anchor" in saved_state.get(idx, {})}
        # torch would cast a bf16-weight parameter's delta to bf16 (its dtype): kept fp32 below.
        deltas = {idx: saved_state[idx]["delta"] for idx, p in zip(saved_ids, own_params)
                  if id(p) in self._bf16_weights and "delta" in saved_state.get(idx, {})}
        saved_dtype = next((s["exp_avg"].dtype for s in saved_state.values() if "exp_avg" in s), None)
        if saved_dtype is not None and (saved_dtype == torch.bfloat16) != self.compact:
            if self.compact:
                raise UserError(f"checkpoint: its optimizer state is {saved_dtype}, this run's optimizer.state_dtype "
                                "is bfloat16; converting fp32 moments to bf16 is not exact, so it is refused: resume "
                                "with state_dtype float32 (or start the bf16 run from the model only)")
            # bf16 moments widen to fp32 exactly, and the weights already are theta* + delta.
        dropped = {"anchor"} if self.compact else {"anchor", "delta"}
        stripped = {
            "param_groups": saved_groups,
            "state": {i: {k: v for k, v in s.items() if k not in dropped} for i, s in saved_state.items()},
        }
        super().load_state_dict(stripped)
        if self.compact:  # torch casts state to the parameter's dtype; the exact way back to bf16
            for state in self.state.values():
                for key in ("exp_avg", "exp_avg_sq"):
                    if key in state:
                        state[key] = state[key].to(self.state_dtype)
        for group, anchored in zip(self.param_groups, own_anchored):
            group["anchored"] = anchored  # this optimizer's split, whatever the checkpoint's groups said
        for idx, p in zip(saved_ids, own_params):
            if idx in deltas:
                self.state[p]["delta"] = deltas[idx].detach().to(device=p.device, dtype=torch.float32, copy=True)
            if idx in anchors:
                # torch would cast state to the parameter's dtype; a bf16 anchor stays bf16.
                self.state[p]["anchor"] = anchors[idx].detach().to(device=p.device, copy=True)
        self._resolved_impl = self._resolve_impl()
