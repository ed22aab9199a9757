"""LoRA through peft (ft_framework/lora.py): config checks, default targets (ALBERT's shared layer),
every optimizer of the registry, the merged weights' forgetting distance. Real runs on the tiny
BERT: tests/recipes/test_lora_run.py."""

import pytest
import torch

pytest.importorskip("peft")

from ft_framework.config import ConfigError, validate_config  # noqa: E402
from ft_framework.models.lora import apply_lora, default_target_modules, merged_copy, merged_forgetting_distance  # noqa: E402
from ft_framework.optim import available_optimizers, build_optimizer  # noqa: E402
from ft_framework.optim.groups import build_param_groups  # noqa: E402


def tiny_albert():
    from transformers import AlbertConfig, AlbertForSequenceClassification

    cfg = AlbertConfig(vocab_size=100, embedding_size=16, hidden_size=32, num_hidden_layers=3,
                       num_attention_heads=2, intermediate_size=37, hidden_dropout_prob=0.0,
                       attention_probs_dropout_prob=0.0, classifier_dropout_prob=0.0)
    torch.manual_seed(0)
    return AlbertForSequenceClassification(cfg)


class _Lora:
    def __init__(self, r=4, alpha=8.0, dropout=0.0, target_modules=None):
        self.r, self.alpha, self.dropout, self.target_modules = r, alpha, dropout, target_modules


def _base(**model):
    return {"model": {"name_or_path": "x", **model}, "data": {"task": "sst2"},
            "schedule": {"warmup_steps": 0}, "training": {"max_steps": 1}}


def test_config_refuses_what_cannot_combine_with_lora():
    assert validate_config(_base(lora={"r": 4})).model.lora.alpha == 16.0
    with pytest.raises(ConfigError, match="init: random"):
        validate_config(_base(lora={"r": 4}, init="random"))
    with pytest.raises(ConfigError, match="mixout"):
        validate_config(_base(lora={}, mixout=0.1))
    data = _base(lora={})
    data["strategy"] = {"name": "deepspeed", "deepspeed": {"zero_stage": 3}}
    with pytest.raises(ConfigError, match="ZeRO-3"):
        validate_config(data)
    data["strategy"]["deepspeed"]["zero_stage"] = 2
    validate_config(data)
    data["checkpoint"] = {"every_steps": 10}
    validate_config(data)  # checkpoints (the sharded layout) work; the best-model copy does not yet
    data["evaluation"] = {"select_best": True}
    with pytest.raises(ConfigError, match="select_best"):
        validate_config(data)
    with pytest.raises(ConfigError, match="lora"):
        validate_config(_base(lora={"rank": 4}))


def test_albert_shared_layer_gets_one_shared_adapter_per_target():
    model = tiny_albert()
    assert default_target_modules(model) == ["query", "value"]
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    lora = apply_lora(model, _Lora(), ["classifier.weight", "classifier.bias"])
    trainable = [n for n, p in lora.named_parameters() if p.requires_grad]
    # One shared layer (3 layers, 1 group): one A and one B per target, used by every layer.
    assert sum(".lora_A." in n for n in trainable) == 2 and sum(".lora_B." in n for n in trainable) == 2
    assert all("albert_layer_groups.0.albert_layers.0" in n for n in trainable if "lora_" in n)
    assert {n for n in trainable if "lora_" not in n} == {"base_model.model.classifier.modules_to_save.default.weight",
                                                         "base_model.model.classifier.modules_to_save.default.bias"}
    with torch.no_grad():
        for n, p in lora.named_parameters():
            if ".lora_B." in n:
                p.normal_(0, 0.1)
    expected = 0.0
    for module in lora.modules():
        if hasattr(module, "lora_A") and "default" in module.lora_A:
            b, a = module.lora_B["default"].weight.detach().double(), module.lora_A["default"].weight.detach().double()
            delta = b @ a * module.scaling["default"]
            expected += float(delta.square().sum())
    merged = merged_copy(lora)
    pretrained_q = before["albert.encoder.albert_layer_groups.0.albert_layers.0.attention.query.weight"]
    merged_q = merged.state_dict()["albert.encoder.albert_layer_groups.0.albert_layers.0.attention.query.weight"]
    assert not torch.equal(merged_q, pretrained_q)
    dist = sum(float((merged.state_dict()[n].double() - before[n].double()).square().sum())
               for n in before if not n.startswith("classifier."))
    # The merged weights are fp32 (θ* + ΔW rounded): equal to fp32 precision.
    assert merged_forgetting_distance(lora) == pytest.approx(dist ** 0.5, rel=1e-6)
    assert merged_forgetting_distance(lora) == pytest.approx(expected ** 0.5, rel=1e-9)
    x = torch.randint(0, 100, (2, 7))
    lora.eval(), merged.eval()
    with torch.no_grad():
        torch.testing.assert_close(lora(input_ids=x).logits, merged(input_ids=x).logits, rtol=1e-5, atol=1e-6)


def test_unknown_target_module_is_a_clear_error():
    with pytest.raises(ValueError, match="match no module.*Linear modules are"):
        apply_lora(tiny_albert(), _Lora(target_modules=["q_proj"]), [])


@pytest.mark.parametrize("name", available_optimizers())
def test_every_optimizer_trains_the_adapters_only(name):
    model = tiny_albert()
    lora = apply_lora(model, _Lora(), ["classifier.weight", "classifier.bias"])
    frozen = {n: p.detach().clone() for n, p in lora.named_parameters() if not p.requires_grad}
    groups = build_param_groups(lora, {}, lr=1e-2)
    opt = build_optimizer(name, groups, impl="torch")
    batch = {"input_ids": torch.randint(0, 100, (4, 6)), "labels": torch.tensor([0, 1, 0, 1])}
    for _ in range(2):
        lora(**batch).loss.backward()
        opt.step()
        opt.zero_grad()
    assert all(torch.equal(p, frozen[n]) for n, p in lora.named_parameters() if n in frozen)
    assert merged_forgetting_distance(lora) > 0
