"""The element program of coefficients.py as multi-tensor torch ops (any device).

Like the C++ kernel it runs in delta form (see cpp/step_args.h): the step's total change is
accumulated in a temporary and the parameter is rounded once, which keeps fp32 results within
2e-6 (relative) of a float64 reference after 200 steps. It is the exact program of
cpp/step_body.h, operation for operation (exact_change), so it stores the kernel's bits.

On CUDA the `torch._foreach_*` ops are multi-tensor kernels; on CPU they fall back to per-tensor
loops (PyTorch excludes CPU from its foreach kernels), where the C++ kernel is the fast path.
"""

from __future__ import annotations

import struct
from typing import Sequence

import torch

from ft_framework.optim.coefficients import StepCoefficients, split_importance
from ft_framework.optim.compact import round_nearest_bf16, rounding_bits, stochastic_round_bf16


def _as_dtype(tensors: list[torch.Tensor], dtype: torch.dtype) -> list[torch.Tensor]:
    return [t if t.dtype == dtype else t.to(dtype) for t in tensors]


def _f32(x: float) -> float:
    """x rounded to float32, as the kernel's coefficient struct and torch's scalar operand hold it."""
    return struct.unpack("f", struct.pack("f", x))[0]


def _sqrt_rn(vs: list[torch.Tensor]) -> list[torch.Tensor]:
    """The correctly rounded fp32 square root of each tensor. torch's fp32 sqrt on a CPU is not
    correctly rounded (torch 2.13: 1 ulp off for ~16% of values); the float64 sqrt, within an ulp of
    float64, rounded to fp32 is (a float's square root lies at least 2^-51, relative, from a
    midpoint between two floats). CUDA's fp32 sqrt is IEEE's (torch is not built with fast math)."""
    if all(v.device.type == "cuda" or v.dtype != torch.float32 for v in vs):
        return torch._foreach_sqrt(vs)
    return [torch.sqrt(v.double()).float() if v.dtype == torch.float32 else torch.sqrt(v) for v in vs]


def _lerp_(es: list[torch.Tensor], xs: list[torch.Tensor], w: float | list[torch.Tensor]) -> None:
    """e <- (x - e) * w + e, in place: a product then a sum, each rounded (never torch's lerp); w a
    scalar or a tensor per e (the per-element pull fractions)."""
    moved = torch._foreach_sub(xs, es)
    torch._foreach_mul_(moved, w)
    torch._foreach_add_(es, moved)


def pull_weights(w: float, fs: list[torch.Tensor] | None) -> float | list[torch.Tensor]:
    """A pull's fraction: the coefficient `w`, or with importances `fs` per element
    min(fp32(w) * fp32(F~), 1) (cpp/step_args.h; a NaN stays a NaN, as the kernel's min keeps it)."""
    if fs is None:
        return w
    weights = torch._foreach_mul(fs, w)
    torch._foreach_clamp_max_(weights, 1.0)
    return weights


def _as_f32(fs: list[torch.Tensor] | None) -> list[torch.Tensor] | None:
    return None if fs is None else _as_dtype(fs, torch.float32)


def exact_change(ps: list[torch.Tensor], ds: list[torch.Tensor] | None, gs: list[torch.Tensor],
                 ms: list[torch.Tensor], vs: list[torch.Tensor], c: StepCoefficients,
                 fs: list[torch.Tensor] | None = None) -> list[torch.Tensor]:
    """The exact element program (cpp/step_body.h) on fp32 tensor lists: updates the moments ms and
    vs in place and returns each tensor's total change e (p <- p - e), given ds = p - θ* (None: no
    anchor terms) and fs the per-element importances F~ of the pulls (None: none; read only with
    ds). Operation for operation as the C++ kernel and the Triton program compute it: each
    product and sum a separate, correctly rounded fp32 op (no lerp, addcmul or fused multiply-add,
    whose rounding differs), a true division and a correctly rounded sqrt, so every implementation
    stores the same bits. The scalar operands are the coefficients rounded to fp32 (the kernel
    holds 1 − β as computed in double, then rounded)."""
    scaled = torch._foreach_mul(gs, 1.0 - c.beta1)
    torch._foreach_mul_(ms, c.beta1)
    torch._foreach_add_(ms, scaled)                             # g (1 − β1) + m β1
    scaled = torch._foreach_mul(gs, 1.0 - c.beta2)
    torch._foreach_mul_(scaled, gs)
    torch._foreach_mul_(vs, c.beta2)
    torch._foreach_add_(vs, scaled)                             # (g (1 − β2)) g + v β2
    denom = _sqrt_rn(vs)
    torch._foreach_mul_(denom, c.denom_scale)
    torch._foreach_add_(denom, c.eps)
    es = torch._foreach_div(ms, denom)
    torch._foreach_mul_(es, c.step_size)
    fs = _as_f32(fs) if ds is not None else None
    if _f32(c.pre_decay) != 0.0 or (ds is not None and _f32(c.pre_pull) != 0.0):
        pre = torch._foreach_mul(ps, c.pre_decay)
        if ds is not None:
            _lerp_(pre, ds, pull_weights(c.pre_pull, fs))
        torch._foreach_add_(es, pre)
    if ds is not None:
        _lerp_(es, ds, pull_weights(c.post_pull, fs))
    if _f32(c.post_decay) != 0.0:
        _lerp_(es, ps, c.post_decay)
    return es


def foreach_step(
    params: list[torch.Tensor],
    grads: list[torch.Tensor],
    exp_avgs: list[torch.Tensor],
    exp_avg_sqs: list[torch.Tensor],
    anchors: list[torch.Tensor] | None,
    c: StepCoefficients,
    importances: list[torch.Tensor] | None = None,
) -> None:
    """Applies one step with the same coefficients to fp32 tensors of one device, in place: the
    exact program (exact_change), bit for bit the C++ kernel's and the Triton program's.
    `importances` (beside `anchors`): each pull's fraction min(w * F~, 1) per element."""
    if not params:
        return
    dtype = params[0].dtype
    use_anchor = anchors is not None and c.uses_anchor
    diffs = torch._foreach_sub(params, _as_dtype(anchors, dtype)) if use_anchor else None  # p - a
    torch._foreach_sub_(params, exact_change(params, diffs, _as_dtype(grads, dtype), exp_avgs, exp_avg_sqs, c,
                                             importances))


def compact_step(params: list[torch.Tensor | None], grads: list[torch.Tensor], exp_avgs: list[torch.Tensor],
                 exp_avg_sqs: list[torch.Tensor], deltas: list[torch.Tensor | None],
                 anchors: list[torch.Tensor | None], c: StepCoefficients, seed: int, step: int,
                 index_bases: list[int], weights: list[torch.Tensor] | None = None,
                 importances: list[torch.Tensor | None] | None = None) -> None:
    """One step of the compact state (optim/compact.py), in place: the moments are bf16 (m rounded
    to nearest even, v stochastically with the bits of (seed, step, index_bases[i] + element)).
    Where deltas[i] is given (an anchored parameter) it is the fp32 master, the pull reads it
    exactly, and params[i] is written as anchors[i] + deltas[i]; where only anchors[i] is given,
    params[i] is the master (DeepSpeed's partitions) and the pull reads params[i] - anchors[i].
    `weights` (the bf16 weight form, cpp/step_args.h): each new weight is also written into
    weights[i] in bf16, rounded to nearest even, and a delta master keeps no fp32 weight
    (params[i] None); weights[i] may be grads[i] itself (every gradient is read first).
    `importances[i]` (beside anchors[i], optional): its pulls weighted per element (exact_change).
    Bit for bit the C++ kernel's result (exact_change). The tensors of each kind (delta master,
    anchored parameter master, no anchor; with or without importance) step together as foreach ops."""
    importances = [None] * len(grads) if importances is None else importances
    kinds: dict[tuple[str, bool], list[int]] = {}
    for i, (delta, anchor, importance) in enumerate(zip(deltas, anchors, importances)):
        kind = "delta" if delta is not None else "param" if anchor is not None else "none"
        if importance is not None and anchor is None:
            raise ValueError("the importance weighs the pull toward theta*: it needs its anchor")
        kinds.setdefault((kind, importance is not None), []).append(i)
    for (kind, weighted), idx in kinds.items():
        fs = [importances[i] for i in idx] if weighted else None
        gs = [grads[i].float() for i in idx]  # copies: a bf16 gradient may be the weight written below
        ms = [exp_avgs[i].float() for i in idx]
        vs = [exp_avg_sqs[i].float() for i in idx]
        if kind == "delta":
            anchors32 = [anchors[i].float() for i in idx]
            ds = [deltas[i] for i in idx]
            es = exact_change(torch._foreach_add(anchors32, ds), ds, gs, ms, vs, c, fs)
            torch._foreach_sub_(ds, es)
            thetas = torch._foreach_add(anchors32, ds)
            if weights is None:
                for i, theta in zip(idx, thetas):
                    params[i].copy_(theta)
        else:
            ps = [params[i] for i in idx]
            ds = torch._foreach_sub(ps, [anchors[i].float() for i in idx]) if kind == "param" else None
            torch._foreach_sub_(ps, exact_change(ps, ds, gs, ms, vs, c, fs))
            thetas = ps
        if weights is not None:
            for i, theta in zip(idx, thetas):
                weights[i].copy_(round_nearest_bf16(theta))  # the kernel's store_rne, its NaN too
        for i, m, v in zip(idx, ms, vs):
            exp_avgs[i].copy_(round_nearest_bf16(m))  # the kernel's store_rne, its NaN too
            exp_avg_sqs[i].copy_(stochastic_round_bf16(
                v, rounding_bits(seed, step, index_bases[i], v.numel(), v.device)))


def inverse_keep(c: StepCoefficients, use_anchor: bool, largest_importance: float | None = None) -> float:
    """1 / (1 - A), where the step maps p to (1 - A) p - B (cpp/step_args.h): A depends only on
    the coefficients and the stages that run. With importances (`largest_importance`: their
    largest F~) the pulls' part of A is per element: this is the decays' part alone. Raises
    ValueError when the step removes all of p, or an element's weighted pull reached theta*."""
    a = 0.0
    pre = c.pre_decay != 0.0 or (use_anchor and c.pre_pull != 0.0)
    pulls = use_anchor and largest_importance is None
    if pre:
        a = c.pre_decay
        if pulls:
            a += c.pre_pull * (1.0 - a)
    if pulls:
        a += c.post_pull * (1.0 - a)
    if c.post_decay != 0.0:
        a += c.post_decay * (1.0 - a)
    whole = not 1.0 - a > 0.0
    if use_anchor and largest_importance is not None:
        largest_pull = max(_f32(_f32(c.pre_pull) * largest_importance) if pre else 0.0,
                           _f32(_f32(c.post_pull) * largest_importance))
        whole = whole or not largest_pull < 1.0
    if whole:
        raise ValueError("this step removes all of p (pulls and decays sum to >= 1, or an importance-weighted pull "
                         "reached theta*): it cannot be undone")
    return 1.0 / (1.0 - a)


def _largest(fs: list[torch.Tensor]) -> float:
    """The largest value of the importances (a NaN as infinity: its step cannot be undone either)."""
    tops = [f.float().nan_to_num(nan=float("inf")).max() for f in fs if f.numel()]
    return float(torch.stack(tops).max()) if tops else 0.0


def foreach_inverse_step(
    params: list[torch.Tensor],
    grads: list[torch.Tensor],
    exp_avgs: list[torch.Tensor],
    exp_avg_sqs: list[torch.Tensor],
    anchors: list[torch.Tensor] | None,
    c: StepCoefficients,
    importances: list[torch.Tensor] | None = None,
) -> None:
    """Undoes foreach_step with the same gradients, coefficients and importances, in place (the
    inverse of cpp/step_args.h): p from the stepped moments, then the moments; no saved copy."""
    if not params:
        return
    dtype = params[0].dtype
    grads = _as_dtype(grads, dtype)
    use_anchor = anchors is not None and c.uses_anchor
    fs = _as_f32(importances) if use_anchor else None
    keep = inverse_keep(c, use_anchor, None if fs is None else _largest(fs))
    # The forward's Adam term, recomputed with the forward's ops from the stepped moments.
    denom = _sqrt_rn(exp_avg_sqs)
    torch._foreach_mul_(denom, c.denom_scale)
    torch._foreach_add_(denom, c.eps)
    change = torch._foreach_div(exp_avgs, denom)
    torch._foreach_mul_(change, c.step_size)
    # The rest of the forward's change at p = 0, where p - a = -a: B of p' = (1 - A) p - B.
    if use_anchor and fs is not None:
        # The weighted pulls (per-element fractions), as the kernel's inverse forms them.
        minus_a = torch._foreach_neg(_as_dtype(anchors, dtype))
        w_pre, w_post = pull_weights(c.pre_pull, fs), pull_weights(c.post_pull, fs)
        if c.pre_decay != 0.0 or c.pre_pull != 0.0:
            torch._foreach_add_(change, torch._foreach_mul(w_pre, minus_a))
        _lerp_(change, minus_a, w_post)
    elif use_anchor:
        minus_a = torch._foreach_neg(_as_dtype(anchors, dtype))
        if c.pre_pull != 0.0:
            torch._foreach_add_(change, minus_a, alpha=c.pre_pull)
        if c.post_pull != 0.0:
            torch._foreach_lerp_(change, minus_a, c.post_pull)
    if c.post_decay != 0.0:
        torch._foreach_mul_(change, 1.0 - c.post_decay)
    torch._foreach_add_(params, change)
    if fs is not None:  # keep / ((1 - w_pre) (1 - w_post)) per element (cpp/step_args.h)
        kept = torch._foreach_neg(w_post)
        torch._foreach_add_(kept, 1.0)
        if c.pre_decay != 0.0 or c.pre_pull != 0.0:
            kept_pre = torch._foreach_neg(w_pre)
            torch._foreach_add_(kept_pre, 1.0)
            torch._foreach_mul_(kept, kept_pre)
        torch._foreach_mul_(params, [torch.full_like(k, _f32(keep)).div_(k) for k in kept])
    else:
        torch._foreach_mul_(params, keep)
    # m = (m' - (1 - b1) g) / b1 and v = max(0, (v' - (1 - b2) g^2) / b2); with beta 0 the old
    # moment is not in m' (and no later step reads it): it becomes 0.
    if c.beta1 > 0.0:
        torch._foreach_add_(exp_avgs, grads, alpha=-(1.0 - c.beta1))
        torch._foreach_div_(exp_avgs, c.beta1)
    else:
        torch._foreach_zero_(exp_avgs)
    if c.beta2 > 0.0:
        torch._foreach_addcmul_(exp_avg_sqs, grads, grads, -(1.0 - c.beta2))
        torch._foreach_div_(exp_avg_sqs, c.beta2)
        torch._foreach_clamp_min_(exp_avg_sqs, 0.0)
    else:
        torch._foreach_zero_(exp_avg_sqs)


def finite_flags(grads: list[torch.Tensor]) -> list[bool]:
    """Per tensor: whether every element is finite."""
    return [bool(torch.isfinite(g).all()) for g in grads]


class TorchProgram:
    """The torch ops as a step program (optim/programs.py): any device and floating dtype."""

    name = "torch"

    def unavailable(self) -> str | None:
        return None

    def refusal(self, param: torch.Tensor, automatic: bool) -> str | None:
        return None

    def step(self, tensors: Sequence[tuple], c: StepCoefficients, num_threads: int | None = None) -> None:
        # foreach_step takes one device and dtype, all with theta* or none, all with importance or none
        kinds: dict[tuple, list[tuple]] = {}
        for t in tensors:
            (p, g, m, v, a), f = split_importance(t, 5)
            if f is not None and a is None:
                raise ValueError("the importance weighs the pull toward theta*: it needs its anchor")
            kinds.setdefault((p.device, p.dtype, a is not None, f is not None), []).append((p, g, m, v, a, f))
        for (_device, _dtype, anchored, weighted), rows in kinds.items():
            params, grads, ms, vs, anchors, importances = (list(column) for column in zip(*rows))
            foreach_step(params, grads, ms, vs, anchors if anchored else None, c,
                         importances if weighted else None)

    def guarded_step(self, tensors: tuple, c: StepCoefficients, num_threads: int | None = None) -> bool:
        if not finite_flags([tensors[1]])[0]:
            return False
        self.step([tensors], c)
        return True

    def inverse(self, tensors: tuple, c: StepCoefficients, num_threads: int | None = None) -> None:
        row, importance = split_importance(tensors, 5)
        if importance is not None and row[4] is None:
            raise ValueError("the importance weighs the pull toward theta*: it needs its anchor")
        foreach_inverse_step(*[[x] if x is not None else None for x in row], c,
                             None if importance is None else [importance])

    def step_compact(self, tensors: Sequence[tuple], c: StepCoefficients, seed: int, step: int,
                     num_threads: int | None = None) -> None:
        if tensors:
            rows = [split_importance(t, 7) for t in tensors]
            params, grads, ms, vs, deltas, anchors, bases = (list(column) for column in zip(*(r for r, _ in rows)))
            compact_step(params, grads, ms, vs, deltas, anchors, c, seed, step, bases,
                         importances=[f for _, f in rows])

    def step_compact_bf16(self, tensors: Sequence[tuple], c: StepCoefficients, seed: int, step: int,
                          num_threads: int | None = None) -> None:
        if tensors:
            rows = [split_importance(t, 8) for t in tensors]
            masters, grads, ms, vs, deltas, anchors, bases, weights = (list(column)
                                                                       for column in zip(*(r for r, _ in rows)))
            check_bf16_form(masters, deltas, weights)
            compact_step(masters, grads, ms, vs, deltas, anchors, c, seed, step, bases, weights,
                         importances=[f for _, f in rows])


def check_bf16_form(masters: list, deltas: list, weights: list) -> None:
    """The rows of the bf16 weight form every program takes: a master exactly where no delta is."""
    for master, delta, weight in zip(masters, deltas, weights):
        if (master is None) != (delta is not None):
            raise ValueError("the bf16 weight form keeps no fp32 weight of a delta master: pass master=None exactly "
                             "where a delta is given (an fp32 master otherwise)")
        if weight.dtype != torch.bfloat16:
            raise TypeError(f"the bf16 weight form writes bf16 weights, got {weight.dtype}")
