"""Memory-lean activations (models/fused_activations.py): the separate-op tanh GELUs and the fused op
compute the same function within the dtype's rounding, the transform replaces them in a model,
keeps its outputs, and the traced activations shrink."""

from __future__ import annotations

import pytest
import torch
from torch.nn import functional as F
from transformers import AlbertConfig, AlbertForSequenceClassification
from transformers import activations as hf

from ft_framework.config import validate_config
from ft_framework.models.fused_activations import FUSED_FORMS, FusedTanhGELU, describe_fused, fuse_activations
from ft_framework.strategies.memory_trace import trace_micro_batch
from tiny_run import two_label_classifier_kind

SEPARATE = {"gelu_new": hf.NewGELUActivation, "gelu_fast": hf.FastGELUActivation,
            "gelu_python_tanh": lambda: hf.ACT2FN["gelu_python_tanh"]}


def inputs(dtype: torch.dtype) -> torch.Tensor:
    """Every value on a fine grid over [-12, 12] (beyond it GELU is x or 0 in both forms)."""
    return torch.linspace(-12.0, 12.0, 400_001).to(dtype).unique()


def bf16_ulp(value: torch.Tensor) -> torch.Tensor:
    magnitude = value.double().abs().clamp_min(2.0 ** -126)
    return torch.pow(2.0, torch.floor(torch.log2(magnitude)) - 7)


@pytest.mark.parametrize("form", FUSED_FORMS)
def test_each_separate_form_agrees_with_the_fused_op_in_fp32(form):
    x = inputs(torch.float32)
    separate, fused = SEPARATE[form]()(x).double(), F.gelu(x, approximate="tanh").double()
    # Relative to the input's magnitude, GELU's output scale: where the output cancels to nearly 0
    # (x < -3) an output-relative error would measure each form's own cancellation, not their difference.
    assert ((separate - fused).abs() <= 1e-6 * x.double().abs()).all()


@pytest.mark.parametrize("form", FUSED_FORMS)
def test_each_separate_form_agrees_with_the_fused_op_within_one_bf16_ulp(form):
    x = inputs(torch.bfloat16)
    fused = F.gelu(x, approximate="tanh")                                    # bf16 in, bf16 out, as the model runs
    exact = SEPARATE[form]()(x.float()).to(torch.bfloat16)                   # the formula without bf16 intermediates
    diff = (fused.double() - exact.double()).abs()
    # one bf16 ulp of the output, or fp32's rounding at the input's scale where the output is ~0
    # (x near -5: both forms' fp32 cancellation, 1e-7 against an input of 5)
    bound = torch.maximum(bf16_ulp(torch.maximum(fused.double().abs(), exact.double().abs())),
                          2.0 ** -23 * x.double().abs())
    assert (diff <= bound).all()


def tiny_albert(hidden_act: str = "gelu_new") -> AlbertForSequenceClassification:
    torch.manual_seed(0)
    return AlbertForSequenceClassification(AlbertConfig(
        vocab_size=100, embedding_size=16, hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
        intermediate_size=64, hidden_act=hidden_act, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0,
        classifier_dropout_prob=0.0, num_labels=2))


def test_the_transform_replaces_the_separate_gelu_and_keeps_the_outputs():
    model = tiny_albert().eval()
    ids = torch.randint(0, 100, (3, 11), generator=torch.Generator().manual_seed(1))
    before = model(input_ids=ids).logits
    replaced = fuse_activations(model)
    assert replaced == {"gelu_new": 1}  # ALBERT shares one layer (and its activation) across its depth
    assert any(isinstance(m, FusedTanhGELU) for m in model.modules())
    assert not any(isinstance(m, hf.NewGELUActivation) for m in model.modules())
    torch.testing.assert_close(model(input_ids=ids).logits, before, rtol=1e-6, atol=1e-6)
    assert fuse_activations(model) == {}  # nothing left to fuse
    assert describe_fused(replaced) == "1 gelu_new module(s) -> fused tanh GELU"


def test_a_model_without_a_separate_form_is_left_as_it_is():
    model = tiny_albert("gelu")  # the exact GELU: F.gelu already
    assert fuse_activations(model) == {} and not any(isinstance(m, FusedTanhGELU) for m in model.modules())


def test_the_trace_of_the_fused_model_keeps_fewer_activation_bytes():
    arch = tiny_albert().config
    kw = dict(batch_size=4, seq_len=16, param_dtype=torch.float32, autocast_dtype=None, checkpointing=False,
              keep_grads=False, task=two_label_classifier_kind())
    separate = trace_micro_batch(arch, fused_activations=False, **kw)
    fused = trace_micro_batch(arch, fused_activations=True, **kw)
    assert fused.param_bytes == separate.param_bytes and fused.above_params < separate.above_params
    # gelu_new as separate ops keeps 0.5*x, tanh's output and 1 + tanh beyond x: 3 [tokens x 64] fp32 per layer use
    kept_less = separate.above_params - fused.above_params
    assert kept_less >= 2 * 3 * 4 * 16 * 64 * 4


def test_the_switch_is_on_by_default_and_can_be_turned_off():
    base = {"model": {"name_or_path": "bert-base-uncased"}, "data": {"task": "rte"},
            "optimizer": {"name": "adamw", "hparams": {"lr": 2e-5}}, "schedule": {"warmup_steps": 0},
            "training": {"max_steps": 1}}
    assert validate_config(base).model.fused_activations is True
    off = validate_config({**base, "model": {**base["model"], "fused_activations": False}})
    assert off.model.fused_activations is False
