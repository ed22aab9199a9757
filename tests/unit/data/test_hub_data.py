"""Your own data from a Hub data set (data/hub_tables.py; data.source: hub with data.hub_id), offline:
a data set in the Hugging Face cache (tests/hub_cache.py makes one as a download leaves it) loads with
HF_HUB_OFFLINE=1 in a fresh process, and gives the tokens (SFT) and the texts and labels (labelled
data) of the same rows read from JSON lines; the token cache keys on the data set's revision. The
config's rules for the hub source are checked here too."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

TESTS = Path(__file__).resolve().parents[2]
if str(TESTS) not in sys.path:  # the worker below runs this file as a script
    sys.path.insert(0, str(TESTS))

from hub_cache import REVISION, cache_hub_dataset, offline_env  # noqa: E402

from ft_framework.config.schema import DataConfig  # noqa: E402

PAIRS = [{"prompt": f"Question {i}: what is {i} + {i}?", "completion": f" {2 * i}"} for i in range(7)]
CHATS = [{"messages": [{"role": "user", "content": f"Say {word}"}, {"role": "assistant", "content": word}]}
         for word in ("yes", "no", "maybe")]
REVIEWS = [{"text": f"review number {i}", "label": i % 2, "stars": i} for i in range(6)]
SPLITS = {"pairs": {"train": PAIRS, "test": PAIRS[:3]}, "chats": {"train": CHATS, "test": CHATS[1:]},
          "reviews": {"train": REVIEWS, "dev": REVIEWS[2:]},
          "bad": {"train": CHATS[:1] + [{"messages": [{"role": "user", "content": "no answer"}]}], "test": CHATS}}


# ---- the worker: runs offline in a fresh process -------------------------------------------------------
def _worker(home: Path) -> dict:
    from tiny_llm import build_tiny_llm_dir, build_tiny_tokenizer, write_sft_run_config

    from ft_framework.data.hub_tables import HubSource, open_hub_split
    from ft_framework.data.own_data import own_data_splits, own_hub_splits
    from ft_framework.data.sft import SFTSettings, load_sft_data
    from ft_framework.data.tasks import own_data_task
    from ft_framework.errors import UserError

    tokenizer = build_tiny_tokenizer()
    out: dict = {"sft": {}, "errors": {}}

    def entries() -> int:
        return sum(not path.name.startswith(".") for path in (home / "tokens").iterdir())

    def items(data):
        return [data.train[i] for i in range(len(data.train))], [data.eval["validation"][i]
                                                                  for i in range(len(data.eval["validation"]))]

    for name in ("pairs", "chats"):
        files = {}
        for ours, theirs in (("train", "train"), ("validation", "test")):
            path = home / f"{name}_{ours}.jsonl"
            path.write_text("".join(json.dumps(row) + "\n" for row in SPLITS[name][theirs]), encoding="utf-8")
            files[ours] = path
        settings = SFTSettings(max_seq_length=64)
        from_files = items(load_sft_data(files, tokenizer, settings, cache_dir=home / "tokens"))
        for streaming in (False, True):
            source = HubSource(f"someorg/{name}", None, {"train": "train", "validation": "test"}, streaming)
            hub = {split: open_hub_split(source, split) for split in source.splits}
            entries_before = entries()
            from_hub = items(load_sft_data(hub, tokenizer, settings, cache_dir=home / "tokens"))
            out["sft"][f"{name} streaming={streaming}"] = {
                "same": from_hub == from_files, "rows": len(from_hub[0]),
                "fingerprints": {split: split_.fingerprint for split, split_ in hub.items()},
                "new_entries": entries() - entries_before}

    spec = own_data_task("reviews", text_columns=("text",), label_column="label", labels=("0", "1"),
                         eval_splits=("validation",))
    files = {}
    for ours, theirs in (("train", "train"), ("validation", "dev")):
        files[ours] = home / f"reviews_{ours}.jsonl"
        files[ours].write_text("".join(json.dumps(row) + "\n" for row in SPLITS["reviews"][theirs]))
    own_files = own_data_splits(spec, files)
    own_hub = own_hub_splits(spec, HubSource("someorg/reviews", None, {"train": "train", "validation": "dev"}))
    out["own"] = {split: [own_hub[split].texts == own_files[split].texts,
                          own_hub[split].labels.tolist() == own_files[split].labels.tolist(),
                          len(own_hub[split].labels)] for split in own_files}

    for case, (hub_id, splits, split) in {
            "no such split": ("someorg/pairs", {"train": "train", "validation": "validation"}, "validation"),
            "not cached": ("someorg/absent", {"train": "train", "validation": "validation"}, "train")}.items():
        try:
            open_hub_split(HubSource(hub_id, None, splits), split)
            out["errors"][case] = None
        except UserError as exc:
            out["errors"][case] = str(exc)
    from ft_framework.config import load_config
    from ft_framework.config.errors import ConfigError

    model = build_tiny_llm_dir(home / "llama")
    for case, hub_id in (("config: not cached", "someorg/absent"), ("config: no such split", "someorg/pairs")):
        config = write_sft_run_config(home / "run.yaml", model, home / "run", {})
        try:
            load_config(config, ["data.source=hub", f"data.hub_id={hub_id}", "data.files=null"])
            out["errors"][case] = None
        except ConfigError as exc:
            out["errors"][case] = str(exc)
    bad = HubSource("someorg/bad", None, {"train": "train", "validation": "test"})
    try:
        load_sft_data({"train": open_hub_split(bad, "train"), "validation": open_hub_split(bad, "validation")},
                      tokenizer, SFTSettings(max_seq_length=64), cache_dir=home / "tokens")
        out["errors"]["rows named"] = None
    except UserError as exc:
        out["errors"]["rows named"] = str(exc)
    return out


@pytest.fixture(scope="module")
def offline(tmp_path_factory):
    """The worker's answers, run in a fresh process with HF_HUB_OFFLINE=1 against a cache holding the sets."""
    home = tmp_path_factory.mktemp("hf_home")
    for name, splits in SPLITS.items():
        cache_hub_dataset(home, f"someorg/{name}", splits)
    env = offline_env(dict(os.environ), home)
    env["PYTHONPATH"] = os.pathsep.join([str(TESTS), env.get("PYTHONPATH", "")])
    done = subprocess.run([sys.executable, __file__, str(home)], capture_output=True, text=True, env=env, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize("name", ["pairs", "chats"])
@pytest.mark.parametrize("streaming", [False, True])
def test_sft_rows_from_a_cached_hub_data_set_equal_the_same_rows_from_json_lines(offline, name, streaming):
    got = offline["sft"][f"{name} streaming={streaming}"]
    assert got["same"] and got["rows"] == len(SPLITS[name]["train"])
    # keyed on the revision, the configuration and the split: one entry per split, read again when streamed
    assert got["new_entries"] == (0 if streaming else 2)
    assert len(set(got["fingerprints"].values())) == 2


def test_labelled_texts_from_a_cached_hub_data_set_equal_the_same_rows_from_json_lines(offline):
    assert offline["own"] == {"train": [True, True, 6], "validation": [True, True, 4]}


def test_hub_mistakes_are_one_line(offline):
    errors = offline["errors"]
    assert errors["no such split"] == ("data.splits.validation: someorg/pairs has no split 'validation'; its splits: "
                                       "train, test (data.splits maps ours to them, e.g. {train: train, validation: "
                                       "test})")
    assert errors["not cached"].startswith("data.hub_id 'someorg/absent': cannot load the data set (")
    assert errors["not cached"].endswith("offline (HF_HUB_OFFLINE=1) only a data set already in the Hugging Face "
                                         "cache loads")
    assert "\n" not in errors["not cached"]
    # ft-train checks an offline Hub source before it loads anything
    assert errors["config: not cached"].startswith("data.hub_id 'someorg/absent': cannot load the data set (")
    assert errors["config: no such split"].startswith("data.splits.validation: someorg/pairs has no split")
    assert errors["rows named"] == ("someorg/bad[train][1]: the conversation has no assistant message; the loss is on "
                                    "the assistant's turns (roles: ['user'])")


def test_the_fingerprint_is_the_revisions(tmp_path):
    from ft_framework.data.hub_tables import HubSource, HubSplit

    class Builder:  # what HubSplit reads of datasets' builder: its configuration and revision
        config_id, hash = "default", REVISION

    source = HubSource("org/name", None, {"train": "train", "validation": "test"})
    one, again = HubSplit(source, "train", Builder()), HubSplit(source, "train", Builder())
    assert one.fingerprint == again.fingerprint != HubSplit(source, "validation", Builder()).fingerprint
    moved = Builder()
    moved.hash = "f" * 40
    assert HubSplit(source, "train", moved).fingerprint != one.fingerprint


# ---- the config ----------------------------------------------------------------------------------------
SFT = {"problem": "causal_lm", "source": "hub", "hub_id": "trl-lib/Capybara"}
OWN = {"source": "hub", "hub_id": "org/reviews", "text_columns": ["text"], "labels": ["neg", "pos"]}


def test_a_hub_source_is_read_for_sft_and_for_labelled_texts():
    sft = DataConfig.model_validate({**SFT, "splits": {"train": "train", "validation": "test"}, "hub_config": "c"})
    assert (sft.hub_source().hub_id, sft.hub_source().config, dict(sft.hub_source().splits)) == \
        ("trl-lib/Capybara", "c", {"train": "train", "validation": "test"})
    assert sft.task_spec().eval_splits == ("validation",)
    with_test = DataConfig.model_validate({**OWN, "splits": {"train": "a", "validation": "b", "test": "c"},
                                           "streaming": True})
    assert with_test.task_spec().eval_splits == ("validation", "test") and with_test.hub_source().streaming
    assert with_test.loader_arguments()["hub"] == with_test.hub_source()
    for cfg in (sft, with_test):  # results.json keeps the resolved config; it validates back to the same one
        assert DataConfig.model_validate(cfg.model_dump()) == cfg
    assert DataConfig.model_validate({"task": "sst2"}).hub_source() is None  # GLUE from the Hub, as before
    assert DataConfig.model_validate({"task": "sst2", "hub_id": "me/glue"}).hub_source() is None


@pytest.mark.parametrize("data, message", [
    ({"problem": "causal_lm", "source": "hub"}, "data.source: hub with data.problem: causal_lm needs data.hub_id"),
    ({"source": "hub", "text_columns": ["text"], "labels": ["a", "b"]},
     "data.text_columns describes your own data: set data.source: files with it (or data.source: hub with "
     "data.hub_id and no data.task)"),
    ({**SFT, "files": {"train": "a.jsonl", "validation": "b.jsonl"}},
     "data.files is read only with data.source: files"),
    ({**SFT, "source": "files", "files": {"train": "a.jsonl", "validation": "b.jsonl"}},
     "data.hub_id names a Hub data set, which data.source: files does not read"),
    ({"problem": "causal_lm", "source": "files", "files": {"train": "a", "validation": "b"}, "splits": {"train": "x"}},
     "data.splits describes your own data set on the Hub: set data.source: hub with data.hub_id"),
    ({"task": "sst2", "streaming": True}, "data.streaming describes your own data set on the Hub"),
    ({**SFT, "splits": {"train": "train"}}, "data.splits.validation is required"),
    ({**SFT, "splits": {"train": "train", "validation": "test", "tset": "x"}},
     "unknown split data.splits.tset (did you mean 'test'?); valid: train, validation, test"),
    ({**SFT, "splits": {"train": "train", "validation": " "}}, "data.splits.validation is empty"),
    ({**SFT, "hub_id": ""}, "data.hub_id is empty"),
    ({"source": "hub"}, "set data.task (a GLUE task: cola"),
])
def test_hub_config_mistakes_are_one_line(data, message):
    from pydantic import ValidationError

    with pytest.raises(ValidationError) as refused:
        DataConfig.model_validate(data)
    assert message in str(refused.value)


if __name__ == "__main__":
    print(json.dumps(_worker(Path(sys.argv[1]))))
