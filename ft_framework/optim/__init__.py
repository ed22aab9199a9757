"""Optimizers: RecAdam and the baselines it is compared against, behind one registry."""

from ft_framework.optim.adam import AdamW, BertAdam
from ft_framework.optim.anneal import ANNEAL_FUNCTIONS, anneal_lambda
from ft_framework.optim.base import AnchoredOptimizer, PullOvershootWarning
from ft_framework.optim.prior_wd import PriorWD
from ft_framework.optim.recadam import RecAdam
from ft_framework.optim.registry import available_optimizers, build_optimizer, optimizer_hparams, register_optimizer

__all__ = [
    "ANNEAL_FUNCTIONS", "AdamW", "AnchoredOptimizer", "BertAdam", "PriorWD", "PullOvershootWarning",
    "RecAdam", "anneal_lambda", "available_optimizers", "build_optimizer", "optimizer_hparams",
    "register_optimizer",
]
