"""Activation checkpointing: each transformer block (models/blocks.py) keeps only its inputs in
forward and recomputes its activations during backward (``training.activation_checkpointing``).

Every block's ``forward`` is replaced, on the instance, by one that runs the original under
``torch.utils.checkpoint.checkpoint(..., use_reentrant=False)``. Why this way:

- the block's own module hooks stay outside the checkpoint (``__call__`` runs them once), so the
  hooks a strategy puts on a block (FSDP2's ``fully_shard``) do not run again in the recomputation,
  while the hooks of the modules inside it (DeepSpeed ZeRO-3's parameter gathering) do, which is
  what the recomputation needs;
- parameter names and the state dict stay those of the plain model (θ*, the optimizer's groups and
  the checkpoint layout are keyed by them), unlike torch's ``checkpoint_wrapper``;
- non-reentrant checkpointing needs no input that requires grad (LoRA's frozen embeddings), works
  with DDP (``no_sync`` included) and keeps keyword arguments;
- the random state is saved at the block's forward and restored for the recomputation
  (``preserve_rng_state``), so dropout and Mixout draw the same masks twice.

Apply it once, before a strategy wraps the model (FSDP2 then shards the same blocks).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from ft_framework.errors import UserError
from ft_framework.models.blocks import transformer_block_lists

__all__ = ["apply_activation_checkpointing", "checkpointed_blocks"]


class CheckpointedForward:
    """A block's forward run under non-reentrant checkpointing while training with grad enabled.

    A class rather than a closure so that ``copy.deepcopy`` of the model binds the copy to the
    copied block (a closure would be shared and keep calling the original).
    """

    def __init__(self, block: nn.Module) -> None:
        self.block = block
        self.forward = block.forward  # the forward it replaces (bound to the block)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        if not (self.block.training and torch.is_grad_enabled()):
            return self.forward(*args, **kwargs)
        # checkpoint saves the random state of the device it infers from its positional arguments
        # only: keyword tensors travel positionally too, so that on a GPU dropout and Mixout replay
        # the same masks even when a block is called with keywords only.
        num_args, names = len(args), list(kwargs)

        def run(*values: Any) -> Any:
            return self.forward(*values[:num_args], **dict(zip(names, values[num_args:])))

        return checkpoint(run, *args, *kwargs.values(), use_reentrant=False, preserve_rng_state=True)


def checkpointed_blocks(model: nn.Module) -> list[nn.Module]:
    """The blocks of `model` whose forward runs under activation checkpointing."""
    return [m for m in model.modules() if isinstance(m.__dict__.get("forward"), CheckpointedForward)]


def apply_activation_checkpointing(model: nn.Module) -> int:
    """Runs each transformer block of `model` under non-reentrant activation checkpointing (in
    place) and returns how many block modules it wraps. A module called several times (ALBERT's
    shared layer group) counts once and is checkpointed at every call. Applying it again changes
    nothing. Raises UserError when the model has no block to wrap."""
    blocks = [block for _, blocks in transformer_block_lists(model) for block in blocks]
    if not blocks:
        raise UserError(
            f"training.activation_checkpointing: found no transformer blocks to checkpoint in "
            f"{type(model).__name__} (a block is an entry of an nn.ModuleList of modules with "
            f"parameters, such as BERT's encoder.layer); set training.activation_checkpointing: false")
    for block in blocks:
        if not isinstance(block.__dict__.get("forward"), CheckpointedForward):
            block.forward = CheckpointedForward(block)
    return len(blocks)
