"""Your own data end to end: the recipes configs/own_data_csv.yaml and own_data_jsonl.yaml through
ft-train (the CLI, on the tiny model), a regression problem against the mean baseline, a sweep over
an own-data config, and a GLUE TSV saved by a spreadsheet, which trains as the plain file does."""

from __future__ import annotations

import csv
import json
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import yaml

from tiny_run import write_run_config
from ft_framework.cli import report_main, train_main
from ft_framework.config import load_config
from ft_framework.resources import quickstart_glue_dir
from ft_framework.trainer import Trainer

REPO = Path(__file__).resolve().parents[2]
REVIEWS = REPO / "examples" / "data" / "reviews"
# Small and fast: the recipe's data, cut to its first examples, on the tiny model.
TINY = ("training.num_epochs=null", "training.max_steps=4", "training.device=cpu", "data.max_train_examples=32",
        "data.max_eval_examples=40", "data.max_seq_length=32", "evaluation.num_evals=2", "logging.progress_bar=false")


def read_jsonl(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def first_labels(path: Path, column: str, n: int) -> list[str]:
    """The labels of the first `n` examples of a CSV or JSONL file, read with the standard library."""
    if path.suffix == ".csv":
        with path.open(newline="", encoding="utf-8") as f:
            return [row[column] for row in csv.DictReader(f)][:n]
    return [r[column] for r in read_jsonl(path)][:n]


def majority_accuracy(train: list[str], dev: list[str]) -> float:
    majority = max(sorted(set(train)), key=train.count)
    return sum(label == majority for label in dev) / len(dev)


@pytest.mark.parametrize("recipe,label_column", [("own_data_csv", "label"), ("own_data_jsonl", "sentiment")])
def test_an_own_data_recipe_runs_through_ft_train(recipe, label_column, tiny_bert_dir, tmp_path, monkeypatch):
    monkeypatch.chdir(REPO)  # the recipes name their files from the repository root, as their first line runs them
    out = tmp_path / "out"
    code = train_main(["--config", f"configs/{recipe}.yaml", f"model.name_or_path={tiny_bert_dir}",
                       f"logging.output_dir={out}", *TINY])
    assert code == 0
    results = json.loads((out / "results.json").read_text())
    assert results["task"] == "reviews" and results["main_metric"] == "accuracy"
    assert results["train_examples"] == 32 and results["steps"] == 4
    assert set(results["final"]["metrics"]) == set(results["baseline"]["metrics"]) == {"validation"}
    assert set(results["final"]["metrics"]["validation"]) == {"accuracy", "mcc"}
    # The baseline, computed here from the files themselves: the majority train label on dev.
    suffix = ".csv" if recipe.endswith("csv") else ".jsonl"
    expected = majority_accuracy(first_labels(REVIEWS / f"train{suffix}", label_column, 32),
                                 first_labels(REVIEWS / f"dev{suffix}", label_column, 40))
    assert results["baseline"]["metrics"]["validation"] == {"accuracy": pytest.approx(expected), "mcc": 0.0}
    run_accuracy = results["final"]["metrics"]["validation"]["accuracy"]
    assert results["failed"] is (run_accuracy <= expected)
    evals = [r for r in read_jsonl(out / "metrics.jsonl") if r["type"] == "eval"]
    assert [r["step"] for r in evals] == [2, 4]


def write_scores(path: Path, rows: list[tuple[str, float]]) -> Path:
    path.write_text("".join(json.dumps({"sentence": text, "score": score}) + "\n" for text, score in rows))
    return path


def quickstart_sentences(file_name: str, n: int) -> list[tuple[str, int]]:
    lines = (quickstart_glue_dir() / "SST-2" / file_name).read_text().splitlines()[1:n + 1]
    return [(text, int(label)) for text, label in (line.split("\t") for line in lines)]


def test_own_regression_data_reports_the_mean_baseline(tiny_bert_dir, tmp_path):
    # A made-up score: 4 for a positive review, 1 for a negative one, plus a length term.
    def scores(file_name, n):
        return [(text, 1.0 + 3.0 * label + len(text) / 100) for text, label in quickstart_sentences(file_name, n)]

    train, dev = scores("train.tsv", 24), scores("dev.tsv", 20)
    cfg = write_run_config(tmp_path / "run.yaml", tiny_bert_dir, tmp_path / "out",
                           data={"task": None, "source": "files", "name": "scores",
                                 "files": {"train": str(write_scores(tmp_path / "train.jsonl", train)),
                                           "validation": str(write_scores(tmp_path / "dev.jsonl", dev))},
                                 "text_columns": ["sentence"], "label_column": "score", "problem": "regression",
                                 "max_train_examples": None, "max_eval_examples": None},
                           training={"max_steps": 3})
    assert train_main(["--config", str(cfg), "evaluation.num_evals=1"]) == 0
    results = json.loads((tmp_path / "out" / "results.json").read_text())
    assert results["task"] == "scores" and results["main_metric"] == "pearson"
    train_mean = np.mean(np.asarray([s for _, s in train], dtype=np.float32), dtype=np.float64)
    dev_scores = np.asarray([s for _, s in dev], dtype=np.float32).astype(np.float64)
    assert results["baseline"]["metrics"]["validation"] == {
        "pearson": 0.0, "spearmanr": 0.0, "mse": pytest.approx(np.mean((dev_scores - train_mean) ** 2), rel=1e-6)}
    assert set(results["final"]["metrics"]["validation"]) == {"pearson", "spearmanr", "mse"}


def spreadsheet_copy(src: Path, dst: Path) -> None:
    """`src` as a spreadsheet saves a TSV: byte-order mark, CRLF, cells holding quotes quoted."""
    with src.open(newline="", encoding="utf-8") as f:
        rows = list(csv.reader(f, delimiter="\t", quoting=csv.QUOTE_NONE))
    with dst.open("w", newline="", encoding="utf-8-sig") as f:
        csv.writer(f, dialect="excel-tab").writerows(rows)  # excel-tab: CRLF, minimal quoting


def test_a_glue_tsv_saved_by_a_spreadsheet_trains_like_the_plain_file(tiny_bert_dir, tmp_path):
    plain = tmp_path / "plain" / "SST-2"
    shutil.copytree(quickstart_glue_dir() / "SST-2", plain)
    # Raw quotes, as GLUE's sentences have them; the spreadsheet will quote these cells.
    lines = (plain / "train.tsv").read_text().splitlines()
    lines[1:4] = [f'"{lines[1]}', lines[2].replace(" was ", ' was " '), lines[3].replace(" .", ' "so" .')]
    (plain / "train.tsv").write_text("\n".join(lines) + "\n")
    sheet = tmp_path / "sheet" / "SST-2"
    sheet.mkdir(parents=True)
    for name in ("train.tsv", "dev.tsv"):
        spreadsheet_copy(plain / name, sheet / name)
    raw = (sheet / "train.tsv").read_bytes()
    assert raw.startswith(b"\xef\xbb\xbfsentence\tlabel\r\n") and b'"""' in raw

    losses = {}
    for name in ("plain", "sheet"):
        cfg = write_run_config(tmp_path / f"{name}.yaml", tiny_bert_dir, tmp_path / f"out_{name}",
                               data={"source": str(tmp_path / name), "max_train_examples": 16},
                               training={"max_steps": 4}, evaluation={"num_evals": 1})
        results = Trainer(load_config(cfg)).fit()
        losses[name] = ([r["loss"] for r in read_jsonl(tmp_path / f"out_{name}" / "metrics.jsonl")
                         if r["type"] == "train"], results["final"]["metrics"])
    assert len(losses["plain"][0]) == 4
    assert losses["sheet"] == losses["plain"]


@pytest.mark.slow
def test_a_sweep_over_an_own_data_config(tiny_bert_dir, tmp_path):
    base = write_run_config(tmp_path / "base.yaml", tiny_bert_dir, tmp_path / "unused",
                            data={"task": None, "source": "files", "name": "reviews",
                                  "files": {"train": str(REVIEWS / "train.csv"), "validation": str(REVIEWS / "dev.csv")},
                                  "text_columns": ["text"], "labels": ["negative", "positive"],
                                  "max_train_examples": 32, "max_eval_examples": 32},
                            training={"max_steps": 2, "per_device_batch_size": 8, "device": "cpu"},
                            evaluation={"num_evals": 1, "batch_size": 32})
    sweep = {"base": base.name, "output_dir": str(tmp_path / "store"), "axes": {"training.seed": [1, 2]},
             "methods": {"recadam": {}}, "runner": {"name": "local", "max_parallel": 2, "num_cpus_per_run": 1}}
    (tmp_path / "sweep.yaml").write_text(yaml.safe_dump(sweep, sort_keys=False))
    out = subprocess.run([sys.executable, str(REPO / "launch" / "sweep.py"), "--config", str(tmp_path / "sweep.yaml"),
                          "--no-progress"], cwd=tmp_path, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, (out.stdout + out.stderr)[-4000:]
    results = [json.loads(p.read_text()) for p in sorted((tmp_path / "store").rglob("results.json"))]
    assert len(results) == 2 and {r["task"] for r in results} == {"reviews"}
    assert {r["config"]["training"]["seed"] for r in results} == {1, 2}
    assert report_main([str(tmp_path / "store"), "--no-plots", "--out", str(tmp_path / "report")]) == 0
    report = "\n".join(p.read_text() for p in (tmp_path / "report").glob("*.md"))
    assert "reviews" in report
