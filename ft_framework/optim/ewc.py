"""EWC (Kirkpatrick et al. 2017) as a step rule: AdamW, then a decoupled pull toward theta* weighted
per element by the normalised diagonal Fisher F~ of theta* (optimizer.importance, optim/importance.py):

    theta_i -= min(lr * ewc_lambda * F~_i, 1) * (theta_i - theta*_i)

the decoupled step of the penalty (ewc_lambda / 2) * sum_i F~_i (theta_i - theta*_i)^2 (the clamp,
which the step program applies, keeps an element from being pulled past theta*). With F~ = 1 it is
the uniform pull that RecAdam's pretraining simulation stands in for (its gamma, pretrain_cof, in the
same unit: mean(F~) = 1). Parameters without theta* take AdamW's step.

The rule without torch; optim/optimizers.py puts it on AnchoredOptimizer (the optimizer EWC).
"""

from __future__ import annotations

from ft_framework.optim.adam import AdamWRule
from ft_framework.optim.coefficients import StepCoefficients
from ft_framework.optim.registry import register_optimizer


@register_optimizer("ewc")
class EWCRule(AdamWRule):
    """AdamW's hyper-parameters and defaults, plus ewc_lambda (the penalty's strength, in
    RecAdam's pretrain_cof unit). Needs optimizer.importance: without F~ it would be L2-SP."""

    # The config refuses this rule without optimizer.importance (config/schema.py); the step, a
    # parameter with theta* and no F~ (optim/base.py).
    needs_importance = True

    def __init__(self, params, lr: float = 1e-3, betas: tuple[float, float] = (0.9, 0.999),
                 eps: float = 1e-8, weight_decay: float = 1e-2, ewc_lambda: float = 5000.0, *,
                 impl: str = "auto", anchor_dtype: str = "float32", state_dtype: str = "float32",
                 rounding_seed: int = 0):
        defaults = dict(lr=lr, betas=tuple(betas), eps=eps, weight_decay=weight_decay, ewc_lambda=float(ewc_lambda))
        # AdamWRule.__init__ would drop ewc_lambda from the defaults: AnchoredOptimizer's directly.
        super(AdamWRule, self).__init__(params, defaults, impl=impl, anchor_dtype=anchor_dtype,
                                        state_dtype=state_dtype, rounding_seed=rounding_seed)

    @staticmethod
    def max_pull(hparams) -> float:
        """lr * ewc_lambda at F~ = 1, the same at every step (an element of larger F~ is clamped at
        theta* by the program, never pulled past it)."""
        return hparams["lr"] * (hparams.get("ewc_lambda") or 0.0)

    def coefficients(self, group, step, has_anchor):
        c = super().coefficients(group, step, has_anchor)
        if has_anchor and group["ewc_lambda"] > 0:
            return StepCoefficients(beta1=c.beta1, beta2=c.beta2, eps=c.eps, step_size=c.step_size,
                                    denom_scale=c.denom_scale, pre_decay=c.pre_decay,
                                    post_pull=group["lr"] * group["ewc_lambda"])
        return c
