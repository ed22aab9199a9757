"""The optimizer registry: names to rules, without torch, so that the config checks an optimizer's
hyper-parameters (and its pull, validation.py) before torch is imported.

    opt = build_optimizer(name, param_groups, impl="auto", **hparams)   # optim/optimizers.py

Users add their own with ``@register_optimizer("name")`` on a class (or factory) whose signature is
``(params, <hyper-parameters with defaults>..., impl=...)``; ``impl`` is optional. Such a class is its
own optimizer; a built-in name holds the torch-free rule (adam.py, recadam.py, prior_wd.py) that
optim/optimizers.py puts on AnchoredOptimizer.
"""

from __future__ import annotations

import inspect
from typing import Any, Callable

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


# The built-in rules register themselves when ft_framework.optim is imported, which happens before
# this module can be imported (it lives inside that package).


def available_optimizers() -> list[str]:
    return sorted(_REGISTRY)


def optimizer_factory(name: str):
    """The class (or factory) registered under `name`; an unknown name lists the valid ones."""
    if name not in _REGISTRY:
        raise ValueError(f"unknown optimizer {name!r}; available: {', '.join(available_optimizers())}")
    return _REGISTRY[name]


def factory_signature(factory) -> inspect.Signature:
    return inspect.signature(factory.__init__ if inspect.isclass(factory) else factory)


def optimizer_hparams(name: str) -> dict[str, Any]:
    """Valid hyper-parameter names of optimizer ``name`` with their defaults."""
    sig = factory_signature(optimizer_factory(name))
    return {
        k: (None if p.default is inspect.Parameter.empty else p.default)
        for k, p in sig.parameters.items()
        if k not in _NON_HPARAMS and p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD)
    }
