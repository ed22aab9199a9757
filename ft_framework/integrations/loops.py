"""Our optimizers in an Accelerate loop or a plain PyTorch loop.

    opt, theta_star = optimizer_for_model("recadam", model, new_parameters=new, lr=1e-4, anneal_k=0.5)
    model, opt, loader = accelerator.prepare(model, opt, loader)
    place_anchors(accelerator.unwrap_model(model), opt, theta_star)
    del theta_star   # under FSDP2 each rank now keeps only its shard of theta*

The groups are ``build_param_groups``' (anchored vs new, no decay on bias/norm); theta* is copied
from the model when the optimizer is built and placed after wrapping by the very function our
strategies use, so under FSDP2 the anchors are sharded like the parameters.
"""

from __future__ import annotations

from typing import Any, Iterable, Mapping

import torch
from torch import nn

from ft_framework.models.loading import capture_pretrained_state
from ft_framework.optim import build_optimizer
from ft_framework.optim.groups import build_param_groups
from ft_framework.strategies.base import place_anchors as _place_anchors

__all__ = ["optimizer_for_model", "place_anchors"]


def optimizer_for_model(name: str, model: nn.Module, *, new_parameters: Iterable[str], lr: float,
                        weight_decay: float = 0.0, impl: str = "auto",
                        **hparams: Any) -> tuple[torch.optim.Optimizer, dict[str, torch.Tensor]]:
    """Optimizer `name` of our registry over `model`, without anchors yet, and theta* (fp32 copies
    of every trainable parameter not in `new_parameters`) for `place_anchors` after wrapping."""
    new_parameters = list(new_parameters)
    unknown = sorted(set(new_parameters) - {n for n, _ in model.named_parameters()})
    if unknown:
        raise ValueError(f"new_parameters names parameters the model does not have: {unknown[:5]}")
    frozen = [n for n, p in model.named_parameters() if not p.requires_grad]
    theta_star = capture_pretrained_state(model, exclude=[*new_parameters, *frozen])
    groups = build_param_groups(model, theta_star, lr=lr, weight_decay=weight_decay, attach_anchors=False)
    return build_optimizer(name, groups, impl=impl, **hparams), theta_star  # lr and weight_decay: in the groups


def place_anchors(model: nn.Module, optimizer: torch.optim.Optimizer, theta_star: Mapping[str, torch.Tensor]) -> None:
    """theta* into the optimizer state after ``accelerator.prepare`` (or any wrapping): `model`
    unwrapped, `optimizer` ours or Accelerate's wrapper around it."""
    _place_anchors(model, getattr(optimizer, "optimizer", optimizer), theta_star)
