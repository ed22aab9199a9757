"""The shared element program every optimizer rule is expressed in.

Each update rule (AdamW, BERTAdam, RecAdam, prior_wd) reduces, for one tensor at one step, to
these coefficients (see cpp/step_args.h for the program). The C++ kernel and the torch
multi-tensor path both execute the same program, so the rule-specific math (bias correction,
lambda(t)) lives in one place.
"""

from __future__ import annotations

from dataclasses import dataclass


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
