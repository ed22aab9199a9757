"""Activation checkpointing (models/activation_checkpointing.py): the blocks it wraps, gradients
that equal those without it bit for bit (CPU fp32, dropout and Mixout on) under the single-device
strategy, LoRA and the serial and overlapped offload (where each parameter's post-accumulate-grad
hook fires once per backward), and a lower measured activation peak. 2 ranks: DDP in
tests/unit/distributed/test_ddp_no_sync.py, ZeRO-2/3 in tests/distributed/test_deepspeed.py, FSDP2
in tests/distributed/test_fsdp.py; the trainer's wiring in tests/recipes/test_train_end_to_end.py."""

import copy

import pytest
import torch
from torch import nn
from transformers import (AlbertConfig, AlbertForSequenceClassification, BertConfig, BertForSequenceClassification,
                          DebertaV2Config, DebertaV2ForSequenceClassification, DistilBertConfig,
                          DistilBertForSequenceClassification, RobertaConfig, RobertaForSequenceClassification)

from ft_framework.config import ConfigError, validate_config
from ft_framework.errors import UserError
from ft_framework.models.activation_checkpointing import apply_activation_checkpointing, checkpointed_blocks
from ft_framework.models.blocks import transformer_block_lists
from ft_framework.models.loading import MixoutLinear, apply_mixout
from ft_framework.models.lora import apply_lora
from ft_framework.optim import build_optimizer
from ft_framework.optim.groups import build_param_groups
from ft_framework.run.fingerprint import check_resume, config_record
from ft_framework.strategies import OffloadedSingleDeviceStrategy, SingleDeviceStrategy
from ft_framework.strategies.memory_trace import live_bytes

SIZES = dict(vocab_size=100, hidden_size=32, num_hidden_layers=3, num_attention_heads=2, intermediate_size=37)
DROPOUT = dict(hidden_dropout_prob=0.1, attention_probs_dropout_prob=0.1)
MIXOUT_P = 0.3
STEPS = 3


def tiny_bert(**overrides):
    torch.manual_seed(0)
    return BertForSequenceClassification(BertConfig(**{**SIZES, **DROPOUT, **overrides}))


def tiny_albert():
    """ALBERT's one layer group, shared by all 3 layers: one module called 3 times per forward."""
    torch.manual_seed(0)
    return AlbertForSequenceClassification(AlbertConfig(embedding_size=16, classifier_dropout_prob=0.1,
                                                        **SIZES, **DROPOUT))


def batch(step: int, size: int = 4, seq: int = 10) -> dict:
    gen = torch.Generator().manual_seed(50 + step)
    ids = torch.randint(0, SIZES["vocab_size"], (size, seq), generator=gen)
    mask = torch.ones_like(ids)
    mask[0, seq // 2:] = 0  # one padded example: the attention mask goes through the blocks too
    return {"input_ids": ids, "attention_mask": mask, "labels": torch.randint(0, 2, (size,), generator=gen)}


@pytest.mark.parametrize("model, expected", [
    (lambda: tiny_bert(), ["bert.encoder.layer.0", "bert.encoder.layer.1", "bert.encoder.layer.2"]),
    (tiny_albert, ["albert.encoder.albert_layer_groups.0"]),
    (lambda: RobertaForSequenceClassification(RobertaConfig(**SIZES)),
     [f"roberta.encoder.layer.{i}" for i in range(3)]),
    (lambda: DebertaV2ForSequenceClassification(DebertaV2Config(**SIZES)),
     [f"deberta.encoder.layer.{i}" for i in range(3)]),
    (lambda: DistilBertForSequenceClassification(DistilBertConfig(vocab_size=100, dim=32, n_layers=2, n_heads=2,
                                                                  hidden_dim=37)),
     ["distilbert.transformer.layer.0", "distilbert.transformer.layer.1"]),
], ids=["bert", "albert_shared", "roberta", "deberta_v2", "distilbert"])
def test_each_transformer_block_is_wrapped_once_and_names_stay(model, expected):
    model = model()
    names_before = [n for n, _ in model.named_parameters()]
    assert apply_activation_checkpointing(model) == len(expected)
    assert apply_activation_checkpointing(model) == len(expected)  # again: nothing nested
    by_module = {m: n for n, m in model.named_modules()}
    assert [by_module[m] for m in checkpointed_blocks(model)] == expected
    # θ*, the param groups and the checkpoint layout are keyed by these names.
    assert [n for n, _ in model.named_parameters()] == names_before


def test_a_model_without_blocks_is_a_one_line_error_naming_its_class():
    with pytest.raises(UserError, match="no transformer blocks to checkpoint in Sequential.*"
                                        "training.activation_checkpointing: false"):
        apply_activation_checkpointing(nn.Sequential(nn.Linear(4, 4), nn.Tanh(), nn.Linear(4, 2)))


def test_the_key_is_a_training_option_off_by_default():
    base = {"model": {"name_or_path": "x"}, "data": {"task": "sst2"}, "schedule": {"warmup_steps": 0},
            "optimizer": {"name": "adamw"},
            "training": {"max_steps": 1}}
    assert validate_config(base).training.activation_checkpointing is False
    on = validate_config({**base, "training": {"max_steps": 1, "activation_checkpointing": True}})
    assert on.training.activation_checkpointing is True
    with pytest.raises(ConfigError, match="training.activation_checkpointing"):
        validate_config({**base, "training": {"max_steps": 1, "activation_checkpointing": "blocks"}})


def test_a_run_may_resume_with_checkpointing_switched_and_keeps_its_fingerprint():
    """Same gradients, other memory: a resume may switch it, also from a checkpoint saved before
    the key existed."""
    base = {"model": {"name_or_path": "x"}, "data": {"task": "sst2"}, "schedule": {"warmup_steps": 0},
            "optimizer": {"name": "adamw"}, "training": {"max_steps": 1}}
    before_the_key = copy.deepcopy(validate_config(base).to_dict())
    del before_the_key["training"]["activation_checkpointing"]
    on = validate_config({**base, "training": {"max_steps": 1, "activation_checkpointing": True}}).to_dict()
    saved, current = config_record(before_the_key, 1), config_record(on, 1)
    assert saved["fingerprint"] == current["fingerprint"]
    changes = check_resume(saved, current, step=1)
    assert [(c["key"], c["old"], c["new"]) for c in changes] == [("training.activation_checkpointing", None, True)]


# ---- the same gradients ------------------------------------------------------------------------------
def _pretrained(model) -> dict[str, torch.Tensor]:
    """θ*: every weight but the new head, nudged so that Mixout's target differs from the weight."""
    gen = torch.Generator().manual_seed(7)
    return {n: p.detach() + 0.02 * torch.randn(p.shape, generator=gen)
            for n, p in model.named_parameters() if not n.startswith("classifier")}


def _lora(model):
    pytest.importorskip("peft")

    class LoraCfg:
        r, alpha, dropout, target_modules = 4, 8.0, 0.1, None

    return apply_lora(model, LoraCfg(), ["classifier.weight", "classifier.bias"])


def _train(make_model, strategy, checkpointing: bool, lora: bool = False):
    """STEPS steps with dropout and Mixout (or LoRA) on; returns every backward's gradients,
    post-accumulate-grad hook counts and block-internal forward calls, and the final weights."""
    model = make_model()
    pretrained = _pretrained(model)
    if lora:
        model = _lora(model)
    else:
        assert apply_mixout(model, MIXOUT_P, pretrained)
    if checkpointing:
        apply_activation_checkpointing(model)
    model.train()
    params = {n: p for n, p in model.named_parameters() if p.requires_grad}
    anchored = {n: t for n, t in pretrained.items() if n in params}
    strategy.setup(model, lambda m: build_optimizer(
        "recadam", build_param_groups(m, anchored, lr=1e-2, weight_decay=0.01, attach_anchors=False),
        impl="auto", anneal_k=0.5, anneal_t0=2, pretrain_cof=5.0), anchors=dict(anchored))
    record = {"grads": [], "fired": [], "inner_calls": 0}
    fired, grads = {}, {}

    def on_grad(p, name):
        fired[name] = fired.get(name, 0) + 1
        grads[name] = p.grad.detach().clone()

    for name, p in params.items():
        p.register_post_accumulate_grad_hook(lambda p, name=name: on_grad(p, name))
    first_block = transformer_block_lists(model)[0][1][0]
    for module in first_block.modules():
        if module is not first_block:
            module.register_forward_hook(lambda *_: record.__setitem__("inner_calls", record["inner_calls"] + 1))
    for step in range(STEPS):
        torch.manual_seed(100 + step)  # dropout's and Mixout's draws
        fired.clear()
        grads.clear()
        strategy.backward(strategy.forward(batch(step)).loss)
        record["fired"].append(dict(fired))
        record["grads"].append(dict(grads))
        strategy.clip_and_step(1.0)
    strategy.close()
    record["params"] = {n: p.detach().clone() for n, p in params.items()}
    record["names"] = list(params)
    return record


STRATEGIES = {
    "single": lambda: SingleDeviceStrategy("fp32", "cpu"),
    "offload_serial": lambda: OffloadedSingleDeviceStrategy("fp32", "cpu", overlap=False),
    # Tiny buckets: the worker steps tensors while backward (and its recomputation) goes on.
    "offload_overlapped": lambda: OffloadedSingleDeviceStrategy("fp32", "cpu", overlap=True, worker_threads=1,
                                                                bucket_mb=0.0005),
}


@pytest.mark.parametrize("make_model", [tiny_bert, tiny_albert], ids=["bert", "albert_shared"])
@pytest.mark.parametrize("strategy", list(STRATEGIES))
def test_gradients_and_weights_equal_those_without_checkpointing_bit_for_bit(make_model, strategy):
    plain = _train(make_model, STRATEGIES[strategy](), checkpointing=False)
    checkpointed = _train(make_model, STRATEGIES[strategy](), checkpointing=True)
    # The modules inside a block ran again in the recomputation (which stops once the block's last
    # saved tensor is recomputed, so a module that ends the block may not run twice).
    assert plain["inner_calls"] < checkpointed["inner_calls"] <= 2 * plain["inner_calls"]
    for step in range(STEPS):
        assert set(checkpointed["grads"][step]) == set(plain["names"])
        for name in plain["names"]:
            assert torch.equal(checkpointed["grads"][step][name], plain["grads"][step][name]), (step, name)
        # A weight's gradient is final once: the recomputation adds nothing to it (the overlapped
        # offload steps each weight from this hook).
        assert checkpointed["fired"][step] == plain["fired"][step] == {n: 1 for n in plain["names"]}
    for name in plain["names"]:
        assert torch.equal(checkpointed["params"][name], plain["params"][name]), name


def test_overlapped_offload_hands_each_parameter_to_its_worker_once_per_backward():
    strategy = STRATEGIES["offload_overlapped"]()
    handed = []
    hand_over = strategy._hand_over
    strategy._hand_over = lambda: (handed.append(len(strategy._bucket)), hand_over())[1]
    record = _train(tiny_bert, strategy, checkpointing=True)
    assert sum(handed) == len(record["names"]) * STEPS and len([n for n in handed if n]) > STEPS


def test_lora_gradients_equal_those_without_checkpointing_bit_for_bit():
    plain = _train(tiny_bert, SingleDeviceStrategy("fp32", "cpu"), checkpointing=False, lora=True)
    checkpointed = _train(tiny_bert, SingleDeviceStrategy("fp32", "cpu"), checkpointing=True, lora=True)
    # Only the adapters and the head train: the frozen base weights need no gradient in the recomputation.
    assert all(".lora_" in n or ".classifier." in n for n in plain["names"])
    assert plain["inner_calls"] < checkpointed["inner_calls"] <= 2 * plain["inner_calls"]
    for step in range(STEPS):
        for name in plain["names"]:
            assert torch.equal(checkpointed["grads"][step][name], plain["grads"][step][name]), (step, name)
    for name in plain["names"]:
        assert torch.equal(checkpointed["params"][name], plain["params"][name]), name


def test_mixout_and_dropout_draw_the_same_masks_in_the_recomputation():
    """Recorded at the draw: Mixout's masks in the recomputation are the forward's, in order."""
    model = tiny_bert()
    apply_mixout(model, MIXOUT_P, _pretrained(model))
    apply_activation_checkpointing(model)
    model.train()
    layer = model.bert.encoder.layer[1].intermediate.dense
    assert isinstance(layer, MixoutLinear)
    drawn = []
    mixed = layer.mixed_weight
    layer.mixed_weight = lambda: drawn.append(mixed()) or drawn[-1]
    torch.manual_seed(3)
    model(**batch(0)).loss.backward()
    assert len(drawn) == 2 and torch.equal(drawn[0], drawn[1])


# ---- the activation peak ----------------------------------------------------------------------------
def _activation_peak(checkpointing: bool) -> int:
    model = tiny_bert(num_hidden_layers=4)
    if checkpointing:
        apply_activation_checkpointing(model)
    model.train()
    data = batch(0, size=8, seq=64)
    torch.manual_seed(1)
    with live_bytes() as meter:  # the memory plan's own counter of live storage bytes
        model(**data).loss.backward()
    return meter.peak


def test_checkpointing_lowers_the_measured_activation_peak():
    plain, checkpointed = _activation_peak(False), _activation_peak(True)
    # 4 blocks keep their inputs only, and one block's activations live at a time in backward.
    assert checkpointed < 0.6 * plain, (checkpointed, plain)
