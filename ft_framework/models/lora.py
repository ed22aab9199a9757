"""LoRA (Hu et al. 2022) through peft, as a fine-tuning method beside the optimizers.

``model.lora: {r, alpha, dropout, target_modules}`` freezes every pretrained weight (they stay θ*
exactly) and trains low-rank adapters ``ΔW = (alpha / r) · B A`` on the target Linear layers, plus
the new classification head (peft's ``modules_to_save``). The optimizer (any one of the registry)
sees only the adapters and the head, none of which has a θ*, so it keeps no anchors: the forgetting
distance of a LoRA run is that of its merged weights,

    ‖θ_merged − θ*‖₂ = sqrt(Σ_layers ‖(alpha / r) · B A‖²_F)

(:func:`merged_forgetting_distance`; exact, since the frozen base weights are θ*). ALBERT's shared
layer is one set of modules applied ``num_hidden_layers`` times: it gets one adapter per target,
shared like the weights it adapts, and merging it changes every layer alike.

Export (:func:`save_model`) writes the merged model (a plain transformers model: ``save_pretrained``
after ``merge_and_unload``) and the adapter alone under ``adapter/`` (peft's ``save_pretrained``).
"""

from __future__ import annotations

import logging
import math
from pathlib import Path
from typing import Any, Iterable

import torch
from torch import nn

logger = logging.getLogger(__name__)

__all__ = ["DEFAULT_TARGET_MODULES", "ADAPTER_SUBDIR", "LORA_INSTALL_HINT", "require_peft",
           "default_target_modules", "apply_lora", "is_lora_model", "merged_forgetting_distance",
           "merged_copy", "save_model", "unadapted_state"]

ADAPTER_SUBDIR = "adapter"
LORA_INSTALL_HINT = "pip install 'ft_framework[lora]' (or: pip install peft)"

# model_type -> Linear module names adapted by default (the attention query and value
# projections, as in Hu et al. §7.1). ALBERT's names are those of its one shared layer.
DEFAULT_TARGET_MODULES: dict[str, list[str]] = {
    "bert": ["query", "value"],
    "roberta": ["query", "value"],
    "xlm-roberta": ["query", "value"],
    "camembert": ["query", "value"],
    "electra": ["query", "value"],
    "albert": ["query", "value"],
    "distilbert": ["q_lin", "v_lin"],
    "deberta-v2": ["query_proj", "value_proj"],
    "deberta": ["in_proj"],
    "xlnet": ["q", "v"],
    "gpt2": ["c_attn"],
    "llama": ["q_proj", "v_proj"],
    "mistral": ["q_proj", "v_proj"],
    "qwen2": ["q_proj", "v_proj"],
    "qwen3": ["q_proj", "v_proj"],
    "gemma2": ["q_proj", "v_proj"],
    "gemma3_text": ["q_proj", "v_proj"],
    "phi3": ["qkv_proj"],  # query, key and value in one Linear
}


def require_peft() -> Any:
    """The peft module, or an ImportError that names the pip extra."""
    try:
        import peft
    except ImportError as exc:  # pragma: no cover - peft is a test dependency
        raise ImportError(f"model.lora needs peft, which is not installed: {LORA_INSTALL_HINT}") from exc
    return peft


def default_target_modules(model: nn.Module) -> list[str]:
    """The target modules for `model`'s architecture (see DEFAULT_TARGET_MODULES, then peft's table)."""
    model_type = getattr(getattr(model, "config", None), "model_type", None)
    if model_type in DEFAULT_TARGET_MODULES:
        return list(DEFAULT_TARGET_MODULES[model_type])
    try:
        from peft.utils.constants import TRANSFORMERS_MODELS_TO_LORA_TARGET_MODULES_MAPPING as peft_defaults
    except ImportError:  # pragma: no cover - older peft
        peft_defaults = {}
    if model_type in peft_defaults:
        return list(peft_defaults[model_type])
    linear = sorted({name.rsplit(".", 1)[-1] for name, m in model.named_modules() if isinstance(m, nn.Linear)})
    raise ValueError(f"no default model.lora.target_modules for model type {model_type!r}; set "
                     f"model.lora.target_modules to some of its Linear module names: {', '.join(linear)}")


def _head_modules(model: nn.Module, new_parameter_names: Iterable[str]) -> list[str]:
    """Names of the modules owning the new (head) parameters: trained in full, saved with the adapter."""
    return sorted({name.rpartition(".")[0] for name in new_parameter_names if "." in name})


def apply_lora(model: nn.Module, lora_cfg: Any, new_parameter_names: Iterable[str]) -> nn.Module:
    """Wraps `model` in a peft LoRA model: pretrained weights frozen, adapters and the head trainable.

    `lora_cfg` has r, alpha, dropout and target_modules (None: the architecture's default).
    """
    peft = require_peft()
    targets = list(lora_cfg.target_modules) if lora_cfg.target_modules else default_target_modules(model)
    present = {name.rsplit(".", 1)[-1] for name, _ in model.named_modules()}
    missing = [t for t in targets if t not in present]
    if missing:
        linear = sorted({n.rsplit(".", 1)[-1] for n, m in model.named_modules() if isinstance(m, nn.Linear)})
        raise ValueError(f"model.lora.target_modules {missing} match no module of this model; its Linear "
                         f"modules are: {', '.join(linear)}")
    config = peft.LoraConfig(r=lora_cfg.r, lora_alpha=lora_cfg.alpha, lora_dropout=lora_cfg.dropout,
                             target_modules=targets, modules_to_save=_head_modules(model, new_parameter_names) or None,
                             bias="none")
    wrapped = peft.get_peft_model(model, config)
    trainable = sum(p.numel() for p in wrapped.parameters() if p.requires_grad)
    total = sum(p.numel() for p in wrapped.parameters())
    logger.info("LoRA r=%d alpha=%g on %s: %d trainable parameters of %d (%.2f%%)", lora_cfg.r, lora_cfg.alpha,
                targets, trainable, total, 100.0 * trainable / max(1, total))
    return wrapped


def is_lora_model(model: nn.Module) -> bool:
    try:
        from peft import PeftModel
    except ImportError:
        return False
    return isinstance(model, PeftModel)


def _full(t: torch.Tensor) -> torch.Tensor:
    """A DTensor's full value (FSDP2: gathered by DTensor itself), or the tensor."""
    return t.full_tensor() if hasattr(t, "full_tensor") else t


@torch.no_grad()
def unadapted_state(model: nn.Module) -> tuple[str, dict[str, torch.Tensor]] | None:
    """For a LoRA model whose adapters leave its function the base model's (every B zero, as peft
    initialises them, so ΔW = 0 whatever A's random values; no modules_to_save copies): the base
    model's class name and its state as it was before the wrap (the adapters' tensors left out, the
    wrapped layers' weights under their own names). None for any other model (its state is its own)."""
    if not is_lora_model(model):
        return None
    from peft.tuners.lora import LoraLayer
    from peft.utils import ModulesToSaveWrapper

    base = model.get_base_model()
    layers: dict[str, Any] = {}
    for name, module in base.named_modules():
        if isinstance(module, ModulesToSaveWrapper):
            return None
        if isinstance(module, LoraLayer):
            zero_b = [*(m.weight for m in module.lora_B.values()), *module.lora_embedding_B.values()]
            if any(bool(_full(b).count_nonzero()) for b in zero_b):
                return None
            layers[name + "."] = module
    state = {}
    for key, tensor in base.state_dict(keep_vars=False).items():
        layer = next((prefix for prefix in layers if key.startswith(prefix)), None)
        if layer is not None:
            rest = key[len(layer):]
            if rest.split(".", 1)[0] in layers[layer].adapter_layer_names:  # peft's names of adapter parameters
                continue
            if rest.startswith("base_layer."):
                key = layer + rest[len("base_layer."):]
        state[key] = tensor
    return type(base).__name__, state


@torch.no_grad()
def merged_forgetting_distance(model: nn.Module) -> float:
    """‖θ_merged − θ*‖₂ over the adapted weights: sqrt(Σ ‖scaling · B A‖²_F) over every LoRA layer.

    Every rank must call it under FSDP (the adapters are sharded DTensors, gathered one layer at a
    time by DTensor). DeepSpeed ZeRO-3 partitions parameters and is refused with LoRA by the config.
    """
    from peft.tuners.lora import LoraLayer

    total = 0.0
    for module in model.modules():
        if not isinstance(module, LoraLayer):
            continue
        for adapter in module.active_adapters:
            if adapter not in module.lora_A:
                continue
            a = _full(module.lora_A[adapter].weight).double()
            b = _full(module.lora_B[adapter].weight).double()
            delta = (b @ a) * float(module.scaling[adapter])
            total += float(delta.square().sum())
    return math.sqrt(total)


def merged_copy(model: nn.Module) -> nn.Module:
    """The plain transformers model with the adapters merged in (`model` itself is left unchanged)."""
    import copy

    return copy.deepcopy(model).merge_and_unload()


def save_model(model: nn.Module, directory: Path, tokenizer: Any = None) -> None:
    """save_pretrained of `model` into `directory`; a LoRA model is written merged (loads with plain
    transformers) and its adapter alone into `directory`/adapter (loads with peft)."""
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    if is_lora_model(model):
        model.save_pretrained(directory / ADAPTER_SUBDIR)
        merged_copy(model).save_pretrained(directory)
    else:
        model.save_pretrained(directory)
    if tokenizer is not None:
        tokenizer.save_pretrained(directory)
