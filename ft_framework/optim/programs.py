"""The step programs: every implementation of the exact element program (cpp/step_body.h) behind
one interface, and the registry AnchoredOptimizer picks one from (its ``impl``).

AnchoredOptimizer owns the state and the rules (coefficients per group and step, compact numbering,
the undo copies); a program only runs the element program on tensors it is handed:

    cpu     the C++ SIMD kernel (optim/cpu.py)          CPU fp32 parameters
    triton  one Triton launch per bucket (triton_step)  CUDA parameters where triton imports
    torch   torch._foreach_* ops (optim/torch_step.py)  any device, any floating dtype

Every program stores the same bits for the same inputs, both states (the fp32 state and the
compact one, optim/compact.py). ``impl="auto"`` takes the first registered program that runs here
and takes every parameter automatically; the order below is that preference. A fourth program is
one module with a class of this protocol, listed in ``_BUILT_IN`` (or registered from anywhere with
`register_step_program`); nothing else changes.
"""

from __future__ import annotations

from typing import Protocol, Sequence

import torch

from ft_framework.optim.coefficients import StepCoefficients
from ft_framework.optim.cpu import CpuKernelProgram
from ft_framework.optim.torch_step import TorchProgram
from ft_framework.optim.triton_step import TritonProgram

# Every row ends with `importance`: the anchored tensor's per-element importance F~ (bf16, the
# optimizer state base.IMPORTANCE) or None. With it each pull's fraction w (pre_pull, post_pull) is
# min(fp32(w) * fp32(F~_i), 1) per element (cpp/step_args.h); None runs the unweighted program, the
# same bits at the same speed. A row may leave it off (coefficients.split_importance).
# (param, grad, exp_avg, exp_avg_sq, anchor or None, importance or None): one tensor's fp32-state step.
Fp32Tensors = tuple
# (param, grad, exp_avg, exp_avg_sq, delta or None, anchor or None, index_base, importance or None):
# one compact step.
CompactTensors = tuple
# (master or None, grad, exp_avg, exp_avg_sq, delta or None, anchor or None, index_base, weight,
# importance or None): one compact step in the bf16 weight form; master is None exactly where delta is.
CompactBf16Tensors = tuple


class StepProgram(Protocol):
    """One implementation of the element program. Tensors are rank-local (a DTensor's local shard),
    updated in place; every tensor of one call shares the coefficients `c`, device and param dtype."""

    name: str

    def unavailable(self) -> str | None:
        """Why this program cannot run on this machine (one line), or None when it can."""

    def refusal(self, param: torch.Tensor, automatic: bool) -> str | None:
        """Why this program cannot step `param` in place, or None; `automatic`: asked by
        impl="auto", which may be stricter (the Triton interpreter runs CPU tensors, auto never
        picks it for them)."""

    def step(self, tensors: Sequence[Fp32Tensors], c: StepCoefficients, num_threads: int | None = None) -> None:
        """One fp32-state step of each tensor, gradients known finite."""

    def guarded_step(self, tensors: Fp32Tensors, c: StepCoefficients, num_threads: int | None = None) -> bool:
        """One fp32-state step of one tensor when its gradient is finite (True); else untouched."""

    def inverse(self, tensors: Fp32Tensors, c: StepCoefficients, num_threads: int | None = None) -> None:
        """Undoes `step` of one tensor with the same gradient and coefficients (cpp/step_args.h)."""

    def step_compact(self, tensors: Sequence[CompactTensors], c: StepCoefficients, seed: int, step: int,
                     num_threads: int | None = None) -> None:
        """One compact-state step of each tensor; v's stochastic rounding keyed on (seed, step,
        index_base + element) (optim/compact.py)."""

    def step_compact_bf16(self, tensors: Sequence[CompactBf16Tensors], c: StepCoefficients, seed: int, step: int,
                          num_threads: int | None = None) -> None:
        """step_compact in the bf16 weight form (the device-lean offload's, cpp/step_args.h): the same
        stored state, bit for bit, and each new weight also written in bf16 (rounded to nearest
        even) into `weight`, which may be the bf16 gradient itself; a delta master keeps no fp32
        weight (master None: theta* + delta is formed in registers, never stored in fp32)."""


# In the order impl="auto" prefers them.
_BUILT_IN: tuple[StepProgram, ...] = (CpuKernelProgram(), TritonProgram(), TorchProgram())
_PROGRAMS: dict[str, StepProgram] = {program.name: program for program in _BUILT_IN}


def register_step_program(program: StepProgram, *, replace: bool = False) -> None:
    """Adds a program under `program.name` (last in auto's preference)."""
    if program.name == "auto" or (program.name in _PROGRAMS and not replace):
        raise ValueError(f"step program {program.name!r} is already registered (pass replace=True to override)")
    _PROGRAMS[program.name] = program


def impl_names() -> tuple[str, ...]:
    """The valid values of an optimizer's ``impl``."""
    return ("auto", *_PROGRAMS)


def step_program(name: str) -> StepProgram:
    if name not in _PROGRAMS:
        raise ValueError(f"unknown impl {name!r}; valid: {', '.join(impl_names())}")
    return _PROGRAMS[name]


def resolve_impl(requested: str, params: Sequence[torch.Tensor]) -> str:
    """The program that steps `params` (rank-local tensors): the requested one, which must take
    every parameter, or for "auto" the first that runs here and takes them all ("auto" again while
    there are no parameters: ZeRO-3 fills its groups only inside step())."""
    if requested != "auto":
        program = step_program(requested)
        if (why := program.unavailable()) is not None:
            raise RuntimeError(why)
        problems = [msg for p in params if (msg := program.refusal(p, automatic=False))]
        if problems:
            raise TypeError(f"impl={requested!r} cannot take these parameters: {problems[0]} "
                            f"({len(problems)} parameter(s) affected); use impl='torch' or 'auto'")
        return requested
    if not params:
        return "auto"
    for name, program in _PROGRAMS.items():
        if program.unavailable() is None and not any(program.refusal(p, automatic=True) for p in params):
            return name
    raise RuntimeError("no step program takes these parameters")  # torch takes any: unreachable
