"""A RecAdam written in the style of the authors' release, for benchmarking only.

Written here from the rule in docs/optimizers.md (not copied from github Sanyuan-Chen/RecAdam); it
reproduces the *structure* of their optimizer, which is what the benchmark measures:

- a plain ``torch.optim.Optimizer`` that loops over the parameters one tensor at a time;
- the pretrained tensors live in the param groups (``group["pretrain_params"]``, aligned with
  ``group["params"]``), not in optimizer state;
- each step is several separate full passes over memory, each allocating or re-reading tensors:

      exp_avg.mul_(b1).add_(g, alpha=1 - b1)
      exp_avg_sq.mul_(b2).addcmul_(g, g, value=1 - b2)
      denom = exp_avg_sq.sqrt().add_(eps)                       # a new tensor
      p.addcdiv_(exp_avg, denom, value=-step_size * lambda)
      p.add_(p - pp, alpha=-lr * (w - lambda) * gamma)          # another new tensor
      p.add_(p, alpha=-lr * weight_decay)                       # only when weight_decay > 0

``python benchmarks/authors_style_recadam.py`` checks that it gives the same numbers as
``ft_framework``'s RecAdam (impl "cpu" and "torch") after a few steps.
"""

from __future__ import annotations

import math

import torch


def _anneal(fun: str, t: int, k: float, t0: float, w: float) -> float:
    """lambda(t) of the spec: sigmoid / linear / constant."""
    if fun == "sigmoid":
        x = k * (t - t0)
        if x >= 0:
            return w / (1.0 + math.exp(-x))
        e = math.exp(x)
        return w * e / (1.0 + e)
    if fun == "linear":
        return w * min(1.0, t / t0)
    if fun == "constant":
        return w
    raise ValueError(f"unknown anneal_fun {fun!r}; valid: sigmoid, linear, constant")


class AuthorsStyleRecAdam(torch.optim.Optimizer):
    """Multi-pass, per-tensor RecAdam; pretrained tensors held in ``group["pretrain_params"]``.

    A group without ``pretrain_params`` (or with ``anneal_w == 0``) is plain Adam (the head).
    """

    def __init__(self, params, lr=1e-3, betas=(0.9, 0.999), eps=1e-6, weight_decay=0.0,
                 correct_bias=True, anneal_fun="sigmoid", anneal_k=0.0, anneal_t0=0.0,
                 anneal_w=1.0, pretrain_cof=5000.0):
        defaults = dict(lr=lr, betas=betas, eps=eps, weight_decay=weight_decay,
                        correct_bias=correct_bias, anneal_fun=anneal_fun, anneal_k=anneal_k,
                        anneal_t0=anneal_t0, anneal_w=anneal_w, pretrain_cof=pretrain_cof)
        super().__init__(params, defaults)

    @torch.no_grad()
    def step(self, closure=None):
        loss = closure() if closure is not None else None
        for group in self.param_groups:
            pretrained = group.get("pretrain_params")
            b1, b2 = group["betas"]
            lr, w, gamma = group["lr"], group["anneal_w"], group["pretrain_cof"]
            for i, p in enumerate(group["params"]):
                if p.grad is None:
                    continue
                grad = p.grad
                state = self.state[p]
                if not state:
                    state["step"] = 0
                    state["exp_avg"] = torch.zeros_like(p)
                    state["exp_avg_sq"] = torch.zeros_like(p)
                exp_avg, exp_avg_sq = state["exp_avg"], state["exp_avg_sq"]
                state["step"] += 1
                t = state["step"]

                exp_avg.mul_(b1).add_(grad, alpha=1.0 - b1)
                exp_avg_sq.mul_(b2).addcmul_(grad, grad, value=1.0 - b2)
                denom = exp_avg_sq.sqrt().add_(group["eps"])

                step_size = lr
                if group["correct_bias"]:
                    step_size = lr * math.sqrt(1.0 - b2 ** t) / (1.0 - b1 ** t)

                pp = pretrained[i] if pretrained is not None else None
                if pp is not None and w > 0:
                    lam = _anneal(group["anneal_fun"], t, group["anneal_k"], group["anneal_t0"], w)
                    p.addcdiv_(exp_avg, denom, value=-step_size * lam)
                    p.add_(p - pp, alpha=-lr * (w - lam) * gamma)
                else:
                    p.addcdiv_(exp_avg, denom, value=-step_size)

                if group["weight_decay"] > 0.0:
                    p.add_(p, alpha=-lr * group["weight_decay"])
        return loss


def check_against_ours(steps: int = 8, n: int = 4099, seed: int = 0, verbose: bool = False) -> dict:
    """Runs the authors-style optimizer and ft_framework's RecAdam (cpu and torch impls) side by side.

    Two anchored groups (sigmoid with lambda moving through t0, linear with weight decay) and one
    head group without anchors; a fresh random gradient every step. Returns the largest relative
    element difference of the parameters, exp_avg and exp_avg_sq per implementation (the
    denominator is floored at 1 % of the tensor's RMS).
    """
    from ft_framework.optim import build_optimizer
    from ft_framework.optim import cpu as cpu_kernel

    gen = torch.Generator().manual_seed(seed)
    shapes = [(n,), (n // 2 + 3,), (257,)]
    theta_star = [torch.randn(s, generator=gen) for s in shapes]
    start = [a + 1e-2 * torch.randn(a.shape, generator=gen) for a in theta_star]
    grads = [[torch.randn(s, generator=gen) * 1e-2 for s in shapes] for _ in range(steps)]
    common = dict(lr=2e-4, betas=(0.9, 0.999), eps=1e-6, pretrain_cof=500.0, anneal_w=1.0)
    settings = [
        dict(anneal_fun="sigmoid", anneal_k=0.5, anneal_t0=float(steps // 2), weight_decay=0.0),
        dict(anneal_fun="linear", anneal_k=0.0, anneal_t0=float(steps), weight_decay=0.01),
        dict(anneal_fun="sigmoid", anneal_k=0.5, anneal_t0=float(steps // 2), weight_decay=0.01),
    ]

    def run(make):
        params = [torch.nn.Parameter(s.clone()) for s in start]
        opt = make(params)
        for g in grads:
            for p, gi in zip(params, g):
                p.grad = gi.clone()
            opt.step()
        return params, opt

    def make_authors(params):
        groups = [{"params": [params[0]], "pretrain_params": [theta_star[0]], **settings[0]},
                  {"params": [params[1]], "pretrain_params": [theta_star[1]], **settings[1]},
                  {"params": [params[2]], **settings[2], "anneal_w": 0.0}]   # the head: plain Adam
        return AuthorsStyleRecAdam(groups, **common)

    def make_ours(impl):
        def make(params):
            groups = [{"params": [params[0]], "anchors": [theta_star[0]], **settings[0]},
                      {"params": [params[1]], "anchors": [theta_star[1]], **settings[1]},
                      {"params": [params[2]], **settings[2]}]                # no anchor: plain Adam
            return build_optimizer("recadam", groups, impl=impl, **common)
        return make

    ref_params, ref_opt = run(make_authors)
    impls = ["torch"] + (["cpu"] if cpu_kernel.kernel_available() else [])
    out = {}
    for impl in impls:
        params, opt = run(make_ours(impl))
        worst = {"param": 0.0, "exp_avg": 0.0, "exp_avg_sq": 0.0}
        for p, q in zip(params, ref_params):
            pairs = {"param": (p.detach(), q.detach()),
                     "exp_avg": (opt.state[p]["exp_avg"], ref_opt.state[q]["exp_avg"]),
                     "exp_avg_sq": (opt.state[p]["exp_avg_sq"], ref_opt.state[q]["exp_avg_sq"])}
            for key, (a, b) in pairs.items():
                a, b = a.double(), b.double()
                # Relative per element; the floor (1 % of the tensor's RMS) keeps elements that
                # cancel to ~0 (exp_avg changes sign) from dividing by almost nothing.
                floor = 1e-2 * b.square().mean().sqrt().clamp_min(1e-30)
                rel = ((a - b).abs() / torch.maximum(b.abs(), floor)).max().item()
                worst[key] = max(worst[key], rel)
        # How far the parameters moved, to show the check is not vacuous.
        moved = max((p.detach() - s).abs().max().item() for p, s in zip(params, start))
        worst["max_param_change"] = moved
        out[impl] = worst
        if verbose:
            print(f"authors-style vs ours impl={impl}: max relative difference after {steps} steps: "
                  + ", ".join(f"{k} {v:.2e}" for k, v in worst.items()))
    return out


if __name__ == "__main__":
    res = check_against_ours(verbose=True)
    bad = {impl: r for impl, r in res.items() if r["param"] > 1e-5}
    if bad:
        raise SystemExit(f"authors-style RecAdam differs from ours by more than 1e-5: {bad}")
    print("OK: same numbers to <= 1e-5 (relative, per element)")
