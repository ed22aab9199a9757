"""The two Adam baselines of Mosbach et al. / Zhang et al.: debiased AdamW and BERTAdam.

Each class is a rule without torch: its ``__init__`` signature holds the hyper-parameters and their
defaults (the registry and the config read them), ``coefficients`` the step. optim/optimizers.py
makes the optimizers of them, ``class AdamW(AdamWRule, AnchoredOptimizer)``, so the
``super().__init__`` of a rule's ``__init__`` is AnchoredOptimizer's.
"""

from __future__ import annotations

import math

from ft_framework.optim.coefficients import StepCoefficients
from ft_framework.optim.registry import register_optimizer


@register_optimizer("adamw")
class AdamWRule:
    """Debiased Adam with decoupled weight decay, exactly ``torch.optim.AdamW``'s rule.

    Anchors, if given, are kept only for telemetry (the forgetting distance); the rule ignores them.
    """

    def __init__(self, params, lr: float = 1e-3, betas: tuple[float, float] = (0.9, 0.999),
                 eps: float = 1e-8, weight_decay: float = 1e-2, *, impl: str = "auto",
                 anchor_dtype: str = "float32", state_dtype: str = "float32", rounding_seed: int = 0):
        defaults = dict(lr=lr, betas=tuple(betas), eps=eps, weight_decay=weight_decay)
        super().__init__(params, defaults, impl=impl, anchor_dtype=anchor_dtype,
                         state_dtype=state_dtype, rounding_seed=rounding_seed)

    def coefficients(self, group, step, has_anchor):
        lr, (b1, b2) = group["lr"], group["betas"]
        return StepCoefficients(
            beta1=b1, beta2=b2, eps=group["eps"],
            step_size=lr / (1 - b1**step),
            denom_scale=1.0 / math.sqrt(1 - b2**step),
            pre_decay=lr * group["weight_decay"],
        )


@register_optimizer("bertadam")
class BertAdamRule:
    """Devlin et al.'s BERTAdam / HF ``transformers.AdamW``: eps on the uncorrected sqrt(v), decay
    after the step. ``correct_bias=False`` (the default) is the "no bias correction" variant that
    Mosbach et al. and Zhang et al. show to be unstable; True is HF's debiased variant."""

    def __init__(self, params, lr: float = 1e-3, betas: tuple[float, float] = (0.9, 0.999),
                 eps: float = 1e-6, weight_decay: float = 0.0, correct_bias: bool = False, *,
                 impl: str = "auto", anchor_dtype: str = "float32", state_dtype: str = "float32",
                 rounding_seed: int = 0):
        defaults = dict(lr=lr, betas=tuple(betas), eps=eps, weight_decay=weight_decay,
                        correct_bias=bool(correct_bias))
        super().__init__(params, defaults, impl=impl, anchor_dtype=anchor_dtype,
                         state_dtype=state_dtype, rounding_seed=rounding_seed)

    def coefficients(self, group, step, has_anchor):
        return StepCoefficients(
            beta1=group["betas"][0], beta2=group["betas"][1], eps=group["eps"],
            step_size=hf_step_size(group, step),
            post_decay=group["lr"] * group["weight_decay"],
        )


def hf_step_size(group, step: int) -> float:
    """HF-style step size: lr * sqrt(1 - b2^t) / (1 - b1^t) with bias correction, else lr."""
    lr, (b1, b2) = group["lr"], group["betas"]
    if group["correct_bias"]:
        return lr * math.sqrt(1 - b2**step) / (1 - b1**step)
    return lr
