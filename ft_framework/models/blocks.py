"""Which modules are a model's transformer blocks: the units FSDP2 shards one by one
(strategies/fsdp.py) and activation checkpointing recomputes one by one
(models/activation_checkpointing.py), so both always agree on them."""

from __future__ import annotations

from torch import nn

__all__ = ["transformer_block_lists"]


def transformer_block_lists(model: nn.Module) -> list[tuple[str, nn.ModuleList]]:
    """The outermost `nn.ModuleList`s whose entries are blocks (modules with submodules and
    parameters): BERT's `encoder.layer`, ALBERT's `encoder.albert_layer_groups`, GPT-2's `h`...
    ModuleLists nested inside a chosen one are skipped."""
    chosen: list[tuple[str, nn.ModuleList]] = []
    for name, module in model.named_modules():
        if not isinstance(module, nn.ModuleList) or len(module) == 0:
            continue
        if any(name.startswith(prefix + ".") for prefix, _ in chosen):
            continue
        if all(any(True for _ in child.children()) and any(True for _ in child.parameters())
               for child in module):
            chosen.append((name, module))
    return chosen
