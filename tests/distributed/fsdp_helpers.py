"""Shared by the FSDP worker (run under torchrun) and its pytest side: the tiny ALBERT, its
"pretrained" state, the synthetic batches and the optimizer settings."""

from __future__ import annotations

import torch

STEPS = 5            # optimizer steps of a full run
RESUME_AT = 3        # step after which checkpoints are written
GLOBAL_BATCH = 8
SEQ_LEN = 12
VOCAB = 100
MAX_GRAD_NORM = 0.5  # small enough that some steps are clipped
LR = 1e-3  # in the param groups (build_param_groups), not again as an optimizer keyword
HPARAMS = dict(pretrain_cof=10.0, anneal_k=0.5, anneal_t0=3)


def tiny_albert(dropout: float = 0.0):
    """Identical on every rank (seeded): AlbertForSequenceClassification, no dropout by default."""
    from transformers import AlbertConfig, AlbertForSequenceClassification

    cfg = AlbertConfig(vocab_size=VOCAB, embedding_size=16, hidden_size=32, num_hidden_layers=2,
                       num_attention_heads=2, intermediate_size=37, hidden_dropout_prob=dropout,
                       attention_probs_dropout_prob=dropout, classifier_dropout_prob=dropout)
    torch.manual_seed(0)
    return AlbertForSequenceClassification(cfg)


def pretrained_state(model) -> dict[str, torch.Tensor]:
    """theta*: the model's own initial weights for everything but the (new) classifier head."""
    return {n: p.detach().clone().float() for n, p in model.named_parameters()
            if not n.startswith("classifier.")}


def global_batches() -> list[dict[str, torch.Tensor]]:
    gen = torch.Generator().manual_seed(1234)
    out = []
    for _ in range(STEPS):
        ids = torch.randint(0, VOCAB, (GLOBAL_BATCH, SEQ_LEN), generator=gen)
        out.append({"input_ids": ids, "attention_mask": torch.ones_like(ids),
                    "labels": torch.randint(0, 2, (GLOBAL_BATCH,), generator=gen)})
    return out


def rank_slice(batch: dict[str, torch.Tensor], rank: int, world: int) -> dict[str, torch.Tensor]:
    """Rank r's contiguous 1/world of a global batch (equal halves: the mean gradient is the same)."""
    n = GLOBAL_BATCH // world
    return {k: v[rank * n:(rank + 1) * n] for k, v in batch.items()}


def make_optimizer_builder(pretrained: dict[str, torch.Tensor], **kw):
    """Groups split into anchored and new parameters, without theta*: the strategy places it
    (setup(..., anchors=pretrained)) after wrapping."""
    from ft_framework.optim import build_optimizer
    from ft_framework.optim.groups import build_param_groups

    def build(model):
        groups = build_param_groups(model, pretrained, lr=LR, attach_anchors=False)
        return build_optimizer("recadam", groups, **{**HPARAMS, **kw})

    return build
