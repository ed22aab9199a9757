"""R3F (models/r3f.py): the loss and its gradient against an independent float64 re-implementation
(plain torch: the noise added through inputs_embeds, the KL written with F.kl_div), the noise's
key (replay, a 2-way split of the batch, padding), the same gradients under activation
checkpointing, LoRA and Mixout with R3F, and the config's ranges and refusals. 2 ranks (DDP,
ZeRO-2, FSDP2): tests/distributed/test_r3f_distributed.py."""

import copy

import pytest
import torch
import torch.nn.functional as F
from transformers import BertConfig, BertForSequenceClassification

from ft_framework import counter_rng
from ft_framework.config import ConfigError, apply_overrides, validate_config
from ft_framework.models.activation_checkpointing import apply_activation_checkpointing
from ft_framework.models.loading import apply_mixout
from ft_framework.models.r3f import R3FSettings, attach_r3f, embedding_noise, tag_batch

SIZES = dict(vocab_size=50, hidden_size=24, num_hidden_layers=2, num_attention_heads=2, intermediate_size=37,
             num_labels=3, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)
MAX_LEN = 11
EXAMPLES = [17, 3, 40]
STEP = 5


def tiny_bert(dtype=torch.float64) -> BertForSequenceClassification:
    torch.manual_seed(0)
    return BertForSequenceClassification(BertConfig(**SIZES)).to(dtype)


def batch() -> dict[str, torch.Tensor]:
    torch.manual_seed(1)
    ids = torch.randint(5, 50, (3, 7))
    mask = torch.ones(3, 7, dtype=torch.int64)
    mask[1, 4:] = 0  # a padded example
    return {"input_ids": ids, "attention_mask": mask, "labels": torch.tensor([2, 0, 1])}


def settings(noise="uniform", sigma=0.3, weight=1.7) -> R3FSettings:
    return R3FSettings(weight=weight, noise=noise, sigma=sigma, seed=11, max_seq_length=MAX_LEN)


def ours(model, s: R3FSettings):
    objective = attach_r3f(model, s)
    loss = model(**tag_batch(batch(), EXAMPLES, STEP)).loss
    loss.backward()
    return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}, objective


def reference(model, s: R3FSettings):
    """fairseq's criterion written out in float64: clean forward, noised forward through inputs_embeds."""
    b = batch()
    inputs = {"attention_mask": b["attention_mask"]}
    clean = model(input_ids=b["input_ids"], **inputs).logits
    noise = embedding_noise(s, STEP, torch.tensor(EXAMPLES), 7, SIZES["hidden_size"]).double()
    embeds = model.get_input_embeddings()(b["input_ids"]) + noise
    noised = model(inputs_embeds=embeds, **inputs).logits
    symm = (F.kl_div(F.log_softmax(noised, -1), F.softmax(clean, -1), reduction="sum")
            + F.kl_div(F.log_softmax(clean, -1), F.softmax(noised, -1), reduction="sum")) / clean.shape[0]
    loss = F.cross_entropy(clean, b["labels"]) + s.weight * symm
    loss.backward()
    return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}


@pytest.mark.parametrize("noise", ["uniform", "normal"])
def test_loss_and_gradient_equal_a_float64_reference(noise):
    s = settings(noise)
    model = tiny_bert()
    want_loss, want_grads = reference(copy.deepcopy(model), s)
    got_loss, got_grads, objective = ours(model, s)
    torch.testing.assert_close(got_loss, want_loss, rtol=1e-12, atol=1e-12)
    assert sorted(got_grads) == sorted(want_grads)
    for name, grad in want_grads.items():
        torch.testing.assert_close(got_grads[name], grad, rtol=1e-10, atol=1e-12, msg=name)
    kl = objective.pop_metrics()["r3f_kl"]
    assert kl > 1e-6 and objective.pop_metrics() == {}  # the noise changes the output; the window resets


def test_untagged_batches_run_the_plain_model():
    model, plain = tiny_bert(), tiny_bert()
    attach_r3f(model, settings())
    torch.testing.assert_close(model(**batch()).logits, plain(**batch()).logits, rtol=0, atol=0)


def test_noise_is_keyed_on_example_position_and_step():
    s = settings()
    examples = torch.tensor([5, 9, 2, 7])
    whole = embedding_noise(s, STEP, examples, 6, 13)
    assert torch.equal(whole, embedding_noise(s, STEP, examples, 6, 13))  # replay
    halves = torch.cat([embedding_noise(s, STEP, examples[:2], 6, 13), embedding_noise(s, STEP, examples[2:], 6, 13)])
    assert torch.equal(whole, halves)  # a 2-way split of the batch
    assert torch.equal(whole[:, :4], embedding_noise(s, STEP, examples, 4, 13))  # less padding
    assert torch.equal(whole[[2, 0]], embedding_noise(s, STEP, torch.tensor([2, 5]), 6, 13))  # another order
    assert not torch.equal(whole, embedding_noise(s, STEP + 1, examples, 6, 13))
    # element (example 9, position 3, dim 4) is draw ((9 · MAX_LEN + 3) · 13 + 4) of the R3F stream
    u = counter_rng.uniform(s.seed, counter_rng.STREAM_R3F_NOISE, STEP, torch.tensor([(9 * MAX_LEN + 3) * 13 + 4]))
    assert whole[1, 3, 4] == ((2 * u - 1) * s.sigma)[0]


@pytest.mark.parametrize("noise,bound_or_std", [("uniform", 0.3), ("normal", 0.3)])
def test_noise_distribution(noise, bound_or_std):
    z = embedding_noise(settings(noise), STEP, torch.arange(200), MAX_LEN, 64).double()
    if noise == "uniform":
        assert z.abs().max() < bound_or_std and z.abs().max() > 0.999 * bound_or_std
        assert abs(z.std().item() - bound_or_std / 3**0.5) < 0.005
    else:
        assert abs(z.std().item() - bound_or_std) < 0.005
    assert abs(z.mean().item()) < 0.003


def test_activation_checkpointing_gives_the_same_gradients():
    s = settings()
    plain, checkpointed = tiny_bert(torch.float32), tiny_bert(torch.float32)
    apply_activation_checkpointing(checkpointed)
    want_loss, want, _ = ours(plain, s)
    got_loss, got, _ = ours(checkpointed, s)
    assert torch.equal(got_loss, want_loss)
    assert sorted(got) == sorted(want)
    for name, grad in want.items():
        assert torch.equal(got[name], grad), name


def test_mixout_and_lora_train_with_r3f():
    peft = pytest.importorskip("peft")
    mixed = tiny_bert(torch.float32)
    apply_mixout(mixed, 0.3, {n: p.detach().clone() for n, p in mixed.named_parameters()})
    mixed.train()
    loss, grads, objective = ours(mixed, settings())
    assert torch.isfinite(loss) and objective.pop_metrics()["r3f_kl"] > 0
    lora = peft.get_peft_model(tiny_bert(torch.float32), peft.LoraConfig(r=2, target_modules=["query", "value"],
                                                                        task_type="SEQ_CLS"))
    objective = attach_r3f(lora, settings())
    lora(**tag_batch(batch(), EXAMPLES, STEP)).loss.backward()
    assert objective.pop_metrics()["r3f_kl"] > 0
    assert all(p.grad is not None for n, p in lora.named_parameters() if p.requires_grad)


def minimal() -> dict:
    return {"model": {"name_or_path": "some/model"}, "data": {"task": "rte"},
            "optimizer": {"name": "adamw", "hparams": {"lr": 2e-5}},
            "schedule": {"warmup_ratio": 0.1}, "training": {"max_steps": 100, "r3f": {}}}


def test_config_defaults_and_off():
    cfg = validate_config(minimal())
    assert (cfg.training.r3f.weight, cfg.training.r3f.noise, cfg.training.r3f.sigma) == (1.0, "uniform", 1e-5)
    assert validate_config(apply_overrides(minimal(), ["training.r3f=null"])).training.r3f is None
    assert cfg.to_dict()["training"]["r3f"] == {"weight": 1.0, "noise": "uniform", "sigma": 1e-5}


@pytest.mark.parametrize("override,said", [
    ("training.r3f.weight=0", "greater than 0"),
    ("training.r3f.sigma=-1e-5", "greater than 0"),
    ("training.r3f.noise=gaussian", "'uniform' or 'normal'"),
    ("training.r3f.lambda=1.0", "weight"),
    ("data.task=stsb", "training.r3f needs a classification task"),
])
def test_bad_values_and_regression_are_refused(override, said):
    with pytest.raises(ConfigError) as info:
        validate_config(apply_overrides(minimal(), [override]), pinned=[override])
    assert said in str(info.value)
