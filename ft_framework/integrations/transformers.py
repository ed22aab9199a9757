"""Any optimizer of our registry (RecAdam, PriorWD, our AdamW; C++ kernel on CPU) inside a
``transformers.Trainer``, with theta* kept correctly.

    from ft_framework.integrations.transformers import ft_optimizer, ForgettingCallback
    trainer = Trainer(model=model, args=args, train_dataset=ds,
                      optimizer_cls_and_kwargs=ft_optimizer("recadam", args, new_parameters=new,
                                                            anneal_k=0.5, anneal_t0=100),
                      callbacks=[ForgettingCallback()])

It uses the Trainer's public hook ``optimizer_cls_and_kwargs`` with a factory: the Trainer calls
``factory()(model)`` inside ``create_optimizer``. At that moment, before any step, theta* is copied
from the model (fp32) for every parameter that is not new (``new_parameters``: the head and
anything else the checkpoint did not provide), and the groups are those of
``ft_framework.optim.build_param_groups``: the same anchored/new split as ``ft-train``. theta*
lives in the optimizer state (``state[p]["anchor"]``), so the Trainer's own ``optimizer.pt``
carries it and ``trainer.train(resume_from_checkpoint=...)`` restores it bit for bit; a resume
never re-captures theta* from the resumed weights.
"""

from __future__ import annotations

import logging
from typing import Any, Iterable

import torch
from torch import nn
from transformers import TrainerCallback

from ft_framework.errors import UserError
from ft_framework.models.loading import _new_parameter_names, capture_pretrained_state
from ft_framework.optim import build_optimizer, optimizer_hparams
from ft_framework.optim.groups import build_param_groups

logger = logging.getLogger(__name__)

__all__ = ["FtOptimizerFactory", "ft_optimizer", "new_parameter_names", "ForgettingCallback"]


def new_parameter_names(model: nn.Module, loading_info: dict[str, Any]) -> list[str]:
    """Names of the parameters ``from_pretrained(..., output_loading_info=True)`` did not load
    (missing or shape-mismatched keys): the new head. The same rule ``ft-train`` uses."""
    return _new_parameter_names(model, loading_info)


def _trainer_hparams(name: str, args: Any) -> dict[str, Any]:
    """lr, weight decay, betas and eps from TrainingArguments, for the hyper-parameters that
    optimizer `name` has."""
    valid = optimizer_hparams(name)
    out: dict[str, Any] = {}
    if args is None:
        return out
    candidates = {"lr": args.learning_rate, "betas": (args.adam_beta1, args.adam_beta2), "eps": args.adam_epsilon}
    out.update({k: v for k, v in candidates.items() if k in valid})
    return out


class FtOptimizerFactory:
    """The factory the Trainer's ``optimizer_cls_and_kwargs`` hook takes: ``factory()(model)``
    builds the optimizer. Keeps the built optimizer in ``.optimizer`` and theta*'s parameter names
    in ``.anchored_names``."""

    def __init__(self, name: str, *, new_parameters: Iterable[str], weight_decay: float = 0.0,
                 impl: str = "auto", **hparams: Any):
        valid = optimizer_hparams(name)  # raises on an unknown name, listing the valid ones
        unknown = sorted(set(hparams) - set(valid) - {"weight_decay"})
        if unknown:
            raise TypeError(f"unknown hyper-parameter(s) {unknown} for optimizer {name!r}; valid: {sorted(valid)}")
        if isinstance(new_parameters, str):
            raise TypeError("new_parameters must be a list of parameter names, not one string")
        self.name = name
        self.new_parameters = list(new_parameters)
        self.weight_decay = weight_decay
        self.impl = impl
        self.hparams = hparams
        self.optimizer: torch.optim.Optimizer | None = None
        self.anchored_names: list[str] = []

    def __call__(self, model: nn.Module | None = None, **kwargs: Any):
        # The Trainer calls a factory twice: factory() and then factory()(model, **kwargs).
        if model is None:
            return self
        if kwargs:
            raise TypeError(f"unexpected optimizer kwargs from the Trainer: {sorted(kwargs)}")
        return self.build(model)

    def build(self, model: nn.Module) -> torch.optim.Optimizer:
        names = {n for n, _ in model.named_parameters()}
        unknown = sorted(set(self.new_parameters) - names)
        if unknown:
            raise ValueError(f"new_parameters names parameters the model does not have: {unknown[:5]}")
        # theta* now, from the weights the optimizer will train (before any step).
        theta_star = capture_pretrained_state(model, exclude=self.new_parameters)
        hparams = dict(self.hparams)
        lr = hparams.pop("lr")
        groups = build_param_groups(model, theta_star, lr=lr, weight_decay=self.weight_decay)
        # build_param_groups' split, read before the optimizer takes the anchors out of the groups.
        self.anchored_names = sorted(n for g in groups if g["anchors"] is not None for n in g["param_names"])
        new = sorted(n for g in groups if g["anchors"] is None for n in g["param_names"])
        opt = build_optimizer(self.name, groups, impl=self.impl, **hparams)  # lr, weight_decay: in the groups
        logger.info("%s (impl %s): %d anchored parameters, not anchored (new): %s",
                    self.name, opt.impl, len(self.anchored_names), new)
        self.optimizer = opt
        return opt


def ft_optimizer(name: str, args: Any = None, *, new_parameters: Iterable[str], impl: str = "auto",
                 **hparams: Any) -> tuple[FtOptimizerFactory, dict]:
    """The value for ``Trainer(optimizer_cls_and_kwargs=...)``: optimizer `name` of our registry.

    lr, betas, eps and weight decay come from `args` (TrainingArguments) unless given in
    `hparams`; `new_parameters` are the names not anchored (see `new_parameter_names`)."""
    sharded = [f for f in ("deepspeed", "fsdp") if args is not None and getattr(args, f, None)]
    if sharded:
        # Both repartition the parameters after create_optimizer, which would orphan anchors kept
        # per parameter; placing theta* into their partitions is not wired to the Trainer yet.
        raise UserError(f"ft_optimizer: TrainingArguments({sharded[0]}=...) is not supported yet (theta* would "
                        "not follow the repartitioned parameters); use ft-train (strategy.name: deepspeed or "
                        "fsdp) or an Accelerate loop with ft_framework.integrations.loops")
    merged = {**_trainer_hparams(name, args), **hparams}
    if "lr" not in merged:
        raise TypeError("ft_optimizer needs lr: pass the TrainingArguments or lr=...")
    weight_decay = merged.pop("weight_decay", args.weight_decay if args is not None else 0.0)
    return FtOptimizerFactory(name, new_parameters=new_parameters, weight_decay=weight_decay, impl=impl,
                              **merged), {}


class ForgettingCallback(TrainerCallback):
    """Adds lambda(t) (per anchored group, for optimizers that anneal) and ||theta - theta*||_2 to
    every log of the Trainer, so its own ``report_to`` integrations record them.

    The Trainer calls callbacks in order and its reporters come first; ``on_log`` therefore also
    writes the values into ``state.log_history``, and `install` puts the callback ahead of the
    reporters so that they see the values too."""

    @staticmethod
    def install(trainer: Any) -> "ForgettingCallback":
        cb = ForgettingCallback()
        trainer.callback_handler.callbacks.insert(0, cb)
        return cb

    def on_log(self, args, state, control, logs=None, optimizer=None, **kwargs):
        if logs is None or optimizer is None:
            return
        opt = getattr(optimizer, "optimizer", optimizer)  # accelerate's AcceleratedOptimizer wraps it
        if not hasattr(opt, "forgetting_distance"):
            return
        # Replicated parameters (one process or DDP; ft_optimizer refuses ZeRO and FSDP): no all-reduce.
        extra: dict[str, float] = {"forgetting_distance": opt.forgetting_distance()}
        for group, lam in zip(opt.param_groups, opt.current_lambdas()):
            anchored = any("anchor" in opt.state.get(p, {}) for p in group["params"])
            if lam is not None and anchored:
                extra[f"lambda/{group.get('group_name', '')}"] = float(lam)
        logs.update(extra)
        if state.log_history and state.log_history[-1].get("step") == state.global_step:
            state.log_history[-1].update(extra)
