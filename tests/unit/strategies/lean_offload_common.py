"""The tiny BERT, its theta* and its batches, shared by tests/unit/strategies/test_offload_lean.py and the
DeepSpeed run it compares with (lean_offload_ds_worker.py)."""

import torch
from transformers import BertConfig, BertForSequenceClassification

STEPS = 20
BATCH = 8
SEQ = 16
VOCAB = 96
LR = 2e-3
HPARAMS = dict(anneal_fun="sigmoid", anneal_k=0.5, anneal_t0=5, pretrain_cof=50.0)


def make_model_and_anchors():
    """A tiny BERT classifier (fp32, as loaded) and its "pretrained" state: every weight but the
    classifier's, nudged away from the initial values so that the pull toward theta* does work."""
    torch.manual_seed(0)
    cfg = BertConfig(vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
                     intermediate_size=37, max_position_embeddings=64, hidden_dropout_prob=0.0,
                     attention_probs_dropout_prob=0.0)
    model = BertForSequenceClassification(cfg)
    # DeepSpeed makes its fp32 masters from the bf16 model (its first cast rounds the loaded fp32
    # weights); ours are the loaded fp32 weights. Weights that bf16 represents exactly start both
    # from the same masters.
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(p.bfloat16().float())
    gen = torch.Generator().manual_seed(1)
    anchors = {n: (p.detach() + 0.01 * torch.randn(p.shape, generator=gen)).clone()
               for n, p in model.named_parameters() if not n.startswith("classifier")}
    return model, anchors


def batch(step: int) -> dict:
    gen = torch.Generator().manual_seed(100 + step)
    return {"input_ids": torch.randint(1, VOCAB, (BATCH, SEQ), generator=gen),
            "attention_mask": torch.ones(BATCH, SEQ, dtype=torch.long),
            "labels": torch.randint(0, 2, (BATCH,), generator=gen)}


def make_optimizer(model, anchors, rule: str = "recadam", state_dtype: str = "float32"):
    from ft_framework.optim import build_optimizer
    from ft_framework.optim.groups import build_param_groups

    groups = build_param_groups(model, anchors, lr=LR, weight_decay=0.01, attach_anchors=False)
    extra = dict(state_dtype=state_dtype, anchor_dtype="bfloat16") if state_dtype != "float32" else {}
    return build_optimizer(rule, groups, impl="auto", **HPARAMS, **extra)


def train(strategy, steps: int = STEPS, accum: int = 1, max_grad_norm: float | None = None) -> list[float]:
    """As the trainer does: each micro-batch's loss divided by `accum`, clipped at `max_grad_norm`
    (None: not clipped); the gradient norms."""
    norms = []
    for step in range(steps):
        full = batch(step)
        for micro in range(accum):
            part = {k: v[micro::accum] for k, v in full.items()}
            loss = strategy.forward(part).loss
            strategy.backward(loss / accum if accum > 1 else loss, last_micro_batch=micro == accum - 1)
        norms.append(strategy.clip_and_step(max_grad_norm))
    return norms
