"""Counter-based random numbers: each draw is a pure function of (seed, stream, step, element).

Our own random draws inside numerics (R3F's embedding noise, the compact optimizer state's
stochastic rounding) must not depend on how the work is split: a replayed step, a resharded run, a
rolled-back speculative step or an activation-checkpointing recomputation must draw exactly the
same numbers for the same element. A stateful generator (``torch.Generator``) cannot promise that;
a hash of the draw's coordinates can.

The hash is ``lowbias32`` (Chris Wellons' integer-hash search, "hash-prospector": a bijection of
32-bit words with two multiplies and three xor-shifts), applied as a chain over the key words::

    key  = h(h(h(h(seed ^ SALT) ^ stream) ^ step_lo) ^ step_hi)      # once per call, in Python
    bits = h(h(key ^ index_lo) ^ index_hi)                           # per element

Every word is an unsigned 32-bit integer; ``index`` is a non-negative int64 element coordinate
(up to 2**63), split into its low and high words. The C++ step computes the same function (one
definition of each constant lives here; the kernel's copy is tested against this one bit for bit).

On torch the words live in int64 tensors. A 32 x 32-bit product does not fit in a signed 64-bit
integer, and signed overflow is undefined behaviour in the C++ under torch's kernels, so the
multiply is done in 16-bit limbs: every intermediate stays below 2**49.
"""

from __future__ import annotations

import torch

MASK32 = 0xFFFFFFFF
# Separates our streams from any other user of lowbias32 on the same seed (arbitrary odd constant).
SEED_SALT = 0x9E3779B9
LOWBIAS32_MUL1 = 0x7FEB352D
LOWBIAS32_MUL2 = 0x846CA68B

# One stream id per use, so that two uses at the same (seed, step, element) draw independently.
STREAM_R3F_NOISE = 1
STREAM_STOCHASTIC_ROUNDING = 2
STREAM_REPLAY_ROWS = 3  # which replay rows a step takes (data/replay.py)


def lowbias32_int(x: int) -> int:
    """The hash on one Python int (the reference for the tensor version, and for the key)."""
    x &= MASK32
    x ^= x >> 16
    x = (x * LOWBIAS32_MUL1) & MASK32
    x ^= x >> 15
    x = (x * LOWBIAS32_MUL2) & MASK32
    x ^= x >> 16
    return x


def stream_key(seed: int, stream: int, step: int) -> int:
    """The 32-bit key of one (seed, stream, step); every element's draw starts from it."""
    for name, value in (("seed", seed), ("stream", stream), ("step", step)):
        if not 0 <= value < 2**64:
            raise ValueError(f"counter_rng: {name}={value} must be in [0, 2**64)")
    key = lowbias32_int((seed & MASK32) ^ (seed >> 32) ^ SEED_SALT)
    key = lowbias32_int(key ^ (stream & MASK32))
    key = lowbias32_int(key ^ (step & MASK32))
    return lowbias32_int(key ^ (step >> 32))


def _mul32(x: torch.Tensor, constant: int) -> torch.Tensor:
    """(x * constant) mod 2**32 for int64 x in [0, 2**32), without leaving int64's range."""
    low = x * (constant & 0xFFFF)
    high = (x * (constant >> 16)) & 0xFFFF
    return (low + (high << 16)) & MASK32


def _lowbias32(x: torch.Tensor) -> torch.Tensor:
    x = x ^ (x >> 16)
    x = _mul32(x, LOWBIAS32_MUL1)
    x = x ^ (x >> 15)
    x = _mul32(x, LOWBIAS32_MUL2)
    return x ^ (x >> 16)


def random_bits(seed: int, stream: int, step: int, index: torch.Tensor) -> torch.Tensor:
    """32 random bits per element of ``index`` (non-negative int64), as int64 in [0, 2**32)."""
    if index.dtype != torch.int64:
        raise TypeError(f"counter_rng: index must be int64, got {index.dtype}")
    key = stream_key(seed, stream, step)
    bits = _lowbias32((index & MASK32) ^ key)
    return _lowbias32(bits ^ (index >> 32))


def uniform(seed: int, stream: int, step: int, index: torch.Tensor) -> torch.Tensor:
    """float32 uniform on the open interval (0, 1), symmetric about 1/2: (top 23 bits + 1/2) / 2**23.

    23 bits, not 24: (k + 1/2) needs one bit more than k, and float32 holds 24, so every value is
    exact and u and 1 - u are equally likely (noise drawn as (2u - 1)·σ has mean exactly 0).
    """
    top23 = (random_bits(seed, stream, step, index) >> 9).to(torch.float32)
    return (top23 + 0.5) * 2.0**-23
