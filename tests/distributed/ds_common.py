"""Model, data and configs shared by the DeepSpeed worker (ranks) and its test (reference)."""

import torch
from transformers import AlbertConfig, AlbertForSequenceClassification

from ft_framework.config import DeepSpeedConfig, TrainingConfig

CASES = ("zero1", "zero2", "zero2_offload", "zero3", "zero3_offload")
# Activation checkpointing against the same run without it (dropout and Mixout on).
CHECKPOINTING_CASES = ("zero2", "zero3")
# Two micro-batches per optimizer step: the same global batches, so the same result as one process.
ACCUM_CASES = ("zero1_accum", "zero2_offload_accum", "zero3_accum")
ACCUM = 2
GLOBAL_BATCH = 8
SEQ = 12
LR = 1e-3  # in the param groups (build_param_groups), not again as an optimizer keyword
HPARAMS = dict(anneal_k=0.5, anneal_t0=3, pretrain_cof=10.0)


def make_model_and_anchors(dropout: float = 0.0):
    """A tiny ALBERT and its "pretrained" state: every weight but the classifier, nudged away
    from the initial values so the pull toward theta* does real work."""
    torch.manual_seed(0)
    cfg = AlbertConfig(vocab_size=100, embedding_size=16, hidden_size=32, num_hidden_layers=2,
                       num_attention_heads=2, intermediate_size=37, hidden_dropout_prob=dropout,
                       attention_probs_dropout_prob=dropout, classifier_dropout_prob=dropout)
    model = AlbertForSequenceClassification(cfg)
    gen = torch.Generator().manual_seed(1)
    anchors = {n: (p.detach() + 0.01 * torch.randn(p.shape, generator=gen)).clone()
               for n, p in model.named_parameters() if not n.startswith("classifier")}
    return model, anchors


def global_batch(step: int) -> dict:
    gen = torch.Generator().manual_seed(100 + step)
    return {"input_ids": torch.randint(0, 100, (GLOBAL_BATCH, SEQ), generator=gen),
            "attention_mask": torch.ones(GLOBAL_BATCH, SEQ, dtype=torch.long),
            "labels": torch.randint(0, 2, (GLOBAL_BATCH,), generator=gen)}


def batches_for_rank(step: int, rank: int, world: int) -> dict:
    return {k: v[rank::world] for k, v in global_batch(step).items()}


def accumulation(case: str) -> int:
    return ACCUM if case.endswith("_accum") else 1


def ds_configs(case: str, world_size: int):
    stage = int(case[4])
    offload = "offload" in case
    accum = accumulation(case)
    ds = DeepSpeedConfig(zero_stage=stage, offload_optimizer=offload, offload_param=offload and stage == 3)
    training = TrainingConfig(max_steps=5, per_device_batch_size=GLOBAL_BATCH // world_size // accum,
                              gradient_accumulation_steps=accum, device="cpu", max_grad_norm=None)
    return ds, training
