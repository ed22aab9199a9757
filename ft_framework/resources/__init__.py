"""Data files shipped inside the package (included in the wheel with the package directory)."""

from pathlib import Path


def quickstart_glue_dir() -> Path:
    """Root of the synthetic quickstart task in GLUE layout (``<root>/SST-2/{train,dev}.tsv``).

    Pass it as ``load_glue("sst2", source=str(quickstart_glue_dir()), ...)``.
    """
    return Path(__file__).resolve().parent / "quickstart_glue"


def quickstart_sft_dir() -> Path:
    """The SFT quickstart's task (``train.jsonl``, ``validation.jsonl``: prompt/completion rows of
    orders rewritten in a made-up house style; its README.md says how scripts/make_quickstart_sft.py
    wrote them): the built-in data set ``quickstart_sft``."""
    return Path(__file__).resolve().parent / "quickstart_sft"


# General text shipped in the package, by the name a config gives it as "builtin:<name>"
# (optimizer.importance.source, data.replay.file): the file inside this package. general_text/ is written
# by scripts/build_general_text.py from the docstrings of Python's standard library (its README.md).
GENERAL_TEXTS = {"general_text": "general_text/general_text.txt"}


def general_text_file(name: str) -> Path:
    """The shipped general-text file GENERAL_TEXTS names `name` (one document a line, UTF-8)."""
    return Path(__file__).resolve().parent / GENERAL_TEXTS[name]


def benchmarks_dir() -> Path:
    """The lm-evaluation-harness tasks shipped with the package, one folder each (a task YAML, its rows,
    their licence and provenance): pass it to lm-eval as `--include_path` or `TaskManager(include_path=...)`.
    wordnet_gloss/ is written by scripts/build_wordnet_benchmark.py from WordNet 3.0."""
    return Path(__file__).resolve().parent / "benchmarks"


# Hub ids whose published architecture (config.json only, no weights) ships in architectures/, so
# that the memory plan answers for them without the Hugging Face cache.
PUBLISHED_ARCHITECTURES = {
    "albert/albert-xxlarge-v2": "albert-xxlarge-v2.json", "albert-xxlarge-v2": "albert-xxlarge-v2.json",
    "google-bert/bert-base-uncased": "bert-base-uncased.json", "bert-base-uncased": "bert-base-uncased.json",
    "google-bert/bert-large-uncased": "bert-large-uncased.json", "bert-large-uncased": "bert-large-uncased.json",
    # A base model and its -Instruct share the architecture (their config.json differ in token ids only).
    "meta-llama/Llama-3.1-8B": "llama-3.1-8b.json", "meta-llama/Llama-3.1-8B-Instruct": "llama-3.1-8b.json",
    "meta-llama/Llama-3.2-1B": "llama-3.2-1b.json", "meta-llama/Llama-3.2-1B-Instruct": "llama-3.2-1b.json",
    "Qwen/Qwen2.5-7B": "qwen2.5-7b.json", "Qwen/Qwen2.5-7B-Instruct": "qwen2.5-7b.json",
}


def published_architecture_file(hub_id: str) -> Path | None:
    """The shipped config.json of `hub_id`'s architecture, or None when none ships."""
    name = PUBLISHED_ARCHITECTURES.get(hub_id)
    return Path(__file__).resolve().parent / "architectures" / name if name else None
