"""optimizer.importance (optim/importance.py) against an independent float64 reference: the Fisher of
theta* as the mean over batches of each batch's squared gradient, from a float64 copy of the same
tiny decoder, normalised to mean 1 over the anchored elements, compared element by element with
the bf16 F~ the capture puts in the optimizer state; the capture moves nothing; the offloads (serial,
overlapped, device-lean with the compact state) capture what one device captures; EWC's step with a
real capture equals a float64 reference of the weighted rule."""

from __future__ import annotations

import math

import pytest
import torch
from tiny_llm import build_tiny_tokenizer, tiny_llm_config

from ft_framework.optim import build_optimizer
from ft_framework.optim.base import IMPORTANCE
from ft_framework.optim.groups import build_param_groups
from ft_framework.optim.importance import anchored_tensors, capture_fisher, place_importance, prepare_importance
from ft_framework.strategies.offload import OffloadedSingleDeviceStrategy
from ft_framework.strategies.single import SingleDeviceStrategy

BATCHES, ROWS, LENGTH = 3, 4, 9
# Parameters left out of theta* (a "new" group): they get no importance, and N does not count them.
NEW = ("model.norm.weight",)


def tiny_decoder(dtype: torch.dtype = torch.float32):
    from transformers import AutoModelForCausalLM

    torch.manual_seed(3)
    model = AutoModelForCausalLM.from_config(tiny_llm_config("llama", build_tiny_tokenizer()))
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() >= 2:
                p.normal_(0.0, 0.2)
    return model.to(dtype)


def text_batches(vocab: int) -> list[dict[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(11)
    out = []
    for _ in range(BATCHES):
        ids = torch.randint(0, vocab, (ROWS, LENGTH), generator=g)
        out.append({"input_ids": ids, "labels": ids.clone()})
    return out


def pretrained_state(model) -> dict[str, torch.Tensor]:
    return {n: p.detach().clone().float() for n, p in model.named_parameters() if n not in NEW}


def reference_importance(batches) -> dict[str, torch.Tensor]:
    """F = (1/B) sum_b g_b^2 in float64 from a float64 model, F~ = F / mean(F) over the anchored elements."""
    model = tiny_decoder(torch.float64)
    params = {n: p for n, p in model.named_parameters() if n not in NEW}
    fisher = {n: torch.zeros_like(p) for n, p in params.items()}
    for batch in batches:
        model.zero_grad()
        model(**batch).loss.backward()
        for n, p in params.items():
            fisher[n] += p.grad ** 2 / len(batches)
    mean = sum(float(f.sum()) for f in fisher.values()) / sum(f.numel() for f in fisher.values())
    return {n: f / mean for n, f in fisher.items()}


def capture(strategy, batches, name: str = "recadam", impl: str = "torch", **hparams):
    """theta* captured and placed by `strategy`, then the Fisher pass through its forward, backward
    and unclipped step; returns (model, optimizer, result)."""
    model = tiny_decoder()
    anchors = pretrained_state(model)

    lr = hparams.pop("lr", 1e-3)
    if name == "recadam":
        hparams.setdefault("pretrain_cof", 100.0)

    def make_optimizer(m):
        groups = build_param_groups(m, anchors, lr=lr, weight_decay=0.0, attach_anchors=False)
        return build_optimizer(name, groups, impl=impl, **hparams)

    model, optimizer = strategy.setup(model, make_optimizer, anchors=dict(anchors))

    def micro_step(batch):
        out = strategy.forward(batch)
        strategy.backward(out.loss)
        strategy.step_unclipped()

    fisher = capture_fisher(optimizer, batches, micro_step)
    numel_of = {n: p.numel() for n, p in strategy.unwrapped_model().named_parameters()}
    result = place_importance(fisher, numel_of, partitioned=False, tokens=123, seconds=1.5)
    return model, optimizer, result


def importance_by_name(strategy, optimizer) -> dict[str, torch.Tensor]:
    names = {id(m): n for n, m in strategy._named_masters()} if hasattr(strategy, "_named_masters") else \
        {id(p): n for n, p in strategy.unwrapped_model().named_parameters()}
    return {names[id(p)]: optimizer.state[p][IMPORTANCE] for p in anchored_tensors(optimizer)}


@pytest.fixture(scope="module")
def single():
    batches = text_batches(len(build_tiny_tokenizer()))
    strategy = SingleDeviceStrategy("fp32", "cpu")
    before = {n: p.detach().clone() for n, p in tiny_decoder().named_parameters()}
    model, optimizer, result = capture(strategy, batches)
    return batches, strategy, model, optimizer, result, before


def test_the_capture_equals_the_float64_fisher_normalised_to_mean_one(single):
    batches, strategy, _, optimizer, result, _ = single
    want = reference_importance(batches)
    got = importance_by_name(strategy, optimizer)
    assert sorted(got) == sorted(want)
    for name, ref in want.items():
        assert got[name].dtype == torch.bfloat16 and got[name].shape == ref.shape, name
        # bf16 holds 8 significant bits: the captured value is the reference's to within its rounding
        # (and the fp32 gradients' few ulp), never more than one bf16 step away.
        torch.testing.assert_close(got[name].double(), ref, rtol=2 ** -7, atol=1e-5, msg=name)
    everything = torch.cat([got[n].double().reshape(-1) for n in want])
    assert float(everything.mean()) == pytest.approx(1.0, abs=2e-3)
    assert result.batches == BATCHES and result.tokens == 123 and result.seconds == 1.5
    assert result.anchored_elements == everything.numel()
    assert result.max_importance == float(everything.max())
    # mean(F) before the normalisation, of F = (1/B) sum g^2, from the same fp32 model's gradients
    model = tiny_decoder()
    params = {n: p for n, p in model.named_parameters() if n not in NEW}
    total = 0.0
    for batch in batches:
        model.zero_grad()
        model(**batch).loss.backward()
        total += sum(float(p.grad.double().square().sum()) for p in params.values())
    assert result.mean_fisher == pytest.approx(total / BATCHES / everything.numel(), rel=1e-5)


def test_the_capture_moves_nothing_and_leaves_the_new_parameters_alone(single):
    _, strategy, model, optimizer, _, before = single
    for name, p in model.named_parameters():
        assert torch.equal(p.detach(), before[name]), name
        assert p.grad is None, name
    named = dict(model.named_parameters())
    for name in NEW:
        assert IMPORTANCE not in optimizer.state.get(named[name], {}), name
    # no step was counted: the moments do not exist yet
    assert not any("step" in s or "exp_avg" in s for s in optimizer.state.values())
    assert optimizer.gradient_sink is None


def test_prepare_importance_gives_every_anchored_tensor_an_empty_target():
    strategy = SingleDeviceStrategy("fp32", "cpu")
    model = tiny_decoder()
    anchors = pretrained_state(model)
    _, optimizer = strategy.setup(model, lambda m: build_optimizer(
        "prior_wd", build_param_groups(m, anchors, lr=1e-3, attach_anchors=False), impl="torch"), anchors=dict(anchors))
    prepare_importance(optimizer)
    for name, p in model.named_parameters():
        state = optimizer.state.get(p, {})
        if name in NEW:
            assert IMPORTANCE not in state
        else:
            assert state[IMPORTANCE].dtype == torch.bfloat16 and not state[IMPORTANCE].any(), name


@pytest.mark.parametrize("overlap", [False, True])
def test_the_offloaded_optimizer_captures_what_one_device_captures(single, overlap):
    batches, strategy, _, optimizer, result, _ = single
    offload = OffloadedSingleDeviceStrategy("fp32", "cpu", overlap=overlap)
    try:
        model, off_optimizer, off_result = capture(offload, batches)
        want, got = importance_by_name(strategy, optimizer), importance_by_name(offload, off_optimizer)
        assert sorted(got) == sorted(want)
        for name in want:
            assert torch.equal(got[name], want[name]), name
        assert off_result.mean_fisher == result.mean_fisher
        assert off_result.max_importance == result.max_importance
        assert offload.rollbacks == offload.skipped_steps == 0
        for name, p in model.named_parameters():  # nothing moved
            assert torch.equal(p.detach(), tiny_decoder().get_parameter(name).detach()), name
    finally:
        offload.close()


def test_the_device_lean_offload_with_bf16_weights_captures_and_keeps_its_weights(single):
    """bf16 weights on the device, the compact state's bf16 weight form on the host (the step writes
    each weight where its gradient landed): the pass reads the gradients there and puts the weights
    back as theta* + delta rounded to bf16, so nothing moves."""
    batches, strategy, _, optimizer, _, _ = single
    lean = OffloadedSingleDeviceStrategy("bf16", "cpu", overlap=False)
    try:
        model, lean_optimizer, result = capture(lean, batches, anchor_dtype="bfloat16", state_dtype="bfloat16")
        assert lean.bf16_weights
        start = {n: p.detach().to(torch.bfloat16) for n, p in tiny_decoder().named_parameters()}
        for name, p in model.named_parameters():
            assert torch.equal(p.detach(), start[name]), name
        got, want = importance_by_name(lean, lean_optimizer), importance_by_name(strategy, optimizer)
        assert sorted(got) == sorted(want)
        mean = sum(float(t.double().sum()) for t in got.values()) / sum(t.numel() for t in got.values())
        assert mean == pytest.approx(1.0, abs=2e-3)
        # the bf16 model's gradients: F~ follows the fp32 model's closely, not bit for bit
        flat_got = torch.cat([got[n].double().reshape(-1) for n in want])
        flat_want = torch.cat([want[n].double().reshape(-1) for n in want])
        assert float(torch.corrcoef(torch.stack([flat_got, flat_want]))[0, 1]) > 0.99
        assert result.max_importance > 1.0
    finally:
        lean.close()


def ewc_reference(theta, anchor, importance, grads, *, lr, wd, lam, betas=(0.9, 0.999), eps=1e-8):
    """EWC as docs/forgetting_methods.md defines it, in float64: AdamW (decoupled decay, debiased
    moments), then the pull min(lr * lambda * F~, 1) * (theta - theta*) with the weight
    w_i = min(fp32(lr * lambda) * fp32(F~_i), 1) the program forms in fp32."""
    b1, b2 = betas
    th, m, v = theta.double().clone(), torch.zeros_like(theta, dtype=torch.float64), \
        torch.zeros_like(theta, dtype=torch.float64)
    w = torch.clamp(torch.tensor(lr * lam, dtype=torch.float32) * importance.float(), max=1.0).double()
    for t, g in enumerate(grads, start=1):
        g = g.double()
        m = b1 * m + (1 - b1) * g
        v = b2 * v + (1 - b2) * g * g
        th = th * (1 - lr * wd)
        th = th - (lr / (1 - b1 ** t)) * m / (v.sqrt() / math.sqrt(1 - b2 ** t) + eps)
        th = th - w * (th - anchor.double())
    return th


@pytest.mark.parametrize("impl", ["torch", "cpu"])
def test_ewc_with_a_captured_importance_equals_the_weighted_float64_rule(impl):
    """Needs the weighted pull in the step programs (issue 51's first part): a real capture's F~
    (values from 0 to well above 1/(lr * lambda), so the clamp acts) weighs EWC's pull element by element."""
    from ft_framework.optim.cpu import kernel_available

    if impl == "cpu" and not kernel_available():
        pytest.skip("the C++ kernel is not built")
    lr, wd, lam = 1e-2, 0.05, 20.0
    batches = text_batches(len(build_tiny_tokenizer()))
    strategy = SingleDeviceStrategy("fp32", "cpu")
    model, optimizer, _ = capture(strategy, batches, name="ewc", impl=impl, lr=lr, ewc_lambda=lam)
    for group in optimizer.param_groups:
        group["weight_decay"] = wd
    params = {n: p for n, p in model.named_parameters() if n not in NEW}
    start = {n: p.detach().clone() for n, p in params.items()}
    importance = {n: optimizer.state[p][IMPORTANCE].clone() for n, p in params.items()}
    assert any(float((lr * lam * f.float()).max()) > 1.0 for f in importance.values())  # the clamp is reached
    # theta* at a distance from theta, so that the pull moves the weights
    g = torch.Generator().manual_seed(4)
    for p in params.values():
        optimizer.state[p]["anchor"].add_(torch.randn(p.shape, generator=g) * 0.05)
    grads = {n: [torch.randn(p.shape, generator=g) for _ in range(3)] for n, p in params.items()}
    for step in range(3):
        for n, p in model.named_parameters():
            p.grad = grads[n][step].clone() if n in params else torch.zeros_like(p)
        optimizer.step()
    for n, p in params.items():
        want = ewc_reference(start[n], optimizer.state[p]["anchor"], importance[n], grads[n], lr=lr, wd=wd, lam=lam)
        torch.testing.assert_close(p.detach().double(), want, rtol=1e-5, atol=1e-6, msg=n)


@pytest.mark.parametrize("state_dtype,split", [("float32", False), ("bfloat16", False), ("float32", True)])
def test_ewc_without_an_importance_refuses_to_step(state_dtype, split):
    """EWC built from Python with theta* and no capture would be L2-SP under EWC's name: its step (the
    fp32 program, the compact one, the offloads' tensor-by-tensor steps) refuses; a zero lambda, which
    pulls nothing, steps; prior_wd, whose pull is unweighted without F~, steps."""
    layer = torch.nn.Linear(5, 3)
    anchors = {n: p.detach().clone() for n, p in layer.named_parameters()}

    def step(name, **hparams):
        optimizer = build_optimizer(name, build_param_groups(layer, anchors, lr=1e-3), impl="torch",
                                    state_dtype=state_dtype, anchor_dtype=state_dtype, **hparams)
        for p in layer.parameters():
            p.grad = torch.ones_like(p)
        if split:
            optimizer.step_tensors(list(layer.parameters()))
        else:
            optimizer.step()

    with pytest.raises(ValueError, match="weighted by the importance F~, and a parameter has theta\\* but no F~"):
        step("ewc", ewc_lambda=10.0)
    step("ewc", ewc_lambda=0.0)
    step("prior_wd")


@pytest.mark.parametrize("gradient,said", [
    (float("nan"), "met a NaN or infinite gradient on the general text"),
    (0.0, "is zero on every anchored element"),
])
def test_a_fisher_that_cannot_be_normalised_is_one_line(gradient, said):
    from ft_framework.errors import UserError

    layer = torch.nn.Linear(5, 3)
    optimizer = build_optimizer("prior_wd", build_param_groups(layer, {n: p.detach().clone() for n, p in
                                                                       layer.named_parameters()}, lr=1e-3))

    def micro_step(_batch):  # every gradient `gradient`, or 1 but one NaN
        for p in layer.parameters():
            p.grad = torch.full_like(p, 1.0 if math.isnan(gradient) else gradient)
        layer.weight.grad[1, 2] = gradient
        optimizer.step()

    fisher = capture_fisher(optimizer, [None, None], micro_step)
    with pytest.raises(UserError) as info:
        place_importance(fisher, {n: p.numel() for n, p in layer.named_parameters()}, partitioned=False)
    assert said in str(info.value) and "\n" not in str(info.value)
