"""Our SFT tokens against TRL's (trl >= 1.16, SFTTrainer's dataset preparation) for the same rows and
tokenizer, nothing truncated: the same input_ids, and the same loss mask. A row's first token is
never a target in either (a causal LM's loss predicts token t from the tokens before it): TRL's label
there may be the token itself, ours is -100, so the labels are compared from the second token on.

Two tokenizers: the byte-level one of tests/tiny_llm.py, and one whose BPE merges across a prompt's
end and adds a BOS token (the prompt/completion boundary is where the token lists first differ).

Rows: text, prompt/completion of strings, conversations (marked templates, or what markers would
mark), TRL's conversational prompt/completion, ShareGPT conversations as TRL converts them, and
rows with tools and tool calls."""

from __future__ import annotations

import json

import pytest

from sft_helpers import (CHATML_TEMPLATE, CHATS, MARKED_CHATML, MARKED_WITH_NEWLINE, PAIRS, TEXTS, TOOLS_TEMPLATE,
                         build_tiny_tokenizer, merging_tokenizer, tiny_model, write_jsonl)

from ft_framework.data.sft import SFTSettings, load_sft_data

trl = pytest.importorskip("trl", reason="trl is in the test extra: pip install -e '.[test]'")
pytestmark = pytest.mark.slow  # importing trl takes seconds

TOKENIZERS = {"bytes": build_tiny_tokenizer, "merges": merging_tokenizer}


def trl_rows(tmp_path, rows, tokenizer, **config):
    """(input_ids, labels) of each row after TRL's SFTTrainer prepared the data set."""
    from datasets import Dataset
    from trl import SFTConfig, SFTTrainer

    args = SFTConfig(output_dir=str(tmp_path / "trl"), max_length=None, report_to=[], use_cpu=True, bf16=False,
                     **config)
    trainer = SFTTrainer(model=tiny_model("llama", tokenizer), args=args, train_dataset=Dataset.from_list(rows),
                         processing_class=tokenizer)
    return [(row["input_ids"], row["labels"]) for row in trainer.train_dataset]


def our_rows(tmp_path, rows, tokenizer, **settings):
    path = write_jsonl(tmp_path / "rows.jsonl", rows)
    data = load_sft_data({"train": path, "validation": path}, tokenizer, SFTSettings(max_seq_length=10_000, **settings),
                         cache_dir=tmp_path / "cache")
    assert data.stats["train"]["truncated"] == data.stats["train"]["dropped_no_completion"] == 0
    return [(item["input_ids"], item["labels"]) for item in (data.train[i] for i in range(len(data.train)))]


def assert_same(ours, theirs):
    assert len(ours) == len(theirs)
    for (our_ids, our_labels), (their_ids, their_labels) in zip(ours, theirs):
        assert our_ids == their_ids
        assert our_labels[0] == -100
        assert our_labels[1:] == their_labels[1:]


@pytest.mark.parametrize("tokenizer_name", TOKENIZERS)
def test_text_rows(tmp_path, tokenizer_name):
    tokenizer = TOKENIZERS[tokenizer_name]()
    assert_same(our_rows(tmp_path, TEXTS, tokenizer), trl_rows(tmp_path, TEXTS, tokenizer))


@pytest.mark.parametrize("tokenizer_name", TOKENIZERS)
@pytest.mark.parametrize("train_on_prompt", [False, True])
def test_prompt_completion_rows(tmp_path, tokenizer_name, train_on_prompt):
    tokenizer = TOKENIZERS[tokenizer_name]()
    ours = our_rows(tmp_path, PAIRS, tokenizer, train_on_prompt=train_on_prompt)
    assert_same(ours, trl_rows(tmp_path, PAIRS, tokenizer, completion_only_loss=not train_on_prompt))
    if tokenizer_name == "merges":  # the case the boundary rule is for is in the rows
        prompt_alone = tokenizer(PAIRS[1]["prompt"])["input_ids"]
        assert ours[1][0][:len(prompt_alone)] != prompt_alone


@pytest.mark.parametrize("tokenizer_name", TOKENIZERS)
@pytest.mark.parametrize("template", ["marked", "marked_with_newline"])
def test_conversations_with_a_marked_template_follow_its_markers(tmp_path, tokenizer_name, template):
    tokenizer = TOKENIZERS[tokenizer_name]()
    tokenizer.chat_template = {"marked": MARKED_CHATML, "marked_with_newline": MARKED_WITH_NEWLINE}[template]
    assert_same(our_rows(tmp_path, CHATS, tokenizer), trl_rows(tmp_path, CHATS, tokenizer, assistant_only_loss=True))


@pytest.mark.parametrize("tokenizer_name", TOKENIZERS)
def test_conversations_without_markers_train_what_markers_around_the_turn_would(tmp_path, tokenizer_name):
    """TRL refuses a template without markers that it does not know; ours takes an assistant turn as
    what it adds after the generation prompt, which is what MARKED_CHATML marks."""
    tokenizer = TOKENIZERS[tokenizer_name]()
    assert tokenizer.chat_template == CHATML_TEMPLATE
    ours = our_rows(tmp_path, CHATS, tokenizer)
    tokenizer.chat_template = MARKED_CHATML
    assert_same(ours, trl_rows(tmp_path, CHATS, tokenizer, assistant_only_loss=True))


@pytest.mark.parametrize("template", [CHATML_TEMPLATE, MARKED_CHATML])
def test_conversations_trained_on_every_token(tmp_path, template):
    tokenizer = merging_tokenizer()
    tokenizer.chat_template = template
    assert_same(our_rows(tmp_path, CHATS, tokenizer, train_on_prompt=True),
                trl_rows(tmp_path, CHATS, tokenizer, assistant_only_loss=False))


# ShareGPT as TRL converts it (maybe_convert_to_chatml: from -> role, value -> content): the speakers
# TRL keeps as roles. Ours reads the same rows (and maps human / gpt, which TRL would not).
SHAREGPT = [{"conversations": [{"from": m["role"], "value": m["content"]} for m in row["messages"]]}
            for row in CHATS]
# TRL's conversational prompt/completion, a completion of several messages among them.
CHAT_PAIRS = [{"prompt": row["messages"][:-1], "completion": row["messages"][-1:]} for row in CHATS[:2]] + [
    {"prompt": [{"role": "user", "content": "Count"}],
     "completion": [{"role": "assistant", "content": "one"}, {"role": "user", "content": "more"},
                    {"role": "assistant", "content": "two"}]}]
TOOL_PAIRS = [{"prompt": [{"role": "user", "content": "2+2?"}],
               "completion": [{"role": "assistant", "content": "",
                               "tool_calls": [{"type": "function", "function": {"name": "add", "arguments": "2, 2"}}]},
                              {"role": "tool", "content": "4"}, {"role": "assistant", "content": "It is 4."}],
               "tools": [{"type": "function", "function": {"name": "add", "description": "adds"}}]}]


@pytest.mark.parametrize("tokenizer_name", TOKENIZERS)
def test_sharegpt_conversations_as_trl_converts_them(tmp_path, tokenizer_name):
    tokenizer = TOKENIZERS[tokenizer_name]()
    (tmp_path / "every").mkdir()
    ours = our_rows(tmp_path, SHAREGPT, tokenizer)
    every = our_rows(tmp_path / "every", SHAREGPT, tokenizer, train_on_prompt=True)
    # SFTTrainer converts ShareGPT rows itself when it trains on every token; it checks assistant_only_loss
    # before converting (and refuses), so that case takes the rows through its conversion function first.
    assert_same(every, trl_rows(tmp_path / "every", SHAREGPT, tokenizer, assistant_only_loss=False))
    tokenizer.chat_template = MARKED_CHATML  # TRL needs markers for the assistant's turns
    converted = [trl.maybe_convert_to_chatml(json.loads(json.dumps(row))) for row in SHAREGPT]
    assert_same(ours, trl_rows(tmp_path, converted, tokenizer, assistant_only_loss=True))


@pytest.mark.parametrize("tokenizer_name", TOKENIZERS)
@pytest.mark.parametrize("train_on_prompt", [False, True])
def test_conversational_prompt_completion_rows(tmp_path, tokenizer_name, train_on_prompt):
    tokenizer = TOKENIZERS[tokenizer_name]()
    assert_same(our_rows(tmp_path, CHAT_PAIRS, tokenizer, train_on_prompt=train_on_prompt),
                trl_rows(tmp_path, CHAT_PAIRS, tokenizer, completion_only_loss=not train_on_prompt))


@pytest.mark.parametrize("tokenizer_name", TOKENIZERS)
def test_conversational_prompt_completion_with_tools(tmp_path, tokenizer_name):
    tokenizer = TOKENIZERS[tokenizer_name]()
    tokenizer.chat_template = TOOLS_TEMPLATE
    ours = our_rows(tmp_path, TOOL_PAIRS, tokenizer)
    assert "Tools: " in tokenizer.decode(ours[0][0]) and "<call>" in tokenizer.decode(ours[0][0])
    assert_same(ours, trl_rows(tmp_path, TOOL_PAIRS, tokenizer))


MARKED_TOOLS_TEMPLATE = (
    "{% if tools %}{{ '<|im_start|>system\nTools: ' + (tools | tojson) + '<|im_end|>\n' }}{% endif %}"
    "{% for m in messages %}{% if m['role'] == 'assistant' %}{{ '<|im_start|>assistant\n' }}{% generation %}"
    "{{ m['content'] }}{% if m['tool_calls'] %}{% for c in m['tool_calls'] %}"
    "{{ '<call>' + (c['function'] | tojson) + '</call>' }}{% endfor %}{% endif %}{{ '<|im_end|>\n' }}"
    "{% endgeneration %}{% else %}{{ '<|im_start|>' + m['role'] + '\n' + m['content'] + '<|im_end|>\n' }}{% endif %}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}")
TOOL_CHATS = [{"messages": row["prompt"] + row["completion"], "tools": row["tools"]} for row in TOOL_PAIRS] + [
    {"messages": CHATS[0]["messages"], "tools": TOOL_PAIRS[0]["tools"]}]


@pytest.mark.parametrize("tokenizer_name", TOKENIZERS)
def test_conversations_with_tools_follow_the_templates_markers(tmp_path, tokenizer_name):
    """A marked template gets each row's tools (a row at a time); the same rows through the unmarked
    template take the same tokens and targets."""
    tokenizer = TOKENIZERS[tokenizer_name]()
    tokenizer.chat_template = TOOLS_TEMPLATE
    (tmp_path / "unmarked").mkdir()
    unmarked = our_rows(tmp_path / "unmarked", TOOL_CHATS, tokenizer)
    tokenizer.chat_template = MARKED_TOOLS_TEMPLATE
    ours = our_rows(tmp_path, TOOL_CHATS, tokenizer)
    assert ours == unmarked and all("Tools: " in tokenizer.decode(ids) for ids, _ in ours)
    assert_same(ours, trl_rows(tmp_path, TOOL_CHATS, tokenizer, assistant_only_loss=True))
