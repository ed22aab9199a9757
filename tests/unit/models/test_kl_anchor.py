"""The KL anchor to θ* (loss.kl_to_pretrained; models/kl_anchor.py, models/lm_head_requests.py) against
a reference computed with the full θ* model: a deep copy of a tiny Llama at θ*, its full softmax, in
float64. Stored targets come from the pass's own request (TopKDistribution) at θ*; the trained model
is θ* moved by noise. With k = the vocabulary the anchor is the full KL (1e-6); with k < vocabulary it
is the full KL minus the tail's gap p*_tail · KL(p*|tail ‖ p|tail), computed here from the full
distributions (and never more than the full KL). Its gradient equals autograd through the
approximation's formula written out here over the whole logits; the chunked head and the whole
logits give the same values and gradients. Chunks of a few positions (awkward sizes)."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F

from lm_head_cases import label_batch as batch, random_tiny_lm

from ft_framework.models import lm_head_requests
from ft_framework.models.kl_anchor import model_fingerprint
from ft_framework.models.lora import apply_lora
from ft_framework.models.lm_head_requests import (REQUEST_KEY, AnchorTargets, NextTokenLoss, TopKDistribution,
                                                  install_head_requests)


def tiny_llama(requests: bool = True):
    model = random_tiny_lm("llama")
    if requests:
        install_head_requests(model)
    return model


@pytest.fixture(autouse=True)
def small_chunks(monkeypatch):
    monkeypatch.setattr(lm_head_requests, "CHUNK_LOGITS", 5 * 263)  # 5 positions a chunk


@pytest.fixture(scope="module")
def models():
    """(θ*, θ): θ* and a deep copy of it moved by noise (the model being trained)."""
    star = tiny_llama(requests=False)
    theta = copy.deepcopy(star)  # before the requests: a copy's forward would call the original's
    install_head_requests(star)
    install_head_requests(theta)
    g = torch.Generator().manual_seed(11)
    with torch.no_grad():
        for param in theta.parameters():
            param.add_(0.05 * torch.randn(param.shape, generator=g))
    return star, theta


def label_positions(labels: torch.Tensor) -> list[tuple[int, int]]:
    """(row, position) of each label token's prediction, row-major: position t predicts label t + 1."""
    return [(b, t - 1) for b in range(labels.shape[0]) for t in range(1, labels.shape[1]) if labels[b, t] != -100]


def stored(star, ids, labels, mask, k: int) -> AnchorTargets:
    """What the pass stores: θ*'s top k and tail at each label position."""
    with torch.no_grad():
        answer = star(input_ids=ids, attention_mask=mask, **{REQUEST_KEY: TopKDistribution(labels, k)}).logits
    width = (answer.shape[1] - 1) // 2
    tail = answer[:, -1]
    return AnchorTargets(answer[:, :width].long(), answer[:, width:2 * width],
                         None if width == star.config.vocab_size else tail)


def full_kl_and_gap(star, theta, ids, labels, mask, k: int) -> tuple[float, float]:
    """Σ over label positions of KL(p* ‖ p) over the whole vocabulary, and of the tail's gap
    p*_tail · KL(p*|tail ‖ p|tail) (the tail: the ids outside p*'s top k), in float64."""
    with torch.no_grad():
        z_star = star(input_ids=ids, attention_mask=mask).logits.double()
        z = theta(input_ids=ids, attention_mask=mask).logits.double()
    full, gap = 0.0, 0.0
    for b, t in label_positions(labels):
        log_star, log_p = F.log_softmax(z_star[b, t], -1), F.log_softmax(z[b, t], -1)
        full += float((log_star.exp() * (log_star - log_p)).sum())
        tail = torch.ones_like(log_star, dtype=torch.bool)
        tail[log_star.topk(k).indices] = False
        if tail.any():
            star_tail_mass, p_tail_mass = log_star[tail].exp().sum(), log_p[tail].exp().sum()
            cond_star = log_star[tail] - star_tail_mass.log()
            cond_p = log_p[tail] - p_tail_mass.log()
            gap += float(star_tail_mass * (cond_star.exp() * (cond_star - cond_p)).sum())
    return full, gap


def reference_formula(logits: torch.Tensor, labels: torch.Tensor, anchor: AnchorTargets) -> torch.Tensor:
    """The approximation written out over the whole logits, position by position: over the stored
    top-k ids and one tail bucket, p_tail = 1 − Σ_k p_k."""
    total = logits.new_zeros((), dtype=torch.float64)
    for n, (b, t) in enumerate(label_positions(labels)):
        log_p = F.log_softmax(logits[b, t].double(), -1)
        ids, log_star = anchor.ids[n], anchor.logp[n].double()
        total = total + (log_star.exp() * (log_star - log_p[ids])).sum()
        if anchor.tail_logp is not None:
            star_tail = anchor.tail_logp[n].double()
            total = total + star_tail.exp() * (star_tail - torch.log1p(-log_p[ids].exp().sum()))
    return total


@pytest.mark.parametrize("k", [259, 300, 1, 7, 40])
def test_the_anchor_is_the_full_kl_less_the_tail_gap(models, k):
    star, theta = models
    vocab = star.config.vocab_size
    ids, labels, mask = batch(vocab)
    anchor = stored(star, ids, labels, mask, k)
    with torch.no_grad():
        ce, kl = theta(input_ids=ids, attention_mask=mask, **{REQUEST_KEY: NextTokenLoss(labels, anchor=anchor)}).logits
    full, gap = full_kl_and_gap(star, theta, ids, labels, mask, min(k, vocab))
    assert full > 1e-2  # θ moved: the test can fail
    if k >= vocab:
        assert anchor.tail_logp is None and gap == 0.0
        assert float(kl) == pytest.approx(full, rel=1e-6, abs=1e-6)
    else:
        assert gap > 0.0
        # fp32: the tail's log-mass is a difference of two log-sum-exps of ~5 (k = 1: 2.7e-6 relative)
        assert float(kl) == pytest.approx(full - gap, rel=5e-6, abs=1e-6)
        assert float(kl) <= full + 1e-6
    with torch.no_grad():
        plain = theta(input_ids=ids, attention_mask=mask, **{REQUEST_KEY: NextTokenLoss(labels)}).logits
    assert float(ce) == float(plain)  # the cross-entropy is the plain request's, bit for bit


@pytest.mark.parametrize("k", [259, 7])
def test_its_gradient_is_autograd_through_the_formula_over_the_whole_logits(models, k):
    star, theta = models
    ids, labels, mask = batch(star.config.vocab_size)
    anchor = stored(star, ids, labels, mask, k)
    params = dict(theta.named_parameters())
    theta.zero_grad(set_to_none=True)
    want = reference_formula(theta(input_ids=ids, attention_mask=mask).logits, labels, anchor)
    want.backward()
    want_grads = {n: p.grad.clone() for n, p in params.items()}
    theta.zero_grad(set_to_none=True)
    ce, kl = theta(input_ids=ids, attention_mask=mask, **{REQUEST_KEY: NextTokenLoss(labels, anchor=anchor)}).logits
    assert float(kl.detach()) == pytest.approx(float(want.detach()), rel=1e-6, abs=1e-6)
    (0.0 * ce + kl).backward()
    for name, param in params.items():
        torch.testing.assert_close(param.grad, want_grads[name], rtol=1e-5, atol=1e-6, msg=name)
    theta.zero_grad(set_to_none=True)


@pytest.mark.parametrize("k", [259, 7])
def test_the_chunked_head_and_the_whole_logits_agree(models, k):
    """The head's chunked answer and the same request on the finished logits (training.chunked_loss off
    computes the latter's formula, anchor_kl): both terms, and the gradient of ce + β · kl."""
    star, theta = models
    ids, labels, mask = batch(star.config.vocab_size)
    anchor = stored(star, ids, labels, mask, k)
    params = dict(theta.named_parameters())
    results = []
    for chunked in (True, False):
        theta.zero_grad(set_to_none=True)
        request = NextTokenLoss(labels, anchor=anchor)
        if chunked:
            answer = theta(input_ids=ids, attention_mask=mask, **{REQUEST_KEY: request}).logits
        else:
            answer = request(theta(input_ids=ids, attention_mask=mask).logits, None)
        (answer[0] + 0.3 * answer[1]).backward()
        results.append((answer.detach(), {n: p.grad.clone() for n, p in params.items()}))
    (got, got_grads), (want, want_grads) = results
    torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)
    for name in params:  # fp32 sums taken in another order: relative to the gradient's own scale
        scale = float(want_grads[name].abs().max())
        torch.testing.assert_close(got_grads[name], want_grads[name], rtol=1e-5, atol=1e-6 * scale,
                                   msg=lambda m: f"{name}: {m}")
    theta.zero_grad(set_to_none=True)


def test_at_theta_star_the_anchor_is_zero_and_pulls_nowhere():
    star = tiny_llama()
    ids, labels, mask = batch(star.config.vocab_size)
    anchor = stored(star, ids, labels, mask, 7)
    ce, kl = star(input_ids=ids, attention_mask=mask, **{REQUEST_KEY: NextTokenLoss(labels, anchor=anchor)}).logits
    assert abs(float(kl.detach())) < 1e-5
    kl.backward()
    assert max(float(p.grad.abs().max()) for p in star.parameters()) < 1e-5


def test_a_batch_whose_targets_do_not_cover_its_label_tokens_is_refused(models):
    star, theta = models
    ids, labels, mask = batch(star.config.vocab_size)
    anchor = stored(star, ids, labels, mask, 7)
    short = AnchorTargets(anchor.ids[1:], anchor.logp[1:], anchor.tail_logp[1:])
    with pytest.raises(ValueError, match="cover"):
        theta(input_ids=ids, attention_mask=mask, **{REQUEST_KEY: NextTokenLoss(labels, anchor=short)})


def test_a_lora_model_at_theta_star_is_keyed_as_its_base_model():
    """peft starts each adapter's B at zero: the wrapped model computes the base model's function
    whatever A's random values, so every seed's wrap has the base model's fingerprint (and its
    outputs); an adapter that changes the function (a B not zero) keys the wrapped model itself."""
    from types import SimpleNamespace

    base = tiny_llama(requests=False)
    lora = SimpleNamespace(r=4, alpha=8.0, dropout=0.0, target_modules=None)
    wrapped = []
    for seed in (1, 2):
        torch.manual_seed(seed)
        wrapped.append(apply_lora(copy.deepcopy(base), lora, []))
    a = [dict(m.named_parameters()) for m in wrapped]
    name = next(n for n in a[0] if "lora_A" in n)
    assert not torch.equal(a[0][name], a[1][name])  # each seed its own A
    ids = torch.tensor([[1, 5, 9, 2, 7]])
    with torch.no_grad():
        want = base(input_ids=ids).logits
        assert all(torch.equal(m(input_ids=ids).logits, want) for m in wrapped)
    assert model_fingerprint(wrapped[0]) == model_fingerprint(wrapped[1]) == model_fingerprint(base)
    with torch.no_grad():
        next(p for n, p in wrapped[0].named_parameters() if "lora_B" in n)[0, 0] = 0.5
    assert model_fingerprint(wrapped[0]) != model_fingerprint(base)
    changed = copy.deepcopy(base)
    with torch.no_grad():
        changed.lm_head.weight[0, 0] += 1.0
    assert model_fingerprint(changed) != model_fingerprint(base)
