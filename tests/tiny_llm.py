"""Tiny decoder LLMs for the tests: a byte-level tokenizer with a ChatML chat template, and a
randomly initialized causal LM of each supported architecture, saved with save_pretrained so that
runs load them through the real from_pretrained path (as a user's checkpoint would be).

    model_dir = build_tiny_llm_dir(tmp_path / "llama", "llama")

Every model is a few hundred thousand parameters, so a forward and backward take milliseconds."""

from __future__ import annotations

from pathlib import Path

# SmolLM2's and Qwen's template (ChatML), written out so the tests need no hub.
CHATML_TEMPLATE = (
    "{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + "
    "'<|im_end|>' + '\n' }}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}")
SPECIAL_TOKENS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")

_COMMON = dict(hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
               num_key_value_heads=2, max_position_embeddings=256)
# model_type -> config keyword arguments (besides vocab_size and the special token ids).
TINY_LLM_CONFIGS: dict[str, dict] = {
    "llama": dict(_COMMON, tie_word_embeddings=True),
    "qwen2": dict(_COMMON, tie_word_embeddings=True),
    "qwen3": dict(_COMMON, head_dim=8, tie_word_embeddings=True),
    "mistral": dict(_COMMON, tie_word_embeddings=False, sliding_window=None),
    "gemma": dict(_COMMON, head_dim=8, tie_word_embeddings=True),
    "gemma2": dict(_COMMON, head_dim=8, query_pre_attn_scalar=8, sliding_window=64, tie_word_embeddings=True),
    "gemma3_text": dict(_COMMON, head_dim=8, query_pre_attn_scalar=8, sliding_window=64, tie_word_embeddings=True),
    "phi3": dict(_COMMON, num_key_value_heads=4, tie_word_embeddings=False, pad_token_id=None),
    "gpt2": dict(n_embd=32, n_layer=2, n_head=4, n_positions=256, tie_word_embeddings=True),
}
TINY_LLM_ARCHITECTURES = tuple(TINY_LLM_CONFIGS)


def build_tiny_tokenizer(path: Path | None = None):
    """A byte-level BPE tokenizer without merges (one token per UTF-8 byte, 256 of them) plus the
    ChatML special tokens, its chat template set; saved into `path` when given."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {ch: i for i, ch in enumerate(sorted(pre_tokenizers.ByteLevel.alphabet()))}
    backend = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    backend.decoder = decoders.ByteLevel()
    backend.add_special_tokens(list(SPECIAL_TOKENS))
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=backend, eos_token="<|im_end|>", pad_token="<|endoftext|>")
    tokenizer.chat_template = CHATML_TEMPLATE
    if path is not None:
        tokenizer.save_pretrained(path)
    return tokenizer


def tiny_llm_config(model_type: str, tokenizer):
    """The transformers config of a tiny `model_type` decoder for `tokenizer`'s vocabulary."""
    from transformers import AutoConfig

    kwargs = dict(TINY_LLM_CONFIGS[model_type])
    kwargs.setdefault("pad_token_id", tokenizer.pad_token_id)
    return AutoConfig.for_model(model_type, vocab_size=len(tokenizer), eos_token_id=tokenizer.eos_token_id,
                                bos_token_id=None, **kwargs)


def build_tiny_llm_dir(path: Path, model_type: str = "llama", seed: int = 0) -> Path:
    """Saves a randomly initialized tiny `model_type` causal LM (every parameter then counts as
    pretrained, as with a real checkpoint) and the tiny tokenizer into `path`."""
    import torch
    from transformers import AutoModelForCausalLM

    path = Path(path)
    tokenizer = build_tiny_tokenizer(path)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(tiny_llm_config(model_type, tokenizer))
    with torch.no_grad():  # a trained model's scale: random init at std 0.02 makes near-uniform outputs
        for name, param in model.named_parameters():
            if param.dim() >= 2:
                param.normal_(0.0, 0.2)
    model.save_pretrained(path)
    return path


def write_sft_rows(directory: Path, *, train_rows: int = 48, eval_rows: int = 12, seed: int = 0) -> dict[str, str]:
    """prompt/completion JSON lines of a small copying task (rows of several lengths, so that ranks
    hold different numbers of label tokens): {"train": path, "validation": path}."""
    import json
    import random

    rng = random.Random(seed)
    words = ["cat", "dog", "sun", "tree", "blue", "red", "fish", "bird", "moon", "stone", "river"]

    def row() -> dict:
        picked = [rng.choice(words) for _ in range(rng.randint(1, 4))]
        return {"prompt": "Reverse: " + " ".join(picked) + "\n", "completion": " ".join(reversed(picked))}

    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    files = {}
    for split, count in (("train", train_rows), ("validation", eval_rows)):
        path = directory / f"{split}.jsonl"
        path.write_text("".join(json.dumps(row()) + "\n" for _ in range(count)))
        files[split] = str(path)
    return files


def write_sft_run_config(path, model_dir, output_dir, files: dict[str, str], **sections):
    """A short supervised fine-tuning run of a tiny decoder on `files`; `sections` update the defaults."""
    import yaml

    cfg = {
        "model": {"name_or_path": str(model_dir)},
        "data": {"problem": "causal_lm", "source": "files", "files": dict(files), "max_seq_length": 64,
                 "token_cache_dir": str(Path(output_dir).parent / "token_cache")},
        "optimizer": {"name": "recadam", "hparams": {"lr": 3e-3, "anneal_k": 0.5, "anneal_t0": 5,
                                                      "pretrain_cof": 100.0}},
        "schedule": {"name": "linear", "warmup_steps": 1},
        "training": {"max_steps": 6, "per_device_batch_size": 8, "seed": 1, "data_seed": 2, "device": "cpu"},
        "evaluation": {"num_evals": 2, "batch_size": 8, "forgetting": {"num_sentences": 7},
                       "generation": {"samples": 2, "max_new_tokens": 8}},
        "logging": {"output_dir": str(output_dir), "log_every_steps": 1, "progress_bar": False},
    }
    for section, values in sections.items():
        cfg.setdefault(section, {}).update(values)
    Path(path).write_text(yaml.safe_dump(cfg))
    return path
