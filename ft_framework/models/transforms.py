"""The model transforms of a run, in the order they are applied, each with the config key that turns
it on and why it stands where it stands: the one place that says in which order a model is changed
between the checkpoint and the strategy's wrap.

    checkpoint loaded in fp32 ──► θ* captured ──► model.init: random ──► model.reinit_top_layers
      ──► model.mixout ──► model.dtype ──► model.lora                      (WHILE_LOADING)
      ──► model.fused_activations ──► training.activation_checkpointing ──► training.r3f
                                                                            (BEFORE_THE_WRAP)
      ──► Strategy.setup wraps the model and places θ* in the optimizer

Two points of the run fix the order. θ* (the exact fp32 pretrained value of every parameter the
checkpoint provides) is captured right after the checkpoint loads, before anything changes a
weight; the transforms that need it, or that change weights, come after it inside
:func:`ft_framework.models.loading.load_model`, which applies them itself (ft-interpolate and the
library's users load models through it too). The transforms that change how the model computes,
not what it holds, come after loading and before the strategy wraps the model: the assembly
(ft_framework/assembly.py) applies them with :func:`apply_before_the_wrap`, in this list's order.
tests/unit/test_assembly.py checks that both orders are this list's.

A transform's ``apply`` returns what the run records of it (results.json's ``fused_activations``,
the R3F objective whose KL the logs report); ``describe`` turns that into the run's log line.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable

from torch import nn

from ft_framework.models.activation_checkpointing import apply_activation_checkpointing
from ft_framework.models.fused_activations import describe_fused, fuse_activations
from ft_framework.models.r3f import R3FSettings, attach_r3f

if TYPE_CHECKING:
    from ft_framework.config import RunConfig

__all__ = ["BEFORE_THE_WRAP", "MODEL_TRANSFORMS", "ModelTransform", "WHILE_LOADING", "apply_before_the_wrap",
           "transform_names"]

# Where a transform is applied.
WHILE_LOADING = "while loading (models/loading.py: load_model)"
BEFORE_THE_WRAP = "after loading, before the strategy wraps the model (assembly.py)"


@dataclass(frozen=True)
class ModelTransform:
    """One model transform: its config key, where it is applied, why there, whether a run's config
    turns it on, and (for those applied before the wrap) how it is applied and logged."""

    name: str                                  # the config key that turns it on
    where: str                                 # WHILE_LOADING or BEFORE_THE_WRAP
    why: str                                   # why it stands where it stands in MODEL_TRANSFORMS
    enabled: Callable[["RunConfig"], bool]
    # (model, run config) -> what the run records of it; None for WHILE_LOADING (load_model applies those).
    apply: Callable[[nn.Module, "RunConfig"], Any] | None = None
    # What apply returned (None: the transform was off) -> the run's log line, or None for no line.
    describe: Callable[[Any], str | None] = lambda record: None


def _fused_line(replaced: dict[str, int] | None) -> str:
    return "model.fused_activations: " + ("off (the model's own activation modules)" if replaced is None
                                          else describe_fused(replaced))


def _checkpointing_line(num_blocks: int | None) -> str | None:
    if num_blocks is None:
        return None
    return (f"activation checkpointing: {num_blocks} transformer block module(s) recompute their activations "
            "in backward")


def _attach_r3f(model: nn.Module, cfg: "RunConfig") -> Any:
    r3f = cfg.training.r3f
    # The data seed keys the noise, as it keys the data order: the init seed is the weights'.
    return attach_r3f(model, R3FSettings(weight=r3f.weight, noise=r3f.noise, sigma=r3f.sigma,
                                         seed=cfg.training.data_seed, max_seq_length=cfg.data.max_seq_length))


MODEL_TRANSFORMS: tuple[ModelTransform, ...] = (
    ModelTransform(
        "model.init", WHILE_LOADING,
        "RI (init: random) re-draws every pretrained weight with the model's own init: after θ* is captured, "
        "so that θ* stays the checkpoint's values, and inside the init seed's generator right after the "
        "new head was drawn, so that the head is the same for PI and RI runs of one seed (Zhang et al. App. B).",
        enabled=lambda cfg: cfg.model.init == "random"),
    ModelTransform(
        "model.reinit_top_layers", WHILE_LOADING,
        "Re-draws the top L layers and the pooler: after θ* is captured (their anchors stay pretrained), in "
        "the same generator as RI, after the head, for the same reason.",
        enabled=lambda cfg: bool(cfg.model.reinit_top_layers)),
    ModelTransform(
        "model.mixout", WHILE_LOADING,
        "Swaps each pretrained Linear for a MixoutLinear that mixes toward θ*: after θ* is captured (its "
        "target is θ*'s tensor) and after the re-initializations (it mixes the weights as they start "
        "training, whatever they were re-drawn to); before the cast, which then casts its weights with the "
        "rest. Once the strategy has placed θ* in the optimizer, each module reads its target there.",
        enabled=lambda cfg: cfg.model.mixout > 0),
    ModelTransform(
        "model.dtype", WHILE_LOADING,
        "Casts the model to model.dtype: after θ* is captured (θ* is exact fp32 whatever the model trains "
        "in) and after every transform that reads or re-draws weights; before LoRA, so that it casts the "
        "weights LoRA freezes and leaves the adapters to peft, which keeps them in fp32.",
        enabled=lambda cfg: cfg.model.dtype != "float32"),
    ModelTransform(
        "model.lora", WHILE_LOADING,
        "peft wraps the model in LoRA adapters and freezes every pretrained weight at θ*: last while loading, "
        "on the model as it will train (the config refuses RI, re-init and Mixout with it), its adapters "
        "drawn from a generator seeded with the init seed of their own. The optimizer then anchors "
        "nothing (the frozen weights are θ*), and every later transform sees peft's wrapper.",
        enabled=lambda cfg: cfg.model.lora is not None),
    ModelTransform(
        "model.fused_activations", BEFORE_THE_WRAP,
        "Replaces activations written as separate ops by the fused op (models/fused_activations.py): after "
        "loading (peft's wrapper holds the same activation modules), before activation checkpointing and "
        "before the strategy wraps the model, the order in which the memory plan's trace "
        "(strategies/memory_trace.py) applies the two, so that the plan traces the model the run trains.",
        enabled=lambda cfg: cfg.model.fused_activations,
        apply=lambda model, cfg: fuse_activations(model),
        describe=_fused_line),
    ModelTransform(
        "training.activation_checkpointing", BEFORE_THE_WRAP,
        "Runs each transformer block under non-reentrant checkpointing (models/activation_checkpointing.py): "
        "after LoRA (the blocks it finds are inside peft's wrapper, adapters included) and after the fused "
        "activations (as the memory plan traces it); before any strategy wraps the model, so that FSDP2 "
        "shards the same blocks and its hooks on each block stay outside the checkpoint.",
        enabled=lambda cfg: cfg.training.activation_checkpointing,
        apply=lambda model, cfg: apply_activation_checkpointing(model),
        describe=_checkpointing_line),
    ModelTransform(
        "training.r3f", BEFORE_THE_WRAP,
        "Replaces the forward of the model the strategy gets (peft's wrapper under LoRA) by one that runs "
        "the clean and the noised pass (models/r3f.py): last, just before the strategy wraps the model, so "
        "that every wrapper (DDP, DeepSpeed, FSDP2) sees R3F's two passes as one forward per backward.",
        enabled=lambda cfg: cfg.training.r3f is not None,
        apply=_attach_r3f),
)


def transform_names(where: str | None = None) -> list[str]:
    """The names of MODEL_TRANSFORMS in order (those applied at `where`, when given)."""
    return [t.name for t in MODEL_TRANSFORMS if where is None or t.where == where]


def apply_before_the_wrap(model: nn.Module, cfg: "RunConfig",
                          log: Callable[[str], None] = lambda line: None) -> dict[str, Any]:
    """Applies, in place and in MODEL_TRANSFORMS' order, the transforms that stand between loading and
    the strategy's wrap and that `cfg` turns on; `log` gets each one's log line. Returns {name: what
    its apply returned}, None for one that is off."""
    applied: dict[str, Any] = {}
    for transform in MODEL_TRANSFORMS:
        if transform.where != BEFORE_THE_WRAP:
            continue
        record = transform.apply(model, cfg) if transform.enabled(cfg) else None
        applied[transform.name] = record
        line = transform.describe(record)
        if line is not None:
            log(line)
    return applied
