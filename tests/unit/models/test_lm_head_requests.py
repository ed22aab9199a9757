"""Head requests (models/lm_head_requests.py): the chunked next-token loss, its per-token evaluation
and the forgetting probe's log-probabilities equal what the whole logits give, element by element
(every gradient included), on tiny decoders with tied embeddings (Llama, Qwen2, Gemma, Gemma 3), untied
(Mistral) and one whose logits change after the head (Gemma 2's soft-cap: the request takes the
finished logits). Chunks of a few positions (awkward sizes) so that every batch spans several."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from lm_head_cases import label_batch as batch, random_tiny_lm

from ft_framework.models import lm_head_requests
from ft_framework.models.lm_head_requests import (NextTokenLoss, ProbeLogProbs, REQUEST_KEY, head_is_chunked,
                                                  install_head_requests)

MODELS = {"llama": True, "qwen2": True, "gemma": True, "gemma3_text": True, "mistral": True, "gemma2": False}


def tiny(model_type: str):
    return random_tiny_lm(model_type)


def reference_loss(logits, labels):
    """Σ over label tokens of -log softmax(logits at t - 1)[label t], written out position by position."""
    total = logits.new_zeros((), dtype=torch.float32)
    for b in range(labels.shape[0]):
        for t in range(1, labels.shape[1]):
            if labels[b, t] != -100:
                total = total - F.log_softmax(logits[b, t - 1].float(), -1)[labels[b, t]]
    return total


@pytest.fixture(autouse=True)
def small_chunks(monkeypatch):
    monkeypatch.setattr(lm_head_requests, "CHUNK_LOGITS", 5 * 263)  # 5 positions of a 263-token vocabulary


@pytest.mark.parametrize("model_type", list(MODELS))
def test_the_chunked_loss_and_its_gradients_equal_the_whole_logits(model_type):
    model = tiny(model_type)
    assert install_head_requests(model) is MODELS[model_type] is head_is_chunked(model)
    ids, labels, mask = batch(model.config.vocab_size)
    want = reference_loss(model(input_ids=ids, attention_mask=mask).logits, labels)
    want.backward()
    want_grads = {n: p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad(set_to_none=True)
    got = model(input_ids=ids, attention_mask=mask, **{REQUEST_KEY: NextTokenLoss(labels)}).logits
    assert got.shape == () and float(got.detach()) == pytest.approx(float(want.detach()), rel=1e-6)
    got.backward()
    for name, param in model.named_parameters():
        # fp32 rounding of sums taken in another order: relative to the gradient's own scale
        scale = float(want_grads[name].abs().max())
        torch.testing.assert_close(param.grad, want_grads[name], rtol=1e-5, atol=2e-6 * scale, msg=name)
    if model.config.tie_word_embeddings:
        assert model.get_output_embeddings().weight is model.get_input_embeddings().weight


@pytest.mark.parametrize("model_type", ["llama", "gemma2"])
def test_per_token_losses_and_greedy_hits(model_type):
    model = tiny(model_type)
    install_head_requests(model)
    ids, labels, mask = batch(model.config.vocab_size)
    with torch.no_grad():
        logits = model(input_ids=ids, attention_mask=mask).logits.float()
        got = model(input_ids=ids, attention_mask=mask, **{REQUEST_KEY: NextTokenLoss(labels, per_token=True)}).logits
    k = 0
    for b in range(3):
        for t in range(1, 13):
            if labels[b, t] != -100:
                want = -F.log_softmax(logits[b, t - 1], -1)[labels[b, t]]
                assert float(got[0, k]) == pytest.approx(float(want), rel=1e-5)
                assert bool(got[1, k]) == bool(logits[b, t - 1].argmax() == labels[b, t])
                k += 1
    assert got.shape == (2, k)


def test_without_a_request_the_model_is_unchanged():
    model = tiny("llama")
    ids, _, mask = batch(model.config.vocab_size)
    with torch.no_grad():
        before = model(input_ids=ids, attention_mask=mask).logits
        install_head_requests(model)
        assert install_head_requests(model)  # installing twice changes nothing
        torch.testing.assert_close(model(input_ids=ids, attention_mask=mask).logits, before, rtol=0, atol=0)


@pytest.mark.parametrize("model_type", ["qwen2", "gemma2"])
def test_probe_log_probabilities_and_kl(model_type):
    model = tiny(model_type)
    install_head_requests(model)
    ids, _, mask = batch(model.config.vocab_size)
    with torch.no_grad():
        logits = model(input_ids=ids, attention_mask=mask).logits.float()
        logp = model(input_ids=ids, attention_mask=mask, **{REQUEST_KEY: ProbeLogProbs(ids, mask, rows=2)}).logits
        want = torch.cat([F.log_softmax(logits[r, :int(mask[r].sum()) - 1], -1) for r in range(2)])
        torch.testing.assert_close(logp, want, rtol=1e-5, atol=1e-6)
        reference = torch.log_softmax(torch.randn(want.shape, generator=torch.Generator().manual_seed(1)), -1)
        scores = model(input_ids=ids, attention_mask=mask,
                       **{REQUEST_KEY: ProbeLogProbs(ids, mask, rows=2, reference=reference)}).logits
    targets = torch.cat([ids[r, 1:int(mask[r].sum())] for r in range(2)])
    torch.testing.assert_close(scores[0], -want.gather(1, targets[:, None])[:, 0], rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(scores[1], (reference.exp() * (reference - want)).sum(-1), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("weights", ["fp32 under bf16 autocast", "bf16"])
def test_bf16_losses_and_gradients_agree_within_bf16_rounding(weights):
    """The head's logits in bf16 as the model computes them (autocast's cast of fp32 weights, or bf16
    weights), widened to fp32 for the cross-entropy, as the whole logits' loss does."""
    model = tiny("llama")
    if weights == "bf16":
        model = model.to(torch.bfloat16)
    install_head_requests(model)
    ids, labels, mask = batch(model.config.vocab_size)
    runs = {}
    for chunked in (False, True):
        model.zero_grad(set_to_none=True)
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=weights != "bf16"):
            if chunked:
                loss = model(input_ids=ids, attention_mask=mask, **{REQUEST_KEY: NextTokenLoss(labels)}).logits
            else:
                loss = reference_loss(model(input_ids=ids, attention_mask=mask).logits, labels)
        loss.backward()
        runs[chunked] = (float(loss.detach()), {n: p.grad.float().clone() for n, p in model.named_parameters()})
    assert runs[True][0] == pytest.approx(runs[False][0], rel=1e-3)
    for name, want in runs[False][1].items():
        scale = float(want.abs().max())
        torch.testing.assert_close(runs[True][1][name], want, rtol=0.05, atol=0.02 * scale, msg=name)
