"""The shared element program every optimizer rule is expressed in.

Each update rule (AdamW, BERTAdam, RecAdam, prior_wd) reduces, for one tensor at one step, to
these coefficients (see cpp/step_args.h for the program). The C++ kernel and the torch
multi-tensor path both execute the same program, so the rule-specific math (bias correction,
lambda(t)) lives in one place.
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Any


@dataclass(frozen=True)
class StepCoefficients:
    beta1: float
    beta2: float
    eps: float
    step_size: float         # p -= step_size * m / (sqrt(v) * denom_scale + eps)
    denom_scale: float = 1.0
    pre_decay: float = 0.0   # p -= pre_decay * p, first (a rate, not 1 - rate: see cpp/step_args.h)
    pre_pull: float = 0.0    # p -= pre_pull * (p - anchor), before the Adam step
    post_pull: float = 0.0   # p -= post_pull * (p - anchor), after the Adam step
    post_decay: float = 0.0  # p -= post_decay * p, last

    @property
    def uses_anchor(self) -> bool:
        return self.pre_pull != 0.0 or self.post_pull != 0.0


# The kernel's struct (cpp/step_args.h StepCoeffs) carries 1 - beta as well, rounded once from double
# by the caller: 1.0f - fp32(0.999) would be off by 1.3e-5.
_DERIVED = {
    "one_minus_beta1": lambda c: 1.0 - c.beta1,
    "one_minus_beta2": lambda c: 1.0 - c.beta2,
}
# The struct's fields in its order: the one list the binding (cpp/bindings.cpp), the Python side
# (optim/cpu.py) and tests/unit/optim/test_kernel_fields.py, which parses the C++ sources, agree on.
KERNEL_FIELDS = (
    "beta1", "beta2", "eps", "one_minus_beta1", "one_minus_beta2", "denom_scale", "step_size",
    "pre_decay", "pre_pull", "post_pull", "post_decay",
)


def kernel_values(c: StepCoefficients) -> dict[str, float]:
    """Every field of the kernel's StepCoeffs for `c`, in the struct's order."""
    own = {f.name: getattr(c, f.name) for f in fields(c)}
    return {name: _DERIVED[name](c) if name in _DERIVED else own[name] for name in KERNEL_FIELDS}


def split_importance(row: tuple, width: int) -> tuple[tuple, Any]:
    """A step program's tensor row (optim/programs.py) as its first `width` tensors and its
    per-element importance F~, the row's optional last element (None where the row leaves it off).

    With F~ (an anchored tensor's, bf16) each pull's fraction w (pre_pull, post_pull) is per element
    min(fp32(w) * fp32(F~_i), 1) in every program (cpp/step_args.h); the decays never read it."""
    if len(row) not in (width, width + 1):
        raise ValueError(f"a step row holds {width} tensors and an optional importance, got {len(row)} entries")
    return tuple(row[:width]), (row[width] if len(row) > width else None)
