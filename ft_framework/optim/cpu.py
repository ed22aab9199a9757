"""Python side of the C++ CPU step (ft_framework._cpu_kernel).

The kernel updates memory in place through buffers that share the tensors' memory, so every tensor
is checked here first: a non-contiguous or wrongly typed tensor is refused, never copied (a copy
would silently drop the update — the failure mode of DeepSpeedCPUAdam's binding).

FT_FRAMEWORK_SIMD=scalar|avx2|avx512 forces a SIMD level at import (it must be one this CPU runs).
"""

from __future__ import annotations

import functools
import os
from typing import Sequence

import torch

from ft_framework.optim.coefficients import StepCoefficients, kernel_values, split_importance
from ft_framework.optim.compact import rounding_key

SIMD_ENV_VAR = "FT_FRAMEWORK_SIMD"

try:
    from ft_framework import _cpu_kernel as _kernel
except ImportError as exc:  # the package was installed without building cpp/
    _kernel = None
    _IMPORT_ERROR = exc
else:
    _IMPORT_ERROR = None
    _forced = os.environ.get(SIMD_ENV_VAR)
    if _forced:
        try:
            _kernel.set_level(_forced.strip().lower())
        except ValueError as exc:
            raise RuntimeError(f"{SIMD_ENV_VAR}={_forced!r}: {exc}") from None

_PARAM_DTYPES = (torch.float32,)
_INPUT_DTYPES = (torch.float32, torch.bfloat16)
# The per-element importance F~ (optimizer state, cpp/step_args.h) is read as bf16 only.
_IMPORTANCE_DTYPES = (torch.bfloat16,)


def kernel_available() -> bool:
    return _kernel is not None


def _require_kernel():
    if _kernel is None:
        raise RuntimeError(CpuKernelProgram().unavailable())
    return _kernel


def simd_level() -> str:
    """The SIMD level the kernel runs now: 'scalar', 'avx2' or 'avx512'."""
    return _require_kernel().get_level()


def supported_simd_levels() -> list[str]:
    """Levels this CPU can run, lowest first."""
    return list(_require_kernel().supported_levels())


def set_simd_level(level: str) -> None:
    """Switches the SIMD level for this process (tests and benchmarks use it)."""
    _require_kernel().set_level(level)


def tensor_problem(t: torch.Tensor, role: str, dtypes: tuple[torch.dtype, ...]) -> str | None:
    """Why the kernel cannot take `t` in place, or None when it can."""
    if not t.is_cpu:
        return f"{role} is on {t.device}, the CPU kernel needs CPU tensors"
    if t.dtype not in dtypes:
        return f"{role} has dtype {t.dtype}, the CPU kernel takes {' or '.join(map(str, dtypes))}"
    if not t.is_contiguous():
        return f"{role} is not contiguous (the kernel updates memory in place and never copies)"
    if t.is_sparse:
        return f"{role} is sparse"
    return None


def check_param(p: torch.Tensor) -> str | None:
    return tensor_problem(p, "parameter", _PARAM_DTYPES)


def _importance_problem(importance, anchor) -> str | None:
    """Why the kernel cannot read `importance` beside `anchor` (None: it can, or there is none)."""
    if importance is None:
        return None
    if anchor is None:
        raise ValueError("the importance weighs the pull toward theta*: it needs its anchor")
    return tensor_problem(importance, "importance", _IMPORTANCE_DTYPES)


def _check_step_tensors(param, grad, exp_avg, exp_avg_sq, anchor, importance=None) -> int:
    """The element count of one tensor's step; raises TypeError / ValueError on inputs the kernel
    cannot update in place."""
    checks = [
        tensor_problem(param, "parameter", _PARAM_DTYPES),
        tensor_problem(grad, "gradient", _INPUT_DTYPES),
        tensor_problem(exp_avg, "exp_avg", _PARAM_DTYPES),
        tensor_problem(exp_avg_sq, "exp_avg_sq", _PARAM_DTYPES),
        _importance_problem(importance, anchor),
    ]
    if anchor is not None:
        checks.append(tensor_problem(anchor, "anchor", _INPUT_DTYPES))
    problems = [c for c in checks if c]
    if problems:
        raise TypeError("cannot run the CPU optimizer kernel: " + "; ".join(problems))
    n = param.numel()
    sizes = {"gradient": grad.numel(), "exp_avg": exp_avg.numel(), "exp_avg_sq": exp_avg_sq.numel()}
    if anchor is not None:
        sizes["anchor"] = anchor.numel()
    if importance is not None:
        sizes["importance"] = importance.numel()
    wrong = {k: v for k, v in sizes.items() if v != n}
    if wrong:
        raise ValueError(f"size mismatch with the parameter's {n} elements: {wrong}")
    return n


def _checked_buffers(param, grad, exp_avg, exp_avg_sq, anchor, importance=None) -> tuple | None:
    """The kernel's buffers for one tensor's step, its importance's last (None when the tensor is
    empty), after _check_step_tensors."""
    if _check_step_tensors(param, grad, exp_avg, exp_avg_sq, anchor, importance) == 0:
        return None
    return (_buffer(param), _buffer(grad), _buffer(exp_avg), _buffer(exp_avg_sq),
            None if anchor is None else _buffer(anchor), None if importance is None else _buffer(importance))


def _threads(num_threads: int | None) -> int:
    return torch.get_num_threads() if num_threads is None else int(num_threads)


def fused_step(
    param: torch.Tensor,
    grad: torch.Tensor,
    exp_avg: torch.Tensor,
    exp_avg_sq: torch.Tensor,
    anchor: torch.Tensor | None,
    coeffs: StepCoefficients,
    num_threads: int | None = None,
    *,
    importance: torch.Tensor | None = None,
) -> None:
    """Runs one fused step on one tensor in place; raises TypeError/ValueError on unusable inputs.
    `importance` (bf16, beside an anchor): each pull's fraction is min(w * importance, 1) per element."""
    kernel = _require_kernel()
    buffers = _checked_buffers(param, grad, exp_avg, exp_avg_sq, anchor, importance)
    if buffers is not None:
        kernel.fused_step(*buffers[:5], _kernel_coefficients(coeffs), _threads(num_threads), buffers[5])


def fused_step_many(
    tensors: Sequence[tuple],
    coeffs: StepCoefficients,
    num_threads: int | None = None,
) -> None:
    """fused_step on each (param, grad, exp_avg, exp_avg_sq, anchor[, importance]) of `tensors`, all
    with `coeffs`, in one kernel call: the same arithmetic, bit for bit, with the GIL released once
    instead of once per tensor (a bucket of small tensors cost more in Python than in the kernel).
    Every tensor is checked before any is touched; raises TypeError/ValueError as fused_step."""
    kernel = _require_kernel()
    columns: tuple[list, ...] = ([], [], [], [], [], [], [], [])
    importances: list[int] = []
    for row in tensors:
        (param, grad, exp_avg, exp_avg_sq, anchor), importance = split_importance(row, 5)
        n = _check_step_tensors(param, grad, exp_avg, exp_avg_sq, anchor, importance)
        if n == 0:
            continue
        for column, value in zip(columns, (param.data_ptr(), grad.data_ptr(), exp_avg.data_ptr(),
                                           exp_avg_sq.data_ptr(), 0 if anchor is None else anchor.data_ptr(), n,
                                           grad.dtype is torch.bfloat16,
                                           anchor is not None and anchor.dtype is torch.bfloat16)):
            column.append(value)
        importances.append(0 if importance is None else importance.data_ptr())
    if columns[0]:
        # No importance anywhere: the call of a kernel without them (the list is optional there).
        weighted = {"importances": importances} if any(importances) else {}
        kernel._fused_step_many(*columns, _kernel_coefficients(coeffs), _threads(num_threads), **weighted)


def _check_compact_tensors(param, grad, exp_avg, exp_avg_sq, delta, anchor, importance=None) -> int:
    """The element count of one compact step; raises TypeError / ValueError on inputs the kernel
    cannot update in place."""
    checks = [
        tensor_problem(param, "parameter", _PARAM_DTYPES),
        tensor_problem(grad, "gradient", _INPUT_DTYPES),
        tensor_problem(exp_avg, "exp_avg", (torch.bfloat16,)),
        tensor_problem(exp_avg_sq, "exp_avg_sq", (torch.bfloat16,)),
        _importance_problem(importance, anchor),
    ]
    if delta is not None and anchor is None:
        raise ValueError("the compact step's delta is theta - theta*: it needs its anchor")
    if delta is not None:
        checks.append(tensor_problem(delta, "delta", _PARAM_DTYPES))
    if anchor is not None:
        checks.append(tensor_problem(anchor, "anchor", _INPUT_DTYPES))
    problems = [c for c in checks if c]
    if problems:
        raise TypeError("cannot run the CPU optimizer kernel: " + "; ".join(problems))
    tensors = (param, grad, exp_avg, exp_avg_sq) + tuple(t for t in (delta, anchor, importance) if t is not None)
    if any(t.numel() != param.numel() for t in tensors):
        raise ValueError(f"size mismatch with the parameter's {param.numel()} elements: "
                         f"{[t.numel() for t in tensors]}")
    return param.numel()


def fused_step_compact(
    param: torch.Tensor,
    grad: torch.Tensor,
    exp_avg: torch.Tensor,
    exp_avg_sq: torch.Tensor,
    delta: torch.Tensor | None,
    anchor: torch.Tensor | None,
    coeffs: StepCoefficients,
    sr_key: int,
    index_base: int,
    num_threads: int | None = None,
    *,
    importance: torch.Tensor | None = None,
) -> None:
    """One step of the compact state (optim/compact.py) on one tensor in place: bf16 exp_avg and
    exp_avg_sq; for an anchored parameter with a delta, delta is the master (param is written as
    anchor + delta); with an anchor and no delta, param is the master (DeepSpeed's partitions).
    `sr_key` (compact.rounding_key) and `index_base` key the stochastic rounding; `importance` as
    fused_step's."""
    kernel = _require_kernel()
    if _check_compact_tensors(param, grad, exp_avg, exp_avg_sq, delta, anchor, importance) == 0:
        return
    kernel.fused_step_compact(_buffer(param), _buffer(grad), _buffer(exp_avg), _buffer(exp_avg_sq),
                              None if delta is None else _buffer(delta), None if anchor is None else _buffer(anchor),
                              _kernel_coefficients(coeffs), int(sr_key), int(index_base), _threads(num_threads),
                              None if importance is None else _buffer(importance))


def fused_step_compact_many(tensors: Sequence[tuple], coeffs: StepCoefficients, sr_key: int,
                            num_threads: int | None = None) -> None:
    """fused_step_compact on each (param, grad, exp_avg, exp_avg_sq, delta, anchor, index_base[,
    importance]) of `tensors`, all with `coeffs` and `sr_key`, in one kernel call (bit for bit the
    same; the GIL is released once). Every tensor is checked before any is touched."""
    rows = []
    for row in tensors:
        (param, grad, exp_avg, exp_avg_sq, delta, anchor, index_base), importance = split_importance(row, 7)
        if _check_compact_tensors(param, grad, exp_avg, exp_avg_sq, delta, anchor, importance):
            rows.append((param, grad, exp_avg, exp_avg_sq, delta, anchor, index_base, None, importance))
    _compact_kernel_call(rows, coeffs, sr_key, num_threads)


def _compact_kernel_call(rows: list[tuple], coeffs: StepCoefficients, sr_key: int, num_threads: int | None) -> None:
    """One kernel call over checked rows (param or None, grad, exp_avg, exp_avg_sq, delta, anchor,
    index_base, weight or None, importance or None), none of them empty."""
    kernel = _require_kernel()
    columns: tuple[list, ...] = ([], [], [], [], [], [], [], [], [], [], [])
    importances = [0 if row[8] is None else row[8].data_ptr() for row in rows]
    for param, grad, exp_avg, exp_avg_sq, delta, anchor, index_base, weight, _importance in rows:
        for column, value in zip(columns, (0 if param is None else param.data_ptr(), grad.data_ptr(),
                                           exp_avg.data_ptr(), exp_avg_sq.data_ptr(),
                                           0 if delta is None else delta.data_ptr(),
                                           0 if anchor is None else anchor.data_ptr(), grad.numel(),
                                           grad.dtype is torch.bfloat16,
                                           anchor is not None and anchor.dtype is torch.bfloat16, int(index_base),
                                           0 if weight is None else weight.data_ptr())):
            column.append(value)
    if columns[0]:
        weighted = {"importances": importances} if any(importances) else {}
        kernel._fused_step_compact_many(*columns, _kernel_coefficients(coeffs), int(sr_key), _threads(num_threads),
                                        **weighted)


def _byte_range(t: torch.Tensor) -> tuple[int, int]:
    start = t.data_ptr()
    return start, start + t.numel() * t.element_size()


def _overlaps(a: torch.Tensor, b: torch.Tensor) -> bool:
    (a0, a1), (b0, b1) = _byte_range(a), _byte_range(b)
    return a0 < b1 and b0 < a1


def _check_compact_bf16_tensors(master, grad, exp_avg, exp_avg_sq, delta, anchor, weight, importance=None) -> int:
    """The element count of one step of the bf16 weight form; raises TypeError / ValueError on inputs
    the kernel cannot update in place. `grad` may be `weight` itself (in place), or apart from it."""
    if (master is None) != (delta is not None):
        raise ValueError("the bf16 weight form keeps no fp32 weight of a delta master: pass master=None exactly "
                         "where a delta is given (an fp32 master otherwise: the new head, or DeepSpeed's partition)")
    if delta is not None and anchor is None:
        raise ValueError("the compact step's delta is theta - theta*: it needs its anchor")
    checks = [tensor_problem(weight, "weight", (torch.bfloat16,)),
              tensor_problem(grad, "gradient", _INPUT_DTYPES),
              tensor_problem(exp_avg, "exp_avg", (torch.bfloat16,)),
              tensor_problem(exp_avg_sq, "exp_avg_sq", (torch.bfloat16,)),
              _importance_problem(importance, anchor)]
    if master is not None:
        checks.append(tensor_problem(master, "parameter", _PARAM_DTYPES))
    if delta is not None:
        checks.append(tensor_problem(delta, "delta", _PARAM_DTYPES))
    if anchor is not None:
        checks.append(tensor_problem(anchor, "anchor", _INPUT_DTYPES))
    problems = [c for c in checks if c]
    if problems:
        raise TypeError("cannot run the CPU optimizer kernel: " + "; ".join(problems))
    others = [t for t in (master, exp_avg, exp_avg_sq, delta, anchor, importance) if t is not None]
    if any(t.numel() != weight.numel() for t in (grad, *others)):
        raise ValueError(f"size mismatch with the weight's {weight.numel()} elements: "
                         f"{[t.numel() for t in (grad, *others)]}")
    if weight.numel() == 0:
        return 0
    in_place = grad.dtype is torch.bfloat16 and grad.data_ptr() == weight.data_ptr()
    if (not in_place and _overlaps(grad, weight)) or any(_overlaps(t, weight) for t in others):
        raise ValueError("the bf16 weight may be the bf16 gradient itself (written in its place) and must not "
                         "overlap any other tensor of the step")
    return weight.numel()


def fused_step_compact_bf16_many(tensors: Sequence[tuple], coeffs: StepCoefficients, sr_key: int,
                                 num_threads: int | None = None) -> None:
    """The compact step in its bf16 weight form (the device-lean offload's) on each (master, grad,
    exp_avg, exp_avg_sq, delta, anchor, index_base, weight[, importance]) of `tensors`, in one kernel call: the
    same program as fused_step_compact_many, bit for bit in every stored state, and the new weight
    also stored in bf16 into `weight`, rounded to nearest even. A delta master keeps no fp32 weight
    (master None: theta* + delta is formed in registers); a parameter without theta* keeps its fp32
    master. `weight` may be the bf16 gradient itself: each element's gradient is read before its
    weight is written. Every tensor is checked before any is touched."""
    rows = []
    for row in tensors:
        (master, grad, exp_avg, exp_avg_sq, delta, anchor, index_base, weight), importance = split_importance(row, 8)
        if _check_compact_bf16_tensors(master, grad, exp_avg, exp_avg_sq, delta, anchor, weight, importance):
            rows.append((master, grad, exp_avg, exp_avg_sq, delta, anchor, index_base, weight, importance))
    _compact_kernel_call(rows, coeffs, sr_key, num_threads)


def guarded_step(
    param: torch.Tensor,
    grad: torch.Tensor,
    exp_avg: torch.Tensor,
    exp_avg_sq: torch.Tensor,
    anchor: torch.Tensor | None,
    coeffs: StepCoefficients,
    num_threads: int | None = None,
    *,
    importance: torch.Tensor | None = None,
) -> bool:
    """fused_step when every element of `grad` is finite (returns True); otherwise leaves every
    tensor untouched and returns False (a NaN or infinite step could never be undone)."""
    kernel = _require_kernel()
    buffers = _checked_buffers(param, grad, exp_avg, exp_avg_sq, anchor, importance)
    if buffers is None:
        return True
    return bool(kernel.guarded_step(*buffers[:5], _kernel_coefficients(coeffs), _threads(num_threads), buffers[5]))


def fused_inverse(
    param: torch.Tensor,
    grad: torch.Tensor,
    exp_avg: torch.Tensor,
    exp_avg_sq: torch.Tensor,
    anchor: torch.Tensor | None,
    coeffs: StepCoefficients,
    num_threads: int | None = None,
    *,
    importance: torch.Tensor | None = None,
) -> None:
    """Undoes fused_step(param, grad, ..., coeffs, importance=...) in place: the same gradient,
    coefficients and importance give back the parameter and moments within a few ulp
    (cpp/step_args.h); no saved copy. A step whose weighted pull reached theta* (some
    min(w * importance, 1) = 1) cannot be undone: ValueError."""
    kernel = _require_kernel()
    buffers = _checked_buffers(param, grad, exp_avg, exp_avg_sq, anchor, importance)
    if buffers is not None:
        kernel.fused_inverse(*buffers[:5], _kernel_coefficients(coeffs), _threads(num_threads), buffers[5])


def _buffer(t: torch.Tensor):
    """A 1-D numpy view sharing t's memory (bf16, which numpy lacks, as its int16 bit patterns)."""
    flat = t.detach().view(-1)
    if flat.dtype == torch.bfloat16:
        flat = flat.view(torch.int16)
    return flat.numpy()


@functools.lru_cache(maxsize=256)
def _kernel_coefficients(c: StepCoefficients):
    """The kernel's Coefficients for `c` (cached: a rule's coefficients repeat across tensors)."""
    k = _require_kernel().Coefficients()
    for name, value in kernel_values(c).items():
        setattr(k, name, value)
    return k


class CpuKernelProgram:
    """The C++ kernel as a step program (optim/programs.py): CPU fp32 parameters, every SIMD level
    storing the same bits."""

    name = "cpu"

    def unavailable(self) -> str | None:
        if _kernel is None:
            return (f"the C++ CPU optimizer kernel is not built (ft_framework._cpu_kernel failed to import: "
                    f"{_IMPORT_ERROR}); reinstall with `pip install -e .` on a machine with g++ and cmake, "
                    "or use impl='torch'")
        return None

    def refusal(self, param: torch.Tensor, automatic: bool) -> str | None:
        return check_param(param)

    def step(self, tensors: Sequence[tuple], coeffs: StepCoefficients, num_threads: int | None = None) -> None:
        fused_step_many(tensors, coeffs, num_threads=num_threads)

    def guarded_step(self, tensors: tuple, coeffs: StepCoefficients, num_threads: int | None = None) -> bool:
        row, importance = split_importance(tensors, 5)
        return guarded_step(*row, coeffs, num_threads=num_threads, importance=importance)

    def inverse(self, tensors: tuple, coeffs: StepCoefficients, num_threads: int | None = None) -> None:
        row, importance = split_importance(tensors, 5)
        fused_inverse(*row, coeffs, num_threads=num_threads, importance=importance)

    def step_compact(self, tensors: Sequence[tuple], coeffs: StepCoefficients, seed: int, step: int,
                     num_threads: int | None = None) -> None:
        fused_step_compact_many(tensors, coeffs, rounding_key(seed, step), num_threads=num_threads)

    def step_compact_bf16(self, tensors: Sequence[tuple], coeffs: StepCoefficients, seed: int, step: int,
                          num_threads: int | None = None) -> None:
        fused_step_compact_bf16_many(tensors, coeffs, rounding_key(seed, step), num_threads=num_threads)
