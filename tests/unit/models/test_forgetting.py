"""Functional forgetting (ft_framework/models/forgetting.py) against independent float64 computations:
debiased CKA against the Gram-matrix form of the unbiased HSIC, the MLM loss against a float64
BertForMaskedLM, and zero forgetting for a copy of θ*."""

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from ft_framework.config.schema import ForgettingConfig
from ft_framework.errors import UserError
from ft_framework.models.forgetting import (DEFAULT_PROBE_WORDS, EncoderForgettingProbe, debiased_linear_cka,
                                            default_probe_sentences, mask_positions, read_probe_file)
from ft_framework.models.probes import build_probe

transformers = pytest.importorskip("transformers")


def unbiased_hsic_gram(k: np.ndarray, l: np.ndarray) -> float:
    """Song et al. (2012): HSIC_1 from Gram matrices with zeroed diagonals, float64."""
    n = k.shape[0]
    k, l = k.copy(), l.copy()
    np.fill_diagonal(k, 0.0)
    np.fill_diagonal(l, 0.0)
    one = np.ones(n)
    return float((np.trace(k @ l) + (one @ k @ one) * (one @ l @ one) / ((n - 1) * (n - 2))
                  - 2.0 / (n - 2) * (one @ k @ l @ one)) / (n * (n - 3)))


def cka_gram(x: np.ndarray, y: np.ndarray) -> float:
    k, l = x @ x.T, y @ y.T
    return unbiased_hsic_gram(k, l) / np.sqrt(unbiased_hsic_gram(k, k) * unbiased_hsic_gram(l, l))


def biased_cka(x: np.ndarray, y: np.ndarray) -> float:
    x, y = x - x.mean(0), y - y.mean(0)
    return float(np.linalg.norm(x.T @ y) ** 2 / (np.linalg.norm(x.T @ x) * np.linalg.norm(y.T @ y)))


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_cka_equals_the_gram_form_of_the_unbiased_hsic(seed):
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(37, 20)) + 3.0  # not centred: the Gram form is translation-invariant
    y = x @ rng.normal(size=(20, 11)) + 0.5 * rng.normal(size=(37, 11))
    assert debiased_linear_cka(torch.tensor(x), torch.tensor(y)) == pytest.approx(cka_gram(x, y), abs=1e-10)
    assert debiased_linear_cka(torch.tensor(x), torch.tensor(x)) == pytest.approx(1.0, abs=1e-12)


def test_cka_of_independent_features_is_about_zero_where_the_biased_form_is_not():
    rng = np.random.default_rng(7)
    x, y = rng.normal(size=(64, 384)), rng.normal(size=(64, 384))
    assert biased_cka(x, y) > 0.8
    assert abs(debiased_linear_cka(torch.tensor(x), torch.tensor(y))) < 0.02


def test_default_probe_text_is_fixed_prose():
    sentences = default_probe_sentences(64)
    assert len(sentences) == 64 and sentences == default_probe_sentences(128)[:64]
    shortest, longest = DEFAULT_PROBE_WORDS
    assert all(shortest <= len(s.split()) <= longest and s.endswith(".") for s in sentences)
    assert len(set(sentences)) == len(sentences), "a sentence the documentation repeats is taken once"


def test_probe_file_errors_are_one_line(tmp_path):
    with pytest.raises(UserError, match="is not a file"):
        read_probe_file(str(tmp_path / "nope.txt"), 8)
    (tmp_path / "probe.txt").write_text("one\n\ntwo\n")
    assert read_probe_file(str(tmp_path / "probe.txt"), 8) == ["one", "two"]
    with pytest.raises(UserError, match="at least 4"):
        build_probe(EncoderForgettingProbe, ForgettingConfig(probe_file=str(tmp_path / "probe.txt")),
                    model_name_or_path="unused", mask_seed=0, tokenizer=None, batch_size=4)


def test_masks_depend_on_the_sentence_not_the_batch():
    special = torch.zeros(6, 40, dtype=torch.bool)
    special[:, 0] = special[:, -5:] = True
    whole = mask_positions(special, range(6), seed=3)
    part = mask_positions(special[[4, 1]], [4, 1], seed=3)
    assert torch.equal(part, whole[[4, 1]])
    assert not (whole & special).any() and whole.any(1).all()
    assert not torch.equal(mask_positions(special, range(6), seed=4), whole)


@pytest.fixture(scope="module")
def tiny_mlm_dir(tmp_path_factory, tiny_bert_dir):
    """A tiny BertForMaskedLM (built from a config, with its MLM head) and MiniLM's tokenizer."""
    from transformers import AutoTokenizer, BertConfig, BertForMaskedLM

    path = tmp_path_factory.mktemp("tiny_mlm")
    tokenizer = AutoTokenizer.from_pretrained(tiny_bert_dir)
    torch.manual_seed(0)
    cfg = BertConfig(vocab_size=tokenizer.vocab_size, hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
                     intermediate_size=37, max_position_embeddings=128)
    BertForMaskedLM(cfg).save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path, tokenizer


def _probe(model_dir, tokenizer, batch_size=5):
    return build_probe(EncoderForgettingProbe, ForgettingConfig(num_sentences=12, max_length=24),
                       model_name_or_path=str(model_dir), mask_seed=0, tokenizer=tokenizer, batch_size=batch_size)


def test_a_copy_of_theta_star_reads_zero_forgetting(tiny_mlm_dir):
    from transformers import BertForSequenceClassification

    model_dir, tokenizer = tiny_mlm_dir
    probe = _probe(model_dir, tokenizer)
    assert probe.describe()["mlm"] is True
    model = BertForSequenceClassification.from_pretrained(model_dir, num_labels=2).eval()
    out = probe.measure(lambda batch: model(**batch))
    assert out["cka_drift_last"] == pytest.approx(0.0, abs=1e-9)
    assert out["cka_drift_mean"] == pytest.approx(0.0, abs=1e-9)
    assert out["mlm_forgetting"] == pytest.approx(0.0, abs=1e-6)
    assert out["mlm_loss_pretrained"] > 0


def test_metrics_equal_a_float64_computation(tiny_mlm_dir):
    from transformers import BertForMaskedLM, BertForSequenceClassification

    model_dir, tokenizer = tiny_mlm_dir
    probe = _probe(model_dir, tokenizer)
    finetuned = BertForSequenceClassification.from_pretrained(model_dir, num_labels=2).eval()
    with torch.no_grad():
        gen = torch.Generator().manual_seed(5)
        for p in finetuned.bert.parameters():
            p.add_(0.2 * torch.randn(p.shape, generator=gen))
    out = probe.measure(lambda batch: finetuned(**batch))

    # Independently, in float64: θ*'s MLM model, and θ's encoder under θ*'s head.
    enc = tokenizer(probe.sentences, padding="max_length", truncation=True, max_length=24,
                    return_special_tokens_mask=True, return_tensors="pt")
    special = enc.pop("special_tokens_mask").bool() | (enc["attention_mask"] == 0)
    masked = mask_positions(special, range(12), seed=0)
    masked_ids = enc["input_ids"].masked_fill(masked, tokenizer.mask_token_id)
    star = BertForMaskedLM.from_pretrained(model_dir).double().eval()
    theta_encoder = finetuned.bert.double()

    def features_and_loss(encoder):
        """`encoder`'s features, and its MLM loss under θ*'s head (whose decoder is θ*'s
        word embeddings, tied: not θ's)."""
        with torch.no_grad():
            hidden = encoder(**enc, output_hidden_states=True).hidden_states[1:]
            logits = star.cls(encoder(**{**enc, "input_ids": masked_ids}).last_hidden_state)
        mask = enc["attention_mask"].double()[..., None]
        pooled = [((h * mask).sum(1) / mask.sum(1)).numpy() for h in hidden]
        loss = F.cross_entropy(logits[masked], enc["input_ids"][masked]).item()
        return pooled, loss

    star_features, star_loss = features_and_loss(star.bert)
    theta_features, theta_loss = features_and_loss(theta_encoder)
    drifts = [1.0 - cka_gram(a, b) for a, b in zip(star_features, theta_features)]
    assert drifts[-1] > 0.01  # the perturbation moved the representations
    assert out["cka_drift_last"] == pytest.approx(drifts[-1], abs=1e-5)
    assert out["cka_drift_mean"] == pytest.approx(np.mean(drifts), abs=1e-5)
    assert out["mlm_loss_pretrained"] == pytest.approx(star_loss, rel=1e-5)
    assert out["mlm_loss"] == pytest.approx(theta_loss, rel=1e-5)
    assert out["mlm_forgetting"] == pytest.approx(theta_loss - star_loss, abs=1e-4)
    # Batching changes nothing but fp32 rounding (a batch is cut to its longest sentence, so the
    # matrix products change shape): the masks and the padding do not depend on it.
    finetuned.float()
    assert _probe(model_dir, tokenizer, batch_size=12).measure(lambda batch: finetuned(**batch)) == \
        pytest.approx(out, rel=1e-6, abs=1e-6)


def test_a_checkpoint_without_mlm_head_skips_mlm_forgetting(tiny_bert_dir):
    from transformers import AutoTokenizer

    probe = _probe(tiny_bert_dir, AutoTokenizer.from_pretrained(tiny_bert_dir))
    assert probe.describe()["mlm"] is False and "no masked-LM head" in probe.describe()["mlm_skipped"]
