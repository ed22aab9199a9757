"""Optimizers: RecAdam and the baselines it is compared against, behind one registry."""

from .adam import AdamW, BertAdam
from .anneal import ANNEAL_FUNCTIONS, anneal_lambda
from .base import AnchoredOptimizer, PullOvershootWarning
from .prior_wd import PriorWD
from .recadam import RecAdam
from .registry import available_optimizers, build_optimizer, optimizer_hparams, register_optimizer

__all__ = [
    "ANNEAL_FUNCTIONS", "AdamW", "AnchoredOptimizer", "BertAdam", "PriorWD", "PullOvershootWarning",
    "RecAdam", "anneal_lambda", "available_optimizers", "build_optimizer", "optimizer_hparams",
    "register_optimizer",
]
