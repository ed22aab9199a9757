"""The Triton multi-tensor step (impl="triton"): the exact element program of cpp/step_body.h in one
launch per bucket of tensors, for the fp32 state and the compact one (optim/compact.py).

One launch covers many tensors the way torch's fused AdamW does (multi_tensor_apply): a table of
each tensor's addresses (int64, cast to pointers in the kernel) and a table of (tensor, chunk start)
pairs, one program per chunk of CHUNK elements. The tables are cached by the tensors' addresses,
sizes and index bases, and rebuilt when any changes. Hyper-parameters are runtime arguments (fp32
scalars; the rounding key an unspecialised int32), so a new lr or step never recompiles; only the
stages a rule uses, the dtypes and the state are compile-time.

The program is the exact one, operation for operation (the same bits as every CPU level and the
torch path): a product then a sum, never fused (`enable_fp_fusion=False`: Triton would otherwise
contract a*b + c into an FMA on the GPU), `div_rn` and `sqrt_rn` (Triton's `/` and `sqrt` are
approximate on the GPU). bf16 values are read and written as their bit patterns through integer
ops: widening is exact, and rounding to nearest even ((bits + 0x7FFF + lsb) >> 16, as the C++
store_rne; a NaN of any sign or payload stored as compact.BF16_NAN_BITS) is the same in the compiled
kernel and the interpreter, whose `.to(bfloat16)` truncates. v's stochastic rounding adds the top 16 of counter_rng's 32 bits of
(key, global element index), the lowbias32 chain computed in uint32 lanes as the C++ kernel does.

TRITON_INTERPRET=1 runs the same kernel on CPU tensors (numpy ops, one rounding each: the tests'
mode); the kernel is compiled for the mode set when it is first launched.
"""

from __future__ import annotations

import functools
import os
import struct
from collections import OrderedDict
from typing import Any, Sequence

import torch

from ft_framework.counter_rng import LOWBIAS32_MUL1, LOWBIAS32_MUL2
from ft_framework.optim.coefficients import StepCoefficients, split_importance
from ft_framework.optim.compact import BF16_NAN_BITS, rounding_key
from ft_framework.optim.torch_step import TorchProgram, check_bf16_form

try:
    import triton
    import triton.language as tl
except ImportError as exc:  # an optional dependency: impl="triton" says it needs it
    triton = None
    tl = None
    _IMPORT_ERROR: ImportError | None = exc
else:
    _IMPORT_ERROR = None

INTERPRET_ENV_VAR = "TRITON_INTERPRET"
# Elements per (tensor, chunk) entry: multi_tensor_apply's chunk.
CHUNK = 65536
# Elements per loop iteration of a program on the GPU; the interpreter takes a whole chunk at once
# (numpy ops on 64 Ki elements cost about what they cost on 1 Ki, and the interpreter runs every
# program and iteration one after the other).
GPU_BLOCK = 1024
NUM_WARPS = 4
# Bytes every address of a launch is a multiple of when the kernel is told so (ALIGNED): 16-byte
# loads and stores. A fresh CUDA allocation is aligned far beyond; a view may not be, then no hint.
ALIGN_BYTES = 16
# Columns of the address table (_WEIGHT: the bf16 weight form's output, 0 otherwise; _IMPORTANCE:
# the anchored tensor's per-element importance F~, bf16, 0 otherwise).
_PARAM, _GRAD, _EXP_AVG, _EXP_AVG_SQ, _ANCHOR, _DELTA, _WEIGHT, _IMPORTANCE = range(8)
_COLUMNS = 8
_TABLE_CACHE_SIZE = 64


def interpreting() -> bool:
    return os.environ.get(INTERPRET_ENV_VAR, "0") == "1"


def _step_kernel(addresses, numels, bases, chunk_tensor, chunk_start,
                 beta1, beta2, one_minus_beta1, one_minus_beta2, eps, denom_scale, step_size,
                 pre_decay, pre_pull, post_pull, post_decay, sr_key,
                 GRAD_BF16: tl.constexpr, ANCHOR_BF16: tl.constexpr, HAS_ANCHOR: tl.constexpr,
                 HAS_IMPORTANCE: tl.constexpr,
                 HAS_PRE: tl.constexpr, HAS_POST_DECAY: tl.constexpr, COMPACT: tl.constexpr,
                 DELTA_MASTER: tl.constexpr, WEIGHT_OUT: tl.constexpr, FUSED_MUTANT: tl.constexpr,
                 CHUNK_ELEMS: tl.constexpr, BLOCK: tl.constexpr, ALIGNED: tl.constexpr):
    pid = tl.program_id(0)
    t = tl.load(chunk_tensor + pid)
    start = tl.load(chunk_start + pid)
    end = tl.minimum(start + CHUNK_ELEMS, tl.load(numels + t))
    row = addresses + t * COLUMNS
    param_ptr = tl.load(row + 0).to(tl.pointer_type(tl.float32))
    if GRAD_BF16:
        grad_ptr = tl.load(row + 1).to(tl.pointer_type(tl.uint16))
    else:
        grad_ptr = tl.load(row + 1).to(tl.pointer_type(tl.float32))
    if COMPACT:
        m_ptr = tl.load(row + 2).to(tl.pointer_type(tl.uint16))
        v_ptr = tl.load(row + 3).to(tl.pointer_type(tl.uint16))
    else:
        m_ptr = tl.load(row + 2).to(tl.pointer_type(tl.float32))
        v_ptr = tl.load(row + 3).to(tl.pointer_type(tl.float32))
    if ANCHOR_BF16:
        anchor_ptr = tl.load(row + 4).to(tl.pointer_type(tl.uint16))
    else:
        anchor_ptr = tl.load(row + 4).to(tl.pointer_type(tl.float32))
    delta_ptr = tl.load(row + 5).to(tl.pointer_type(tl.float32))
    # The bf16 weight form (cpp/step_args.h): the new weight also stored in bf16 here (it may be the
    # bf16 gradient: every element's gradient is loaded before its weight is stored), and a delta
    # master's fp32 param is neither loaded nor stored (its address is 0).
    weight_ptr = tl.load(row + 6).to(tl.pointer_type(tl.uint16))
    # The per-element importance F~ of the pulls (cpp/step_args.h), bf16 bits; read only with an anchor.
    importance_ptr = tl.load(row + 7).to(tl.pointer_type(tl.uint16))
    if ALIGNED:
        # Every address of this launch is a multiple of ALIGNMENT bytes and BLOCK divides
        # CHUNK_ELEMS (checked on the host: _aligned), and a chunk starts at a multiple of
        # CHUNK_ELEMS. An address read from a table tells the compiler nothing; with these hints it
        # loads and stores 16 bytes at a time in the unmasked blocks (checked in the PTX:
        # tests/unit/optim/test_triton_kernel_source.py).
        param_ptr = tl.multiple_of(param_ptr, ALIGNMENT)
        grad_ptr = tl.multiple_of(grad_ptr, ALIGNMENT)
        m_ptr = tl.multiple_of(m_ptr, ALIGNMENT)
        v_ptr = tl.multiple_of(v_ptr, ALIGNMENT)
        anchor_ptr = tl.multiple_of(anchor_ptr, ALIGNMENT)
        delta_ptr = tl.multiple_of(delta_ptr, ALIGNMENT)
        weight_ptr = tl.multiple_of(weight_ptr, ALIGNMENT)
        importance_ptr = tl.multiple_of(importance_ptr, ALIGNMENT)
        start = tl.multiple_of(start, CHUNK_ELEMS)
    base = tl.load(bases + t)
    key = sr_key.to(tl.uint32, bitcast=True)
    # The whole blocks without a mask (a mask of unknown extent keeps the compiler from vectorising),
    # then the chunk's last, partial block with one.
    full_end = start + ((end - start) // BLOCK) * BLOCK
    for part in tl.static_range(2):
        if part == 0:
            lo = start
            hi = full_end
        else:
            lo = full_end
            hi = end
        for offset in range(lo, hi, BLOCK):
            if ALIGNED:
                first = tl.multiple_of(offset, BLOCK)  # start + a multiple of BLOCK
            else:
                first = offset
            idx = first + tl.arange(0, BLOCK)
            if part == 0:
                mask = None
            else:
                mask = idx < end
            if GRAD_BF16:
                g = (tl.load(grad_ptr + idx, mask=mask).to(tl.uint32) << 16).to(tl.float32, bitcast=True)
            else:
                g = tl.load(grad_ptr + idx, mask=mask)
            if COMPACT:
                m = (tl.load(m_ptr + idx, mask=mask).to(tl.uint32) << 16).to(tl.float32, bitcast=True)
                v = (tl.load(v_ptr + idx, mask=mask).to(tl.uint32) << 16).to(tl.float32, bitcast=True)
            else:
                m = tl.load(m_ptr + idx, mask=mask)
                v = tl.load(v_ptr + idx, mask=mask)
            if HAS_ANCHOR:
                if ANCHOR_BF16:
                    a = (tl.load(anchor_ptr + idx, mask=mask).to(tl.uint32) << 16).to(tl.float32, bitcast=True)
                else:
                    a = tl.load(anchor_ptr + idx, mask=mask)
            # p and d = p - a, as the C++ kernel forms them for each master.
            # Pairs only ((A and B) and C): Triton before 3.4 refuses a chain of three (tests/unit/optim/
            # test_triton_kernel_source.py scans for them).
            if (COMPACT and HAS_ANCHOR) and DELTA_MASTER:
                d = tl.load(delta_ptr + idx, mask=mask)
                p = a + d
            else:
                p = tl.load(param_ptr + idx, mask=mask)
                if HAS_ANCHOR:
                    d = p - a
            # ---- the exact program (cpp/step_body.h change()): one rounding per operation ----
            if FUSED_MUTANT:  # the tests' deliberately wrong variant: one fused multiply-add
                m = tl.fma(g, one_minus_beta1, beta1 * m)
            else:
                m = one_minus_beta1 * g + beta1 * m
            v = (one_minus_beta2 * g) * g + beta2 * v
            denom = tl.sqrt_rn(v) * denom_scale + eps
            e = step_size * tl.div_rn(m, denom)
            # The pulls' fractions: the coefficients, or per element min(w * F~, 1), a NaN kept as the
            # C++ min(1, x) keeps it (PropagateNan.ALL: minimum, not minnum).
            if HAS_ANCHOR and HAS_IMPORTANCE:
                f = (tl.load(importance_ptr + idx, mask=mask).to(tl.uint32) << 16).to(tl.float32, bitcast=True)
                w_pre = tl.minimum(pre_pull * f, 1.0, propagate_nan=tl.PropagateNan.ALL)
                w_post = tl.minimum(post_pull * f, 1.0, propagate_nan=tl.PropagateNan.ALL)
            else:
                w_pre = pre_pull
                w_post = post_pull
            if HAS_PRE:
                pre = pre_decay * p
                if HAS_ANCHOR:
                    pre = w_pre * (d - pre) + pre
                e = e + pre
            if HAS_ANCHOR:
                e = w_post * (d - e) + e
            if HAS_POST_DECAY:
                e = post_decay * (p - e) + e
            # ---- stores ----
            if (COMPACT and HAS_ANCHOR) and DELTA_MASTER:
                d = d - e
                tl.store(delta_ptr + idx, d, mask=mask)
                theta = a + d
                if not WEIGHT_OUT:
                    tl.store(param_ptr + idx, theta, mask=mask)
            else:
                theta = p - e
                tl.store(param_ptr + idx, theta, mask=mask)
            if WEIGHT_OUT:  # rounded to nearest even, a NaN as bf16's quiet NaN (the C++ store_rne)
                w_bits = theta.to(tl.uint32, bitcast=True)
                w_rounded = (w_bits + (0x7FFF + ((w_bits >> 16) & 1))) >> 16
                w_rounded = tl.where((w_bits & 0x7FFFFFFF) > 0x7F800000, BF16_QUIET_NAN, w_rounded)
                tl.store(weight_ptr + idx, w_rounded.to(tl.uint16), mask=mask)
            if COMPACT:
                m_bits = m.to(tl.uint32, bitcast=True)
                m_rounded = (m_bits + (0x7FFF + ((m_bits >> 16) & 1))) >> 16
                # A NaN (any sign or payload: a GPU's is 0x7FFFFFFF, which the addition carries into
                # the sign) is stored as bf16's quiet NaN, as every program stores it.
                m_rounded = tl.where((m_bits & 0x7FFFFFFF) > 0x7F800000, BF16_QUIET_NAN, m_rounded)
                tl.store(m_ptr + idx, m_rounded.to(tl.uint16), mask=mask)
                # counter_rng's bits of (key, base + idx): lowbias32(lowbias32(lo ^ key) ^ hi).
                gidx = base + idx
                h = gidx.to(tl.uint32) ^ key
                h = h ^ (h >> 16)
                h = h * MUL1
                h = h ^ (h >> 15)
                h = h * MUL2
                h = h ^ (h >> 16)
                h = h ^ (gidx >> 32).to(tl.uint32)
                h = h ^ (h >> 16)
                h = h * MUL1
                h = h ^ (h >> 15)
                h = h * MUL2
                h = h ^ (h >> 16)
                v_word = v.to(tl.uint32, bitcast=True)
                v_bits = (v_word + (h >> 16)) >> 16
                v_bits = tl.where((v_word & 0x7FFFFFFF) > 0x7F800000, BF16_QUIET_NAN, v_bits)
                tl.store(v_ptr + idx, v_bits.to(tl.uint16), mask=mask)
            else:
                tl.store(m_ptr + idx, m, mask=mask)
                tl.store(v_ptr + idx, v, mask=mask)


if tl is not None:
    # counter_rng's constants (the owner), as uint32 compile-time values of the kernel.
    MUL1 = tl.constexpr(LOWBIAS32_MUL1)
    MUL2 = tl.constexpr(LOWBIAS32_MUL2)
    # The compact state's NaN (optim/compact.py owns it) and the address alignment of the hints.
    BF16_QUIET_NAN = tl.constexpr(BF16_NAN_BITS)
    ALIGNMENT = tl.constexpr(ALIGN_BYTES)
    COLUMNS = tl.constexpr(_COLUMNS)


@functools.lru_cache(maxsize=2)
def _jitted(interpret: bool):
    """The kernel compiled for one mode (triton.jit reads TRITON_INTERPRET when it wraps a function)."""
    del interpret  # the cache key: the environment triton.jit reads now
    return triton.jit(_step_kernel, do_not_specialize=["sr_key"])


def _f32(x: float) -> float:
    """x rounded to fp32 (to nearest, as a float argument of a compiled kernel is)."""
    return struct.unpack("f", struct.pack("f", x))[0]


def _i32(key: int) -> int:
    """A uint32 as the int32 with its bits: one argument type for every key (no recompile)."""
    return key - (1 << 32) if key >= 1 << 31 else key


class _Tables:
    """The launch's device tables for one list of tensors, cached by addresses, sizes and bases."""

    def __init__(self, size: int = _TABLE_CACHE_SIZE):
        self._cache: OrderedDict[tuple, tuple[torch.Tensor, ...]] = OrderedDict()
        self._size = size

    def get(self, rows: Sequence[tuple], bases: Sequence[int], device: torch.device,
            chunk: int) -> tuple[torch.Tensor, ...]:
        addresses = [tuple(0 if x is None else x.data_ptr() for x in row) for row in rows]
        numels = [row[1].numel() for row in rows]  # the gradient's: a bf16-form delta row has no param
        key = (device, chunk, tuple(addresses), tuple(numels), tuple(bases))
        hit = self._cache.get(key)
        if hit is not None:
            self._cache.move_to_end(key)
            return hit
        pairs = [(t, s) for t, n in enumerate(numels) for s in range(0, n, chunk)]
        # One int64 buffer, one host-to-device copy (from pinned memory on CUDA: no sync); the
        # tables are views of it.
        flat = [x for row in addresses for x in row] + numels + list(bases)
        flat += [t for t, _ in pairs] + [s for _, s in pairs]
        host = torch.tensor(flat, dtype=torch.int64)
        if device.type == "cuda":
            host = host.pin_memory()
        packed = host.to(device, non_blocking=True)
        sizes = [_COLUMNS * len(rows), len(rows), len(rows), len(pairs), len(pairs)]
        tables = tuple(packed.split(sizes))
        self._cache[key] = tables
        if len(self._cache) > self._size:
            self._cache.popitem(last=False)
        return tables


def _problem(t: torch.Tensor, role: str, dtypes: tuple[torch.dtype, ...], interpret: bool) -> str | None:
    if t.device.type != "cuda" and not (interpret and t.is_cpu):
        return f"{role} is on {t.device}, the Triton step needs CUDA tensors"
    if t.dtype not in dtypes:
        return f"{role} has dtype {t.dtype}, the Triton step takes {' or '.join(map(str, dtypes))}"
    if not t.is_contiguous():
        return f"{role} is not contiguous (the Triton step updates memory in place)"
    return None


_F32 = (torch.float32,)
_INPUTS = (torch.float32, torch.bfloat16)


class TritonProgram(TorchProgram):
    """The Triton kernel as a step program (optim/programs.py). `chunk` and `block` are the
    elements per (tensor, chunk) entry and per loop iteration (default: CHUNK, and GPU_BLOCK on the
    GPU or the whole chunk in the interpreter); `fused_mutant` is the tests' wrong variant.

    guarded_step (a finite check, then this program's step) and inverse come from the torch
    program: the undo is exact to a few ulp whichever implementation runs it (cpp/step_args.h), and
    the overlapped offload, its one user, steps CPU tensors."""

    name = "triton"

    def __init__(self, chunk: int = CHUNK, block: int | None = None, fused_mutant: bool = False):
        self.chunk = chunk
        self.block = block
        self.fused_mutant = fused_mutant
        self._tables = _Tables()

    def unavailable(self) -> str | None:
        if triton is None:
            return f"impl='triton' needs the triton package ({_IMPORT_ERROR}); pip install triton, or use impl='torch'"
        return None

    def refusal(self, param: torch.Tensor, automatic: bool) -> str | None:
        if automatic and param.device.type != "cuda":
            return "auto runs the Triton step on CUDA tensors only"
        return _problem(param, "parameter", _F32, interpreting())

    def step(self, tensors: Sequence[tuple], c: StepCoefficients, num_threads: int | None = None) -> None:
        rows = []
        for row in tensors:
            (p, g, m, v, a), f = split_importance(row, 5)
            self._check(p, g, (m, v), _F32, a, None, importance=f)
            if p.numel():
                rows.append((p, g, m, v, a, None, None, f))
        self._launch(rows, [0] * len(rows), c, 0, compact=False)

    def step_compact(self, tensors: Sequence[tuple], c: StepCoefficients, seed: int, step: int,
                     num_threads: int | None = None) -> None:
        rows, bases = [], []
        for row in tensors:
            (p, g, m, v, delta, a, base), f = split_importance(row, 7)
            if delta is not None and a is None:
                raise ValueError("the compact step's delta is theta - theta*: it needs its anchor")
            self._check(p, g, (m, v), (torch.bfloat16,), a, delta, importance=f)
            if p.numel():
                rows.append((p, g, m, v, a, delta, None, f))
                bases.append(int(base))
        self._launch(rows, bases, c, rounding_key(seed, step), compact=True)

    def step_compact_bf16(self, tensors: Sequence[tuple], c: StepCoefficients, seed: int, step: int,
                          num_threads: int | None = None) -> None:
        """The bf16 weight form (cpp/step_args.h): rows (master or None, grad, m, v, delta, anchor,
        index_base, weight[, importance]); a delta master has no fp32 param, `weight` may be the bf16
        gradient."""
        if not tensors:
            return
        split = [split_importance(row, 8) for row in tensors]
        masters, _, _, _, deltas, _, _, weights = zip(*(row for row, _ in split))
        check_bf16_form(list(masters), list(deltas), list(weights))
        rows, bases = [], []
        for (master, g, m, v, delta, a, base, weight), f in split:
            if delta is not None and a is None:
                raise ValueError("the compact step's delta is theta - theta*: it needs its anchor")
            self._check(master, g, (m, v), (torch.bfloat16,), a, delta, weight, importance=f)
            if weight.numel():
                rows.append((master, g, m, v, a, delta, weight, f))
                bases.append(int(base))
        self._launch(rows, bases, c, rounding_key(seed, step), compact=True)

    def _check(self, p, g, moments, moment_dtypes, a, delta, weight=None, importance=None) -> None:
        interpret = interpreting()
        problems = [_problem(g, "gradient", _INPUTS, interpret)]
        if importance is not None:
            if a is None:
                raise ValueError("the importance weighs the pull toward theta*: it needs its anchor")
            problems.append(_problem(importance, "importance", (torch.bfloat16,), interpret))
        if p is not None:
            problems.append(_problem(p, "parameter", _F32, interpret))
        if weight is not None:
            problems.append(_problem(weight, "weight", (torch.bfloat16,), interpret))
        problems += [_problem(x, role, moment_dtypes, interpret) for x, role in zip(moments, ("exp_avg", "exp_avg_sq"))]
        if a is not None:
            problems.append(_problem(a, "anchor", _INPUTS, interpret))
        if delta is not None:
            problems.append(_problem(delta, "delta", _F32, interpret))
        problems = [x for x in problems if x]
        if problems:
            raise TypeError("cannot run the Triton step: " + "; ".join(problems))
        sizes = [x.numel() for x in (p, g, *moments, a, delta, weight, importance) if x is not None]
        if any(n != g.numel() for n in sizes):
            raise ValueError(f"size mismatch with the gradient's {g.numel()} elements: {sizes}")
        if weight is not None:
            in_place = g.dtype == torch.bfloat16 and g.data_ptr() == weight.data_ptr()
            others = [x for x in (p, *moments, a, delta, importance) if x is not None] + ([] if in_place else [g])
            if any(_overlaps(x, weight) for x in others):
                raise ValueError("the bf16 weight may be the bf16 gradient itself (written in its place) and must "
                                 "not overlap any other tensor of the step")

    def _launch(self, rows: list[tuple], bases: list[int], c: StepCoefficients, key: int, compact: bool) -> None:
        """One launch per kind of tensor (gradient and anchor dtypes; anchor, delta, weight and
        importance present)."""
        if not rows:
            return
        if (why := self.unavailable()) is not None:
            raise RuntimeError(why)
        kinds: dict[tuple, list[int]] = {}
        for i, (p, g, m, v, a, delta, weight, f) in enumerate(rows):
            kinds.setdefault((g.dtype, None if a is None else a.dtype, delta is not None, weight is not None,
                              f is not None), []).append(i)
        interpret = interpreting()
        kernel = _jitted(interpret)
        block = self.block or (self.chunk if interpret else GPU_BLOCK)
        for (grad_dtype, anchor_dtype, has_delta, weight_out, has_importance), idx in kinds.items():
            has_anchor = anchor_dtype is not None
            tables = self._tables.get([rows[i] for i in idx], [bases[i] for i in idx], rows[idx[0]][1].device,
                                      self.chunk)
            flags = dict(GRAD_BF16=grad_dtype == torch.bfloat16, ANCHOR_BF16=anchor_dtype == torch.bfloat16,
                         ALIGNED=_aligned([rows[i] for i in idx], self.chunk, block),
                         HAS_ANCHOR=has_anchor, HAS_IMPORTANCE=has_importance,
                         HAS_PRE=_f32(c.pre_decay) != 0.0 or (has_anchor and _f32(c.pre_pull) != 0.0),
                         HAS_POST_DECAY=_f32(c.post_decay) != 0.0, COMPACT=compact, DELTA_MASTER=has_delta,
                         WEIGHT_OUT=weight_out, FUSED_MUTANT=self.fused_mutant, CHUNK_ELEMS=self.chunk,
                         BLOCK=block)
            kernel[(tables[3].numel(),)](*tables, *_scalars(c), _i32(key), **flags, **_launch_options(interpret))


def _overlaps(a: torch.Tensor, b: torch.Tensor) -> bool:
    a0, b0 = a.data_ptr(), b.data_ptr()
    return a0 < b0 + b.numel() * b.element_size() and b0 < a0 + a.numel() * a.element_size()


def _aligned(rows: Sequence[tuple], chunk: int, block: int) -> bool:
    """Whether the kernel's alignment hints hold for these rows: every address a multiple of
    ALIGN_BYTES, and a loop iteration never starting off a multiple of `block` within its chunk."""
    return chunk % block == 0 and all(x.data_ptr() % ALIGN_BYTES == 0 for row in rows for x in row if x is not None)


def _scalars(c: StepCoefficients) -> list[float]:
    """The program's coefficients in the kernel's argument order, rounded to fp32 here (as the C++
    kernel's struct holds them; 1 - beta computed in double first)."""
    return [_f32(x) for x in (c.beta1, c.beta2, 1.0 - c.beta1, 1.0 - c.beta2, c.eps, c.denom_scale, c.step_size,
                              c.pre_decay, c.pre_pull, c.post_pull, c.post_decay)]


def _launch_options(interpret: bool) -> dict[str, Any]:
    # The interpreter runs numpy ops (one rounding each, no fusion) and ignores compile options.
    return {} if interpret else {"enable_fp_fusion": False, "num_warps": NUM_WARPS}
