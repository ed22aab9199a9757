"""The inverse step (rollback) of every registered rule, in the C++ kernel at every SIMD level this
CPU runs and in the torch path: one step undone gives the old state back to a few ulp, and a run
that speculates (steps with the unclipped gradient, then rolls back and redoes the step clipped, or
rolls back and skips it on a NaN) ends where the plain clip-then-step run ends, within 1e-6."""

import pytest
import torch

from ft_framework.optim import available_optimizers, build_optimizer
from ft_framework.optim.registry import optimizer_factory
from ft_framework.optim.base import IMPORTANCE
from ft_framework.optim import cpu as cpu_kernel
from ft_framework.optim.coefficients import StepCoefficients
from ft_framework.optim.torch_step import foreach_inverse_step, foreach_step
from simd_levels import SIMD_LEVELS, level_or_skip

# Hyper-parameters that switch on every stage a rule has (decay, pulls, annealing). A rule
# registered without an entry here runs with its defaults (and a larger lr, to move).
HPARAMS = {
    "recadam": dict(lr=1e-2, weight_decay=0.01, anneal_fun="sigmoid", anneal_k=0.5, anneal_t0=4,
                    pretrain_cof=5.0),
    "adamw": dict(lr=1e-2, weight_decay=0.05),
    "bertadam": dict(lr=1e-2, weight_decay=0.05, correct_bias=False),
    "prior_wd": dict(lr=1e-2, weight_decay=0.5),
    "ewc": dict(lr=1e-2, weight_decay=0.05, ewc_lambda=20.0),
}
RULES = available_optimizers()
LEVELS = SIMD_LEVELS
SIZES = (1, 15, 17, 1023, (1 << 15) + 33)  # tails, vector bodies, the multi-threaded chunks


def _close(actual: torch.Tensor, expected: torch.Tensor, rel: float, what: str,
           scale: torch.Tensor | None = None) -> None:
    """Element by element: |actual - expected| <= rel * (|expected| + scale), scale defaulting to
    max |expected| (the tensor's magnitude: a moment near zero is exact only to its neighbours' ulp)."""
    scale = (expected.abs().max() if scale is None else scale).clamp_min(1e-30)
    err = (actual.double() - expected.double()).abs()
    bound = rel * (expected.double().abs() + scale.double())
    worst = int((err - bound).argmax())
    assert bool((err <= bound).all()), (f"{what}: element {worst} is {actual.flatten()[worst].item()!r}, "
                                        f"expected {expected.flatten()[worst].item()!r} (rel {rel})")


COEFFS = [
    StepCoefficients(beta1=0.9, beta2=0.999, eps=1e-8, step_size=1e-2, denom_scale=1.3, pre_decay=1e-3),
    StepCoefficients(beta1=0.9, beta2=0.999, eps=1e-6, step_size=1e-2, pre_pull=5e-2, post_pull=0.2,
                     post_decay=1e-3),
    StepCoefficients(beta1=0.8, beta2=0.99, eps=1e-6, step_size=3e-3, post_decay=1e-2),
]


@pytest.mark.parametrize("level", LEVELS)
@pytest.mark.parametrize("grad_dtype", [torch.float32, torch.bfloat16])
def test_kernel_inverse_restores_one_step(level, grad_dtype, restore_level):
    level_or_skip(level)
    cpu_kernel.set_simd_level(level)
    gen = torch.Generator().manual_seed(7)
    for n in SIZES:
        for ci, c in enumerate(COEFFS):
            p0, m0 = torch.randn(n, generator=gen), 0.1 * torch.randn(n, generator=gen)
            v0 = 0.01 * torch.rand(n, generator=gen)
            # Moments that were zero (a parameter's first step) come back as zero, never negative.
            m0[::5], v0[::5] = 0.0, 0.0
            g = torch.randn(n, generator=gen).to(grad_dtype)
            anchor = (p0 + 0.1 * torch.randn(n, generator=gen)).to(grad_dtype) if ci == 1 else None
            p, m, v = p0.clone(), m0.clone(), v0.clone()
            cpu_kernel.fused_step(p, g, m, v, anchor, c, num_threads=3)
            assert not torch.equal(p, p0)
            # What was lost is the rounding of the stepped values: they set the scale.
            stepped = [t.abs().max() for t in (p, m, v)]
            cpu_kernel.fused_inverse(p, g, m, v, anchor, c, num_threads=3)
            for got, want, name, top in zip((p, m, v), (p0, m0, v0), ("param", "exp_avg", "exp_avg_sq"), stepped):
                _close(got, want, 1e-6, f"{level} n={n} coeffs {ci} {name}", torch.maximum(want.abs().max(), top))
            assert bool((v >= 0).all())


@pytest.mark.parametrize("ci", range(len(COEFFS)))
def test_torch_inverse_restores_one_step(ci):
    gen = torch.Generator().manual_seed(11)
    c = COEFFS[ci]
    n = 1023
    p0, m0, v0 = torch.randn(n, generator=gen), 0.1 * torch.randn(n, generator=gen), torch.rand(n, generator=gen)
    g = torch.randn(n, generator=gen)
    anchor = [p0 + 0.1] if c.uses_anchor else None
    p, m, v = p0.clone(), m0.clone(), v0.clone()
    foreach_step([p], [g], [m], [v], anchor, c)
    stepped = [t.abs().max() for t in (p, m, v)]
    foreach_inverse_step([p], [g], [m], [v], anchor, c)
    for got, want, name, top in zip((p, m, v), (p0, m0, v0), ("param", "exp_avg", "exp_avg_sq"), stepped):
        _close(got, want, 1e-6, f"torch coeffs {ci} {name}", torch.maximum(want.abs().max(), top))


@pytest.mark.parametrize("level", LEVELS)
def test_guarded_step_leaves_a_nonfinite_tensor_untouched(level, restore_level):
    level_or_skip(level)
    cpu_kernel.set_simd_level(level)
    c = COEFFS[0]
    for n, bad in ((17, 16), ((1 << 15) + 33, 20000), (1023, 3)):
        for value in (float("nan"), float("inf"), float("-inf")):
            p, g, m, v = torch.ones(n), torch.ones(n), torch.zeros(n), torch.zeros(n)
            g[bad] = value
            assert cpu_kernel.guarded_step(p, g, m, v, None, c, num_threads=2) is False
            assert torch.equal(p, torch.ones(n)) and not m.any() and not v.any()
            g[bad] = 1.0
            assert cpu_kernel.guarded_step(p, g, m, v, None, c, num_threads=2) is True
            assert not torch.equal(p, torch.ones(n))


CLIP_STEPS = {0: 3.0, 2: 2.0, 5: 5.0}  # step -> gradient norm as a multiple of max_grad_norm
NAN_STEP = 3


def _run(rule: str, impl: str, speculate: bool, seed: int = 3):
    """Eight steps of a three-tensor model (one without anchor) with max_grad_norm 1: clipping
    fires on the first step (from zero moments) and on steps 2 and 5, step 3 has a NaN in one
    tensor and is skipped. `speculate` steps each tensor with its unclipped gradient first, then
    keeps it, redoes it clipped, or rolls it back.

    A rollback restores the state to a few ulp of the *unclipped* step's values, so its error,
    relative to the clipped step, grows like 1e-7 x (norm / max_grad_norm): the spikes here stay
    within 5x, as clipping in fine-tuning does (docs/offload.md)."""
    gen = torch.Generator().manual_seed(seed)
    shapes = [(33, 7), (1025,), (5,)]
    params = [torch.nn.Parameter(torch.randn(s, generator=gen)) for s in shapes]
    anchors = [p.detach() + 0.05 * torch.randn(p.shape, generator=gen) for p in params[:2]]
    opt = build_optimizer(rule, [{"params": params[:2], "anchors": anchors}, {"params": params[2:]}], impl=impl,
                          **HPARAMS.get(rule, dict(lr=1e-2)))
    weighted = getattr(optimizer_factory(rule), "needs_importance", False)
    if weighted:
        # F~ in [0, 2): lr * ewc_lambda * F~ < 1; a weighted step is still rolled back from the copies
        # step_tensors keeps (keep_undo), as the overlapped offload does, not by the inverse program
        weights = torch.Generator().manual_seed(seed + 1)
        for p in params[:2]:
            opt.state[p][IMPORTANCE] = (2 * torch.rand(p.shape, generator=weights)).bfloat16()
    max_norm, rollbacks = 1.0, 0
    for step in range(8):
        grads = [torch.randn(p.shape, generator=gen) for p in params]
        total = torch.nn.utils.get_total_norm(grads)
        target = CLIP_STEPS.get(step, 0.3 + 0.05 * step)  # below max_grad_norm: no clipping
        grads = [g * (target / total) for g in grads]
        if step == NAN_STEP:
            grads[1][17] = float("nan")
        for p, g in zip(params, grads):
            p.grad = g
        norm = torch.nn.utils.get_total_norm(grads)
        if speculate:
            used = opt.step_tensors(params, keep_undo=weighted)
            stepped = [(p, c) for p, c in zip(params, used) if c is not None]
            fires = bool(max_norm / (norm + 1e-6) < 1.0)
            if not torch.isfinite(norm) or fires:
                rollbacks += 1
                opt.rollback_tensors([p for p, _ in stepped], None, [c for _, c in stepped])
                if torch.isfinite(norm):
                    torch.nn.utils.clip_grads_with_norm_(params, max_norm, norm)
                    opt.step_tensors(params)
        elif torch.isfinite(norm):
            torch.nn.utils.clip_grads_with_norm_(params, max_norm, norm)
            opt.step()
    return params, opt, rollbacks


@pytest.mark.parametrize("rule", RULES)
@pytest.mark.parametrize("impl_level", ["torch"] + [f"cpu-{lv}" for lv in LEVELS])
def test_speculative_run_equals_clip_then_step(rule, impl_level, restore_level):
    impl, _, level = impl_level.partition("-")
    if impl == "cpu":
        level_or_skip(level)
        cpu_kernel.set_simd_level(level)
    ref_params, ref_opt, _ = _run(rule, impl, speculate=False)
    params, opt, rollbacks = _run(rule, impl, speculate=True)
    assert rollbacks == len(CLIP_STEPS) + 1
    for i, (p, q) in enumerate(zip(params, ref_params)):
        _close(p.detach(), q.detach(), 1e-6, f"{rule} {impl_level} param {i}")
        s, r = opt.state[p], ref_opt.state[q]
        assert float(s["step"]) == float(r["step"]) == 7.0
        assert set(s) == set(r)
        for key in ("exp_avg", "exp_avg_sq", "anchor"):
            if key in r:
                _close(s[key], r[key], 1e-6, f"{rule} {impl_level} {key} {i}")


def test_coefficients_changed_sees_each_group_whose_lr_moved_after_its_step():
    """The overlapped offload asks once per step whether any speculative step's coefficients went
    stale; one tensor per (group, coefficients) answers, so a change in any group must show, also
    in a group whose coefficients were equal to another group's when they stepped."""
    torch.manual_seed(3)
    ps = [torch.nn.Parameter(torch.randn(n)) for n in (5, 7, 9, 11)]
    groups = [dict(params=ps[:2], lr=1e-2, weight_decay=0.0), dict(params=ps[2:], lr=1e-2, weight_decay=0.0)]
    opt = build_optimizer("adamw", groups, impl="cpu")
    grads = [torch.randn_like(p) for p in ps]
    used = opt.step_tensors(ps, grads, known_finite=True)
    assert len({id(c) for c in used}) == 2 and used[0] == used[2]  # equal values, two groups
    assert not opt.coefficients_changed(ps, used)
    opt.param_groups[1]["lr"] = 5e-3
    assert opt.coefficients_changed(ps, used)
    assert not opt.coefficients_changed(ps[:2], used[:2])
    opt.param_groups[1]["lr"] = 1e-2
    opt.param_groups[0]["lr"] = 2e-2
    assert opt.coefficients_changed(ps, used) and not opt.coefficients_changed(ps[2:], used[2:])
