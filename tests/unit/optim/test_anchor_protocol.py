"""The public anchor protocol strategies use: anchor_dtype, set_anchor (with and without a copy),
init_anchor, init_state, and the one check of a checkpoint's anchors."""

import pytest
import torch

from ft_framework.optim import build_optimizer
from ft_framework.optim.base import check_loaded_anchors


def test_set_anchor_without_copy_keeps_the_handed_over_tensor():
    p = torch.nn.Parameter(torch.zeros(3))
    opt = build_optimizer("recadam", [p], lr=1e-3)
    theta = torch.arange(3.0)
    opt.set_anchor(p, theta, copy=False)
    assert opt.state[p]["anchor"].data_ptr() == theta.data_ptr()  # no second copy of theta*
    opt.set_anchor(p, theta)
    assert opt.state[p]["anchor"].data_ptr() != theta.data_ptr()  # the registry path copies


def test_bf16_anchor_dtype_is_public_and_used_by_every_path():
    p = torch.nn.Parameter(torch.zeros(4))
    opt = build_optimizer("recadam", [p], lr=1e-3, anchor_dtype="bfloat16")
    assert opt.anchor_dtype == torch.bfloat16
    opt.set_anchor(p, torch.full((4,), 1.003907), copy=False)
    assert opt.state[p]["anchor"].dtype == torch.bfloat16
    assert float(opt.state[p]["anchor"][0]) == 1.0078125  # the nearest bf16 value
    zero = opt.init_anchor(p)
    assert zero.dtype == torch.bfloat16 and not zero.any() and opt.state[p]["anchor"] is zero


def test_init_state_creates_missing_keys_and_keeps_existing_ones():
    p = torch.nn.Parameter(torch.ones(2))
    opt = build_optimizer("adamw", [p])
    state = opt.init_state(p)
    assert set(state) == {"step", "exp_avg", "exp_avg_sq"} and float(state["step"]) == 0
    state["exp_avg"].fill_(3.0)
    assert float(opt.init_state(p)["exp_avg"][0]) == 3.0


def test_placed_anchor_makes_the_pull_act_like_a_group_anchor():
    torch.manual_seed(3)
    start, theta, grad = torch.randn(5), torch.randn(5), torch.randn(5)
    hp = dict(lr=1e-2, pretrain_cof=10.0, anneal_k=0.5, anneal_t0=3)
    a, b = torch.nn.Parameter(start.clone()), torch.nn.Parameter(start.clone())
    via_group = build_optimizer("recadam", [{"params": [a], "anchors": [theta]}], **hp)
    placed = build_optimizer("recadam", [b], **hp)
    placed.set_anchor(b, theta.clone(), copy=False)
    for _ in range(3):
        a.grad, b.grad = grad.clone(), grad.clone()
        via_group.step()
        placed.step()
    assert torch.equal(a, b) and not torch.equal(a, start)


@pytest.mark.parametrize("entry,match", [
    (("w", None, (2, 3), True), r"checkpoint x has no anchor \(theta\*\) for parameter 'w', which this optimizer anchors"),
    ((0, (3, 2), (2, 3), True), r"checkpoint x: anchor \(theta\*\) for parameter 0 has shape \(3, 2\), the parameter "
                                r"has \(2, 3\): wrong or corrupted checkpoint"),
])
def test_check_loaded_anchors_refuses_missing_and_misshaped(entry, match):
    with pytest.raises(ValueError, match=match):
        check_loaded_anchors("checkpoint x", [entry])


def test_check_loaded_anchors_accepts_matching_and_unanchored():
    check_loaded_anchors("checkpoint x", [("w", (2, 3), (2, 3), True), ("head", None, (2,), False)])
