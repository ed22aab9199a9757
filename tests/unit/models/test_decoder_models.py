"""Decoder LLMs of every supported architecture through the real loading path: θ* for every
parameter (tied embeddings once), the decoder layers as the units of FSDP2 and activation
checkpointing, fused activations where a model writes one as separate ops, LoRA's default targets,
and a run's export that AutoModelForCausalLM loads and generates from, chat template included."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from tiny_llm import TINY_LLM_ARCHITECTURES, build_tiny_llm_dir, write_sft_rows, write_sft_run_config
from ft_framework.config import ModelConfig, load_config
from ft_framework.models.activation_checkpointing import apply_activation_checkpointing, checkpointed_blocks
from ft_framework.models.blocks import transformer_block_lists
from ft_framework.models.fused_activations import fuse_activations
from ft_framework.models.loading import ModelClass, load_model_and_tokenizer
from ft_framework.task_kinds.causal_lm import greedy_completions

CAUSAL_LM = ModelClass("AutoModelForCausalLM", new_head=False)


@pytest.fixture(scope="module")
def model_dirs(tmp_path_factory):
    root = tmp_path_factory.mktemp("decoders")
    return {arch: build_tiny_llm_dir(root / arch, arch) for arch in TINY_LLM_ARCHITECTURES}


@pytest.mark.parametrize("arch", TINY_LLM_ARCHITECTURES)
def test_every_parameter_has_theta_star_and_the_layers_are_the_blocks(model_dirs, arch):
    loaded = load_model_and_tokenizer(ModelConfig(name_or_path=str(model_dirs[arch])), model_class=CAUSAL_LM, seed=0)
    model = loaded.model
    assert type(model).__name__.endswith(("ForCausalLM", "LMHeadModel"))
    assert loaded.new_parameter_names == []
    params = dict(model.named_parameters())  # a tied output layer is the embedding's tensor: listed once
    assert loaded.pretrained_state.keys() == params.keys()
    for name, value in loaded.pretrained_state.items():
        assert value.dtype == torch.float32 and torch.equal(value, params[name].detach()), name
    if model.config.tie_word_embeddings:
        assert model.get_output_embeddings().weight is model.get_input_embeddings().weight
        assert sum(p.numel() for p in model.parameters()) == sum(v.numel() for v in loaded.pretrained_state.values())
    # FSDP2 shards, and activation checkpointing recomputes, one decoder layer at a time.
    (name, layers), = transformer_block_lists(model)
    assert len(layers) == model.config.num_hidden_layers
    assert name.endswith(("layers", "h"))
    assert apply_activation_checkpointing(model) == model.config.num_hidden_layers
    assert checkpointed_blocks(model) == list(layers)


def test_gpt2_gelu_is_fused_and_its_outputs_stay(model_dirs):
    loaded = load_model_and_tokenizer(ModelConfig(name_or_path=str(model_dirs["gpt2"])), model_class=CAUSAL_LM, seed=0)
    ids = torch.tensor([loaded.tokenizer("a fused activation")["input_ids"]])
    with torch.no_grad():
        before = loaded.model.eval()(input_ids=ids).logits
        assert fuse_activations(loaded.model) == {"gelu_new": 2}
        after = loaded.model(input_ids=ids).logits
    torch.testing.assert_close(after, before, rtol=1e-6, atol=1e-5)


@pytest.mark.parametrize("arch", TINY_LLM_ARCHITECTURES)
def test_lora_adapts_a_decoders_default_targets(model_dirs, arch):
    pytest.importorskip("peft")
    from ft_framework.config.schema import LoraConfig

    cfg = ModelConfig(name_or_path=str(model_dirs[arch]), lora=LoraConfig(r=2, alpha=4))
    loaded = load_model_and_tokenizer(cfg, model_class=CAUSAL_LM, seed=0)
    trainable = [n for n, p in loaded.model.named_parameters() if p.requires_grad]
    assert trainable and all("lora_" in n for n in trainable)
    assert loaded.pretrained_state == {}  # the optimizer anchors nothing: the merged weights' distance counts


def test_a_runs_export_loads_and_generates_with_its_chat_template(model_dirs, tmp_path):
    """ft-train's export is a plain transformers directory: AutoModelForCausalLM generates from it
    what the run's own greedy decoding generated, and its tokenizer keeps the chat template."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from ft_framework.trainer import Trainer

    files = write_sft_rows(tmp_path / "data", train_rows=16, eval_rows=4)
    config = write_sft_run_config(tmp_path / "run.yaml", model_dirs["qwen2"], tmp_path / "run", files,
                                  training={"max_steps": 3}, checkpoint={"export_dir": str(tmp_path / "export")})
    trainer = Trainer(load_config(config))
    results = trainer.fit()
    assert results["exported_to"] == str(tmp_path / "export")
    model = AutoModelForCausalLM.from_pretrained(tmp_path / "export", dtype=torch.float32).eval()
    tokenizer = AutoTokenizer.from_pretrained(tmp_path / "export")
    assert tokenizer.chat_template is not None
    messages = [{"role": "user", "content": "Reverse: sun moon"}]
    prompt = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    assert prompt.endswith("<|im_start|>assistant\n")
    ids = tokenizer(prompt, return_tensors="pt")["input_ids"]
    generated = model.generate(ids, max_new_tokens=6, do_sample=False, min_new_tokens=6)[0, ids.shape[1]:].tolist()
    # The same answer as the run's own greedy decoding of the trained model (with its cache).
    trained = trainer.strategy.unwrapped_model().eval()
    ours = greedy_completions(lambda batch: trained(**batch), [ids[0].tolist()], 6, tokenizer.pad_token_id,
                              torch.device("cpu"))[0]
    assert generated == ours
    record = json.loads((tmp_path / "export" / "ft_export.json").read_text())
    assert Path(record["run"]) == (tmp_path / "run").resolve()


def test_a_model_that_names_its_own_code_is_one_line_not_a_prompt(model_dirs, tmp_path):
    """What the config's check (config/loading.py) does for a local directory, loading does for any
    source (a hub id included): transformers refuses without asking, and the refusal is one line."""
    import shutil

    from ft_framework.errors import UserError

    custom = tmp_path / "custom"
    shutil.copytree(model_dirs["llama"], custom)
    config = json.loads((custom / "config.json").read_text())
    config.update(model_type="mycustom", auto_map={"AutoConfig": "configuration_my.MyConfig",
                                                   "AutoModelForCausalLM": "modeling_my.MyModel"})
    (custom / "config.json").write_text(json.dumps(config))
    with pytest.raises(UserError, match="needs its own Python code to load .* never runs"):
        load_model_and_tokenizer(ModelConfig(name_or_path=str(custom)), model_class=CAUSAL_LM, seed=0)
