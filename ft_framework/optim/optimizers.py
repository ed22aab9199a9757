"""The built-in optimizers, each an update rule (adam.py, recadam.py, prior_wd.py, ewc.py) put on
AnchoredOptimizer, and build_optimizer, which builds any registered optimizer by name.

The registry names the torch-free rules, so that the config reads their hyper-parameters without
torch; this module is where a built-in rule becomes its optimizer class. A class a user registers
is its own optimizer.
"""

from __future__ import annotations

from ft_framework.optim.adam import AdamWRule, BertAdamRule
from ft_framework.optim.base import AnchoredOptimizer
from ft_framework.optim.ewc import EWCRule
from ft_framework.optim.groups import GROUP_HPARAMS
from ft_framework.optim.prior_wd import PriorWDRule
from ft_framework.optim.recadam import RecAdamRule
from ft_framework.optim.registry import factory_signature, optimizer_factory, optimizer_hparams

__all__ = ["AdamW", "BertAdam", "EWC", "PriorWD", "RecAdam", "build_optimizer"]


class AdamW(AdamWRule, AnchoredOptimizer):
    __doc__ = AdamWRule.__doc__


class BertAdam(BertAdamRule, AnchoredOptimizer):
    __doc__ = BertAdamRule.__doc__


class RecAdam(RecAdamRule, AnchoredOptimizer):
    __doc__ = RecAdamRule.__doc__


class PriorWD(PriorWDRule, AnchoredOptimizer):
    __doc__ = PriorWDRule.__doc__


class EWC(EWCRule, AnchoredOptimizer):
    __doc__ = EWCRule.__doc__


# What build_optimizer builds for a built-in name, whose registry entry is the rule.
_OPTIMIZER_OF_RULE = {AdamWRule: AdamW, BertAdamRule: BertAdam, RecAdamRule: RecAdam, PriorWDRule: PriorWD,
                       EWCRule: EWC}


def build_optimizer(name: str, param_groups, impl: str = "auto", **hparams):
    """Builds a registered optimizer; unknown names and hyper-parameters are errors listing the valid ones."""
    factory = optimizer_factory(name)
    factory = _OPTIMIZER_OF_RULE.get(factory, factory)
    valid = optimizer_hparams(name)
    unknown = sorted(set(hparams) - set(valid))
    if unknown:
        raise TypeError(f"unknown hyper-parameter(s) {unknown} for optimizer {name!r}; valid: {sorted(valid)}")
    # A keyword is the default of the groups that do not set the value; when every group sets it
    # (build_param_groups' groups do), the keyword is a second spelling that nothing reads.
    groups = list(param_groups) if isinstance(param_groups, (list, tuple)) else []
    if groups and all(isinstance(g, dict) for g in groups):
        ignored = [k for k in GROUP_HPARAMS if k in hparams and all(k in g for g in groups)]
        if ignored:
            raise ValueError(f"{', '.join(ignored)} given twice: every param group sets it, so "
                             f"build_optimizer({ignored[0]}=...) would be ignored; drop the keyword")
    takes_impl = "impl" in factory_signature(factory).parameters
    if takes_impl:
        return factory(param_groups, impl=impl, **hparams)
    if impl not in ("auto", "torch"):
        raise ValueError(f"optimizer {name!r} has no {impl!r} implementation; use impl='auto' or 'torch'")
    return factory(param_groups, **hparams)
