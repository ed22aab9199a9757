"""Parquet for your own data, end to end: configs/own_data_parquet.yaml through ft-train (the CLI's
function, on the tiny model), and the same rows as CSV and as Parquet training the same model bit
for bit."""

from __future__ import annotations

import csv
import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from ft_framework.cli import train_main
from ft_framework.config import load_config
from ft_framework.trainer import Trainer

pa = pytest.importorskip("pyarrow")  # datasets' dependency, so installed with ft_framework
pq = pytest.importorskip("pyarrow.parquet")

REPO = Path(__file__).resolve().parents[2]
RECIPE = "configs/own_data_parquet.yaml"
# Small and fast: the recipe's data, cut to its first examples, on the tiny model.
TINY = ("training.num_epochs=null", "training.max_steps=4", "training.device=cpu", "data.max_train_examples=32",
        "data.max_eval_examples=40", "data.max_seq_length=32", "evaluation.num_evals=2", "logging.progress_bar=false",
        "logging.log_every_steps=1")


def test_the_parquet_recipe_runs_through_ft_train(tiny_bert_dir, tmp_path, monkeypatch):
    monkeypatch.chdir(REPO)  # the recipe names its files from the repository root, as its first line runs it
    out = tmp_path / "out"
    assert train_main(["--config", RECIPE, f"model.name_or_path={tiny_bert_dir}", f"logging.output_dir={out}",
                       *TINY]) == 0
    results = json.loads((out / "results.json").read_text())
    assert results["task"] == "reviews" and results["train_examples"] == 32 and results["steps"] == 4
    assert set(results["final"]["metrics"]) == {"validation"}


def write_hub_layout(csv_path: Path, directory: Path, split: str, shards: int, row_group_size: int) -> None:
    """The rows of `csv_path` as `shards` Parquet files of `split`, named as the Hub names them, with
    small row groups (so a run reads several groups of several files)."""
    with csv_path.open(newline="", encoding="utf-8") as f:
        rows = list(csv.DictReader(f))
    per_shard = -(-len(rows) // shards)
    for i in range(shards):
        part = rows[i * per_shard:(i + 1) * per_shard]
        table = pa.table({"id": [int(r["id"]) for r in part], "text": [r["text"] for r in part],
                          "label": [r["label"] for r in part]})
        path = directory / "data" / f"{split}-{i:05d}-of-{shards:05d}.parquet"
        path.parent.mkdir(parents=True, exist_ok=True)
        pq.write_table(table, path, row_group_size=row_group_size)


def test_the_same_rows_as_csv_and_as_parquet_train_the_same_model_bit_for_bit(tiny_bert_dir, tmp_path):
    reviews = REPO / "examples" / "data" / "reviews"
    hub = tmp_path / "hub"
    write_hub_layout(reviews / "train.csv", hub, "train", shards=3, row_group_size=7)
    write_hub_layout(reviews / "dev.csv", hub, "validation", shards=2, row_group_size=9)
    files = {"csv": (reviews / "train.csv", reviews / "dev.csv"), "parquet": (hub, hub)}
    runs = {}
    for name, (train, validation) in files.items():
        out = tmp_path / f"out_{name}"
        cfg = load_config(REPO / RECIPE, [f"model.name_or_path={tiny_bert_dir}", f"logging.output_dir={out}",
                                          f"data.files.train={train}", f"data.files.validation={validation}", *TINY])
        trainer = Trainer(cfg)
        results = trainer.fit()
        losses = [json.loads(line)["loss"] for line in (out / "metrics.jsonl").read_text().splitlines()
                  if json.loads(line)["type"] == "train"]
        runs[name] = (trainer.model.state_dict(), losses, results["final"]["metrics"])
        trainer.strategy.close()
    (csv_weights, csv_losses, csv_metrics), (pq_weights, pq_losses, pq_metrics) = runs["csv"], runs["parquet"]
    assert len(csv_losses) == 4 and pq_losses == csv_losses and pq_metrics == csv_metrics
    assert csv_weights.keys() == pq_weights.keys()
    assert all(torch.equal(csv_weights[k], pq_weights[k]) for k in csv_weights)
    # Training moved the weights: they are equal because the data were, not because nothing changed.
    pretrained = load_file(str(Path(tiny_bert_dir) / "model.safetensors"))
    moved = [k for k, v in csv_weights.items() if k.removeprefix("bert.") in pretrained
             and not torch.equal(v, pretrained[k.removeprefix("bert.")])]
    assert moved, "no pretrained weight changed in 4 steps"
