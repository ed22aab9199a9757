"""Mixout reads θ* from the optimizer's anchors once they are placed: one copy of θ*, whatever
the strategy (the FSDP2 case, with sharded anchors, is in tests/distributed/test_fsdp.py)."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from ft_framework.models.loading import MixoutLinear, apply_mixout
from ft_framework.optim import build_optimizer
from ft_framework.optim.groups import build_param_groups
from ft_framework.strategies import SingleDeviceStrategy
from ft_framework.strategies.offload import OffloadedSingleDeviceStrategy

P = 0.4


def _model(dtype=torch.float32):
    torch.manual_seed(3)
    model = nn.Sequential(nn.Linear(7, 13), nn.Tanh(), nn.Linear(13, 5), nn.Tanh(), nn.Linear(5, 2))
    # θ*: everything but the head ("4."), which a Mixout model leaves plain.
    pretrained = {n: p.detach().clone() + 0.01 for n, p in model.named_parameters() if not n.startswith("4.")}
    apply_mixout(model, P, pretrained)
    return model.to(dtype), pretrained


def _builder(pretrained, rule="recadam"):
    return lambda m: build_optimizer(rule, build_param_groups(m, pretrained, lr=1e-3, attach_anchors=False),
                                     impl="torch", **({"pretrain_cof": 10.0} if rule == "recadam" else {}))


def _reference_mix(module: MixoutLinear, target: torch.Tensor, seed: int) -> torch.Tensor:
    """The mixed weight of a MixoutLinear that keeps its own copy of `target` (the formula as
    MixoutLinear documents it, from the same random draws)."""
    torch.manual_seed(seed)
    w = module.weight
    mask = torch.rand(w.shape, device=w.device) < P
    t = target.to(w.dtype)
    return (torch.where(mask, t, w) - P * t) / (1.0 - P)


@pytest.mark.parametrize("make", [lambda: SingleDeviceStrategy("fp32", "cpu"),
                                  lambda: OffloadedSingleDeviceStrategy("fp32", "cpu")],
                         ids=["single", "offloaded"])
def test_mixout_modules_read_the_anchors_instead_of_a_copy(make):
    model, pretrained = _model()
    strategy = make()
    strategy.setup(model, _builder(pretrained), anchors=pretrained)
    mixouts = {n: m for n, m in strategy.model.named_modules() if isinstance(m, MixoutLinear)}
    assert set(mixouts) == {"0", "2"}
    for name, module in mixouts.items():
        anchor = strategy.optimizer.state[module.weight]["anchor"]
        assert module.target is None and module.target_tensor() is anchor, name
        assert anchor.data_ptr() == pretrained[f"{name}.weight"].data_ptr()  # handed over, not copied
        module.train()
        torch.manual_seed(11)
        got = module.mixed_weight()
        assert torch.equal(got, _reference_mix(module, pretrained[f"{name}.weight"], 11)), name
    # No buffer of the model holds θ* any more.
    assert all(b is None for m in mixouts.values() for b in m._buffers.values())
    # A load that replaces an anchor is followed at the next forward.
    module = mixouts["2"]
    strategy.optimizer.set_anchor(module.weight, torch.full_like(module.weight, 0.5))
    assert torch.equal(module.target_tensor(), torch.full_like(module.weight, 0.5))
    strategy.close()


def test_a_bf16_model_mixes_toward_the_fp32_anchor_cast_as_before():
    """Before, the model's cast to bf16 made the buffer a bf16 copy; now forward casts the one
    fp32 anchor: the same bf16 values, bit for bit."""
    model, pretrained = _model(torch.bfloat16)
    before = {n: m.target.clone() for n, m in model.named_modules() if isinstance(m, MixoutLinear)}
    assert all(t.dtype == torch.bfloat16 for t in before.values())
    strategy = SingleDeviceStrategy("bf16", "cpu")
    strategy.setup(model, _builder(pretrained), anchors=pretrained)
    for name, module in strategy.model.named_modules():
        if isinstance(module, MixoutLinear):
            assert module.target is None and module.target_tensor().dtype == torch.float32
            module.train()
            torch.manual_seed(5)
            got = module.mixed_weight()
            assert got.dtype == torch.bfloat16
            assert torch.equal(got, _reference_mix(module, before[name], 5)), name


def test_without_anchors_mixout_keeps_its_own_target():
    """A run whose optimizer holds no θ* (AdamW, no anchors placed) mixes toward the module's copy."""
    model, pretrained = _model()
    strategy = SingleDeviceStrategy("fp32", "cpu")
    strategy.setup(model, _builder(pretrained, rule="adamw"), anchors=None)
    for name, module in strategy.model.named_modules():
        if isinstance(module, MixoutLinear):
            assert module.target is not None and module.target_tensor() is module.target
            assert torch.equal(module.target, pretrained[f"{name}.weight"])


def test_a_source_of_another_shape_is_refused():
    _, module = nn.Linear(4, 3), MixoutLinear(4, 3, p=P)
    with pytest.raises(ValueError, match=r"mixout target shape \(3, 5\) != weight shape \(3, 4\)"):
        module.read_target_from(lambda: torch.zeros(3, 5))
    assert module.target is not None  # unchanged
