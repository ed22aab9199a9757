"""Shared pieces of the SFT data tests: a second tiny tokenizer whose BPE merges tokens (so that a
prompt and its completion can merge across their boundary) and adds a BOS token, chat templates with
and without generation markers, rows of each shape, and tiny models in memory."""

from __future__ import annotations

import json
from pathlib import Path

from tiny_llm import CHATML_TEMPLATE, SPECIAL_TOKENS, TINY_LLM_CONFIGS, build_tiny_tokenizer

__all__ = ["CHATML_TEMPLATE", "CHATS", "MARKED_CHATML", "MARKED_WITH_NEWLINE", "PAIRS", "TEXTS", "TOOLS_TEMPLATE",
           "build_tiny_tokenizer", "merging_tokenizer", "tiny_model", "write_jsonl"]

# ChatML with generation markers around what an assistant turn adds after the generation prompt:
# its content, <|im_end|> and the newline.
MARKED_CHATML = (
    "{% for message in messages %}{% if message['role'] == 'assistant' %}{{ '<|im_start|>assistant\n' }}"
    "{% generation %}{{ message['content'] + '<|im_end|>' + '\n' }}{% endgeneration %}"
    "{% else %}{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}{% endif %}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}")
# As TRL's Qwen2.5 training template marks it: the newline after the role name is the assistant's too.
MARKED_WITH_NEWLINE = (
    "{% for message in messages %}{% if message['role'] == 'assistant' %}{{ '<|im_start|>assistant' }}"
    "{% generation %}{{ '\n' + message['content'] + '<|im_end|>\n' }}{% endgeneration %}"
    "{% else %}{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}{% endif %}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}")
# A ChatML template that renders a row's tools (in a system turn of their own) and an assistant's
# tool calls, and the tool's answer as a turn of role tool (Arrow gives every message every field,
# null where absent: the template reads only what is there).
TOOLS_TEMPLATE = (
    "{% if tools %}{{ '<|im_start|>system\nTools: ' + (tools | tojson) + '<|im_end|>\n' }}{% endif %}"
    "{% for m in messages %}{{ '<|im_start|>' + m['role'] + '\n' + m['content'] }}"
    "{% if m['tool_calls'] %}{% for c in m['tool_calls'] %}{{ '<call>' + (c['function'] | tojson) + '</call>' }}"
    "{% endfor %}{% endif %}{{ '<|im_end|>\n' }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}")

TEXTS = [{"text": "The quick brown fox jumps over the lazy dog."}, {"text": "Ünïcödé and emoji 🦊 too"},
         {"text": "already ends with the EOS<|im_end|>"}]
PAIRS = [{"prompt": "Question: what is 12 + 30?\nAnswer:", "completion": " 42"},
         {"prompt": "Hello ", "completion": "there, the theme is the thing"},   # merges across the boundary
         {"prompt": "Translate 'chat' to English:", "completion": " cat<|im_end|>"},  # its EOS is already there
         {"prompt": "", "completion": "from nothing"},
         {"prompt": "Empty answer:", "completion": ""}]
CHATS = [{"messages": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "What is 2+2?"},
                       {"role": "assistant", "content": "4"}]},
         {"messages": [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello there!"},
                       {"role": "user", "content": "And the theme?"}, {"role": "assistant", "content": "Thethe."}]},
         {"messages": [{"role": "user", "content": "last turn is the user's"}, {"role": "assistant", "content": "ok"},
                       {"role": "tool", "content": "{\"result\": 1}"}, {"role": "user", "content": "thanks"}]}]

_CORPUS = ["the theme of the thing is there", "Hello there, the theme is the thing", "Question: what is 12 + 30?",
           "Answer: 42", "Translate to English", "The quick brown fox jumps over the lazy dog."]


def merging_tokenizer():
    """A byte-level BPE trained on a few sentences (merges such as ' the', 'there'), adding a BOS
    token before every text as Llama's tokenizers do, with the ChatML template."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast

    backend = Tokenizer(models.BPE())
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    backend.decoder = decoders.ByteLevel()
    specials = ["<s>", *SPECIAL_TOKENS]
    backend.train_from_iterator(_CORPUS * 20, trainers.BpeTrainer(
        vocab_size=320, special_tokens=specials, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False))
    bos = backend.token_to_id("<s>")
    backend.post_processor = processors.TemplateProcessing(single="<s> $A", pair="<s> $A <s> $B",
                                                           special_tokens=[("<s>", bos)])
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=backend, bos_token="<s>", eos_token="<|im_end|>",
                                        pad_token="<|endoftext|>")
    tokenizer.chat_template = CHATML_TEMPLATE
    return tokenizer


def write_jsonl(path: Path, rows: list[dict]) -> Path:
    path.write_text("".join(json.dumps(row) + "\n" for row in rows), encoding="utf-8")
    return path


def tiny_model(model_type: str, tokenizer, attn_implementation: str = "eager", seed: int = 0, **config):
    """A tiny random `model_type` causal LM (tests/tiny_llm.py's configs, `config` changing some), in
    memory, in eval mode."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    kwargs = dict(TINY_LLM_CONFIGS[model_type], **config)
    kwargs.setdefault("pad_token_id", tokenizer.pad_token_id)
    settings = AutoConfig.for_model(model_type, vocab_size=len(tokenizer), eos_token_id=tokenizer.eos_token_id,
                                    bos_token_id=None, **kwargs)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(settings, attn_implementation=attn_implementation)
    with torch.no_grad():
        for param in model.parameters():
            if param.dim() >= 2:
                param.normal_(0.0, 0.2)
    return model.eval()
