"""cpu.fused_step_many (one kernel call for many tensors) at every SIMD level: bit for bit the
per-tensor fused_step, which test_cpu_kernel.py checks against the float64 reference; every
tensor checked before any is touched."""

import pytest
import torch

from ft_framework.optim import cpu as cpu_kernel
from ft_framework.optim.coefficients import StepCoefficients
from simd_levels import SIMD_LEVELS, level_or_skip

LEVELS = SIMD_LEVELS
# Empty, tails, whole vectors, and one over the kernel's multi-threading threshold (2^15).
SIZES = (0, 1, 7, 15, 16, 17, 63, 64, 65, 1023, (1 << 15) + 33)
COEFFS = StepCoefficients(beta1=0.9, beta2=0.999, eps=1e-6, step_size=1e-2, denom_scale=1.3, pre_decay=1e-3,
                          pre_pull=2e-3, post_pull=0.05, post_decay=1e-4)


def _tensors(seed: int):
    """One (param, grad, exp_avg, exp_avg_sq, anchor) per size, cycling through fp32/bf16
    gradients and no / fp32 / bf16 anchors."""
    gen = torch.Generator().manual_seed(seed)
    out = []
    for i, n in enumerate(SIZES):
        p, m = torch.randn(n, generator=gen), torch.randn(n, generator=gen) * 0.1
        v = torch.rand(n, generator=gen) * 0.01
        g = torch.randn(n, generator=gen).to(torch.bfloat16 if i % 2 else torch.float32)
        anchor = [None, p + 0.1, (p - 0.2).to(torch.bfloat16)][i % 3]
        out.append((p, g, m, v, anchor))
    return out


def _clone(tensors):
    return [tuple(None if t is None else t.clone() for t in row) for row in tensors]


@pytest.mark.parametrize("level", LEVELS)
@pytest.mark.parametrize("threads", [1, 2])
def test_many_equals_one_call_per_tensor(level, threads, restore_level):
    level_or_skip(level)
    cpu_kernel.set_simd_level(level)
    base = _tensors(seed=LEVELS.index(level))
    one_by_one, many = _clone(base), _clone(base)
    for _ in range(3):  # the moments change between steps
        for row in one_by_one:
            cpu_kernel.fused_step(*row, COEFFS, num_threads=threads)
        cpu_kernel.fused_step_many(many, COEFFS, num_threads=threads)
    for n, want, got, before in zip(SIZES, one_by_one, many, base):
        for k, (w, g, b) in enumerate(zip(want[:4], got[:4], before[:4])):
            assert torch.equal(g, w), f"size {n}, tensor {k}"
        if n:
            assert not torch.equal(got[0], before[0]), f"size {n}: the parameter did not move"


def test_a_bad_tensor_anywhere_refuses_the_call_before_any_step():
    if not cpu_kernel.kernel_available():
        pytest.skip("C++ kernel not built")
    good = _tensors(seed=7)
    strided = torch.zeros(2 * 17)[::2]
    bad_rows = {
        "not contiguous": (strided, *good[5][1:]),
        "float64 moment": (good[5][0], good[5][1], good[5][2].double(), *good[5][3:]),
    }
    for what, bad in bad_rows.items():
        rows = _clone(good)
        before = _clone(rows)
        rows.insert(3, bad)
        with pytest.raises(TypeError, match="cannot run the CPU optimizer kernel"):
            cpu_kernel.fused_step_many(rows, COEFFS)
        for row, was in zip(rows[:3] + rows[4:], before):
            assert all(torch.equal(t, w) for t, w in zip(row[:4], was[:4])), what
    rows = _clone(good)
    p, g, m, v, a = rows[-1]
    rows[-1] = (p, g[:-1], m, v, a)
    with pytest.raises(ValueError, match="size mismatch"):
        cpu_kernel.fused_step_many(rows, COEFFS)
