"""SFT batches: rows (or packed sequences of rows) padded into tensors a transformers causal LM takes.

- ``input_ids`` (B, T), padded on the right with the pad token; ``labels`` (B, T), -100 wherever no
  loss is taken (prompts, a row's first token, padding); ``position_ids`` (B, T), restarting at 0
  for each row.
- Rows: ``attention_mask`` (B, T), 1 on tokens and 0 on padding.
- Packed sequences: no ``attention_mask``: the ``position_ids`` restarting at 0 mark where each row
  starts, and transformers (5.24, masking_utils' packed-sequence detection, for a batch without a
  mask and without a cache) builds each kernel's own form of the block-diagonal causal mask from them
  (flex attention a block mask, flash attention varlen bounds, sdpa its boolean mask), sliding
  windows included. The padding at the end is a row of its own, so that no query sees nothing (a
  softmax over nothing is NaN, and NaN times a zero gradient is still NaN).
- Packed sequences with ``dense_packed_mask`` (eager attention): ``attention_mask`` is the
  (B, 1, T, T) additive mask (0 where a token may attend, the dtype's lowest value where not) that
  lets each token see only the earlier tokens of its own row: block-diagonal and causal.

transformers (5.24) passes a 4D mask to the attention unchanged, for sdpa and eager alike (a boolean
one would be added to eager's scores as 0 and 1: it must be additive); it does not apply a model's
sliding window to it. Models whose layers slide take their windows here (``attention_windows``,
from the model's config): Mistral and Phi-3 one windowed mask for every layer, Gemma 2/3 and
Qwen2/3 with sliding layers a mask per layer type, as their forward takes them.
"""

from __future__ import annotations

from typing import Any, Mapping, Sequence

import numpy as np
import torch

__all__ = ["ANCHOR_KEYS", "IGNORE_INDEX", "SFTCollator", "attention_windows", "packed_attention_mask"]

IGNORE_INDEX = -100  # transformers' label for "no loss here"
# A training item's stored KL-anchor targets (models/kl_anchor.py), one row per trained token: the
# collator concatenates them in item order, which is the batch's row-major label order.
ANCHOR_KEYS = ("anchor_ids", "anchor_logp", "anchor_tail")

# A model's layers slide over a window (an int), or each layer type has its own (None: no window).
Windows = int | Mapping[str, int | None] | None


def attention_windows(config: Any) -> Windows:
    """The windows a packed batch's masks need for a transformers model ``config``: a mapping of layer
    type to window when some layers slide and others do not (``layer_types``), one window when every
    layer slides (``sliding_window`` without layer types), None when none slides."""
    window = getattr(config, "sliding_window", None)
    layer_types = getattr(config, "layer_types", None)
    if layer_types:
        if "sliding_attention" not in layer_types:
            return None
        return {kind: (window if kind == "sliding_attention" else None) for kind in sorted(set(layer_types))}
    return window


def packed_attention_mask(segments: torch.Tensor, window: int | None = None,
                          dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """The (B, 1, T, T) additive mask of ``segments`` (B, T): token q attends to token k when both are
    in one segment and k <= q (and q - k < ``window``, when given)."""
    length = segments.shape[1]
    index = torch.arange(length)
    allowed = (segments[:, :, None] == segments[:, None, :]) & (index[None, :, None] >= index[None, None, :])
    if window is not None:
        allowed &= (index[None, :, None] - index[None, None, :]) < window
    mask = torch.zeros(allowed.shape, dtype=dtype)
    mask.masked_fill_(~allowed, torch.finfo(dtype).min)
    return mask[:, None]


class SFTCollator:
    """Collates SFT items (data/sft.py): rows, or packed sequences (items with ``sequence_lengths``).

    ``dense_packed_mask``: packed batches carry the dense 4D mask (else none: position_ids only).
    ``attention_windows``: see :func:`attention_windows` (dense packed masks only). ``mask_dtype``: the
    packed mask's dtype (float32 works with fp32 and bf16 models, under autocast too; a bf16 mask
    takes half the memory with a bf16 model). A class, not a closure, so that it pickles."""

    def __init__(self, pad_token_id: int, *, attention_windows: Windows = None, mask_dtype: torch.dtype = torch.float32,
                 pad_to_multiple_of: int | None = None, dense_packed_mask: bool = False):
        self.pad_token_id = pad_token_id
        self.dense_packed_mask = dense_packed_mask
        self.attention_windows = attention_windows
        self.mask_dtype = mask_dtype
        self.pad_to_multiple_of = pad_to_multiple_of

    def __call__(self, items: Sequence[dict[str, Any]]) -> dict[str, Any]:
        packed = "sequence_lengths" in items[0]
        if any(("sequence_lengths" in item) != packed for item in items):
            raise ValueError("a batch mixes packed sequences and rows")
        width = max(len(item["input_ids"]) for item in items)
        if self.pad_to_multiple_of:
            width = -(-width // self.pad_to_multiple_of) * self.pad_to_multiple_of
        count = len(items)
        input_ids = torch.full((count, width), self.pad_token_id, dtype=torch.long)
        labels = torch.full((count, width), IGNORE_INDEX, dtype=torch.long)
        position_ids = torch.zeros((count, width), dtype=torch.long)
        segments = torch.zeros((count, width), dtype=torch.long)
        for b, item in enumerate(items):
            length = len(item["input_ids"])
            input_ids[b, :length] = torch.tensor(item["input_ids"], dtype=torch.long)
            labels[b, :length] = torch.tensor(item["labels"], dtype=torch.long)
            rows = list(item["sequence_lengths"]) if packed else [length]
            if width > length:
                rows.append(width - length)  # the padding: a segment of its own
            sizes = torch.tensor(rows, dtype=torch.long)
            segments[b] = torch.repeat_interleave(torch.arange(len(rows)), sizes)
            starts = torch.repeat_interleave(torch.cumsum(sizes, 0) - sizes, sizes)
            position_ids[b] = torch.arange(width) - starts
        batch: dict[str, Any] = {"input_ids": input_ids, "labels": labels, "position_ids": position_ids}
        if "anchor_ids" in items[0]:  # the KL anchor's stored targets (models/kl_anchor.py), in label order
            for key in ANCHOR_KEYS:
                batch[key] = torch.from_numpy(np.concatenate([np.asarray(item[key]) for item in items]))
        if not packed:
            batch["attention_mask"] = (segments == 0).long()
        elif not self.dense_packed_mask:
            pass  # the position_ids say where each row starts
        elif isinstance(self.attention_windows, Mapping):
            batch["attention_mask"] = {kind: packed_attention_mask(segments, window, self.mask_dtype)
                                       for kind, window in self.attention_windows.items()}
        else:
            batch["attention_mask"] = packed_attention_mask(segments, self.attention_windows, self.mask_dtype)
        return batch
