"""Optimizers: RecAdam and the baselines it is compared against, behind one registry.

The registry, the rules and the hyper-parameter checks import no torch and are imported here at
once; the optimizer classes and ``build_optimizer`` (optimizers.py, base.py) on first use. So the
config, which checks hyper-parameters against the registry, loads without torch, and ft-train
answers --help and a config error in a fraction of a second (importing torch takes seconds).
"""

from __future__ import annotations

import importlib
from typing import Any

from ft_framework.optim import adam, ewc, prior_wd, recadam  # noqa: F401 - the built-in rules register themselves
from ft_framework.optim.anneal import ANNEAL_FUNCTIONS, anneal_lambda
from ft_framework.optim.registry import available_optimizers, optimizer_hparams, register_optimizer
from ft_framework.optim.validation import PullOvershootWarning

_LAZY = {"AdamW": "optimizers", "BertAdam": "optimizers", "EWC": "optimizers", "PriorWD": "optimizers", "RecAdam": "optimizers",
         "build_optimizer": "optimizers", "AnchoredOptimizer": "base"}

__all__ = [
    "ANNEAL_FUNCTIONS", "AdamW", "AnchoredOptimizer", "BertAdam", "EWC", "PriorWD", "PullOvershootWarning",
    "RecAdam", "anneal_lambda", "available_optimizers", "build_optimizer", "optimizer_hparams",
    "register_optimizer",
]


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        return getattr(importlib.import_module(f"ft_framework.optim.{_LAZY[name]}"), name)
    raise AttributeError(f"module 'ft_framework.optim' has no attribute {name!r}")
