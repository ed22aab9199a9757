"""The C++ CPU step at every SIMD level this CPU runs (scalar included), against the float64
reference, over awkward sizes, fp32/bf16 gradients and anchors, 200 steps."""

import os
import subprocess
import sys

import pytest
import torch

from ft_framework.optim import build_optimizer
from ft_framework.optim import cpu as cpu_kernel
from ft_framework.optim.coefficients import StepCoefficients
from optim_reference import Reference, assert_close_to_reference

pytestmark = pytest.mark.skipif(not cpu_kernel.kernel_available(), reason="C++ kernel not built")

# 200 steps check long-run drift; the 1M+7 size (threads, chunk boundaries, tails) runs fewer
# steps to keep the suite within CI's budget.
STEPS_BY_SIZE = {1: 200, 15: 200, 17: 200, 1023: 200, 1_000_007: 30}
HPARAMS = {
    "recadam": dict(lr=1e-3, weight_decay=0.01, anneal_fun="sigmoid", anneal_k=0.1, anneal_t0=100,
                    pretrain_cof=50.0),
    "adamw": dict(lr=1e-3, weight_decay=0.01),
    "bertadam": dict(lr=1e-3, weight_decay=0.01, correct_bias=False),
    "prior_wd": dict(lr=1e-3, weight_decay=0.1),
}
CASES = [(rule, gd, ad) for rule in HPARAMS for gd in ("float32", "bfloat16")
         for ad in ("float32", "bfloat16") if ad == "float32" or rule in ("recadam", "prior_wd")]


@pytest.mark.parametrize("rule,grad_dtype,anchor_dtype", CASES)
def test_kernel_matches_reference_every_level(rule, grad_dtype, anchor_dtype, restore_level):
    levels = cpu_kernel.supported_simd_levels()
    assert levels[0] == "scalar"
    # A fixed seed per case (hash() of strings changes from process to process).
    gen = torch.Generator().manual_seed(1000 + CASES.index((rule, grad_dtype, anchor_dtype)))
    for n, steps in STEPS_BY_SIZE.items():
        theta0 = torch.randn(n, generator=gen)
        anchor = (theta0 + 0.1 * torch.randn(n, generator=gen)).to(getattr(torch, anchor_dtype)).float()
        refs = Reference(rule, theta0, anchor, **HPARAMS[rule])
        params, opts = {}, {}
        for level in levels:
            params[level] = torch.nn.Parameter(theta0.clone())
            params[level].grad_dtype = None  # allow bf16 gradients on fp32 parameters
            opts[level] = build_optimizer(rule, [{"params": [params[level]], "anchors": [anchor]}],
                                          impl="cpu", anchor_dtype=anchor_dtype, **HPARAMS[rule])
        for _ in range(steps):
            g = torch.randn(n, generator=gen).to(getattr(torch, grad_dtype))
            refs.step(g)
            for level in levels:
                cpu_kernel.set_simd_level(level)
                params[level].grad = g
                opts[level].step()
        for level in levels:
            assert_close_to_reference(params[level].detach(), refs.theta)


def test_levels_agree_on_multithreaded_chunks(restore_level):
    # Odd thread counts and a size just over the parallel threshold exercise the chunk boundaries.
    n = (1 << 15) + 33
    gen = torch.Generator().manual_seed(0)
    base = [torch.randn(n, generator=gen) for _ in range(4)]
    c = StepCoefficients(beta1=0.9, beta2=0.999, eps=1e-6, step_size=1e-2, post_pull=0.05, post_decay=1e-4)
    results = []
    for threads in (1, 2, 3, 7):
        p, g, m, v = (t.clone() for t in base)
        v.abs_()
        cpu_kernel.fused_step(p, g, m, v, base[0] * 0.5, c, num_threads=threads)
        results.append((p, m, v))
    for other in results[1:]:
        for a, b in zip(results[0], other):
            torch.testing.assert_close(a, b, rtol=0, atol=0)


def test_kernel_refuses_non_contiguous_without_touching_anything():
    p = torch.randn(8, 4)
    g = torch.randn(4, 8).t()  # non-contiguous view
    m, v = torch.zeros(8, 4), torch.zeros(8, 4)
    before = p.clone()
    c = StepCoefficients(beta1=0.9, beta2=0.999, eps=1e-8, step_size=1e-3)
    with pytest.raises(TypeError, match="gradient is not contiguous"):
        cpu_kernel.fused_step(p, g, m, v, None, c)
    torch.testing.assert_close(p, before, rtol=0, atol=0)


@pytest.mark.parametrize("role,bad,match", [
    ("param", torch.zeros(4, dtype=torch.float64), "parameter has dtype torch.float64"),
    ("grad", torch.zeros(4, dtype=torch.float16), "gradient has dtype torch.float16"),
    ("anchor", torch.zeros(4, dtype=torch.int32), "anchor has dtype torch.int32"),
    ("exp_avg", torch.zeros(5), "size mismatch"),
    ("exp_avg_sq", torch.zeros(4, dtype=torch.bfloat16), "exp_avg_sq has dtype torch.bfloat16"),
])
def test_kernel_refuses_bad_tensors(role, bad, match):
    args = dict(param=torch.zeros(4), grad=torch.zeros(4), exp_avg=torch.zeros(4),
                exp_avg_sq=torch.zeros(4), anchor=torch.zeros(4))
    args[role] = bad
    c = StepCoefficients(beta1=0.9, beta2=0.999, eps=1e-8, step_size=1e-3)
    with pytest.raises((TypeError, ValueError), match=match):
        cpu_kernel.fused_step(coeffs=c, **args)


def test_unknown_level_is_refused_with_the_valid_ones():
    with pytest.raises(ValueError, match="choose one of: scalar"):
        cpu_kernel.set_simd_level("avx1024")


def _run_with_env(value: str) -> subprocess.CompletedProcess:
    code = "from ft_framework.optim import cpu; print(cpu.simd_level())"
    env = {**os.environ, cpu_kernel.SIMD_ENV_VAR: value}
    return subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True)


def test_environment_variable_forces_a_lower_level():
    out = _run_with_env("scalar")
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "scalar"
    bad = _run_with_env("sse9")
    assert bad.returncode != 0
    assert "FT_FRAMEWORK_SIMD='sse9'" in bad.stderr and "choose one of" in bad.stderr


def test_denormal_flush_is_confined_to_the_kernel(restore_level):
    # Early in RecAdam's sigmoid schedule lambda(t) ~ e^-70, so the Adam term lands in fp32
    # denormals; the kernel flushes them (FTZ/DAZ) for speed but must restore the caller's MXCSR.
    tiny = torch.tensor([1e-40])
    assert tiny.item() != 0.0  # torch keeps denormals by default
    for level in cpu_kernel.supported_simd_levels():
        cpu_kernel.set_simd_level(level)
        for n in (17, 1 << 16):  # one thread, and the OpenMP threads
            p = torch.nn.Parameter(torch.randn(n))
            anchor = p.detach() + 0.01
            opt = build_optimizer("recadam", [{"params": [p], "anchors": [anchor]}], impl="cpu",
                                  lr=2e-5, anneal_k=0.5, anneal_t0=250, pretrain_cof=5000.0)
            ref = Reference("recadam", p.detach(), anchor, lr=2e-5, anneal_k=0.5, anneal_t0=250,
                            pretrain_cof=5000.0)
            for _ in range(120):  # lambda from e^-125 to e^-65
                g = torch.randn(n) * 1e-2
                p.grad = g
                ref.step(g)
                opt.step()
            assert_close_to_reference(p.detach(), ref.theta)
            assert (tiny * 2).item() == pytest.approx(2e-40, rel=1e-3)


@pytest.mark.skipif(not cpu_kernel.kernel_available(), reason="C++ kernel not built")
def test_the_binding_itself_refuses_what_would_write_out_of_bounds():
    from ft_framework.optim.coefficients import StepCoefficients

    kernel = cpu_kernel._require_kernel()
    coeffs = cpu_kernel._kernel_coefficients(StepCoefficients(beta1=0.9, beta2=0.999, eps=1e-8, step_size=0.1))
    p, g = torch.zeros(4), torch.ones(4)
    with pytest.raises(ValueError, match="must have the parameter's 4 elements"):
        kernel.fused_step(p.numpy(), g.numpy(), torch.zeros(3).numpy(), torch.zeros(4).numpy(), None, coeffs, 1)
    with pytest.raises(ValueError, match="exp_avg must hold float32, got buffer format 'd'"):
        kernel.fused_step(p.numpy(), g.numpy(), torch.zeros(4, dtype=torch.float64).numpy(),
                          torch.zeros(4).numpy(), None, coeffs, 1)
    with pytest.raises(ValueError, match="param is not contiguous"):
        kernel.fused_step(torch.zeros(8)[::2].numpy(), g.numpy(), torch.zeros(4).numpy(),
                          torch.zeros(4).numpy(), None, coeffs, 1)
    m, v = torch.zeros(4), torch.zeros(4)
    kernel.fused_step(p.numpy(), g.numpy(), m.numpy(), v.numpy(), None, coeffs, 1)
    assert torch.allclose(m, torch.full((4,), 0.1)) and bool((p < 0).all())  # updated in place
