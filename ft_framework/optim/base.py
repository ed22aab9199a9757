"""Common machinery of every optimizer in the registry: anchors (theta*) in optimizer state,
lazy state, the choice between the torch and the C++ implementation, telemetry and checkpoints.

A concrete optimizer only says how its rule maps (group, step, has-anchor) to StepCoefficients.
"""

from __future__ import annotations

import math
import warnings
from collections import defaultdict
from typing import Any, Iterable

import torch

from . import cpu as cpu_kernel
from .coefficients import StepCoefficients
from .torch_step import foreach_step

IMPLS = ("auto", "torch", "cpu")
ANCHOR_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}
# Keys a param group may carry besides the optimizer's hyper-parameters.
GROUP_META_KEYS = frozenset({"params", "anchors", "param_names", "group_name", "initial_lr"})


def local_tensor(t: torch.Tensor) -> torch.Tensor:
    """The rank-local shard of a DTensor (FSDP2), or the tensor itself; element-wise steps run on it."""
    return t.to_local() if hasattr(t, "to_local") else t


class PullOvershootWarning(RuntimeWarning):
    """lr * (anneal_w - lambda) * pretrain_cof >= 1: the pull toward theta* overshoots it."""


class AnchoredOptimizer(torch.optim.Optimizer):
    """Base class: Adam-family rule + optional anchors, torch or C++ implementation.

    Param groups may carry ``"anchors"``: a list aligned with ``"params"`` whose entries are the
    pretrained tensors (or None). They are copied into ``state[p]["anchor"]`` and removed from the
    group, so they are partitioned, offloaded and checkpointed like ``exp_avg``.
    """

    def __init__(self, params: Iterable, defaults: dict[str, Any], impl: str = "auto",
                 anchor_dtype: str = "float32"):
        if impl not in IMPLS:
            raise ValueError(f"unknown impl {impl!r}; valid: {', '.join(IMPLS)}")
        if anchor_dtype not in ANCHOR_DTYPES:
            raise ValueError(f"unknown anchor_dtype {anchor_dtype!r}; valid: {', '.join(ANCHOR_DTYPES)}")
        if impl == "cpu" and not cpu_kernel.kernel_available():
            cpu_kernel._require_kernel()  # raises with the build instructions
        self._requested_impl = impl
        self._anchor_dtype = ANCHOR_DTYPES[anchor_dtype]
        self._warned_overshoot: set[int] = set()
        super().__init__(params, defaults)
        self._resolved_impl = self._resolve_impl()

    # ---- construction -------------------------------------------------------------------
    def add_param_group(self, param_group: dict[str, Any]) -> None:
        anchors = param_group.pop("anchors", None) if isinstance(param_group, dict) else None
        unknown = set(param_group) - set(self.defaults) - GROUP_META_KEYS if isinstance(param_group, dict) else set()
        if unknown:
            raise ValueError(
                f"unknown param-group key(s) {sorted(unknown)} for {type(self).__name__}; valid: "
                f"{sorted(set(self.defaults) | GROUP_META_KEYS)}"
            )
        super().add_param_group(param_group)
        group = self.param_groups[-1]
        self.validate_group(group)
        if anchors is not None:
            params = group["params"]
            if len(anchors) != len(params):
                raise ValueError(f"'anchors' has {len(anchors)} entries but 'params' has {len(params)}")
            for p, a in zip(params, anchors):
                if a is not None:
                    self.set_anchor(p, a)

    def validate_group(self, group: dict[str, Any]) -> None:
        """Checks a group's hyper-parameters; subclasses extend it."""
        if not group["lr"] >= 0:
            raise ValueError(f"lr must be >= 0, got {group['lr']}")
        b1, b2 = group["betas"]
        if not (0 <= b1 < 1 and 0 <= b2 < 1):
            raise ValueError(f"betas must be in [0, 1), got {group['betas']}")
        if not group["eps"] > 0:
            raise ValueError(f"eps must be > 0, got {group['eps']}")
        if not group["weight_decay"] >= 0:
            raise ValueError(f"weight_decay must be >= 0, got {group['weight_decay']}")

    def set_anchor(self, p: torch.Tensor, anchor: torch.Tensor) -> None:
        """Stores theta* for parameter p (copied, on p's device, in the anchor dtype).

        For a sharded DTensor parameter (FSDP2) a full anchor is sharded like p, locally on each
        rank (every rank holds the full pretrained value while loading, so no communication).
        """
        if tuple(anchor.shape) != tuple(p.shape):
            raise ValueError(f"anchor shape {tuple(anchor.shape)} does not match parameter shape {tuple(p.shape)}")
        anchor = anchor.detach()
        if hasattr(p, "device_mesh") and not hasattr(anchor, "device_mesh"):
            from torch.distributed.tensor import distribute_tensor

            anchor = distribute_tensor(anchor.to(device=local_tensor(p).device, dtype=self._anchor_dtype),
                                       p.device_mesh, p.placements, src_data_rank=None)
            self.state[p]["anchor"] = anchor
            return
        self.state[p]["anchor"] = anchor.to(device=p.device, dtype=self._anchor_dtype, copy=True)

    def _resolve_impl(self) -> str:
        """'auto' becomes 'cpu' when every parameter is a CPU fp32 tensor and the kernel is built."""
        params = [p for g in self.param_groups for p in g["params"]]
        if self._requested_impl == "torch":
            return "torch"
        problems = [msg for p in params if (msg := cpu_kernel.check_param(local_tensor(p)))]
        if self._requested_impl == "cpu":
            if problems:
                raise TypeError(f"impl='cpu' cannot take these parameters: {problems[0]} "
                                f"({len(problems)} parameter(s) affected); use impl='torch' or 'auto'")
            return "cpu"
        if not params:
            return "auto"  # ZeRO-3 fills param_groups only inside step(): decide there
        return "cpu" if cpu_kernel.kernel_available() and not problems else "torch"

    @property
    def impl(self) -> str:
        """The implementation in use: 'cpu' (C++ kernel) or 'torch' ('auto' until params are seen)."""
        return self._resolved_impl

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
        if self._requested_impl == "auto":
            # DeepSpeed and FSDP swap in their own (e.g. CPU-offloaded) tensors after construction.
            self._resolved_impl = self._resolve_impl()
        for gi, group in enumerate(self.param_groups):
            buckets: dict[tuple, list] = defaultdict(list)
            for p in group["params"]:
                if p.grad is None:
                    continue
                if p.grad.is_sparse:
                    raise RuntimeError(f"{type(self).__name__} does not support sparse gradients")
                state = self._init_state(p)
                state["step"] += 1
                t = int(state["step"].item())
                anchor = state.get("anchor")
                c = self.coefficients(group, t, anchor is not None)
                self._warn_if_overshoot(gi, c)
                key = (c, local_tensor(p).device, p.dtype, anchor is not None and c.uses_anchor)
                buckets[key].append(p)
            for (c, _device, _dtype, with_anchor), ps in buckets.items():
                self._apply(ps, c, with_anchor)
        return loss

    def _init_state(self, p: torch.Tensor) -> dict[str, Any]:
        # Lazy: under ZeRO-3 the parameters only exist inside step() (see shared/spec/FACTS.md).
        state = self.state[p]
        if "step" not in state:
            state["step"] = torch.tensor(0.0, dtype=torch.float32)
            state["exp_avg"] = torch.zeros_like(p, memory_format=torch.preserve_format)
            state["exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format)
        return state

    def _apply(self, ps: list[torch.Tensor], c: StepCoefficients, with_anchor: bool) -> None:
        states = [self.state[p] for p in ps]
        params = [local_tensor(p) for p in ps]
        grads = [local_tensor(p.grad) for p in ps]
        ms = [local_tensor(s["exp_avg"]) for s in states]
        vs = [local_tensor(s["exp_avg_sq"]) for s in states]
        anchors = [local_tensor(s["anchor"]) for s in states] if with_anchor else None
        if self._resolved_impl == "cpu":
            for i in range(len(params)):
                cpu_kernel.fused_step(params[i], grads[i], ms[i], vs[i],
                                      anchors[i] if anchors else None, c)
        else:
            foreach_step(params, grads, ms, vs, anchors, c)

    def _warn_if_overshoot(self, group_index: int, c: StepCoefficients) -> None:
        if max(c.pre_pull, c.post_pull) >= 1.0 and group_index not in self._warned_overshoot:
            self._warned_overshoot.add(group_index)
            warnings.warn(
                f"param group {group_index}: the pull toward the pretrained weights removes "
                f"{max(c.pre_pull, c.post_pull):.3g} x (theta - theta*) in one step (>= 1 overshoots "
                "theta* and diverges); lower lr, pretrain_cof or anneal_w",
                PullOvershootWarning, stacklevel=3)

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
        total = torch.zeros((), dtype=torch.float64)
        for p, state in self.state.items():
            anchor = state.get("anchor")
            if anchor is None:
                continue
            diff = local_tensor(p).detach().double() - local_tensor(anchor).double()
            total += diff.square().sum().cpu()
        return total

    def forgetting_distance(self, reduce_group=None, all_reduce: bool = False) -> float:
        """||theta - theta*||_2 over all anchored parameters.

        With sharded parameters (ZeRO, FSDP) each rank holds a disjoint shard: pass
        ``all_reduce=True`` (and optionally a process group) to sum the shards with one all-reduce.
        Do not all-reduce replicated parameters (plain DDP): that would count them once per rank.
        """
        sq = self.forgetting_sq_sum()
        if all_reduce:
            import torch.distributed as dist

            backend = dist.get_backend(reduce_group)
            device = torch.device("cuda", torch.cuda.current_device()) if backend == "nccl" else torch.device("cpu")
            buf = sq.to(device)
            dist.all_reduce(buf, group=reduce_group)
            sq = buf.cpu()
        return math.sqrt(float(sq))

    # ---- checkpoints ---------------------------------------------------------------------
    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Loads like torch, keeping anchors in their stored dtype, and refusing to lose them.

        A checkpoint that lacks the anchor of a parameter this optimizer anchors would silently turn
        RecAdam into Adam (or re-anchor to the current weights): that is an error.
        """
        saved_groups = state_dict["param_groups"]
        own_params = [p for g in self.param_groups for p in g["params"]]
        saved_ids = [i for g in saved_groups for i in g["params"]]
        if len(saved_ids) != len(own_params):
            raise ValueError(f"checkpoint has {len(saved_ids)} parameters, this optimizer has {len(own_params)}")
        saved_state = state_dict["state"]
        anchors: dict[int, torch.Tensor] = {}
        for idx, p in zip(saved_ids, own_params):
            entry = saved_state.get(idx, {})
            if "anchor" in entry:
                a = entry["anchor"]
                if tuple(a.shape) != tuple(p.shape):
                    raise ValueError(f"checkpoint anchor for parameter {idx} has shape {tuple(a.shape)}, "
                                     f"the parameter has {tuple(p.shape)}: wrong or corrupted checkpoint")
                anchors[idx] = a
            elif "anchor" in self.state.get(p, {}):
                raise ValueError(
                    f"checkpoint has no anchor (theta*) for parameter {idx}, which this optimizer anchors; "
                    "loading it would silently drop the pull toward the pretrained weights. Load a "
                    "checkpoint saved with anchors, or build the optimizer without anchors")
        stripped = {
            "param_groups": saved_groups,
            "state": {i: {k: v for k, v in s.items() if k != "anchor"} for i, s in saved_state.items()},
        }
        super().load_state_dict(stripped)
        for idx, p in zip(saved_ids, own_params):
            if idx in anchors:
                # torch would cast state to the parameter's dtype; a bf16 anchor stays bf16.
                self.state[p]["anchor"] = anchors[idx].detach().to(device=p.device, copy=True)
        self._resolved_impl = self._resolve_impl()
