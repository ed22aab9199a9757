"""An SFT run from a Hub data set in the Hugging Face cache trains offline (HF_HUB_OFFLINE=1, ft-train
in a fresh process) and equals the run on the same rows from JSON lines: the same losses at every
step, the same evaluations."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from hub_cache import cache_hub_dataset, offline_env
from tiny_llm import build_tiny_llm_dir, write_sft_rows, write_sft_run_config

REPO = Path(__file__).resolve().parents[2]


def records(run_dir: Path, kind: str) -> list[dict]:
    return [r for r in map(json.loads, (run_dir / "metrics.jsonl").read_text().splitlines()) if r["type"] == kind]


def train(config: Path, env: dict, cwd: Path) -> dict:
    done = subprocess.run([sys.executable, str(REPO / "launch" / "train.py"), "--config", str(config)],
                          capture_output=True, text=True, cwd=cwd, env=env, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads((Path(yaml_output_dir(config)) / "results.json").read_text())


def yaml_output_dir(config: Path) -> str:
    return yaml.safe_load(config.read_text())["logging"]["output_dir"]


@pytest.mark.slow  # two ft-train processes
def test_an_sft_run_from_a_cached_hub_data_set_trains_offline_as_from_json_lines(tmp_path):
    model = build_tiny_llm_dir(tmp_path / "llama", "llama")
    files = write_sft_rows(tmp_path / "data", train_rows=24, eval_rows=6)
    rows = {split: [json.loads(line) for line in Path(path).read_text().splitlines()] for split, path in files.items()}
    home = tmp_path / "hf_home"
    cache_hub_dataset(home, "someorg/reverse-words", {"train": rows["train"], "test": rows["validation"]})
    env = offline_env(dict(os.environ), home)
    common = dict(training={"max_steps": 4}, evaluation={"num_evals": 2, "batch_size": 8,
                                                         "forgetting": {"num_sentences": 4}})
    from_files = write_sft_run_config(tmp_path / "files.yaml", model, tmp_path / "files_run", files, **common)
    from_hub = write_sft_run_config(tmp_path / "hub.yaml", model, tmp_path / "hub_run", files, **common)
    hub_cfg = yaml.safe_load(from_hub.read_text())
    hub_cfg["data"].pop("files")
    hub_cfg["data"].update(source="hub", hub_id="someorg/reverse-words",
                           splits={"train": "train", "validation": "test"})
    from_hub.write_text(yaml.safe_dump(hub_cfg))

    want, got = train(from_files, env, tmp_path), train(from_hub, env, tmp_path)
    assert got["sft"] == want["sft"] and got["sft"]["train"]["rows"] == 24
    assert got["final"]["metrics"] == want["final"]["metrics"]
    losses = [r["loss"] for r in records(tmp_path / "hub_run", "train")]
    assert len(losses) == 4 and losses == [r["loss"] for r in records(tmp_path / "files_run", "train")]
    assert losses[-1] < losses[0]
    # What each run read, as its checkpoints record it: the files by their bytes, the Hub set's splits
    # by their revision under the one key that names it.
    assert set(want["data_content"]) == {"data.files.train", "data.files.validation"}
    assert set(got["data_content"]) == {"data.hub_id"} and len(got["data_content"]["data.hub_id"]) == 32
