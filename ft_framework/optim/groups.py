"""Parameter groups for a Hugging Face model: anchored (pretrained) vs new (head) parameters,
no-decay for biases and normalization layers, optional layer-wise learning-rate decay (LLRD).

Anchored parameters are found by matching the model's parameters against the pretrained state
dict (name and shape), never by name substrings: the authors' substring filter silently drops the
penalty for models whose parameter names lack the expected prefix (XLNet, XLM-R, T5, GPT-2).
"""

from __future__ import annotations

import re
from collections import OrderedDict
from typing import Any, Mapping

import torch
from torch import nn

# What every group of build_param_groups carries: callers give the optimizer these through the
# groups only, not again as build_optimizer keywords (a second spelling of one value).
GROUP_HPARAMS = ("lr", "weight_decay")

_NORM_TYPES: tuple[type, ...] = (nn.LayerNorm, nn.GroupNorm, nn.BatchNorm1d, nn.RMSNorm)
# Custom norms (T5LayerNorm, LlamaRMSNorm, ...) are not nn.LayerNorm subclasses; their class
# names say what they are.
_NORM_NAME = re.compile(r"(LayerNorm|RMSNorm|GroupNorm)$")
# Index of the transformer block a parameter belongs to: BERT "layer.3.", GPT-2 "h.3.",
# T5 "block.3.", Llama "layers.3.", ALBERT "albert_layer_groups.0.".
_LAYER_INDEX = re.compile(r"(?:^|\.)(?:layer|layers|h|block|blocks|albert_layer_groups)\.(\d+)\.")


def is_norm_module(module: nn.Module) -> bool:
    return isinstance(module, _NORM_TYPES) or bool(_NORM_NAME.search(type(module).__name__))


def no_decay_parameter_names(model: nn.Module) -> set[str]:
    """Biases and every parameter of a normalization module, found by module type."""
    names = set()
    for module_name, module in model.named_modules():
        norm = is_norm_module(module)
        for pname, _ in module.named_parameters(recurse=False):
            if norm or pname == "bias":
                names.add(f"{module_name}.{pname}" if module_name else pname)
    return names


def layer_depths(names: list[str]) -> dict[str, int]:
    """Depth of each parameter for LLRD, in registration order: what comes before the first
    transformer block (embeddings, ALBERT's embedding projection) is depth 0, block i is i+1,
    what comes after the blocks (pooler, head) is the top."""
    indices = {n: int(m.group(1)) for n in names if (m := _LAYER_INDEX.search(n))}
    top = (max(indices.values()) + 2) if indices else 1
    depths, seen_block = {}, False
    for n in names:
        if n in indices:
            depths[n], seen_block = indices[n] + 1, True
        else:
            depths[n] = top if seen_block else 0
    return depths


def build_param_groups(
    model: nn.Module,
    pretrained_state: Mapping[str, torch.Tensor] | None = None,
    *,
    lr: float,
    weight_decay: float = 0.0,
    no_decay_bias_and_norm: bool = True,
    layerwise_lr_decay: float | None = None,
    extra_group_options: Mapping[str, Any] | None = None,
    attach_anchors: bool = True,
    child_tuning: bool = False,
) -> list[dict[str, Any]]:
    """Groups ready for ``build_optimizer``: each has params, anchors (or None), anchored, lr,
    weight_decay, param_names and group_name.

    A parameter is anchored when ``pretrained_state`` has a tensor of the same name and shape;
    its anchor is that tensor as fp32 (so theta* is exact even if the model trains in bf16).
    This is the one place that decides it: each group carries the decision as ``anchored``.
    With ``attach_anchors=False`` the groups are split the same way (anchored parameters never
    share a group with new ones) but carry no anchors: a strategy places theta* after wrapping
    (Strategy.setup(..., anchors=pretrained_state)) into the anchored groups' parameters.
    ``layerwise_lr_decay`` = d gives a block at depth k (of top K) the rate lr * d**(K - k).

    Every group also carries ``child_candidate``: whether Child-Tuning (optim/child_tuning.py) may
    mask its parameters. With ``child_tuning=True`` the candidates are the anchored parameters
    inside the transformer blocks (the authors mask the encoder layers only: embeddings, pooler and
    the new head always update), in groups of their own; otherwise no group is a candidate.
    """
    if layerwise_lr_decay is not None and not 0 < layerwise_lr_decay <= 1:
        raise ValueError(f"layerwise_lr_decay must be in (0, 1], got {layerwise_lr_decay}")
    named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    if not named:
        raise ValueError("the model has no trainable parameters")
    pretrained_state = pretrained_state or {}
    no_decay = no_decay_parameter_names(model) if no_decay_bias_and_norm else set()
    depths = layer_depths([n for n, _ in named]) if layerwise_lr_decay else {}
    top = max(depths.values(), default=0)
    mismatched = [n for n, p in named if n in pretrained_state and tuple(pretrained_state[n].shape) != tuple(p.shape)]
    if mismatched:
        raise ValueError(f"pretrained tensors have other shapes than the model's parameters: {mismatched[:5]}")

    groups: "OrderedDict[tuple, dict[str, Any]]" = OrderedDict()
    for name, p in named:
        anchored = name in pretrained_state
        decays = name not in no_decay
        scale = layerwise_lr_decay ** (top - depths[name]) if layerwise_lr_decay else 1.0
        candidate = child_tuning and anchored and bool(_LAYER_INDEX.search(name))
        key = (anchored, decays, scale, candidate)
        if key not in groups:
            groups[key] = {
                "params": [], "anchors": [] if anchored and attach_anchors else None, "anchored": anchored,
                "child_candidate": candidate, "param_names": [],
                "lr": lr * scale, "weight_decay": weight_decay if decays else 0.0,
                "group_name": f"{'anchored' if anchored else 'new'}/{'decay' if decays else 'no_decay'}"
                              + (f"/lr_x{scale:.4g}" if layerwise_lr_decay else "")
                              + ("/child" if candidate else ""),
                **dict(extra_group_options or {}),
            }
        g = groups[key]
        g["params"].append(p)
        g["param_names"].append(name)
        if anchored and attach_anchors:
            g["anchors"].append(pretrained_state[name].detach().to(torch.float32))
    return list(groups.values())
