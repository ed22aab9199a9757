"""The compact optimizer state (optimizer.state_dtype: bfloat16), what the torch path and the C++
kernel share: its rounding rules, the key of its stochastic rounding and the global element index.

Per element, against the fp32 state's 16 bytes (master, m, v, fp32 theta*) plus the model's weight:

    exp_avg     bf16, rounded to nearest even
    exp_avg_sq  bf16, rounded stochastically: bits(v) + (16 random bits), truncated. v's decrement
                (1 - beta2) * v is below half a bf16 ulp at beta2 = 0.999, so round-to-nearest could
                only let v grow (a ratchet); stochastic rounding is unbiased.
    anchor      theta* in bf16, read only
    delta       theta - theta* in fp32, the master of an anchored parameter: the pull reads it
                exactly, and the model's weight is written as theta* + delta each step.

A parameter without theta* (the new head) keeps its fp32 weight as the master.

A NaN moment (any sign, any payload) is stored as BF16_NAN_BITS, bf16's positive quiet NaN, by
every program: the integer roundings alone would carry a GPU's NaN (0x7FFFFFFF) into the sign and
store -0.0, and torch's own casts give 0x7FC0, 0xFFFF or the NaN's top bits depending on the CPU.

The random bits are counter_rng's, stream STREAM_STOCHASTIC_ROUNDING, keyed on (seed, step, global
element index): a replayed step rounds identically, under any thread count or split. The global
element index is owned here (`element_offsets`): the parameters numbered one after the other in
param-group order over the full model, so a shard (a ZeRO flat partition, an FSDP2 shard) adds its
offset inside its parameter to its parameter's base.
"""

from __future__ import annotations

from typing import Iterable

import torch

from ft_framework.counter_rng import MASK32, STREAM_STOCHASTIC_ROUNDING, random_bits, stream_key

STATE_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}
# The bits of the NaN every program stores in a bf16 moment (the C++ kernel's copy: step_body.h).
BF16_NAN_BITS = 0x7FC0


def element_offsets(params: Iterable[torch.Tensor]) -> dict[int, int]:
    """id(p) -> the global index of p's first element: running sums of the full numel (a DTensor's
    numel is its global one) over `params` in order (the optimizer passes its param groups' order)."""
    offsets, base = {}, 0
    for p in params:
        offsets[id(p)] = base
        base += p.numel()
    return offsets


def rounding_key(seed: int, step: int) -> int:
    """The 32-bit key of step `step`'s stochastic rounding (what the C++ kernel takes as sr_key)."""
    return stream_key(seed, STREAM_STOCHASTIC_ROUNDING, step)


def rounding_bits(seed: int, step: int, index_base: int, numel: int, device=None) -> torch.Tensor:
    """counter_rng's 32 bits (int64) of elements [index_base, index_base + numel) at `step`."""
    index = torch.arange(index_base, index_base + numel, dtype=torch.int64, device=device)
    return random_bits(seed, STREAM_STOCHASTIC_ROUNDING, step, index)


def _from_high_halves(words: torch.Tensor) -> torch.Tensor:
    """bf16 whose bits are the top 16 bits of each 32-bit word (int64 in [0, 2**32))."""
    high = (words & MASK32) >> 16
    return torch.where(high >= 1 << 15, high - (1 << 16), high).to(torch.int16).view(torch.bfloat16)


def _words(x: torch.Tensor) -> torch.Tensor:
    return x.contiguous().view(torch.int32).to(torch.int64) & MASK32


def _nan_to_quiet(x: torch.Tensor, rounded: torch.Tensor) -> torch.Tensor:
    """`rounded` (bf16, x's shape) with BF16_NAN_BITS wherever fp32 `x` is a NaN."""
    return rounded.view(torch.int16).masked_fill(torch.isnan(x), BF16_NAN_BITS).view(torch.bfloat16)


def round_nearest_bf16(x: torch.Tensor) -> torch.Tensor:
    """fp32 `x` to bf16, to nearest even (the kernel's store_rne), a NaN as BF16_NAN_BITS."""
    return _nan_to_quiet(x, x.to(torch.bfloat16))


def stochastic_round_bf16(x: torch.Tensor, bits: torch.Tensor) -> torch.Tensor:
    """fp32 `x` to bf16, up with probability (dropped 16 bits) / 2**16, with the top 16 of `bits`
    (what the kernel's store_sr does; for finite x, whose rounding up may reach infinity only from
    within one ulp of bf16's largest value), a NaN as BF16_NAN_BITS."""
    x = x.float()
    return _nan_to_quiet(x, _from_high_halves(_words(x).reshape(-1) + (bits.reshape(-1) >> 16)).view(x.shape))

