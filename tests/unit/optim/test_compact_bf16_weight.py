"""The compact state's bf16 weight form (the device-lean offload's, cpp/step_args.h): the step reads
the gradient (bf16, or the fp32 sum of micro-batches) and writes the new weight in bf16, in the bf16
gradient's place, with no fp32 weight of an anchored parameter (theta* + delta formed in registers).

Every program (the C++ kernel at every SIMD level, the torch path, Triton under TRITON_INTERPRET=1)
stores the same bits, element by element, over sizes that leave tails at every vector width and
cross the kernel's thread split and Triton's 64 Ki chunk; the stored state (delta, m, v, the head's
fp32 master) is the fp32-weight form's, bit for bit, and the weight is that form's fp32 weight
rounded to nearest even; and the run stays on the float64 reference of optim_reference.py."""

import pytest
import torch

from ft_framework.optim import build_optimizer
from ft_framework.optim import cpu as cpu_kernel
from ft_framework.optim import triton_step
from ft_framework.optim.coefficients import StepCoefficients
from ft_framework.optim.compact import rounding_bits, rounding_key, stochastic_round_bf16
from optim_reference import Reference
from rule_hparams import RULE_HPARAMS as HPARAMS
from simd_levels import SIMD_LEVELS, level_or_skip

pytestmark = pytest.mark.usefixtures("restore_level")

SEED = 4321
# Tails at every vector width (1, 7, 17, 1037); 70001 crosses the kernel's thread split (32 Ki
# elements) and Triton's 64 Ki chunk.
ANCHORED_SIZES = (1, 7, 17, 1037, 70001)
HEAD_SIZES = (3, 33)
STEPS = 4
PATHS = SIMD_LEVELS + ["torch", "triton"]


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.int16 if t.element_size() == 2 else torch.int32)


def _same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.dtype == b.dtype and torch.equal(_bits(a), _bits(b))


def _use_path(path: str, monkeypatch) -> str:
    """The optimizer's impl for `path` (a SIMD level, "torch" or "triton"), set up."""
    if path == "triton":
        if triton_step.triton is None:
            pytest.skip("triton is not installed (pip install triton)")
        monkeypatch.setenv(triton_step.INTERPRET_ENV_VAR, "1")
        return "triton"
    if path == "torch":
        return "torch"
    level_or_skip(path)
    cpu_kernel.set_simd_level(path)
    return "cpu"


def _model(rule: str, impl: str, seed: int = SEED):
    gen = torch.Generator().manual_seed(7)
    thetas = [torch.randn(n, generator=gen) * 0.05 for n in ANCHORED_SIZES]
    anchored = [torch.nn.Parameter(t + torch.randn(n, generator=gen) * 1e-3) for t, n in zip(thetas, ANCHORED_SIZES)]
    head = [torch.nn.Parameter(torch.randn(n, generator=gen) * 0.05) for n in HEAD_SIZES]
    opt = build_optimizer(rule, [{"params": anchored, "anchors": thetas}, {"params": head}], impl=impl,
                          state_dtype="bfloat16", anchor_dtype="bfloat16", rounding_seed=seed, **HPARAMS[rule])
    return anchored, head, opt


def _gradients(step: int, sizes, fp32: bool) -> list[torch.Tensor]:
    """Gradients whose scale sweeps 1e-3..1e3 over the steps (the moments cross many bf16 binades)."""
    gen = torch.Generator().manual_seed(100 + step)
    grads = [torch.randn(n, generator=gen) * 10.0 ** ((step % 7) - 3) for n in sizes]
    return grads if fp32 else [g.bfloat16() for g in grads]


def bf16_form_run(rule: str, impl: str, fp32_grads: bool):
    """STEPS steps in the bf16 weight form, as the device-lean offload takes them: each anchored
    parameter keeps its weight in a bf16 buffer (keep_bf16_weight) that receives its bf16 gradient
    and then the new weight (in place); the head keeps its fp32 master and its own bf16 buffer. With
    fp32_grads the step reads fp32 gradients (the sums of accumulated micro-batches) and the buffers
    only receive the weights. Returns the optimizer's parameters and state, and every buffer."""
    anchored, head, opt = _model(rule, impl)
    landing = {}
    for p in anchored:
        opt.init_state(p)
        landing[id(p)] = torch.empty(p.shape, dtype=torch.bfloat16)
        opt.keep_bf16_weight(p, landing[id(p)])
        assert p.dtype == torch.bfloat16 and p.data_ptr() == landing[id(p)].data_ptr()
    for p in head:
        landing[id(p)] = torch.empty(p.shape, dtype=torch.bfloat16)
    params = anchored + head
    for t in range(STEPS):
        grads = _gradients(t, [p.numel() for p in params], fp32_grads)
        if not fp32_grads:  # the gradient lands in the buffer the weight is written into
            for p, g in zip(params, grads):
                landing[id(p)].copy_(g)
            grads = [landing[id(p)] for p in params]
        used = opt.step_tensors(params, grads, known_finite=True, weights=[landing[id(p)] for p in params])
        assert None not in used
    return anchored, head, opt, landing


def fp32_form_run(rule: str, impl: str, fp32_grads: bool):
    """The same steps in the fp32-weight form (the fp32 parameter written as theta* + delta)."""
    anchored, head, opt = _model(rule, impl)
    params = anchored + head
    for t in range(STEPS):
        grads = _gradients(t, [p.numel() for p in params], fp32_grads)
        opt.step_tensors(params, grads, known_finite=True)
    return anchored, head, opt


def _stored(anchored, head, opt, landing) -> list[torch.Tensor]:
    """Everything the bf16 form stores: delta, m, v of each anchored tensor, the head's fp32
    master, m, v, and every weight buffer."""
    out = []
    for p in anchored:
        s = opt.state[p]
        out += [s["delta"], s["exp_avg"], s["exp_avg_sq"], landing[id(p)]]
    for p in head:
        s = opt.state[p]
        out += [p.detach(), s["exp_avg"], s["exp_avg_sq"], landing[id(p)]]
    return [x.clone() for x in out]


@pytest.mark.parametrize("fp32_grads", [False, True], ids=["bf16_grad_in_place", "fp32_grad"])
@pytest.mark.parametrize("rule", sorted(HPARAMS))
def test_the_bf16_form_stores_the_fp32_forms_state_and_its_rounded_weight(rule, fp32_grads, monkeypatch):
    """At the scalar level: delta, m, v and the head's master are the fp32-weight form's bits, and
    every weight is that form's fp32 weight rounded to nearest even."""
    impl = _use_path("scalar", monkeypatch)
    anchored, head, opt, landing = bf16_form_run(rule, impl, fp32_grads)
    a2, h2, opt2 = fp32_form_run(rule, impl, fp32_grads)
    for p, q in zip(anchored, a2):
        for key in ("delta", "exp_avg", "exp_avg_sq"):
            assert _same_bits(opt.state[p][key], opt2.state[q][key]), (key, p.numel())
        assert _same_bits(landing[id(p)], q.detach().to(torch.bfloat16)), p.numel()
    for p, q in zip(head, h2):
        assert _same_bits(p.detach(), q.detach())
        assert _same_bits(landing[id(p)], q.detach().to(torch.bfloat16))
        for key in ("exp_avg", "exp_avg_sq"):
            assert _same_bits(opt.state[p][key], opt2.state[q][key]), key


@pytest.mark.parametrize("fp32_grads", [False, True], ids=["bf16_grad_in_place", "fp32_grad"])
@pytest.mark.parametrize("path", PATHS[1:])
@pytest.mark.parametrize("rule", sorted(HPARAMS))
def test_every_simd_level_torch_and_triton_store_the_scalar_kernels_bits(rule, path, fp32_grads, monkeypatch):
    _use_path("scalar", monkeypatch)
    want = _stored(*bf16_form_run(rule, "cpu", fp32_grads))
    impl = _use_path(path, monkeypatch)
    got = _stored(*bf16_form_run(rule, impl, fp32_grads))
    for i, (g, w) in enumerate(zip(got, want)):
        assert _same_bits(g, w), (path, i, int((_bits(g) != _bits(w)).sum()))


def _bf16_ulp(x: torch.Tensor) -> torch.Tensor:
    exponent = torch.frexp(x.abs().clamp_min(1e-38).float())[1].double()
    return torch.pow(2.0, exponent - 8)


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("rule", sorted(HPARAMS))
def test_each_step_of_the_bf16_form_matches_the_float64_reference(rule, path, monkeypatch):
    """Element by element, every step, against the independent float64 rule (optim_reference.py)
    given the state before it: delta within an fp32 rounding of its change, m within a bf16 ulp, v
    the reference's v stochastically rounded with the same bits (but within an fp32 ulp of a bf16
    step), and the bf16 weight the nearest bf16 of theta* + delta (within half a bf16 ulp of the
    reference's theta, plus the fp32 roundings)."""
    impl = _use_path(path, monkeypatch)
    anchored, head, opt = _model(rule, impl)
    params = anchored + head
    landing = {id(p): torch.empty(p.shape, dtype=torch.bfloat16) for p in params}
    for p in anchored:
        opt.init_state(p)
        opt.keep_bf16_weight(p, landing[id(p)])
    bases = {id(p): opt.index_base(p) for p in params}
    for t in range(1, STEPS + 1):
        gen = torch.Generator().manual_seed(11 + t)
        grads = [(torch.randn(p.numel(), generator=gen) * 10 ** (-t / 10)).bfloat16() for p in params]
        refs = {}
        for p, g in zip(params, grads):
            s = opt.init_state(p)
            anchor = s.get("anchor")
            anchor64 = None if anchor is None else anchor.double()
            theta = anchor64 + s["delta"].double() if anchor is not None else p.detach().double()
            m_terms = 0.9 * s["exp_avg"].double().abs() + 0.1 * g.double().abs()
            ref, nudged = (Reference(rule, theta, anchor64, **HPARAMS[rule]) for _ in range(2))
            for r, m_error in ((ref, 0.0), (nudged, 2.4e-7 * m_terms / 0.9)):
                r.m, r.v, r.t = s["exp_avg"].double() + m_error, s["exp_avg_sq"].double(), t - 1
                r.step(g)
            # the fp32 m' = 0.9 m + 0.1 g carries a few ulp of its terms, which may cancel: its
            # error moves theta by as much as the reference moves for m' nudged by that much
            m_sensitivity = (nudged.theta - ref.theta).abs()
            refs[id(p)] = (ref, theta, m_terms, m_sensitivity)
            landing[id(p)].copy_(g)
        opt.step_tensors(params, [landing[id(p)] for p in params], known_finite=True,
                         weights=[landing[id(p)] for p in params])
        for p in params:
            ref, old, m_terms, m_sensitivity = refs[id(p)]
            s = opt.state[p]
            weight = landing[id(p)].double()
            if "delta" in s:
                anchor64 = s["anchor"].double()
                got, want, before = s["delta"].double(), ref.theta - anchor64, old - anchor64
                theta32 = (s["anchor"].float() + s["delta"]).double()
            else:
                got, want, before = p.detach().double(), ref.theta, old
                theta32 = p.detach().double()
            change = (want - before).abs()
            fp32_error = 2.4e-7 * want.abs() + 4e-6 * change + 2 * m_sensitivity + 1e-30
            assert ((got - want).abs() <= fp32_error).all(), (t, p.numel())
            # the weight: theta32 rounded to nearest bf16, so within half a bf16 ulp of it
            assert ((weight - theta32).abs() <= _bf16_ulp(theta32) / 2).all(), (t, p.numel())
            assert ((weight - ref.theta).abs() <= _bf16_ulp(ref.theta) / 2 + 2.4e-7 * ref.theta.abs()
                    + fp32_error).all(), (t, p.numel())
            assert ((s["exp_avg"].double() - ref.m).abs() <= _bf16_ulp(ref.m) + 2.4e-7 * m_terms).all()
            v_ref = stochastic_round_bf16(ref.v.float(), rounding_bits(SEED, t, bases[id(p)], p.numel())).double()
            assert (s["exp_avg_sq"].double() == v_ref).float().mean() >= 0.99, t
            assert ((s["exp_avg_sq"].double() - v_ref).abs() <= _bf16_ulp(ref.v)).all()


def test_the_forgetting_distance_reads_delta_and_a_rollback_restores_the_bf16_weight(monkeypatch):
    """A bf16-weight parameter has no fp32 theta: ||theta - theta*|| is ||delta||, exactly; a
    speculative step kept with keep_undo rolls back to its state, the weight rewritten as the
    nearest bf16 of theta* + delta."""
    impl = _use_path("scalar", monkeypatch)
    anchored, head, opt, landing = bf16_form_run("recadam", impl, fp32_grads=True)
    want = sum(float(opt.state[p]["delta"].double().square().sum()) for p in anchored)
    assert opt.forgetting_distance() == pytest.approx(want ** 0.5, rel=1e-15)
    p = anchored[3]
    before = [x.clone() for x in (opt.state[p]["delta"], opt.state[p]["exp_avg"], opt.state[p]["exp_avg_sq"])]
    weight_before = (opt.state[p]["anchor"].float() + opt.state[p]["delta"]).bfloat16()
    used = opt.step_tensors([p], [torch.ones(p.shape)], keep_undo=True)
    assert not torch.equal(opt.state[p]["delta"], before[0])
    opt.rollback_tensors([p], None, used)
    for x, y in zip((opt.state[p]["delta"], opt.state[p]["exp_avg"], opt.state[p]["exp_avg_sq"]), before):
        assert _same_bits(x, y)
    assert _same_bits(landing[id(p)], weight_before)


def test_the_programs_refuse_what_the_bf16_form_cannot_write_in_place():
    level_or_skip("scalar")
    n = 64
    gen = torch.Generator().manual_seed(0)
    anchor = torch.randn(n, generator=gen).bfloat16()
    delta, grad = torch.randn(n, generator=gen) * 1e-3, torch.randn(n, generator=gen).bfloat16()
    m, v = torch.zeros(n, dtype=torch.bfloat16), torch.zeros(n, dtype=torch.bfloat16)
    c = StepCoefficients(beta1=0.9, beta2=0.999, eps=1e-6, step_size=1e-3, post_pull=0.01)
    key = rounding_key(1, 1)
    with pytest.raises(ValueError, match="must not overlap"):  # the weight written over the first moment
        cpu_kernel.fused_step_compact_bf16_many([(None, grad, m, v, delta, anchor, 0, m)], c, key)
    with pytest.raises(ValueError, match="must not overlap"):  # a gradient half over its weight
        both = torch.zeros(n + 8, dtype=torch.bfloat16)
        cpu_kernel.fused_step_compact_bf16_many([(None, both[8:], m, v, delta, anchor, 0, both[:n])], c, key)
    with pytest.raises(ValueError, match="master=None exactly where a delta is given"):
        cpu_kernel.fused_step_compact_bf16_many([(anchor.float() + delta, grad, m, v, delta, anchor, 0, grad)], c, key)
    with pytest.raises(TypeError, match="weight has dtype torch.float32"):
        cpu_kernel.fused_step_compact_bf16_many([(None, grad, m, v, delta, anchor, 0, delta.clone())], c, key)
    # the fp32 state has no bf16 form, and a delta master that keeps its fp32 weight cannot take one
    p = torch.nn.Parameter(torch.zeros(n))
    fp32 = build_optimizer("adamw", [p], impl="cpu")
    with pytest.raises(ValueError, match="compact state"):
        fp32.step_tensors([p], [grad], weights=[torch.zeros(n, dtype=torch.bfloat16)])
    q = torch.nn.Parameter(anchor.float() + delta)
    compact = build_optimizer("recadam", [{"params": [q], "anchors": [anchor.float()]}], impl="cpu",
                              state_dtype="bfloat16", anchor_dtype="bfloat16", lr=1e-5)
    with pytest.raises(ValueError, match="init_state first"):
        compact.keep_bf16_weight(q, torch.zeros(n, dtype=torch.bfloat16))
    with pytest.raises(ValueError, match="stale"):
        compact.step_tensors([q], [grad], weights=[torch.zeros(n, dtype=torch.bfloat16)])
    other = build_optimizer("recadam", [{"params": [q], "anchors": [anchor.float()]}], impl="cpu",
                            state_dtype="bfloat16", anchor_dtype="bfloat16", lr=1e-5)
    other.keep_masters_in_params()
    other.init_state(q)  # no delta: DeepSpeed's partitions are their own masters
    with pytest.raises(ValueError, match="init_state first"):
        other.keep_bf16_weight(q, torch.zeros(n, dtype=torch.bfloat16))
    with pytest.raises(ValueError, match="must be bfloat16"):
        compact.keep_bf16_weight(q, torch.zeros(n))
    assert compact.impl == "cpu"
    compact.keep_bf16_weight(q, torch.zeros(n, dtype=torch.bfloat16))
    assert compact._resolve_impl() == "cpu"  # its bf16 data does not push auto or cpu off the kernel
