"""Independent float64 reference of the update rules (docs/optimizers.md), written rule by rule
from their formulas (deliberately not through ft_framework's StepCoefficients program)."""

from __future__ import annotations

import math

import torch


def ref_lambda(fun, t, k, t0, w):
    if fun == "sigmoid":
        if t == t0 or k == 0:
            return w / 2
        if math.isinf(k):
            return w if t > t0 else 0.0
        z = -k * (t - t0)
        return w / (1 + math.exp(z)) if z < 700 else 0.0
    if fun == "linear":
        return w * min(1.0, t / t0)
    return w


DEFAULTS = {
    "adamw": dict(lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=1e-2),
    "bertadam": dict(lr=1e-3, betas=(0.9, 0.999), eps=1e-6, weight_decay=0.0, correct_bias=False),
    "recadam": dict(lr=1e-3, betas=(0.9, 0.999), eps=1e-6, weight_decay=0.0, correct_bias=True,
                    anneal_fun="sigmoid", anneal_k=0.0, anneal_t0=0.0, anneal_w=1.0, pretrain_cof=5000.0),
    "prior_wd": dict(lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=1e-2),
}


class Reference:
    """One parameter tensor in float64, stepped by the spec's rule for `rule`."""

    def __init__(self, rule: str, theta: torch.Tensor, anchor: torch.Tensor | None, **hp):
        self.rule = rule
        self.hp = {**DEFAULTS[rule], **hp}
        self.theta = theta.double().clone()
        self.anchor = None if anchor is None else anchor.double().clone()
        self.m = torch.zeros_like(self.theta)
        self.v = torch.zeros_like(self.theta)
        self.t = 0

    def step(self, g: torch.Tensor, lr: float | None = None):
        hp = self.hp
        lr = hp["lr"] if lr is None else lr
        b1, b2 = hp["betas"]
        eps, wd = hp["eps"], hp["weight_decay"]
        g = g.double()
        self.t += 1
        t = self.t
        self.m = b1 * self.m + (1 - b1) * g
        self.v = b2 * self.v + (1 - b2) * g * g
        th = self.theta
        if self.rule == "adamw":
            th = th * (1 - lr * wd)
            th = th - (lr / (1 - b1**t)) * self.m / (self.v.sqrt() / math.sqrt(1 - b2**t) + eps)
        elif self.rule == "bertadam":
            denom = self.v.sqrt() + eps
            s = lr * math.sqrt(1 - b2**t) / (1 - b1**t) if hp["correct_bias"] else lr
            th = th - s * self.m / denom
            th = th - lr * wd * th
        elif self.rule == "recadam":
            denom = self.v.sqrt() + eps
            s = lr * math.sqrt(1 - b2**t) / (1 - b1**t) if hp["correct_bias"] else lr
            w = hp["anneal_w"]
            if self.anchor is not None and w > 0:
                lam = ref_lambda(hp["anneal_fun"], t, hp["anneal_k"], hp["anneal_t0"], w)
                th = th - s * lam * self.m / denom
                th = th - lr * (w - lam) * hp["pretrain_cof"] * (th - self.anchor)
            else:
                th = th - s * self.m / denom
            if wd > 0:
                th = th - lr * wd * th
        elif self.rule == "prior_wd":
            if self.anchor is not None:
                th = th - lr * wd * (th - self.anchor)
            else:
                th = th - lr * wd * th
            th = th - (lr / (1 - b1**t)) * self.m / (self.v.sqrt() / math.sqrt(1 - b2**t) + eps)
        else:
            raise ValueError(self.rule)
        self.theta = th


def assert_close_to_reference(actual: torch.Tensor, ref: torch.Tensor, rel_to_scale: float = 2e-6):
    """Element-wise: |actual - ref| <= rel_to_scale * max|ref| (the issue's numerics target)."""
    scale = max(ref.abs().max().item(), 1e-30)
    torch.testing.assert_close(actual.double(), ref, rtol=0.0, atol=rel_to_scale * scale)
