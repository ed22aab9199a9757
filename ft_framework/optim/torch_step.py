"""The element program of coefficients.py as multi-tensor torch ops (any device).

Like the C++ kernel it runs in delta form (see cpp/step_args.h): the step's total change is
accumulated in a temporary and the parameter is rounded once, which keeps fp32 results within
2e-6 (relative) of a float64 reference after 200 steps.

On CUDA the `torch._foreach_*` ops are multi-tensor kernels; on CPU they fall back to per-tensor
loops (PyTorch excludes CPU from its foreach kernels), where the C++ kernel is the fast path.
"""

from __future__ import annotations

import struct

import torch

from ft_framework.optim.coefficients import StepCoefficients
from ft_framework.optim.compact import rounding_bits, stochastic_round_bf16


def _as_dtype(tensors: list[torch.Tensor], dtype: torch.dtype) -> list[torch.Tensor]:
    return [t if t.dtype == dtype else t.to(dtype) for t in tensors]


def foreach_step(
    params: list[torch.Tensor],
    grads: list[torch.Tensor],
    exp_avgs: list[torch.Tensor],
    exp_avg_sqs: list[torch.Tensor],
    anchors: list[torch.Tensor] | None,
    c: StepCoefficients,
) -> None:
    """Applies one step with the same coefficients to tensors of one device and dtype, in place."""
    if not params:
        return
    dtype = params[0].dtype
    use_anchor = anchors is not None and c.uses_anchor
    diffs = torch._foreach_sub(params, _as_dtype(anchors, dtype)) if use_anchor else None  # p - a
    torch._foreach_sub_(params, _foreach_change(params, _as_dtype(grads, dtype), exp_avgs, exp_avg_sqs, diffs, c))


def _foreach_change(params, grads, exp_avgs, exp_avg_sqs, diffs, c: StepCoefficients) -> list[torch.Tensor]:
    """Updates the moments in place and returns each tensor's total change e (p <- p - e), given
    diffs = p - a (None: no anchor terms)."""
    use_anchor = diffs is not None
    torch._foreach_lerp_(exp_avgs, grads, 1.0 - c.beta1)     # b1*m + (1-b1)*g
    torch._foreach_mul_(exp_avg_sqs, c.beta2)
    torch._foreach_addcmul_(exp_avg_sqs, grads, grads, 1.0 - c.beta2)
    change = torch._foreach_sqrt(exp_avg_sqs)
    if c.denom_scale != 1.0:
        torch._foreach_mul_(change, c.denom_scale)
    torch._foreach_add_(change, c.eps)
    torch._foreach_div_(change, exp_avgs)                    # denom / m ...
    torch._foreach_reciprocal_(change)                       # ... -> m / denom, in place
    torch._foreach_mul_(change, c.step_size)
    if c.pre_decay != 0.0 or (use_anchor and c.pre_pull != 0.0):
        pre = torch._foreach_mul(params, c.pre_decay)
        if use_anchor and c.pre_pull != 0.0:
            torch._foreach_lerp_(pre, diffs, c.pre_pull)
        torch._foreach_add_(change, pre)
    if use_anchor and c.post_pull != 0.0:
        torch._foreach_lerp_(change, diffs, c.post_pull)     # e + w * ((p - a) - e)
    if c.post_decay != 0.0:
        torch._foreach_lerp_(change, params, c.post_decay)   # e + w * (p - e)
    return change


def _f32(x: float) -> float:
    """x rounded to float32, as the kernel's coefficient struct and torch's scalar operand hold it."""
    return struct.unpack("f", struct.pack("f", x))[0]


def _compact_change(p: torch.Tensor, d: torch.Tensor | None, g: torch.Tensor, m: torch.Tensor, v: torch.Tensor,
                    c: StepCoefficients) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(e, m', v') of the compact program, operation for operation as cpp/step_body.h's compact
    path computes them: each product and sum a separate, correctly rounded fp32 op (no lerp,
    addcmul or fused multiply-add, whose rounding differs), a true division. The stored moments are
    rounded to bf16 afterwards, so any other order could round one of them to another bf16 value;
    this one gives the kernel's bits at every SIMD level. d = p − θ* (None: no anchor terms)."""
    m = g * (1.0 - c.beta1) + m * c.beta1  # the kernel holds 1 − β as computed in double, then rounded
    v = (g * (1.0 - c.beta2)) * g + v * c.beta2
    # torch's fp32 sqrt on a CPU is not correctly rounded (torch 2.13: 1 ulp off for ~16% of
    # values) and the kernel's is. The float64 sqrt, within an ulp of float64, rounded to fp32 is:
    # a float's square root lies at least 2^-51 (relative) from a midpoint between two floats.
    denom = torch.sqrt(v.double()).float() * c.denom_scale + c.eps
    e = (m / denom) * c.step_size

    def lerp(e: torch.Tensor, x: torch.Tensor, w: float) -> torch.Tensor:  # e + w (x − e), unfused
        return (x - e) * w + e

    if _f32(c.pre_decay) != 0.0 or (d is not None and _f32(c.pre_pull) != 0.0):
        pre = p * c.pre_decay
        if d is not None:
            pre = lerp(pre, d, c.pre_pull)
        e = e + pre
    if d is not None:
        e = lerp(e, d, c.post_pull)
    if _f32(c.post_decay) != 0.0:
        e = lerp(e, p, c.post_decay)
    return e, m, v


def compact_step(params: list[torch.Tensor], grads: list[torch.Tensor], exp_avgs: list[torch.Tensor],
                 exp_avg_sqs: list[torch.Tensor], deltas: list[torch.Tensor | None],
                 anchors: list[torch.Tensor | None], c: StepCoefficients, seed: int, step: int,
                 index_bases: list[int]) -> None:
    """One step of the compact state (optim/compact.py), tensor by tensor, in place: the moments are
    bf16 (m rounded to nearest even, v stochastically with the bits of (seed, step, index_bases[i] +
    element)). Where deltas[i] is given (an anchored parameter) it is the fp32 master, the pull
    reads it exactly, and params[i] is written as anchors[i] + deltas[i]; where only anchors[i] is
    given, params[i] is the master (DeepSpeed's partitions) and the pull reads params[i] - anchors[i].
    Bit for bit the C++ kernel's result on a CPU (_compact_change)."""
    for p, g, m16, v16, delta, anchor, base in zip(params, grads, exp_avgs, exp_avg_sqs, deltas, anchors,
                                                   index_bases):
        if delta is not None:
            a = anchor.float()
            e, m, v = _compact_change(a + delta, delta, g.float(), m16.float(), v16.float(), c)
            delta.sub_(e)
            p.copy_(a + delta)
        else:
            d = None if anchor is None else p - anchor.float()
            e, m, v = _compact_change(p, d, g.float(), m16.float(), v16.float(), c)
            p.sub_(e)
        m16.copy_(m)  # torch's cast rounds to nearest even, as the kernel's store_rne
        v16.copy_(stochastic_round_bf16(v, rounding_bits(seed, step, base, v16.numel(), v16.device)))


def inverse_keep(c: StepCoefficients, use_anchor: bool) -> float:
    """1 / (1 - A), where the step maps p to (1 - A) p - B (cpp/step_args.h): A depends only on
    the coefficients and the stages that run. Raises ValueError when the step removes all of p."""
    a = 0.0
    if c.pre_decay != 0.0 or (use_anchor and c.pre_pull != 0.0):
        a = c.pre_decay
        if use_anchor:
            a += c.pre_pull * (1.0 - a)
    if use_anchor:
        a += c.post_pull * (1.0 - a)
    if c.post_decay != 0.0:
        a += c.post_decay * (1.0 - a)
    if not 1.0 - a > 0.0:
        raise ValueError("this step removes all of p (pulls and decays sum to >= 1): it cannot be undone")
    return 1.0 / (1.0 - a)


def foreach_inverse_step(
    params: list[torch.Tensor],
    grads: list[torch.Tensor],
    exp_avgs: list[torch.Tensor],
    exp_avg_sqs: list[torch.Tensor],
    anchors: list[torch.Tensor] | None,
    c: StepCoefficients,
) -> None:
    """Undoes foreach_step with the same gradients and coefficients, in place (the inverse of
    cpp/step_args.h): p from the stepped moments, then the moments; no saved copy of the state."""
    if not params:
        return
    dtype = params[0].dtype
    grads = _as_dtype(grads, dtype)
    use_anchor = anchors is not None and c.uses_anchor
    keep = inverse_keep(c, use_anchor)
    # The forward's Adam term, recomputed with the forward's ops from the stepped moments.
    change = torch._foreach_sqrt(exp_avg_sqs)
    if c.denom_scale != 1.0:
        torch._foreach_mul_(change, c.denom_scale)
    torch._foreach_add_(change, c.eps)
    torch._foreach_div_(change, exp_avgs)
    torch._foreach_reciprocal_(change)
    torch._foreach_mul_(change, c.step_size)
    # The rest of the forward's change at p = 0, where p - a = -a: B of p' = (1 - A) p - B.
    if use_anchor:
        minus_a = torch._foreach_neg(_as_dtype(anchors, dtype))
        if c.pre_pull != 0.0:
            torch._foreach_add_(change, minus_a, alpha=c.pre_pull)
        if c.post_pull != 0.0:
            torch._foreach_lerp_(change, minus_a, c.post_pull)
    if c.post_decay != 0.0:
        torch._foreach_mul_(change, 1.0 - c.post_decay)
    torch._foreach_add_(params, change)
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
