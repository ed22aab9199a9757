"""Every registered optimizer, both implementations, element-wise against the float64 reference
over 200 steps, with anchored and new (head) parameters in separate groups and a changing lr."""

import math

import pytest
import torch

from ft_framework.optim import build_optimizer
from ft_framework.optim import cpu as cpu_kernel
from optim_reference import Reference, assert_close_to_reference

IMPLS = ["torch"] + (["cpu"] if cpu_kernel.kernel_available() else [])
CONFIGS = {
    "recadam-sigmoid": ("recadam", dict(lr=2e-3, weight_decay=0.01, anneal_fun="sigmoid", anneal_k=0.2,
                                        anneal_t0=80, pretrain_cof=20.0)),
    "recadam-sigmoid-k-inf": ("recadam", dict(lr=1e-3, anneal_fun="sigmoid", anneal_k=math.inf,
                                              anneal_t0=50, pretrain_cof=30.0)),
    "recadam-sigmoid-k-0": ("recadam", dict(lr=1e-3, anneal_fun="sigmoid", anneal_k=0.0, pretrain_cof=30.0)),
    "recadam-linear": ("recadam", dict(lr=1e-3, anneal_fun="linear", anneal_t0=120, pretrain_cof=10.0)),
    "recadam-constant": ("recadam", dict(lr=1e-3, anneal_fun="constant", anneal_w=0.7)),
    "recadam-no-bias-correction": ("recadam", dict(lr=1e-3, correct_bias=False, anneal_k=0.1,
                                                   anneal_t0=30, pretrain_cof=40.0)),
    "adamw": ("adamw", dict(lr=1e-3, weight_decay=0.05, betas=(0.8, 0.99))),
    "bertadam": ("bertadam", dict(lr=1e-3, weight_decay=0.01)),
    "bertadam-correct-bias": ("bertadam", dict(lr=1e-3, weight_decay=0.01, correct_bias=True)),
    "prior_wd": ("prior_wd", dict(lr=1e-3, weight_decay=0.5)),
}
SHAPES = [(7, 5), (33,), (1,)]  # anchored parameters; the head is a (3, 5) tensor without anchor


def lr_at(step: int, base: float) -> float:
    """A warm-up then decay schedule, so per-step lr reaches every coefficient."""
    return base * min(1.0, step / 20) * (1 - step / 400)


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("config", list(CONFIGS))
def test_optimizer_matches_reference_over_200_steps(config, impl):
    rule, hp = CONFIGS[config]
    gen = torch.Generator().manual_seed(7)
    thetas = [torch.randn(s, generator=gen) for s in SHAPES]
    anchors = [t + 0.05 * torch.randn(t.shape, generator=gen) for t in thetas]
    head0 = torch.randn(3, 5, generator=gen)
    params = [torch.nn.Parameter(t.clone()) for t in thetas]
    head = torch.nn.Parameter(head0.clone())
    groups = [{"params": params, "anchors": anchors}, {"params": [head], "weight_decay": 0.0}]
    opt = build_optimizer(rule, groups, impl=impl, **hp)
    assert opt.impl == impl
    refs = [Reference(rule, t, a, **hp) for t, a in zip(thetas, anchors)]
    head_ref = Reference(rule, head0, None, **{**hp, "weight_decay": 0.0})
    for step in range(1, 201):
        lr = lr_at(step, hp["lr"])
        for g in opt.param_groups:
            g["lr"] = lr
        for p, r in zip(params + [head], refs + [head_ref]):
            grad = torch.randn(p.shape, generator=gen)
            p.grad = grad
            r.step(grad, lr=lr)
        opt.step()
    for p, r in zip(params + [head], refs + [head_ref]):
        assert_close_to_reference(p.detach(), r.theta)


@pytest.mark.parametrize("impl", IMPLS)
def test_adamw_matches_torch_adamw(impl):
    gen = torch.Generator().manual_seed(3)
    init = [torch.randn(s, generator=gen) for s in [(64, 17), (1023,), (1,)]]
    ours = [torch.nn.Parameter(t.clone()) for t in init]
    theirs = [torch.nn.Parameter(t.clone()) for t in init]
    hp = dict(lr=3e-3, betas=(0.9, 0.98), eps=1e-8, weight_decay=0.1)
    opt = build_optimizer("adamw", [{"params": ours}], impl=impl, **hp)
    ref = torch.optim.AdamW(theirs, foreach=False, **hp)
    for _ in range(200):
        for a, b in zip(ours, theirs):
            g = torch.randn(a.shape, generator=gen)
            a.grad, b.grad = g, g.clone()
        opt.step()
        ref.step()
    for a, b in zip(ours, theirs):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(opt.state[a]["exp_avg_sq"], ref.state[b]["exp_avg_sq"], rtol=1e-5, atol=1e-12)


@pytest.mark.skipif(not cpu_kernel.kernel_available(), reason="C++ kernel not built")
@pytest.mark.parametrize("rule,hp", [CONFIGS[c] for c in ("recadam-sigmoid", "adamw", "bertadam", "prior_wd")])
def test_torch_and_cpu_implementations_agree(rule, hp):
    gen = torch.Generator().manual_seed(11)
    theta, anchor = torch.randn(4099, generator=gen), torch.randn(4099, generator=gen)
    results = {}
    grads = [torch.randn(4099, generator=gen) for _ in range(200)]
    for impl in ("torch", "cpu"):
        p = torch.nn.Parameter(theta.clone())
        opt = build_optimizer(rule, [{"params": [p], "anchors": [anchor]}], impl=impl, **hp)
        for g in grads:
            p.grad = g
            opt.step()
        results[impl] = p.detach()
    scale = results["torch"].abs().max().item()
    torch.testing.assert_close(results["cpu"], results["torch"], rtol=0, atol=1e-6 * scale)


def test_parameters_without_grad_are_left_alone():
    a, b = torch.nn.Parameter(torch.ones(3)), torch.nn.Parameter(torch.ones(3))
    opt = build_optimizer("recadam", [{"params": [a, b], "anchors": [torch.zeros(3), torch.zeros(3)]}],
                          lr=1e-3, pretrain_cof=10.0)
    a.grad = torch.ones(3)
    opt.step()
    assert torch.equal(b.detach(), torch.ones(3))
    assert "step" not in opt.state[b] and "anchor" in opt.state[b]
    assert int(opt.state[a]["step"]) == 1


def test_bf16_params_run_on_the_torch_path_against_reference():
    # Mixed-precision training on an accelerator keeps bf16 params; the torch path must handle them.
    gen = torch.Generator().manual_seed(5)
    theta = torch.randn(257, generator=gen).bfloat16()
    p = torch.nn.Parameter(theta.clone())
    opt = build_optimizer("adamw", [p], impl="auto", lr=1e-2)
    assert opt.impl == "torch"  # the CPU kernel takes fp32 parameters only
    ref = Reference("adamw", theta.float(), None, lr=1e-2)
    for _ in range(20):
        g = torch.randn(257, generator=gen).bfloat16()
        p.grad = g
        ref.step(g)
        opt.step()
    torch.testing.assert_close(p.detach().double(), ref.theta, rtol=0, atol=0.05)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("config", ["recadam-sigmoid", "adamw", "bertadam", "prior_wd"])
def test_torch_impl_on_cuda_matches_reference(config):
    rule, hp = CONFIGS[config]
    gen = torch.Generator().manual_seed(2)
    theta, anchor = torch.randn(10_007, generator=gen), torch.randn(10_007, generator=gen)
    p = torch.nn.Parameter(theta.cuda())
    opt = build_optimizer(rule, [{"params": [p], "anchors": [anchor.cuda()]}], impl="auto", **hp)
    assert opt.impl == "torch"
    ref = Reference(rule, theta, anchor, **hp)
    for _ in range(200):
        g = torch.randn(10_007, generator=gen)
        p.grad = g.cuda()
        ref.step(g)
        opt.step()
    assert_close_to_reference(p.detach().cpu(), ref.theta)
