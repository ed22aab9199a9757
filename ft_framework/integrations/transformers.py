"""Any optimizer of our registry (RecAdam, PriorWD, our AdamW; C++ kernel on CPU) inside a
``transformers.Trainer``, with theta* kept correctly.

    from ft_framework.integrations.transformers import ft_optimizer, install_callbacks
    trainer = Trainer(model=model, args=args, train_dataset=ds,
                      optimizer_cls_and_kwargs=ft_optimizer("recadam", args, new_parameters=new,
                                                            anneal_k=0.5, anneal_t0=100))
    install_callbacks(trainer)

It uses the Trainer's public hook ``optimizer_cls_and_kwargs`` with a factory: the Trainer calls
``factory()(model)`` inside ``create_optimizer``. At that moment, before any step, theta* is copied
from the model (fp32) for every parameter that is not new (``new_parameters``: the head and
anything else the checkpoint did not provide), and the groups are those of
``ft_framework.optim.build_param_groups``: the same anchored/new split as ``ft-train``, carried
by each group's ``anchored`` flag. theta* lives in the optimizer state (``state[p]["anchor"]``),
so the Trainer's own checkpoints carry it and ``trainer.train(resume_from_checkpoint=...)``
restores it bit for bit; a resume never re-captures theta* from the resumed weights.

Under ``TrainingArguments(deepspeed=...)`` (ZeRO stage 0-2, with or without ``offload_optimizer``)
DeepSpeed flattens and partitions the parameters after ``create_optimizer``. The optimizer is then
built without anchors and theta* waits in the factory until the engine exists; the callback that
`install_callbacks` adds gives each rank's flat partitions their own slice of theta*
(``place_zero_anchors``, the function ``ft-train``'s DeepSpeed strategy uses) and drops the full
copy. ``zero_force_ds_cpu_optimizer`` is set to false for the user: otherwise Accelerate silently
swaps any optimizer for DeepSpeedCPUAdam when the optimizer is offloaded, and RecAdam would run as
Adam. With the offloaded optimizer, impl "auto" steps the CPU partitions with our C++ kernel.
"""

from __future__ import annotations

import logging
from typing import Any, Iterable

import torch
from torch import nn
from transformers import TrainerCallback

from ft_framework.config.deepspeed_stage import unfused_wrapper_problem
from ft_framework.distributed import collectives
from ft_framework.errors import UserError
from ft_framework.models.loading import capture_pretrained_state, new_parameter_names
from ft_framework.optim import build_optimizer, optimizer_hparams
from ft_framework.optim.groups import build_param_groups
from ft_framework.strategies.deepspeed import place_zero_anchors

logger = logging.getLogger(__name__)

__all__ = ["FtOptimizerFactory", "ft_optimizer", "new_parameter_names", "install_callbacks", "ForgettingCallback",
           "ThetaStarPlacement", "DEEPSPEED_ZERO_STAGES"]

DEEPSPEED_ZERO_STAGES = (0, 1, 2)


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
    builds the optimizer. Keeps the built optimizer in ``.optimizer``, theta*'s parameter names in
    ``.anchored_names`` and, once theta* is in the optimizer state, where it came from in
    ``.theta_star_source`` ("model at build", "placed into the partitions", "checkpoint")."""

    def __init__(self, name: str, *, new_parameters: Iterable[str], weight_decay: float = 0.0,
                 impl: str = "auto", place_after_prepare: bool = False, **hparams: Any):
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
        # DeepSpeed repartitions the parameters after create_optimizer: theta* is placed afterwards
        # by ThetaStarPlacement, which install_callbacks adds (and records here).
        self.place_after_prepare = place_after_prepare
        self.placement_installed = False
        self.optimizer: torch.optim.Optimizer | None = None
        self.anchored_names: list[str] = []
        self.pending_theta_star: dict[str, torch.Tensor] | None = None
        self.theta_star_source: str | None = None

    def __call__(self, model: nn.Module | None = None, **kwargs: Any):
        # The Trainer calls a factory twice: factory() and then factory()(model, **kwargs).
        if model is None:
            return self
        if kwargs:
            raise TypeError(f"unexpected optimizer kwargs from the Trainer: {sorted(kwargs)}")
        return self.build(model)

    def build(self, model: nn.Module) -> torch.optim.Optimizer:
        if self.place_after_prepare and not self.placement_installed:
            raise UserError("ft_optimizer under TrainingArguments(deepspeed=...): theta* is placed into DeepSpeed's "
                            "partitions by a callback; call install_callbacks(trainer) before trainer.train()")
        names = {n for n, _ in model.named_parameters()}
        unknown = sorted(set(self.new_parameters) - names)
        if unknown:
            raise ValueError(f"new_parameters names parameters the model does not have: {unknown[:5]}")
        # theta* now, from the weights the optimizer will train (before any step).
        theta_star = capture_pretrained_state(model, exclude=self.new_parameters)
        hparams = dict(self.hparams)
        lr = hparams.pop("lr")
        groups = build_param_groups(model, theta_star, lr=lr, weight_decay=self.weight_decay,
                                    attach_anchors=not self.place_after_prepare)
        self.anchored_names = sorted(n for g in groups if g["anchored"] for n in g["param_names"])
        new = sorted(n for g in groups if not g["anchored"] for n in g["param_names"])
        opt = build_optimizer(self.name, groups, impl=self.impl, **hparams)  # lr, weight_decay: in the groups
        logger.info("%s (impl %s): %d anchored parameters, not anchored (new): %s",
                    self.name, opt.impl, len(self.anchored_names), new)
        if self.place_after_prepare:
            self.pending_theta_star, self.theta_star_source = theta_star, None
        else:
            self.theta_star_source = "model at build"
        self.optimizer = opt
        return opt


def _deepspeed_config(args: Any) -> dict[str, Any]:
    """The DeepSpeed config dict the Trainer will hand to deepspeed.initialize (TrainingArguments
    parsed it into ``hf_deepspeed_config``; Accelerate's plugin shares the same dict)."""
    return args.hf_deepspeed_config.config


def _prepare_deepspeed(args: Any) -> None:
    """Checks the ZeRO stage and lets DeepSpeed run our optimizer on offloaded partitions."""
    config = _deepspeed_config(args)
    stage = int(config.get("zero_optimization", {}).get("stage", 0))
    if stage not in DEEPSPEED_ZERO_STAGES:
        raise UserError(f"ft_optimizer: TrainingArguments(deepspeed=...) sets zero_optimization.stage={stage}; "
                        f"valid with the Trainer: {', '.join(map(str, DEEPSPEED_ZERO_STAGES))} (for ZeRO-3 use ft-train, "
                        "strategy.name: deepspeed with deepspeed.zero_stage: 3)")
    precision = "bf16" if args.bf16 else "fp16" if args.fp16 else "fp32"
    problem = unfused_wrapper_problem(stage, precision)
    if problem:
        raise UserError(f"ft_optimizer: TrainingArguments(deepspeed=...) sets zero_optimization.stage={stage} with "
                        f"{precision}, which {problem}; valid with the Trainer: stage 1 or 2 in bf16/fp16, or stage 0 "
                        "in fp32")
    if config.get("optimizer"):
        raise UserError("ft_optimizer: the DeepSpeed config has an 'optimizer' section, which makes DeepSpeed build its "
                        "own optimizer instead of ours; remove it")
    if config.get("zero_force_ds_cpu_optimizer") not in (None, False):
        raise UserError("ft_optimizer: the DeepSpeed config sets zero_force_ds_cpu_optimizer=true, which replaces our "
                        "optimizer by DeepSpeedCPUAdam when offloading; remove the key (ft_optimizer sets it to false)")
    if config.get("zero_force_ds_cpu_optimizer") is None:
        config["zero_force_ds_cpu_optimizer"] = False
        logger.warning("ft_optimizer: set zero_force_ds_cpu_optimizer=false in the DeepSpeed config, so that the offloaded "
                    "step runs our optimizer (DeepSpeed and Accelerate would otherwise use DeepSpeedCPUAdam)")


def ft_optimizer(name: str, args: Any = None, *, new_parameters: Iterable[str], impl: str = "auto",
                 **hparams: Any) -> tuple[FtOptimizerFactory, dict]:
    """The value for ``Trainer(optimizer_cls_and_kwargs=...)``: optimizer `name` of our registry.

    lr, betas, eps and weight decay come from `args` (TrainingArguments) unless given in
    `hparams`; `new_parameters` are the names not anchored (see `new_parameter_names`). With
    ``args.deepspeed`` set, call `install_callbacks(trainer)` too: it places theta* into
    DeepSpeed's partitions once the engine exists."""
    deepspeed = args is not None and bool(getattr(args, "deepspeed", None))
    if args is not None and getattr(args, "fsdp", None):
        # FSDP replaces the parameters after create_optimizer; placing theta* into its shards is not
        # wired to the Trainer.
        raise UserError("ft_optimizer: TrainingArguments(fsdp=...) is not supported (theta* would not follow the "
                        "sharded parameters); use TrainingArguments(deepspeed=...) with ZeRO 0-2, ft-train "
                        "(strategy.name: fsdp), or an Accelerate loop with ft_framework.integrations.loops")
    if deepspeed and hparams.get("state_dtype", "float32") != "float32":
        # Its partitions would need numbering for the stochastic rounding, and a delta-free master
        # (what ft-train's DeepSpeed strategy does); not wired to the Trainer's engine.
        raise UserError(f"ft_optimizer: state_dtype={hparams['state_dtype']!r} under TrainingArguments(deepspeed=...) "
                        "is not supported; use state_dtype='float32', or ft-train (strategy.name: deepspeed, "
                        "optimizer.state_dtype: bfloat16)")
    if deepspeed:
        _prepare_deepspeed(args)
    merged = {**_trainer_hparams(name, args), **hparams}
    if "lr" not in merged:
        raise TypeError("ft_optimizer needs lr: pass the TrainingArguments or lr=...")
    weight_decay = merged.pop("weight_decay", args.weight_decay if args is not None else 0.0)
    return FtOptimizerFactory(name, new_parameters=new_parameters, weight_decay=weight_decay, impl=impl,
                              place_after_prepare=deepspeed, **merged), {}


def _factory_of(trainer: Any) -> FtOptimizerFactory:
    factory = (trainer.optimizer_cls_and_kwargs or (None,))[0]
    if not isinstance(factory, FtOptimizerFactory):
        raise UserError("install_callbacks(trainer): the Trainer was not built with "
                        "optimizer_cls_and_kwargs=ft_optimizer(...)")
    return factory


class ThetaStarPlacement(TrainerCallback):
    """At the start of training, once the Trainer has built the DeepSpeed engine (and loaded a
    checkpoint when resuming), gives each anchored flat partition its slice of theta*; or, on a
    resume whose checkpoint brought the anchors back, keeps those."""

    def __init__(self, trainer: Any, factory: FtOptimizerFactory):
        self.trainer = trainer
        self.factory = factory

    def on_train_begin(self, args, state, control, **kwargs):
        factory = self.factory
        if factory.pending_theta_star is None:
            return
        opt = factory.optimizer
        anchored = [p for g in opt.param_groups if g["anchored"] for p in g["params"]]
        restored = sum("anchor" in opt.state.get(p, {}) for p in anchored)
        if anchored and restored == len(anchored):
            factory.theta_star_source = "checkpoint"
        elif restored:
            raise UserError(f"the checkpoint resumed at step {state.global_step} holds theta* for {restored} of the "
                            f"{len(anchored)} anchored partitions; resume from a checkpoint this optimizer wrote")
        elif state.global_step > 0:
            raise UserError(f"the checkpoint resumed at step {state.global_step} holds no theta* (anchors) for the "
                            f"{factory.name} optimizer; resume from a checkpoint written with ft_optimizer")
        else:
            place_zero_anchors(self.trainer.model_wrapped, opt, factory.pending_theta_star)
            factory.theta_star_source = "placed into the partitions"
        factory.pending_theta_star = None  # each rank now keeps only its partitions' slices
        logger.info("theta* (%d parameters): %s", len(factory.anchored_names), factory.theta_star_source)


class ForgettingCallback(TrainerCallback):
    """Adds lambda(t) (per anchored group, for optimizers that anneal) and ||theta - theta*||_2 to
    every log of the Trainer, so its own ``report_to`` integrations record them.

    The Trainer calls callbacks in order and its reporters come first; ``on_log`` therefore also
    writes the values into ``state.log_history``, and `install_callbacks` puts the callback ahead
    of the reporters so that they see the values too."""

    def __init__(self, factory: FtOptimizerFactory):
        self.factory = factory

    def on_log(self, args, state, control, logs=None, **kwargs):
        opt = self.factory.optimizer
        if logs is None or opt is None or not hasattr(opt, "forgetting_distance"):
            return
        # Under ZeRO each rank holds disjoint partitions (one all-reduce sums them; every rank logs);
        # without it the parameters are replicated and summing would count them once per rank.
        extra: dict[str, float] = {"forgetting_distance": opt.forgetting_distance(
            all_reduce=self.factory.place_after_prepare and collectives.is_distributed())}
        for group, lam in zip(opt.param_groups, opt.current_lambdas()):
            if lam is not None and group["anchored"]:
                extra[f"lambda/{group.get('group_name', '')}"] = float(lam)
        logs.update(extra)
        if state.log_history and state.log_history[-1].get("step") == state.global_step:
            state.log_history[-1].update(extra)


def install_callbacks(trainer: Any) -> FtOptimizerFactory:
    """Adds our callbacks to a Trainer built with ``optimizer_cls_and_kwargs=ft_optimizer(...)``:
    ForgettingCallback (lambda(t) and ||theta - theta*|| in every log, ahead of the reporters) and,
    under DeepSpeed, ThetaStarPlacement. Returns the optimizer factory."""
    factory = _factory_of(trainer)
    trainer.callback_handler.callbacks.insert(0, ForgettingCallback(factory))
    if factory.place_after_prepare:
        trainer.callback_handler.callbacks.insert(0, ThetaStarPlacement(trainer, factory))
        factory.placement_installed = True
    return factory
