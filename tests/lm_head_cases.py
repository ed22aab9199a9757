"""The LM head's test cases: a tiny decoder with weights large enough that its distributions are
far from uniform, and a batch whose label tokens cover the awkward cases (a prompt, padding, a row
with one label token). Shared by the head's loss tests (test_lm_head_requests.py) and the KL
anchor's (test_kl_anchor.py).

    model = random_tiny_lm("llama"); ids, labels, mask = label_batch(model.config.vocab_size)
"""

from __future__ import annotations

import torch

from tiny_llm import build_tiny_tokenizer, tiny_llm_config


def random_tiny_lm(model_type: str = "llama"):
    """The tiny `model_type` decoder, seeded, its matrices drawn from N(0, 0.2²), eager attention."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(3)
    model = AutoModelForCausalLM.from_config(tiny_llm_config(model_type, build_tiny_tokenizer()),
                                             attn_implementation="eager")
    with torch.no_grad():
        for param in model.parameters():
            if param.dim() >= 2:
                param.normal_(0.0, 0.2)
    return model


def label_batch(vocab: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(input ids, labels, attention mask) of 3 rows of 13 tokens."""
    g = torch.Generator().manual_seed(5)
    ids = torch.randint(0, vocab, (3, 13), generator=g)
    labels = ids.clone()
    labels[0, :4] = -100         # a prompt
    labels[1, 9:] = -100         # padding
    labels[2, :] = -100          # a row with one label token
    labels[2, 6] = ids[2, 6]
    mask = torch.ones_like(ids)
    mask[1, 9:] = 0
    return ids, labels, mask
