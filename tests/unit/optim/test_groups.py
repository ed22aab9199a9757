"""Parameter grouping: anchored vs new by state-dict matching, no-decay by module type, LLRD."""

import pytest
import torch
from torch import nn
from transformers import AlbertConfig, AlbertForSequenceClassification, BertConfig, BertForSequenceClassification

from ft_framework.optim import build_optimizer
from ft_framework.optim.groups import build_param_groups, layer_depths, no_decay_parameter_names


def tiny_albert():
    return AlbertForSequenceClassification(AlbertConfig(
        vocab_size=50, embedding_size=8, hidden_size=16, num_hidden_layers=2, num_attention_heads=2,
        intermediate_size=19))


def tiny_bert(layers=3):
    return BertForSequenceClassification(BertConfig(
        vocab_size=50, hidden_size=16, num_hidden_layers=layers, num_attention_heads=2, intermediate_size=19))


def pretrained_part(model, head_prefix="classifier."):
    return {k: v.clone() for k, v in model.state_dict().items() if not k.startswith(head_prefix)}


def by_name(groups):
    return {n: g for g in groups for n in g["param_names"]}


class T5StyleLayerNorm(nn.Module):
    """A custom norm that is no nn.LayerNorm subclass (like T5LayerNorm)."""

    def __init__(self, d):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(d))


class OddlyNamedModel(nn.Module):
    """Names with no 'bert'/'albert' prefix: a substring filter would find nothing to anchor."""

    def __init__(self):
        super().__init__()
        self.transformer = nn.ModuleDict({"wte": nn.Embedding(10, 4), "ln_f": T5StyleLayerNorm(4)})
        self.score = nn.Linear(4, 2)


def test_anchored_parameters_are_found_by_state_dict_matching():
    model = OddlyNamedModel()
    pretrained = {"transformer.wte.weight": torch.randn(10, 4), "transformer.ln_f.weight": torch.randn(4)}
    groups = by_name(build_param_groups(model, pretrained, lr=1e-3, weight_decay=0.1))
    anchored = {n for n, g in groups.items() if g["anchors"] is not None}
    assert anchored == set(pretrained)
    g = groups["transformer.wte.weight"]
    assert torch.equal(g["anchors"][g["param_names"].index("transformer.wte.weight")], pretrained["transformer.wte.weight"])
    assert groups["score.weight"]["anchors"] is None and groups["score.bias"]["anchors"] is None


def test_no_decay_covers_biases_and_every_norm_by_module_type():
    names = no_decay_parameter_names(tiny_albert())
    assert "albert.encoder.albert_layer_groups.0.albert_layers.0.full_layer_layer_norm.weight" in names
    assert "albert.embeddings.LayerNorm.weight" in names and "classifier.bias" in names
    assert not any(n.endswith("query.weight") for n in names)
    assert no_decay_parameter_names(OddlyNamedModel()) == {"transformer.ln_f.weight", "score.bias"}


def test_groups_feed_the_optimizer_with_head_as_plain_adam():
    model = tiny_albert()
    groups = build_param_groups(model, pretrained_part(model), lr=2e-5, weight_decay=0.01)
    opt = build_optimizer("recadam", groups, anneal_k=0.1, anneal_t0=100, pretrain_cof=5000.0)
    anchored = [p for p in model.parameters() if "anchor" in opt.state[p]]
    assert len(anchored) == len(list(model.parameters())) - 2  # all but the classifier
    decay = {g["group_name"]: g["weight_decay"] for g in opt.param_groups}
    assert decay == {"anchored/decay": 0.01, "anchored/no_decay": 0.0, "new/decay": 0.01, "new/no_decay": 0.0}


def test_mismatched_pretrained_shape_is_an_error():
    model = tiny_bert()
    bad = pretrained_part(model)
    bad["bert.pooler.dense.weight"] = torch.zeros(3, 3)
    with pytest.raises(ValueError, match="bert.pooler.dense.weight"):
        build_param_groups(model, bad, lr=1e-3)


def test_layerwise_lr_decay_rates():
    model = tiny_bert(layers=3)
    groups = by_name(build_param_groups(model, pretrained_part(model), lr=1.0, layerwise_lr_decay=0.5))
    assert groups["bert.embeddings.word_embeddings.weight"]["lr"] == 0.5**4
    for i in range(3):
        assert groups[f"bert.encoder.layer.{i}.attention.self.query.weight"]["lr"] == 0.5 ** (3 - i)
    assert groups["bert.pooler.dense.weight"]["lr"] == 1.0
    assert groups["classifier.weight"]["lr"] == 1.0
    with pytest.raises(ValueError, match=r"layerwise_lr_decay must be in \(0, 1\]"):
        build_param_groups(model, None, lr=1.0, layerwise_lr_decay=1.5)


def test_layer_depths_put_albert_embedding_projection_below_the_shared_block():
    depths = layer_depths([n for n, _ in tiny_albert().named_parameters()])
    assert depths["albert.encoder.embedding_hidden_mapping_in.weight"] == 0
    assert depths["albert.encoder.albert_layer_groups.0.albert_layers.0.ffn.weight"] == 1
    assert depths["classifier.weight"] == depths["albert.pooler.weight"] == 2
