"""RecAdam (Chen et al. 2020) with the semantics of the authors' released code rather than the
paper's Algorithm 1: Adam step scaled by lambda(t), then a decoupled pull
lr * (anneal_w - lambda(t)) * pretrain_cof toward theta*, then weight decay.

The rule without torch (hyper-parameters, coefficients, the pull's bound); optim/optimizers.py puts
it on AnchoredOptimizer (the optimizer RecAdam)."""

from __future__ import annotations

from ft_framework.optim.adam import hf_step_size
from ft_framework.optim.anneal import anneal_lambda
from ft_framework.optim.coefficients import StepCoefficients
from ft_framework.optim.registry import register_optimizer


@register_optimizer("recadam")
class RecAdamRule:
    """Parameters with an anchor and ``anneal_w > 0`` get the RecAdam rule; others (the new
    classifier head) plain Adam. Defaults are those of the authors' release."""

    def __init__(self, params, lr: float = 1e-3, betas: tuple[float, float] = (0.9, 0.999),
                 eps: float = 1e-6, weight_decay: float = 0.0, correct_bias: bool = True,
                 anneal_fun: str = "sigmoid", anneal_k: float = 0.0, anneal_t0: float = 0.0,
                 anneal_w: float = 1.0, pretrain_cof: float = 5000.0, *, impl: str = "auto",
                 anchor_dtype: str = "float32", state_dtype: str = "float32", rounding_seed: int = 0):
        defaults = dict(lr=lr, betas=tuple(betas), eps=eps, weight_decay=weight_decay,
                        correct_bias=bool(correct_bias), anneal_fun=anneal_fun,
                        anneal_k=float(anneal_k), anneal_t0=float(anneal_t0),
                        anneal_w=float(anneal_w), pretrain_cof=float(pretrain_cof))
        super().__init__(params, defaults, impl=impl, anchor_dtype=anchor_dtype,
                         state_dtype=state_dtype, rounding_seed=rounding_seed)

    @staticmethod
    def max_pull(hparams) -> float:
        """lr * (anneal_w - lambda(t)) * pretrain_cof at its largest: t = 1, since lambda only rises
        (validation.pull_overshoot). anneal_w 0 means plain Adam, constant means lambda = w: no pull."""
        w = hparams["anneal_w"]
        if not w > 0:
            return 0.0
        lam = anneal_lambda(hparams["anneal_fun"], 1, hparams["anneal_k"], hparams["anneal_t0"], w)
        return hparams["lr"] * (w - lam) * hparams["pretrain_cof"]

    def group_lambda(self, group, step):
        return anneal_lambda(group["anneal_fun"], step, group["anneal_k"], group["anneal_t0"],
                             group["anneal_w"])

    def coefficients(self, group, step, has_anchor):
        s = hf_step_size(group, step)
        w = group["anneal_w"]
        common = dict(beta1=group["betas"][0], beta2=group["betas"][1], eps=group["eps"],
                      post_decay=group["lr"] * group["weight_decay"])
        if has_anchor and w > 0:
            lam = self.group_lambda(group, step)
            return StepCoefficients(step_size=s * lam,
                                    post_pull=group["lr"] * (w - lam) * group["pretrain_cof"], **common)
        return StepCoefficients(step_size=s, **common)
