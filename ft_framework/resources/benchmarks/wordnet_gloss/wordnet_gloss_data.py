"""The rows of the wordnet_gloss task for lm-evaluation-harness (`custom_dataset` in wordnet_gloss.yaml):
wordnet_gloss.jsonl beside this file, as one `test` split, read without the datasets cache."""

import json
from pathlib import Path

ROWS = Path(__file__).resolve().parent / "wordnet_gloss.jsonl"


def load(**_task_metadata):
    """lm-eval passes the task's metadata (its version) as keyword arguments; the rows do not depend on it."""
    import datasets

    rows = [json.loads(line) for line in ROWS.read_text(encoding="utf-8").splitlines()]
    return datasets.DatasetDict({"test": datasets.Dataset.from_list(rows)})
