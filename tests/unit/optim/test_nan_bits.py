"""A NaN in the compact state's bf16 moments is one bit pattern, BF16_NAN_BITS (optim/compact.py),
in every program: the C++ kernel at every SIMD level, the torch path and the Triton kernel (under
TRITON_INTERPRET=1). A GPU's NaN is 0x7FFFFFFF: the bare integer roundings (bits + 0x7FFF + lsb,
bits + 16 random bits) carry it into the sign and store -0.0, so a NaN gradient made a moment
look like zero on a GPU while it stayed NaN on the CPU. The gradients here hold such GPU-style
NaN patterns (both signs, several payloads), as fp32 and as bf16, beside finite elements whose
bits every program must still agree on."""

import pytest
import torch

from ft_framework.optim import cpu as cpu_kernel
from ft_framework.optim import triton_step
from ft_framework.optim.coefficients import StepCoefficients
from ft_framework.optim.compact import BF16_NAN_BITS, round_nearest_bf16, stochastic_round_bf16
from ft_framework.optim.programs import step_program
from simd_levels import SIMD_LEVELS, level_or_skip

pytestmark = pytest.mark.usefixtures("restore_level")

# fp32 NaN words: a GPU's (0x7FFFFFFF) and its negative, x86's default NaN and its positive, a
# signalling NaN with a low payload, and payloads whose low half carries in the rounding.
FP32_NANS = (0x7FFFFFFF, 0xFFFFFFFF, 0x7FC00000, 0xFFC00000, 0x7F800001, 0xFF800001, 0x7FFF8000, 0xFFFFC000)
# bf16 NaN gradients (a GPU's bf16 NaN is 0x7FFF), widened exactly by every program.
BF16_NANS = (0x7FFF, 0xFFFF, 0x7FC0, 0xFFC0, 0x7F81)
N = 70  # past a 64-lane block and not a multiple of 8 or 16: every SIMD tail runs
C = StepCoefficients(beta1=0.9, beta2=0.999, eps=1e-8, step_size=1e-3, denom_scale=1.0, post_pull=0.01)


def _gradient(bf16: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """A gradient with NaN patterns at spread positions among finite values, and its NaN mask."""
    gen = torch.Generator().manual_seed(3)
    g = torch.randn(N, generator=gen) * 1e-3
    if bf16:
        g = g.bfloat16()
        words, patterns = g.view(torch.int16), [p - (1 << 16) if p >= 1 << 15 else p for p in BF16_NANS]
    else:
        words, patterns = g.view(torch.int32), [p - (1 << 32) if p >= 1 << 31 else p for p in FP32_NANS]
    positions = list(range(1, N, N // len(patterns)))[:len(patterns)]
    for i, p in zip(positions, patterns):
        words[i] = p
    mask = torch.zeros(N, dtype=torch.bool)
    mask[positions] = True
    return g, mask


def _state(bf16_grad: bool):
    gen = torch.Generator().manual_seed(4)
    anchor = (torch.randn(N, generator=gen) * 0.05).bfloat16()
    delta = torch.randn(N, generator=gen) * 1e-3
    param = anchor.float() + delta
    m = (torch.randn(N, generator=gen) * 1e-3).bfloat16()
    v = (torch.rand(N, generator=gen) * 1e-6).bfloat16()
    g, mask = _gradient(bf16_grad)
    return (param, g, m, v, delta, anchor, 1000), mask


def _run(program: str, bf16_grad: bool, level: str | None = None) -> tuple[list[torch.Tensor], torch.Tensor]:
    if level is not None:
        cpu_kernel.set_simd_level(level)
    tensors, mask = _state(bf16_grad)
    step_program(program).step_compact([tensors], C, seed=7, step=3)
    param, _, m, v, delta, _, _ = tensors
    return [param, m, v, delta], mask


def _check(out: list[torch.Tensor], mask: torch.Tensor) -> None:
    param, m, v, delta = out
    for name, moment in (("exp_avg", m), ("exp_avg_sq", v)):
        bits = moment.view(torch.int16).to(torch.int32) & 0xFFFF
        assert bits[mask].tolist() == [BF16_NAN_BITS] * int(mask.sum()), (name, [hex(b) for b in bits[mask].tolist()])
        assert torch.isfinite(moment.float()[~mask]).all(), name
    assert torch.isnan(param[mask]).all() and torch.isnan(delta[mask]).all()


def _same_bits(a: list[torch.Tensor], b: list[torch.Tensor], mask: torch.Tensor) -> bool:
    """Equal bits everywhere in the moments; equal bits at the finite elements of the fp32 tensors
    (an fp32 NaN keeps the hardware's payload, which the contract does not fix)."""
    def words(t):
        return t.view(torch.int16 if t.element_size() == 2 else torch.int32)

    param_a, m_a, v_a, d_a = a
    param_b, m_b, v_b, d_b = b
    return (torch.equal(words(m_a), words(m_b)) and torch.equal(words(v_a), words(v_b))
            and torch.equal(words(param_a)[~mask], words(param_b)[~mask])
            and torch.equal(words(d_a)[~mask], words(d_b)[~mask]))


@pytest.mark.parametrize("bf16_grad", [False, True], ids=["fp32_grad", "bf16_grad"])
@pytest.mark.parametrize("level", SIMD_LEVELS)
def test_the_cpu_kernel_stores_a_nan_moment_as_the_quiet_nan(level, bf16_grad):
    level_or_skip(level)
    out, mask = _run("cpu", bf16_grad, level)
    _check(out, mask)
    scalar, _ = _run("cpu", bf16_grad, "scalar")
    assert _same_bits(out, scalar, mask)


@pytest.mark.parametrize("bf16_grad", [False, True], ids=["fp32_grad", "bf16_grad"])
def test_the_torch_path_stores_the_kernels_bits(bf16_grad):
    level_or_skip("scalar")
    out, mask = _run("torch", bf16_grad)
    _check(out, mask)
    assert _same_bits(out, _run("cpu", bf16_grad, "scalar")[0], mask)


@pytest.mark.skipif(triton_step.triton is None, reason="triton is not installed (pip install triton)")
@pytest.mark.parametrize("bf16_grad", [False, True], ids=["fp32_grad", "bf16_grad"])
def test_the_triton_kernel_stores_the_kernels_bits(bf16_grad, monkeypatch):
    level_or_skip("scalar")
    monkeypatch.setenv(triton_step.INTERPRET_ENV_VAR, "1")
    out, mask = _run("triton", bf16_grad)
    _check(out, mask)
    assert _same_bits(out, _run("cpu", bf16_grad, "scalar")[0], mask)


def test_the_roundings_owned_by_compact_map_every_nan_to_the_quiet_nan():
    """round_nearest_bf16 and stochastic_round_bf16 (the torch path's stores) on NaN words of both
    signs and every payload class; finite values and infinities round as before."""
    words = list(FP32_NANS) + [0x3F800000, 0xBF800000, 0x7F800000, 0xFF800000, 0x7F7FFFFF]
    # made from the words themselves (a Python float would quiet the signalling NaN)
    x = torch.tensor([w - (1 << 32) if w >= 1 << 31 else w for w in words], dtype=torch.int32).view(torch.float32)
    nan = torch.isnan(x)
    for rounded in (round_nearest_bf16(x), stochastic_round_bf16(x, torch.full((len(words),), 0xFFFF_FFFF))):
        bits = rounded.view(torch.int16).to(torch.int32) & 0xFFFF
        assert bits[nan].tolist() == [BF16_NAN_BITS] * int(nan.sum())
        assert bits[~nan][:4].tolist() == [0x3F80, 0xBF80, 0x7F80, 0xFF80]


def _run_bf16_form(program: str, bf16_grad: bool, level: str | None = None):
    """The bf16 weight form (the device-lean offload's): the new weight written in bf16, over the
    bf16 gradient itself where the gradient is bf16; no fp32 weight of the delta master."""
    if level is not None:
        cpu_kernel.set_simd_level(level)
    (_, g, m, v, delta, anchor, base), mask = _state(bf16_grad)
    weight = g if bf16_grad else torch.empty(N, dtype=torch.bfloat16)
    step_program(program).step_compact_bf16([(None, g, m, v, delta, anchor, base, weight)], C, seed=7, step=3)
    return [weight, m, v, delta], mask


@pytest.mark.parametrize("bf16_grad", [False, True], ids=["fp32_grad", "bf16_grad_in_place"])
@pytest.mark.parametrize("program", SIMD_LEVELS + ["torch", "triton"])
def test_the_bf16_weight_form_stores_a_nan_weight_as_the_quiet_nan(program, bf16_grad, monkeypatch):
    """A NaN weight, as a NaN moment, is BF16_NAN_BITS in every program, and the finite elements'
    bits are the scalar kernel's."""
    level_or_skip("scalar")
    want, mask = _run_bf16_form("cpu", bf16_grad, "scalar")
    if program == "triton":
        if triton_step.triton is None:
            pytest.skip("triton is not installed (pip install triton)")
        monkeypatch.setenv(triton_step.INTERPRET_ENV_VAR, "1")
        got, _ = _run_bf16_form("triton", bf16_grad)
    elif program == "torch":
        got, _ = _run_bf16_form("torch", bf16_grad)
    else:
        level_or_skip(program)
        got, _ = _run_bf16_form("cpu", bf16_grad, program)
    for out in (want, got):
        weight, m, v, delta = out
        for name, stored in (("weight", weight), ("exp_avg", m), ("exp_avg_sq", v)):
            bits = stored.view(torch.int16).to(torch.int32) & 0xFFFF
            nans = bits[mask].tolist()
            assert nans == [BF16_NAN_BITS] * int(mask.sum()), (name, [hex(b) for b in nans])
            assert torch.isfinite(stored.float()[~mask]).all(), name
    assert _same_bits(got, want, mask)
