"""Child-Tuning-D against an independent float64 reference: the Fisher over the same batches, the
global top-k mask by sorting, then AdamW steps with masked gradients, written with plain torch
float64 ops from the paper's definitions (not our code), element by element."""

from __future__ import annotations

import math

import pytest
import torch
from transformers import BertConfig, BertForSequenceClassification

from ft_framework.optim import build_optimizer
from ft_framework.optim.base import CHILD_MASK
from ft_framework.optim.child_tuning import run_fisher_pass, select_child
from ft_framework.optim.cpu import kernel_available
from ft_framework.optim.groups import build_param_groups
from ft_framework.strategies.single import SingleDeviceStrategy

# intermediate_size 37: awkward tensor sizes, 13,578 candidate elements (k = ceil(0.3 N) = 4,074).
CONFIG = dict(vocab_size=61, hidden_size=32, num_hidden_layers=2, num_attention_heads=2, intermediate_size=37,
              max_position_embeddings=32, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)
LR, WD, EPS, BETAS, RESERVE_P = 2e-3, 0.1, 1e-8, (0.9, 0.999), 0.3
FISHER_BATCHES, TRAIN_STEPS = 3, 3


def batches(n: int, seed: int) -> list[dict[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    return [{"input_ids": torch.randint(0, CONFIG["vocab_size"], (6, 11), generator=g),
             "attention_mask": torch.ones(6, 11, dtype=torch.long),
             "labels": torch.randint(0, 2, (6,), generator=g)} for _ in range(n)]


def fresh_model(dtype: torch.dtype) -> BertForSequenceClassification:
    torch.manual_seed(5)
    return BertForSequenceClassification(BertConfig(**CONFIG)).to(dtype)


def reference(fisher_data, train_data):
    """Float64 Child-Tuning-D as the authors define it: candidates are the parameters whose name
    contains 'layer' (the encoder blocks); AdamW (torch.optim.AdamW's rule) on g * M, weight decay
    on all but biases and LayerNorm weights."""
    model = fresh_model(torch.float64)
    params = dict(model.named_parameters())
    candidates = [n for n in params if "layer" in n]
    fisher = {n: torch.zeros_like(params[n]) for n in candidates}
    for batch in fisher_data:
        model.zero_grad()
        model(**batch).loss.backward()
        for n in candidates:
            fisher[n] += params[n].grad ** 2
    flat = torch.cat([fisher[n].reshape(-1) for n in candidates])
    k = math.ceil(RESERVE_P * flat.numel())
    tau = torch.sort(flat, descending=True).values[k - 1]
    masks = {n: fisher[n] >= tau for n in candidates}
    m = {n: torch.zeros_like(p) for n, p in params.items()}
    v = {n: torch.zeros_like(p) for n, p in params.items()}
    for t, batch in enumerate(train_data, start=1):
        model.zero_grad()
        model(**batch).loss.backward()
        with torch.no_grad():
            for n, p in params.items():
                g = p.grad * masks[n] if n in masks else p.grad
                wd = 0.0 if n.endswith("bias") or "LayerNorm" in n else WD
                p.mul_(1 - LR * wd)
                m[n] = BETAS[0] * m[n] + (1 - BETAS[0]) * g
                v[n] = BETAS[1] * v[n] + (1 - BETAS[1]) * g * g
                denom = (v[n] / (1 - BETAS[1] ** t)).sqrt() + EPS
                p.sub_(LR / (1 - BETAS[0] ** t) * m[n] / denom)
    return {n: p.detach().clone() for n, p in params.items()}, masks, k


def ours(fisher_data, train_data, impl: str, dtype: torch.dtype):
    model = fresh_model(dtype)
    initial = {n: p.detach().clone() for n, p in model.named_parameters()}
    pretrained = {n: p for n, p in initial.items() if not n.startswith("classifier")}
    strategy = SingleDeviceStrategy(device="cpu")

    def make_optimizer(m):
        groups = build_param_groups(m, pretrained, lr=LR, weight_decay=WD, attach_anchors=False, child_tuning=True)
        return build_optimizer("adamw", groups, impl=impl, betas=BETAS, eps=EPS)

    model, optimizer = strategy.setup(model, make_optimizer, anchors=pretrained)

    def fisher_step(batch):
        strategy.backward(strategy.forward(batch).loss)
        strategy.step_unclipped()

    fisher_pass = run_fisher_pass(optimizer, fisher_data, fisher_step)
    numel_of = {n: p.numel() for n, p in model.named_parameters()}
    result = select_child(fisher_pass, RESERVE_P, numel_of, partitioned=False)
    assert all("step" not in optimizer.state[p] for p in model.parameters()), "the Fisher pass took a step"
    for batch in train_data:
        strategy.backward(strategy.forward(batch).loss)
        strategy.clip_and_step(None)
    named = dict(model.named_parameters())
    masks = {n: optimizer.state[p][CHILD_MASK] for n, p in named.items() if CHILD_MASK in optimizer.state[p]}
    return {n: p.detach().clone() for n, p in named.items()}, masks, result, initial


IMPLS = [("torch", torch.float64, 1e-12, 1e-10),
         pytest.param("cpu", torch.float32, 1e-4, 3e-6,
                      marks=pytest.mark.skipif(not kernel_available(), reason="C++ kernel not built"))]


@pytest.mark.parametrize("impl,dtype,rtol,atol", IMPLS)
def test_child_tuning_matches_float64_reference(impl, dtype, rtol, atol):
    fisher_data, train_data = batches(FISHER_BATCHES, seed=11), batches(TRAIN_STEPS, seed=12)
    want, want_masks, k = reference(fisher_data, train_data)
    got, got_masks, result, initial = ours(fisher_data, train_data, impl, dtype)
    assert sorted(got_masks) == sorted(want_masks)  # groups.py's candidates are the authors' 'layer' parameters
    for name, mask in want_masks.items():
        assert torch.equal(got_masks[name], mask), name
    assert result.candidate_elements == sum(m.numel() for m in want_masks.values()) == 13578
    assert result.kept_elements == sum(int(m.sum()) for m in want_masks.values()) == k == 4074
    assert result.fisher_batches == FISHER_BATCHES
    for name, value in want.items():
        torch.testing.assert_close(got[name].double(), value, rtol=rtol, atol=atol, msg=name)
    # Masked-out candidate elements move only by weight decay (which, as in the authors' code,
    # applies to every element of a decayed parameter).
    for name, mask in got_masks.items():
        wd = 0.0 if name.endswith("bias") or "LayerNorm" in name else WD
        frozen = ~mask
        expected = initial[name][frozen].double() * (1 - LR * wd) ** TRAIN_STEPS
        torch.testing.assert_close(got[name][frozen].double(), expected, rtol=1e-6 if dtype == torch.float32 else 1e-14,
                                   atol=0.0, msg=name)


def test_ties_at_the_threshold_are_all_kept():
    """k = ceil(p N) of 10 equal Fisher values still keeps all 10 (F >= tau)."""
    model = torch.nn.Module()
    model.layer = torch.nn.ModuleList([torch.nn.Linear(5, 2, bias=False)])
    pretrained = {n: p.detach().clone() for n, p in model.named_parameters()}
    groups = build_param_groups(model, pretrained, lr=1e-3, child_tuning=True)
    optimizer = build_optimizer("adamw", groups, impl="torch")
    fisher_pass = run_fisher_pass(optimizer, [None], lambda _: (
        setattr(model.layer[0].weight, "grad", torch.full((2, 5), 0.5)), optimizer.step()))
    result = select_child(fisher_pass, 0.25, {"layer.0.weight": 10}, partitioned=False)
    assert (result.candidate_elements, result.kept_elements, result.threshold) == (10, 10, 0.25)
    assert bool(optimizer.state[model.layer[0].weight][CHILD_MASK].all())


def test_a_pass_whose_steps_saw_no_gradient_is_an_error():
    """A strategy stepping outside optimizer.step() would leave F empty: refused, not 'keep all'."""
    model = torch.nn.Module()
    model.layer = torch.nn.ModuleList([torch.nn.Linear(3, 3)])
    pretrained = {n: p.detach().clone() for n, p in model.named_parameters()}
    optimizer = build_optimizer("adamw", build_param_groups(model, pretrained, lr=1e-3, child_tuning=True),
                                impl="torch")
    fisher_pass = run_fisher_pass(optimizer, [None, None], lambda _: None)
    with pytest.raises(ValueError, match="saw no gradient"):
        select_child(fisher_pass, 0.3, {"layer.0.weight": 9, "layer.0.bias": 3}, partitioned=False)
