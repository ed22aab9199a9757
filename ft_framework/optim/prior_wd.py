"""Weight decay toward the pretrained weights (Lee et al. 2020; Zhang et al. 2021 §7.1):
a decoupled pull lr * weight_decay * (theta - theta*) first, then debiased Adam without decay.
Parameters without an anchor decay toward zero instead.

The rule without torch; optim/optimizers.py puts it on AnchoredOptimizer (the optimizer PriorWD)."""

from __future__ import annotations

import math

from ft_framework.optim.adam import AdamWRule
from ft_framework.optim.coefficients import StepCoefficients
from ft_framework.optim.registry import register_optimizer


@register_optimizer("prior_wd")
class PriorWDRule(AdamWRule):
    """AdamW's hyper-parameters and defaults; only where the decay pulls to differs."""

    @staticmethod
    def max_pull(hparams) -> float:
        """The pull lr * weight_decay * (theta - theta*) is the same at every step."""
        return hparams["lr"] * (hparams.get("weight_decay") or 0.0)

    def coefficients(self, group, step, has_anchor):
        lr, (b1, b2), wd = group["lr"], group["betas"], group["weight_decay"]
        pull = dict(pre_pull=lr * wd) if has_anchor else dict(pre_decay=lr * wd)
        return StepCoefficients(beta1=b1, beta2=b2, eps=group["eps"], step_size=lr / (1 - b1**step),
                                denom_scale=1.0 / math.sqrt(1 - b2**step), **pull)
