"""examples/accelerate_loop.py: RecAdam in an Accelerate loop, theta* placed after prepare."""

from __future__ import annotations


import pytest
import torch

from ft_framework.integrations.loops import optimizer_for_model, place_anchors
from ft_framework.optim import cpu as cpu_kernel


@pytest.mark.slow
def test_accelerate_example_anchors_equal_pretrained(tmp_path, load_example):
    ex = load_example("accelerate_loop")
    reference, _, _ = ex.load_model()  # an independent load of the same checkpoint
    ref = dict(reference.named_parameters())
    out = ex.main(["--max-steps", "3", "--train-examples", "24"])
    assert out["steps"] == 3 and all(map(torch.isfinite, map(torch.tensor, [out["loss_first"], out["loss_last"]])))
    opt, model = out["optimizer"], out["model"]
    assert out["impl"] == ("cpu" if cpu_kernel.kernel_available() else "torch")
    names = {id(p): n for n, p in model.named_parameters()}
    seen = set()
    for group in opt.param_groups:
        for p in group["params"]:
            name = names[id(p)]
            if name.startswith("classifier."):
                assert "anchor" not in opt.state[p], name  # the new head is not pulled anywhere
                continue
            assert torch.equal(opt.state[p]["anchor"], ref[name].detach()), name
            seen.add(name)
    assert seen == set(out["anchored_names"]) and len(seen) == len(ref) - 2
    assert out["forgetting_distance"] > 0


def test_place_anchors_rejects_names_the_model_lacks():
    model = torch.nn.Sequential(torch.nn.Linear(3, 2), torch.nn.Linear(2, 2))
    opt, theta = optimizer_for_model("recadam", model, new_parameters=["1.weight", "1.bias"], lr=1e-3)
    assert sorted(theta) == ["0.bias", "0.weight"]
    with pytest.raises(ValueError, match="does not have: \\['2.weight'\\]"):
        place_anchors(model, opt, {**theta, "2.weight": torch.zeros(2, 2)})
    place_anchors(model, opt, theta)
    assert torch.equal(opt.state[model[0].weight]["anchor"], model[0].weight.detach())
    assert "anchor" not in opt.state[model[1].weight]
    with pytest.raises(ValueError, match="does not have"):
        optimizer_for_model("recadam", model, new_parameters=["head.weight"], lr=1e-3)
