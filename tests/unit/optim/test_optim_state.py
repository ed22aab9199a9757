"""State-dict round trips, exact resume, refusal to lose anchors, and telemetry."""

import copy
import math

import pytest
import torch

from ft_framework.optim import build_optimizer
from ft_framework.optim import cpu as cpu_kernel

IMPLS = ["torch"] + (["cpu"] if cpu_kernel.kernel_available() else [])
HP = dict(lr=1e-3, weight_decay=0.01, anneal_k=0.1, anneal_t0=50, pretrain_cof=20.0)


def make(impl, seed=0, anchor_dtype="float32"):
    gen = torch.Generator().manual_seed(seed)
    body = torch.nn.Parameter(torch.randn(37, 5, generator=gen))
    head = torch.nn.Parameter(torch.randn(11, generator=gen))
    anchor = body.detach() + 0.01 * torch.randn(37, 5, generator=gen)
    opt = build_optimizer("recadam", [{"params": [body], "anchors": [anchor]}, {"params": [head]}],
                          impl=impl, anchor_dtype=anchor_dtype, **HP)
    return opt, [body, head], anchor


def run(opt, params, steps, seed):
    gen = torch.Generator().manual_seed(seed)
    for _ in range(steps):
        for p in params:
            p.grad = torch.randn(p.shape, generator=gen)
        opt.step()


@pytest.mark.parametrize("impl", IMPLS)
def test_resume_is_bitwise_identical_to_an_uninterrupted_run(impl, tmp_path):
    straight, sp, _ = make(impl)
    run(straight, sp, 60, seed=1)
    run(straight, sp, 60, seed=2)

    first, fp, _ = make(impl)
    run(first, fp, 60, seed=1)
    torch.save({"params": [p.detach() for p in fp], "opt": first.state_dict()}, tmp_path / "ckpt.pt")
    del first, fp

    resumed, rp, _ = make(impl, seed=99)  # different initial values, all overwritten by the load
    ckpt = torch.load(tmp_path / "ckpt.pt")
    with torch.no_grad():
        for p, saved in zip(rp, ckpt["params"]):
            p.copy_(saved)
    resumed.load_state_dict(ckpt["opt"])
    run(resumed, rp, 60, seed=2)
    for a, b in zip(sp, rp):
        assert torch.equal(a, b)
    assert resumed.group_steps() == [120, 120]


def test_state_dict_carries_anchors_and_keeps_their_dtype():
    opt, params, anchor = make("torch", anchor_dtype="bfloat16")
    run(opt, params, 3, seed=0)
    sd = opt.state_dict()
    assert torch.equal(sd["state"][0]["anchor"], anchor.bfloat16())
    assert "anchor" not in sd["state"][1]
    assert all("anchors" not in g for g in sd["param_groups"])
    other, oparams, _ = make("torch", seed=5, anchor_dtype="bfloat16")
    other.load_state_dict(copy.deepcopy(sd))
    assert other.state[oparams[0]]["anchor"].dtype == torch.bfloat16  # torch would cast it to fp32
    assert torch.equal(other.state[oparams[0]]["anchor"], anchor.bfloat16())


def test_loading_a_checkpoint_without_anchors_is_an_error():
    opt, params, _ = make("torch")
    run(opt, params, 3, seed=0)
    sd = opt.state_dict()
    del sd["state"][0]["anchor"]
    fresh, _, _ = make("torch")
    with pytest.raises(ValueError, match="no anchor .theta\\*. for parameter 0"):
        fresh.load_state_dict(sd)


def test_loading_a_misshaped_anchor_is_an_error():
    opt, params, _ = make("torch")
    sd = opt.state_dict()
    sd["state"][0]["anchor"] = torch.zeros(5, 37)
    with pytest.raises(ValueError, match="wrong or corrupted checkpoint"):
        make("torch")[0].load_state_dict(sd)


def test_loading_into_a_different_model_size_is_an_error():
    opt, _, _ = make("torch")
    sd = opt.state_dict()
    sd["param_groups"][1]["params"] = []
    with pytest.raises(ValueError, match="checkpoint has 1 parameters, this optimizer has 2"):
        make("torch")[0].load_state_dict(sd)


def test_telemetry_lambda_and_forgetting_distance():
    opt, params, anchor = make("torch")
    assert opt.current_lambdas() == [pytest.approx(1 / (1 + math.exp(5.0))), pytest.approx(1 / (1 + math.exp(5.0)))]
    run(opt, params, 50, seed=0)
    assert opt.current_lambdas()[0] == 0.5  # t = t0
    expected = (params[0].detach().double() - anchor.double()).norm().item()
    assert opt.forgetting_distance() == pytest.approx(expected, rel=1e-12)
