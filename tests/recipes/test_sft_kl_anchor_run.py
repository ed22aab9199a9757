"""loss.kl_to_pretrained end to end on a tiny Llama (models/kl_anchor.py): the pass at θ* is kept in the
token cache and reused by a second run, made again when k changes, rebuilt when damaged; each
training item's stored targets are its own whatever the batching (at θ*, the first step's KL is zero
with packed, shuffled batches); a resumed run continues with the same targets (equal losses and KL,
even when the cache was deleted in between: the pass runs at θ*, before the checkpoint loads); the
chunked head and the whole logits train the same; metrics.jsonl and results.json say what it did."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest
from tiny_llm import build_tiny_llm_dir, write_sft_rows, write_sft_run_config

from ft_framework.config import load_config
from ft_framework.trainer import Trainer

SECTIONS = dict(loss={"kl_to_pretrained": 0.5, "kl_top_k": 8},
                training={"max_steps": 4, "per_device_batch_size": 6},
                evaluation={"num_evals": 1, "generation": {"samples": 0}, "forgetting": {"enabled": False}})


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    root = tmp_path_factory.mktemp("kl_anchor")
    return {"model": build_tiny_llm_dir(root / "llama", "llama"), "files": write_sft_rows(root / "data")}


def config(setup, tmp_path, name, **sections):
    merged = {key: {**SECTIONS.get(key, {}), **sections.get(key, {})} for key in {*SECTIONS, *sections}}
    return write_sft_run_config(tmp_path / f"{name}.yaml", setup["model"], tmp_path / name, setup["files"], **merged)


def fit(path, overrides=()):
    trainer = Trainer(load_config(path, list(overrides)))
    try:
        return trainer.fit()
    finally:
        trainer.strategy.close()


def train_records(run_dir: Path) -> list[dict]:
    return [r for r in map(json.loads, (run_dir / "metrics.jsonl").read_text().splitlines()) if r["type"] == "train"]


def test_the_pass_is_cached_reused_and_made_again_for_another_k(setup, tmp_path):
    first = fit(config(setup, tmp_path, "first"))
    record = first["kl_to_pretrained"]
    assert (record["beta"], record["k"], record["stored_k"], record["reused"]) == (0.5, 8, 8, False)
    assert record["pass_seconds"] > 0 and record["tokens"] > 0
    entry = Path(record["entry"])
    sizes = {p.name: p.stat().st_size for p in entry.iterdir()}
    assert record["cache_bytes"] == sum(size for name, size in sizes.items() if name != "header.json")
    assert sizes["ids"] == sizes["logp"] == record["tokens"] * 8 * 4 and sizes["tail_logp"] == record["tokens"] * 4
    header = json.loads((entry / "header.json").read_text())  # data: JSON and raw arrays, nothing unpickled
    assert header["key"]["k"] == 8 and header["facts"]["tokens"] == record["tokens"]
    assert record["tokens"] == first["sft"]["train"]["completion_tokens"]

    second = fit(config(setup, tmp_path, "second"))
    assert second["kl_to_pretrained"]["reused"] is True and second["kl_to_pretrained"]["entry"] == str(entry)
    assert second["kl_to_pretrained"]["pass_seconds"] == 0.0
    assert [(r["loss"], r["kl_to_pretrained"]) for r in train_records(tmp_path / "second")] == \
        [(r["loss"], r["kl_to_pretrained"]) for r in train_records(tmp_path / "first")]

    other_k = fit(config(setup, tmp_path, "other_k", loss={"kl_top_k": 5}))["kl_to_pretrained"]
    assert other_k["reused"] is False and other_k["entry"] != str(entry) and other_k["stored_k"] == 5
    assert other_k["cache_bytes"] < record["cache_bytes"]

    # A damaged entry is never trusted: made again, with the same values.
    ids = np.fromfile(entry / "ids", dtype=np.int32)
    (entry / "ids").write_bytes(np.roll(ids, 1).tobytes())
    again = fit(config(setup, tmp_path, "again"))["kl_to_pretrained"]
    assert again["reused"] is False and again["entry"] == str(entry)
    assert np.array_equal(np.fromfile(entry / "ids", dtype=np.int32), ids)


def test_each_item_gets_its_own_targets_under_packing_and_shuffling(setup, tmp_path):
    """At θ* the anchor is zero iff every trained token met θ*'s distribution of its own position."""
    results = fit(config(setup, tmp_path, "packed", data={"packing": True},
                         training={"per_device_batch_size": 2, "max_steps": 3}))
    assert 0 < results["sft"]["train"]["packed_sequences"] < results["sft"]["train"]["rows"]
    records = train_records(tmp_path / "packed")
    assert abs(records[0]["kl_to_pretrained"]) < 1e-6
    assert all(r["kl_to_pretrained"] > 1e-6 for r in records[1:])  # θ moved: the KL is not zero by construction
    assert list(records[0])[:5] == ["type", "step", "epoch", "loss", "lr"] and "kl_to_pretrained" in records[0]


def test_a_resumed_run_continues_with_the_same_targets(setup, tmp_path):
    path = config(setup, tmp_path, "full", checkpoint={"every_steps": 2, "keep_last": 2},
                  training={"max_steps": 5})
    fit(path)
    resumed_dir = tmp_path / "resumed"
    trainer = Trainer(load_config(path, [f"logging.output_dir={resumed_dir}"]))
    try:
        assert trainer.fit(stop_after_step=3) == {"stopped_at_step": 3}
    finally:
        trainer.strategy.close()
    # The cache gone: the resumed run's pass runs at θ* again, before the checkpoint loads.
    shutil.rmtree(Path(json.loads((tmp_path / "full" / "results.json").read_text())["kl_to_pretrained"]["entry"]))
    resumed = fit(path, [f"logging.output_dir={resumed_dir}", "checkpoint.resume_from=latest"])
    assert resumed["kl_to_pretrained"]["reused"] is False
    want = [(r["step"], r["loss"], r["kl_to_pretrained"]) for r in train_records(tmp_path / "full")]
    assert [(r["step"], r["loss"], r["kl_to_pretrained"]) for r in train_records(resumed_dir)] == want


def test_the_chunked_head_and_the_whole_logits_train_the_same(setup, tmp_path):
    fit(config(setup, tmp_path, "chunked"))
    fit(config(setup, tmp_path, "whole", training={"chunked_loss": False}))
    chunked, whole = train_records(tmp_path / "chunked"), train_records(tmp_path / "whole")
    for key in ("loss", "kl_to_pretrained", "grad_norm"):
        assert [r[key] for r in chunked] == pytest.approx([r[key] for r in whole], rel=1e-5, abs=1e-7), key


def test_the_anchor_holds_the_model_nearer_theta_star(setup, tmp_path):
    """The same run with β = 0 (off: no pass, no term) and with a large β: the KL at the trained tokens
    that the anchored run logs, measured for both by the forgetting probe's KL from θ*, is smaller."""
    forgetting = {"forgetting": {"enabled": True, "num_sentences": 7}}
    off = fit(config(setup, tmp_path, "off", loss={"kl_to_pretrained": 0.0}, evaluation=forgetting,
                     optimizer={"name": "adamw", "hparams": {"lr": 1e-2}}))
    on = fit(config(setup, tmp_path, "on", loss={"kl_to_pretrained": 20.0}, evaluation=forgetting,
                    optimizer={"name": "adamw", "hparams": {"lr": 1e-2}}))
    assert "kl_to_pretrained" not in off and all("kl_to_pretrained" not in r for r in train_records(tmp_path / "off"))
    assert on["final"]["forgetting"]["kl_from_pretrained"] < off["final"]["forgetting"]["kl_from_pretrained"]


def test_lora_runs_of_any_seed_share_the_base_models_entry(setup, tmp_path):
    """model.lora: the adapters' B starts at zero, so θ* is the base model whatever A's random values
    (each seed's own): a second seed reuses the first's entry, and trains as it does with an entry
    made for its own wrapped model (another cache directory)."""
    lora = {"lora": {"r": 4, "alpha": 8.0}}
    first = fit(config(setup, tmp_path, "seed1", model=lora))["kl_to_pretrained"]
    reused = fit(config(setup, tmp_path, "seed2", model=lora, training={"seed": 7}))["kl_to_pretrained"]
    assert first["reused"] is False and reused["reused"] is True and reused["entry"] == first["entry"]
    built = fit(config(setup, tmp_path, "seed2_built", model=lora, training={"seed": 7},
                       data={"token_cache_dir": str(tmp_path / "own_cache")}))["kl_to_pretrained"]
    assert built["reused"] is False and Path(built["entry"]).name == Path(first["entry"]).name
    want = [(r["loss"], r["kl_to_pretrained"]) for r in train_records(tmp_path / "seed2_built")]
    assert [(r["loss"], r["kl_to_pretrained"]) for r in train_records(tmp_path / "seed2")] == want
    assert want != [(r["loss"], r["kl_to_pretrained"]) for r in train_records(tmp_path / "seed1")]  # A differs
