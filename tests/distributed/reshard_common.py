"""Model, data and the one-process reference shared by reshard_worker.py (the ranks) and
test_checkpoint_reshard.py (the checks)."""

from __future__ import annotations

import torch

STEPS = 5
RESUME_AT = 3
GLOBAL_BATCH = 8
SEQ = 12
LR = 1e-3  # in the param groups (build_param_groups), not again as an optimizer keyword
HPARAMS = dict(anneal_k=0.5, anneal_t0=3, pretrain_cof=10.0)


def make_model_and_anchors(mode: str):
    """A tiny ALBERT and theta* (every weight but the classifier head).

    PI: the model starts at theta* (pretrained initialization). RI: theta* are the "pretrained"
    values but the model is re-initialized (random initialization), so the pull does real work
    from the first step."""
    from transformers import AlbertConfig, AlbertForSequenceClassification

    cfg = AlbertConfig(vocab_size=100, embedding_size=16, hidden_size=32, num_hidden_layers=2,
                       num_attention_heads=2, intermediate_size=37, hidden_dropout_prob=0.0,
                       attention_probs_dropout_prob=0.0, classifier_dropout_prob=0.0)
    torch.manual_seed(0)
    model = AlbertForSequenceClassification(cfg)
    anchors = {n: p.detach().clone() for n, p in model.named_parameters() if not n.startswith("classifier")}
    if mode == "RI":
        gen = torch.Generator().manual_seed(1)
        with torch.no_grad():
            for n, p in model.named_parameters():
                if n in anchors:
                    p.copy_(0.02 * torch.randn(p.shape, generator=gen))
    elif mode != "PI":
        raise ValueError(mode)
    return model, anchors


def global_batch(step: int) -> dict:
    gen = torch.Generator().manual_seed(100 + step)
    return {"input_ids": torch.randint(0, 100, (GLOBAL_BATCH, SEQ), generator=gen),
            "attention_mask": torch.ones(GLOBAL_BATCH, SEQ, dtype=torch.long),
            "labels": torch.randint(0, 2, (GLOBAL_BATCH,), generator=gen)}


def batch_for_rank(step: int, rank: int, world: int) -> dict:
    """Rank r's contiguous 1/world of the global batch: the mean gradient is the global one."""
    n = GLOBAL_BATCH // world
    return {k: v[rank * n:(rank + 1) * n] for k, v in global_batch(step).items()}


def reference(mode: str) -> dict:
    """The one-process run: optimizer state at RESUME_AT and parameters at STEPS, by name."""
    from ft_framework.optim import build_optimizer
    from ft_framework.optim.groups import build_param_groups

    model, anchors = make_model_and_anchors(mode)
    opt = build_optimizer("recadam", build_param_groups(model, anchors, lr=LR, weight_decay=0.01),
                          impl="torch", **HPARAMS)
    out = {"anchors": anchors}
    for step in range(STEPS):
        model(**global_batch(step)).loss.backward()
        opt.step()
        opt.zero_grad()
        if step + 1 == RESUME_AT:
            out["state"] = {n: {"master": p.detach().clone(),
                                **{k: v.clone() for k, v in opt.state[p].items()}}
                            for n, p in model.named_parameters()}
    out["params"] = {n: p.detach().clone() for n, p in model.named_parameters()}
    return out
