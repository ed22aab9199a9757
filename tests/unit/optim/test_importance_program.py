"""The per-element importance F~ in the one element program (cpp/step_args.h): each pull's fraction w
(pre_pull, post_pull) becomes min(fp32(w) * fp32(F~_i), 1), the decays never read F~.

Against a float64 reference written here from the formula (the literal program of step_args.h, not
our code), element by element over awkward sizes at every SIMD level, in the fp32 state and the
compact one (both masters, and the bf16 weight form); the C++ kernel, torch and Triton (the
interpreter) store the same bits; F~ = 1 is the unweighted program bit for bit, through the optimizer
too; a large F~ clamps at theta* and never past it; the inverse undoes a weighted step; a guarded
step with a non-finite gradient leaves everything untouched."""

import struct

import pytest
import torch

from ft_framework.optim import build_optimizer
from ft_framework.optim import cpu as cpu_kernel
from ft_framework.optim import triton_step
from ft_framework.optim.base import IMPORTANCE
from ft_framework.optim.coefficients import StepCoefficients
from ft_framework.optim.compact import rounding_key
from ft_framework.optim.programs import step_program
from ft_framework.optim.torch_step import foreach_inverse_step, foreach_step
from ft_framework.optim.triton_step import TritonProgram
from rule_hparams import RULE_HPARAMS
from simd_levels import SIMD_LEVELS, level_or_skip

pytestmark = pytest.mark.usefixtures("restore_level")

SIZES = (1, 15, 17, 33, 1037, (1 << 15) + 33)  # tails at every width, the multi-threaded chunks
# Every stage: both pulls (weighted), both decays (never weighted), debiasing.
C = StepCoefficients(beta1=0.9, beta2=0.999, eps=1e-8, step_size=1e-2, denom_scale=1.3, pre_decay=1e-3,
                     pre_pull=0.05, post_pull=0.1, post_decay=2e-3)
BF16_HALF_ULP = 2.0 ** -8  # relative: rounding to nearest bf16
BF16_ULP = 2.0 ** -7       # relative: a stochastic rounding to bf16


def _f32(x: float) -> float:
    return struct.unpack("f", struct.pack("f", x))[0]


def importance(n: int, gen: torch.Generator) -> torch.Tensor:
    """bf16 F~ in [0, 4) with zeros, ones, values that clamp the post pull only (w_post F~ > 1 >
    w_pre F~) and values that clamp both."""
    f = torch.rand(n, generator=gen) * 4
    f[0::7], f[1::7], f[2::7], f[3::7] = 0.0, 1.0, 50.0, 12.0
    return f.bfloat16()


def reference(p, g, m, v, a, f, c: StepCoefficients):
    """The program of cpp/step_args.h line by line in float64, with the pull fractions
    min(w * F~, 1): the new (p, m, v), the step's change p - p' and the sum of its terms' sizes
    (what the fp32 roundings are relative to)."""
    p, g, m, v, a, f = (x.double() for x in (p, g, m, v, a, f))
    w_pre = torch.clamp_max(_f32(c.pre_pull) * f, 1.0)
    w_post = torch.clamp_max(_f32(c.post_pull) * f, 1.0)
    start = p.clone()
    terms = []
    for term in ("pre_decay", "pre_pull", "adam", "post_pull", "post_decay"):
        if term == "pre_decay":
            change = c.pre_decay * p
        elif term == "pre_pull":
            change = w_pre * (p - a)
        elif term == "adam":
            m = c.beta1 * m + (1 - c.beta1) * g
            v = c.beta2 * v + (1 - c.beta2) * g * g
            change = c.step_size * m / (torch.sqrt(v) * c.denom_scale + c.eps)
        elif term == "post_pull":
            change = w_post * (p - a)
        else:
            change = c.post_decay * p
        p = p - change
        terms.append(change.abs())
    return p, m, v, start - p, sum(terms)


def assert_close(got, want, bound, what: str) -> None:
    err = (got.double() - want).abs()
    worst = int((err - bound).argmax())
    assert bool((err <= bound).all()), (f"{what}: element {worst} is {got.flatten()[worst].item()!r}, the "
                                        f"reference {want.flatten()[worst].item()!r} (bound {bound[worst].item():.3g})")


def fp32_inputs(n: int, seed: int, anchor_dtype=torch.bfloat16):
    gen = torch.Generator().manual_seed(seed)
    p = torch.randn(n, generator=gen)
    g = torch.randn(n, generator=gen)
    m = 0.1 * torch.randn(n, generator=gen)
    v = 0.01 * torch.rand(n, generator=gen)
    a = (p + 0.1 * torch.randn(n, generator=gen)).to(anchor_dtype)
    return p, g, m, v, a, importance(n, gen)


# ---- the float64 reference -------------------------------------------------------------------

@pytest.mark.parametrize("anchor_dtype", [torch.float32, torch.bfloat16], ids=["anchor32", "anchor16"])
@pytest.mark.parametrize("level", SIMD_LEVELS)
def test_fp32_state_equals_the_float64_reference(level, anchor_dtype):
    level_or_skip(level)
    cpu_kernel.set_simd_level(level)
    for n in SIZES:
        p0, g, m0, v0, a, f = fp32_inputs(n, 3, anchor_dtype)
        p, m, v = p0.clone(), m0.clone(), v0.clone()
        cpu_kernel.fused_step(p, g, m, v, a, C, num_threads=2, importance=f)
        rp, rm, rv, change, terms = reference(p0, g, m0, v0, a, f, C)
        # A few fp32 roundings of the magnitudes the step combines.
        assert_close(p, rp, 1e-6 * (rp.abs() + p0.abs() + a.double().abs() + terms), f"{level} n={n} param")
        assert_close(m, rm, 1e-6 * (rm.abs() + m0.abs() + g.abs()), f"{level} n={n} exp_avg")
        assert_close(v, rv, 1e-6 * rv.abs(), f"{level} n={n} exp_avg_sq")


def compact_inputs(n: int, seed: int):
    gen = torch.Generator().manual_seed(seed)
    a = torch.randn(n, generator=gen).bfloat16()
    delta = 0.1 * torch.randn(n, generator=gen)
    g = torch.randn(n, generator=gen)
    m = (0.1 * torch.randn(n, generator=gen)).bfloat16()
    v = (0.01 * torch.rand(n, generator=gen)).bfloat16()
    return a, delta, g, m, v, importance(n, gen)


@pytest.mark.parametrize("form", ["delta-master", "param-master", "bf16-weight"])
@pytest.mark.parametrize("level", SIMD_LEVELS)
def test_compact_state_equals_the_float64_reference(level, form):
    level_or_skip(level)
    cpu_kernel.set_simd_level(level)
    program = step_program("cpu")
    for n in SIZES:
        a, d0, g, m16, v16, f = compact_inputs(n, 5)
        p0 = a.float() + d0  # the master's weight (the delta master's theta is a + delta in registers)
        m, v = m16.clone(), v16.clone()
        rp, rm, rv, change, terms = reference(a.double() + d0.double(), g, m16, v16, a, f, C)
        if form == "delta-master":
            param, delta = torch.empty(n), d0.clone()
            program.step_compact([(param, g, m, v, delta, a, 0, f)], C, seed=7, step=3)
            rd = d0.double() - change  # the pull read delta exactly
            assert_close(delta, rd, 1e-6 * (rd.abs() + d0.abs() + terms), f"{level} n={n} delta")
            assert_close(param, rp, 1e-6 * rp.abs() + 2e-7 * (a.double().abs() + d0.abs()), f"{level} n={n} param")
        elif form == "param-master":
            param = p0.clone()
            program.step_compact([(param, g, m, v, None, a, 0, f)], C, seed=7, step=3)
            assert_close(param, rp, 1e-6 * (rp.abs() + p0.abs() + terms), f"{level} n={n} param")
        else:
            delta, weight = d0.clone(), torch.empty(n, dtype=torch.bfloat16)
            program.step_compact_bf16([(None, g, m, v, delta, a, 0, weight, f)], C, seed=7, step=3)
            rd = d0.double() - change
            assert_close(delta, rd, 1e-6 * (rd.abs() + d0.abs() + terms), f"{level} n={n} delta")
            assert_close(weight, rp, BF16_HALF_ULP * rp.abs() + 1e-6 * (a.double().abs() + d0.abs()),
                         f"{level} n={n} bf16 weight")
        assert_close(m, rm, BF16_HALF_ULP * rm.abs() + 1e-6 * (m16.double().abs() + g.abs()), f"{level} n={n} m")
        assert_close(v, rv, BF16_ULP * rv.abs() + 1e-9, f"{level} n={n} v")


# ---- one program: every implementation stores the same bits ----------------------------------

def _programs():
    out = [("cpu-" + level, level) for level in SIMD_LEVELS] + [("torch", None)]
    if triton_step.triton is not None:
        out.append(("triton", None))
    return out


def _run(name: str, level: str | None):
    """The program `name` (at SIMD `level` for the kernel); Triton in its interpreter, in chunks of
    256 so programs start inside tensors."""
    if level is not None:
        level_or_skip(level)
        cpu_kernel.set_simd_level(level)
        return step_program("cpu")
    if name == "triton":
        return TritonProgram(chunk=256, block=64)
    return step_program("torch")


def _bits(tensors) -> list[torch.Tensor]:
    return [t.view(torch.int16 if t.dtype == torch.bfloat16 else torch.int32).clone() for t in tensors]


def _fp32_rows(seed: int):
    """Rows of one call: weighted (fp32 and bf16 anchors, bf16 gradient), unweighted anchored, no anchor."""
    rows = []
    for i, n in enumerate((1, 17, 1037, 300)):
        p, g, m, v, a, f = fp32_inputs(n, seed + i, torch.float32 if i == 1 else torch.bfloat16)
        if i == 2:
            g = g.bfloat16()
        rows.append((p, g, m, v, a, f))
    p, g, m, v, a, _ = fp32_inputs(33, seed + 10)
    rows.append((p, g, m, v, a, None))
    p, g, m, v, _, _ = fp32_inputs(15, seed + 11)
    rows.append((p, g, m, v, None, None))
    return rows


def _compact_rows(seed: int, bf16_form: bool):
    rows = []
    for i, n in enumerate((1, 17, 1037, 33)):
        a, d, g, m, v, f = compact_inputs(n, seed + i)
        weighted = f if i < 3 else None
        master = None if bf16_form else torch.empty(n)
        if i == 2:  # the parameter master (DeepSpeed's partitions): no delta, param - anchor
            master, d = a.float() + d, None
        row = (master, g, m, v, d, a, 100 * i)
        rows.append(row + ((torch.empty(n, dtype=torch.bfloat16),) if bf16_form else ()) + (weighted,))
    gen = torch.Generator().manual_seed(seed + 10)
    head = (torch.randn(15, generator=gen), torch.randn(15, generator=gen), torch.zeros(15, dtype=torch.bfloat16),
            torch.zeros(15, dtype=torch.bfloat16), None, None, 7)
    rows.append(head + ((torch.empty(15, dtype=torch.bfloat16),) if bf16_form else ()) + (None,))
    return rows


def _step(program, rows, kind: str) -> None:
    """One step of `rows` in the state `kind` names (fp32, compact, or compact's bf16 weight form)."""
    if kind == "fp32":
        program.step(rows, C)
    elif kind == "compact":
        program.step_compact(rows, C, seed=7, step=3)
    else:
        program.step_compact_bf16(rows, C, seed=7, step=3)


def _outputs(rows, kind: str) -> list[torch.Tensor]:
    if kind == "fp32":
        return _bits([t for r in rows for t in r[:4]])
    return _bits([t for r in rows for t in (r[0], r[2], r[3], r[4]) + ((r[7],) if kind == "bf16" else ())
                  if t is not None])


@pytest.mark.parametrize("kind", ["fp32", "compact", "bf16"])
@pytest.mark.parametrize("name, level", _programs(), ids=[n for n, _ in _programs()])
def test_every_program_stores_the_scalar_kernels_bits(name, level, kind, monkeypatch):
    monkeypatch.setenv(triton_step.INTERPRET_ENV_VAR, "1")
    level_or_skip("scalar")

    def run(program) -> list[torch.Tensor]:
        rows = _fp32_rows(21) if kind == "fp32" else _compact_rows(21, kind == "bf16")
        for _ in range(2):
            _step(program, rows, kind)
        return _outputs(rows, kind)

    cpu_kernel.set_simd_level("scalar")
    want = run(step_program("cpu"))
    got = run(_run(name, level))
    for i, (x, y) in enumerate(zip(got, want)):
        assert torch.equal(x, y), f"{name} {kind}: tensor {i} differs in {(x != y).sum()} elements"


@pytest.mark.parametrize("kind", ["fp32", "compact", "bf16"])
@pytest.mark.parametrize("name, level", _programs(), ids=[n for n, _ in _programs()])
def test_importance_one_is_the_unweighted_program_bit_for_bit(name, level, kind, monkeypatch):
    monkeypatch.setenv(triton_step.INTERPRET_ENV_VAR, "1")
    program = _run(name, level)

    def run(ones: bool) -> list[torch.Tensor]:
        rows = _fp32_rows(31) if kind == "fp32" else _compact_rows(31, kind == "bf16")
        rows = [r[:-1] + ((torch.ones_like(r[-1]) if ones else None) if r[-1] is not None else None,) for r in rows]
        _step(program, rows, kind)
        return _outputs(rows, kind)

    for i, (x, y) in enumerate(zip(run(True), run(False))):
        assert torch.equal(x, y), f"{name} {kind}: tensor {i} differs in {(x != y).sum()} elements"


@pytest.mark.parametrize("compact", [False, True], ids=["fp32", "compact"])
@pytest.mark.parametrize("impl", ["cpu", "torch"])
@pytest.mark.parametrize("rule", ["recadam", "prior_wd"])
def test_the_optimizer_with_importance_one_is_the_rule_without_it(rule, impl, compact):
    """Through AnchoredOptimizer (its rows carry state[IMPORTANCE]): F~ = 1 is the rule bit for bit,
    and a F~ of 2 changes the step (the importance reaches the program)."""
    if impl == "cpu" and not cpu_kernel.kernel_available():
        pytest.skip("C++ kernel not built")

    def run(fill: float | None) -> list[torch.Tensor]:
        gen = torch.Generator().manual_seed(4)
        thetas = [torch.randn(n, generator=gen) for n in (17, 1037)]
        params = [torch.nn.Parameter(t + 0.05 * torch.randn(t.shape, generator=gen)) for t in thetas]
        head = torch.nn.Parameter(torch.randn(5, generator=gen))
        state = dict(state_dtype="bfloat16", anchor_dtype="bfloat16", rounding_seed=9) if compact else {}
        opt = build_optimizer(rule, [{"params": params, "anchors": thetas}, {"params": [head]}], impl=impl,
                              **RULE_HPARAMS[rule], **state)
        if fill is not None:
            for p in params:
                opt.state[p][IMPORTANCE] = torch.full(p.shape, fill, dtype=torch.bfloat16)
        for _ in range(3):
            for p in params + [head]:
                p.grad = torch.randn(p.shape, generator=gen)
            opt.step()
        return _bits([x.detach() for p in params + [head] for x in (p, opt.state[p]["exp_avg"])])

    plain = run(None)
    assert all(torch.equal(x, y) for x, y in zip(run(1.0), plain))
    assert not all(torch.equal(x, y) for x, y in zip(run(2.0), plain))


# ---- the clamp ---------------------------------------------------------------------------------

@pytest.mark.parametrize("name, level", _programs(), ids=[n for n, _ in _programs()])
def test_a_large_importance_stops_at_theta_star(name, level, monkeypatch):
    """w F~ >= 1: the post pull lands on theta* (within the rounding of the change), never past it;
    the unclamped fraction w F~ = 5 would put p at theta* - 4 (p - theta*)."""
    monkeypatch.setenv(triton_step.INTERPRET_ENV_VAR, "1")
    program = _run(name, level)
    c = StepCoefficients(beta1=0.9, beta2=0.999, eps=1e-8, step_size=1e-2, post_pull=0.1)
    n = 1037
    p0, g, m, v, a, _ = fp32_inputs(n, 8, torch.float32)
    p = p0.clone()
    program.step([(p, g, m, v, a, torch.full((n,), 50.0, dtype=torch.bfloat16))], c)
    off = (p - a).abs()
    assert bool((off <= 4 * torch.finfo(torch.float32).eps * (p0.abs() + a.abs())).all()), float(off.max())


# ---- the inverse (rollback) and the guarded step -------------------------------------------------

def _inverse_cases():
    return [("cpu-" + level, level) for level in SIMD_LEVELS] + [("torch", None)]


@pytest.mark.parametrize("name, level", _inverse_cases(), ids=[n for n, _ in _inverse_cases()])
def test_the_inverse_undoes_a_weighted_step(name, level):
    if level is not None:
        level_or_skip(level)
        cpu_kernel.set_simd_level(level)
    c = StepCoefficients(beta1=0.9, beta2=0.999, eps=1e-6, step_size=1e-2, pre_decay=1e-3, pre_pull=0.05,
                         post_pull=0.2, post_decay=1e-3)
    for n in SIZES:
        p0, g, m0, v0, a, _ = fp32_inputs(n, 9)
        m0[::5], v0[::5] = 0.0, 0.0
        f = (torch.rand(n, generator=torch.Generator().manual_seed(n)) * 4).bfloat16()  # w F~ < 1
        p, m, v = p0.clone(), m0.clone(), v0.clone()
        if level is None:
            foreach_step([p], [g], [m], [v], [a], c, [f])
        else:
            cpu_kernel.fused_step(p, g, m, v, a, c, num_threads=3, importance=f)
        assert not torch.equal(p, p0)
        stepped = [t.abs().max() for t in (p, m, v)]
        if level is None:
            foreach_inverse_step([p], [g], [m], [v], [a], c, [f])
        else:
            cpu_kernel.fused_inverse(p, g, m, v, a, c, num_threads=3, importance=f)
        for got, want, what, top in zip((p, m, v), (p0, m0, v0), ("param", "exp_avg", "exp_avg_sq"), stepped):
            scale = torch.maximum(want.abs().max(), top).double()
            assert_close(got, want.double(), 1e-6 * (want.double().abs() + scale), f"{name} n={n} {what}")
        assert bool((v >= 0).all())


@pytest.mark.parametrize("name, level", _inverse_cases(), ids=[n for n, _ in _inverse_cases()])
def test_a_step_pulled_onto_theta_star_cannot_be_undone(name, level):
    if level is not None:
        level_or_skip(level)
        cpu_kernel.set_simd_level(level)
    c = StepCoefficients(beta1=0.9, beta2=0.999, eps=1e-6, step_size=1e-2, post_pull=0.2)
    p, g, m, v, a, _ = fp32_inputs(33, 2)
    f = torch.ones(33, dtype=torch.bfloat16)
    f[20] = 5.0  # 0.2 * 5 = 1: that element is theta*, whatever it was
    with pytest.raises(ValueError, match="cannot be undone"):
        if level is None:
            foreach_inverse_step([p], [g], [m], [v], [a], c, [f])
        else:
            cpu_kernel.fused_inverse(p, g, m, v, a, c, importance=f)


@pytest.mark.parametrize("name, level", _programs(), ids=[n for n, _ in _programs()])
def test_a_guarded_step_with_a_nonfinite_gradient_touches_nothing(name, level, monkeypatch):
    monkeypatch.setenv(triton_step.INTERPRET_ENV_VAR, "1")
    program = _run(name, level)
    for n, bad in ((17, 16), ((1 << 15) + 33, 20000)):
        for value in (float("nan"), float("inf")):
            p, g, m, v, a, f = fp32_inputs(n, 6)
            g[bad] = value
            before = _bits((p, m, v))
            assert program.guarded_step((p, g, m, v, a, f), C) is False
            assert all(torch.equal(x, y) for x, y in zip(_bits((p, m, v)), before))
            g[bad] = 0.5
            assert program.guarded_step((p, g, m, v, a, f), C) is True
            assert not torch.equal(p.view(torch.int32), before[0])


@pytest.mark.parametrize("impl", ["cpu", "torch"])
@pytest.mark.parametrize("scale", [3.0, 1.0e6])
def test_the_optimizer_rolls_back_a_weighted_step_from_its_copies(impl, scale):
    """step_tensors(keep_undo=True) then rollback_tensors through AnchoredOptimizer with
    state[IMPORTANCE]: the state comes back bit for bit, also where the weighted pull put elements
    onto theta* (scale 1e6: min(w * F~, 1) = 1, which no inverse undoes: the overlapped offload's
    speculative steps keep copies instead). A weighted step taken without keep_undo has none."""
    if impl == "cpu":
        level_or_skip("scalar")
    gen = torch.Generator().manual_seed(12)
    thetas = [torch.randn(n, generator=gen) for n in (17, 1037)]
    params = [torch.nn.Parameter(t + 0.05 * torch.randn(t.shape, generator=gen)) for t in thetas]
    opt = build_optimizer("recadam", [{"params": params, "anchors": thetas}], impl=impl, **RULE_HPARAMS["recadam"])
    for p in params:
        opt.state[p][IMPORTANCE] = (torch.rand(p.shape, generator=gen) * scale).bfloat16()
        p.grad = torch.randn(p.shape, generator=gen)
    opt.step()  # moments that are not zero
    before = [x.detach().clone() for p in params for x in (p, opt.state[p]["exp_avg"], opt.state[p]["exp_avg_sq"])]
    steps = [int(opt.state[p]["step"]) for p in params]
    used = opt.step_tensors(params, keep_undo=True)
    assert all(c is not None for c in used)
    if scale > 1e3:  # elements pulled onto theta* (to the rounding of p - (p - theta*))
        assert any(bool(((p.detach() - t).abs() <= 1e-6 * t.abs() + 1e-7).any()) for p, t in zip(params, thetas))
    opt.rollback_tensors(params, None, used)
    after = [x.detach() for p in params for x in (p, opt.state[p]["exp_avg"], opt.state[p]["exp_avg_sq"])]
    assert all(torch.equal(got, want) for got, want in zip(after, before))
    assert [int(opt.state[p]["step"]) for p in params] == steps
    used = opt.step_tensors(params[:1])
    opt._undo.clear()
    with pytest.raises(RuntimeError, match="importance-weighted step was taken without keep_undo=True"):
        opt.rollback_tensors(params[:1], None, used)


# ---- what the programs refuse --------------------------------------------------------------------

@pytest.mark.parametrize("program", ["cpu", "torch"])
def test_an_importance_needs_its_anchor(program):
    if program == "cpu":
        level_or_skip("scalar")
    p, g, m, v, _, f = fp32_inputs(17, 1)
    with pytest.raises(ValueError, match="needs its anchor"):
        step_program(program).step([(p, g, m, v, None, f)], C)


def test_the_kernel_reads_a_bf16_importance_of_the_parameters_size():
    level_or_skip("scalar")
    p, g, m, v, a, f = fp32_inputs(17, 1)
    with pytest.raises(TypeError, match="importance has dtype torch.float32"):
        cpu_kernel.fused_step(p, g, m, v, a, C, importance=f.float())
    with pytest.raises(ValueError, match="importance"):
        cpu_kernel.fused_step(p, g, m, v, a, C, importance=f[:16])
    with pytest.raises(ValueError, match="one step row holds|a step row holds"):
        step_program("cpu").step([(p, g, m, v, a, f, f)], C)
