"""The optimizer registry:

    opt = build_optimizer(name, param_groups, impl="auto", **hparams)

Users add their own with ``@register_optimizer("name")`` on a class (or factory) whose signature is
``(params, <hyper-parameters with defaults>..., impl=...)``; ``impl`` is optional.
"""

from __future__ import annotations

import inspect
from typing import Any, Callable

from ft_framework.optim.groups import GROUP_HPARAMS

_REGISTRY: dict[str, Callable[..., Any]] = {}
# Constructor arguments that are not hyper-parameters.
_NON_HPARAMS = {"self", "params", "impl"}


def register_optimizer(name: str, *, replace: bool = False):
    """Decorator registering an optimizer class or factory under ``name``."""
    if not isinstance(name, str) or not name:
        raise ValueError("optimizer name must be a non-empty string")

    def decorate(factory):
        if name in _REGISTRY and not replace:
            raise ValueError(f"optimizer {name!r} is already registered (pass replace=True to override)")
        _REGISTRY[name] = factory
        return factory

    return decorate


# The built-in optimizers register themselves when ft_framework.optim is imported, which happens
# before this module can be imported (it lives inside that package).


def available_optimizers() -> list[str]:
    return sorted(_REGISTRY)


def optimizer_factory(name: str):
    """The class (or factory) registered under `name`; an unknown name lists the valid ones."""
    if name not in _REGISTRY:
        raise ValueError(f"unknown optimizer {name!r}; available: {', '.join(available_optimizers())}")
    return _REGISTRY[name]


def _signature(factory) -> inspect.Signature:
    return inspect.signature(factory.__init__ if inspect.isclass(factory) else factory)


def optimizer_hparams(name: str) -> dict[str, Any]:
    """Valid hyper-parameter names of optimizer ``name`` with their defaults."""
    sig = _signature(optimizer_factory(name))
    return {
        k: (None if p.default is inspect.Parameter.empty else p.default)
        for k, p in sig.parameters.items()
        if k not in _NON_HPARAMS and p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD)
    }


def build_optimizer(name: str, param_groups, impl: str = "auto", **hparams):
    """Builds a registered optimizer; unknown names and hyper-parameters are errors listing the valid ones."""
    factory = optimizer_factory(name)
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
    takes_impl = "impl" in _signature(factory).parameters
    if takes_impl:
        return factory(param_groups, impl=impl, **hparams)
    if impl not in ("auto", "torch"):
        raise ValueError(f"optimizer {name!r} has no {impl!r} implementation; use impl='auto' or 'torch'")
    return factory(param_groups, **hparams)

