"""A user's own data (data.source: files): the formats (CSV with its quoting, TSV as spreadsheets
write it, JSON lines, datasets' save_to_disk directories, Parquet files and directories as the Hub lays
them out), and every mistake in a file reported with its file, line and column (Parquet: row group
and row)."""

from __future__ import annotations

import csv
import json
from pathlib import Path

import numpy as np
import pytest

from ft_framework.config import DataConfig
from ft_framework.data.glue import glue_splits
from ft_framework.data.own_data import own_data_splits
from ft_framework.data.tasks import get_task, own_data_task
from ft_framework.errors import MissingPath, UserError
from ft_framework.metrics import compute_metrics, majority_baseline

SENTIMENT = own_data_task("reviews", text_columns=("text",), label_column="label", labels=("negative", "positive"),
                          eval_splits=("validation",))
PAIRS = own_data_task("pairs", text_columns=("premise", "hypothesis"), label_column="label",
                      labels=("entailment", "not_entailment"), eval_splits=("validation",))
SCORES = own_data_task("scores", text_columns=("text",), label_column="score", labels=None,
                       eval_splits=("validation",))


def write(path: Path, text: str, encoding: str = "utf-8") -> Path:
    path.write_bytes(text.encode(encoding))
    return path


def both(path: Path) -> dict[str, str]:
    """The same file as train and validation split."""
    return {"train": str(path), "validation": str(path)}


def train_split(spec, path):
    return own_data_splits(spec, both(path))["train"]


# ---------------------------------------------------------------------------------------------- formats


def test_csv_honours_quoting_commas_quotes_and_line_breaks(tmp_path):
    path = write(tmp_path / "train.csv",
                 'text,label\n'
                 '"good, not great",positive\n'
                 '"she said ""wow"" twice",positive\n'
                 '"two\nlines",negative\n'
                 'plain text,negative\n')
    split = train_split(SENTIMENT, path)
    assert split.texts == [["good, not great", 'she said "wow" twice', "two\nlines", "plain text"]]
    assert split.labels.tolist() == [1, 1, 0, 0] and split.labels.dtype == np.int64
    # A quoted line break moves the lines after it: errors still name the line an editor shows.
    write(path, path.read_text() + "more,postive\n")
    with pytest.raises(UserError, match=r"train\.csv:7: unknown label 'postive' in column 'label'; expected one of "
                                        r"\['negative', 'positive'\]"):
        train_split(SENTIMENT, path)


def spreadsheet_tsv(rows: list[list[str]]) -> str:
    """How a spreadsheet saves a TSV: byte-order mark, CRLF line ends, quotes around cells with quotes."""
    out = []
    for row in rows:
        out.append("\t".join('"' + c.replace('"', '""') + '"' if '"' in c else c for c in row))
    return "\ufeff" + "\r\n".join(out) + "\r\n"


ROWS = [["premise", "hypothesis", "label"],
        ['a " raw quote inside', "b.", "entailment"],
        ['"quoted" at the start', 'ends with "quote"', "not_entailment"],
        ["no quotes here", "none either", "entailment"]]


def test_a_spreadsheet_tsv_reads_like_the_plain_file(tmp_path):
    plain = write(tmp_path / "plain.tsv", "\n".join("\t".join(r) for r in ROWS) + "\n")
    sheet = write(tmp_path / "sheet.tsv", spreadsheet_tsv(ROWS))
    assert sheet.read_bytes().startswith(b"\xef\xbb\xbf") and b'"""quoted""' in sheet.read_bytes()
    a, b = train_split(PAIRS, plain), train_split(PAIRS, sheet)
    assert a.texts == b.texts == [[r[0] for r in ROWS[1:]], [r[1] for r in ROWS[1:]]]
    assert a.labels.tolist() == b.labels.tolist() == [0, 1, 0]


def test_a_glue_tsv_saved_by_a_spreadsheet_reads_like_the_original(tmp_path):
    rows = [["sentence", "label"], ['the film \'s " hook " works', "1"], ['"wow"-worthy , not', "0"],
            ["plain", "1"]]
    for name, text in (("plain", "\n".join("\t".join(r) for r in rows) + "\n"), ("sheet", spreadsheet_tsv(rows))):
        (tmp_path / name).mkdir()
        write(tmp_path / name / "train.tsv", text)
        write(tmp_path / name / "dev.tsv", text)
    plain, sheet = (glue_splits(get_task("sst2"), str(tmp_path / n)) for n in ("plain", "sheet"))
    assert plain["train"].texts == sheet["train"].texts == [[r[0] for r in rows[1:]]]
    assert plain["train"].labels.tolist() == sheet["train"].labels.tolist() == [1, 0, 1]


def test_jsonl_with_integer_labels_a_byte_order_mark_and_crlf(tmp_path):
    task = own_data_task("ints", text_columns=("text",), label_column="label", labels=("0", "1"),
                         eval_splits=("validation",))
    lines = [json.dumps({"text": "good", "label": 1}), "", json.dumps({"text": "bad", "label": 0, "extra": [1]})]
    path = write(tmp_path / "train.jsonl", "\ufeff" + "\r\n".join(lines) + "\r\n")
    split = train_split(task, path)
    assert split.texts == [["good", "bad"]] and split.labels.tolist() == [1, 0]


def test_regression_targets_are_float32_scores(tmp_path):
    path = write(tmp_path / "train.jsonl", '{"text": "a", "score": 1}\n{"text": "b", "score": "2.5"}\n'
                                           '{"text": "c", "score": -0.25}\n')
    split = train_split(SCORES, path)
    assert split.labels.dtype == np.float32 and split.labels.tolist() == [1.0, 2.5, -0.25]


def test_datasets_save_to_disk_directories(tmp_path):
    datasets = pytest.importorskip("datasets")
    train = datasets.Dataset.from_dict({"text": ["good", "bad", "fine"], "label": ["positive", "negative", "positive"]})
    dev = datasets.Dataset.from_dict({"text": ["meh"], "label": ["negative"]})
    train.save_to_disk(str(tmp_path / "train_ds"))
    datasets.DatasetDict({"train": train, "validation": dev}).save_to_disk(str(tmp_path / "dd"))
    one = own_data_splits(SENTIMENT, {"train": str(tmp_path / "train_ds"), "validation": str(tmp_path / "dd")})
    assert one["train"].texts == [["good", "bad", "fine"]] and one["train"].labels.tolist() == [1, 0, 1]
    assert one["validation"].texts == [["meh"]] and one["validation"].labels.tolist() == [0]
    bad = datasets.Dataset.from_dict({"text": ["good", "odd"], "label": ["positive", "neutral"]})
    datasets.DatasetDict({"train": bad, "validation": dev}).save_to_disk(str(tmp_path / "bad"))
    with pytest.raises(UserError, match=r"bad\[train\]\[1\]: unknown label 'neutral' in column 'label'"):
        own_data_splits(SENTIMENT, both(tmp_path / "bad"))
    with pytest.raises(UserError, match=r"dd: the saved DatasetDict has no split 'test'; it has \['train', "):
        own_data_task_with_test = own_data_task("t", text_columns=("text",), label_column="label",
                                                labels=("negative", "positive"), eval_splits=("validation", "test"))
        own_data_splits(own_data_task_with_test, {**both(tmp_path / "dd"), "test": str(tmp_path / "dd")})
    (tmp_path / "not_a_dataset").mkdir()
    with pytest.raises(UserError, match="not_a_dataset: a directory, but not one saved with datasets' save_to_disk"):
        own_data_splits(SENTIMENT, both(tmp_path / "not_a_dataset"))


# ---------------------------------------------------------------------------------------------- errors


ERRORS = {
    "missing column": ("train.csv", "txt,label\nhello,positive\n", SENTIMENT,
                       r"train\.csv:1: missing column 'text'; the columns are \['txt', 'label'\]"),
    "missing column after blank lines": ("train.tsv", "\n\ntext\tlbl\nhi\tpositive\n", SENTIMENT,
                                         r"train\.tsv:3: missing column 'label'"),
    "empty text": ("train.csv", "text,label\ngood,positive\n  ,negative\n", SENTIMENT,
                   r"train\.csv:3: column 'text' is empty; every example needs its text"),
    "empty second text": ("train.tsv", "premise\thypothesis\tlabel\na\t\tentailment\n", PAIRS,
                          r"train\.tsv:2: column 'hypothesis' is empty"),
    "non-numeric target": ("train.csv", "text,score\na,1.5\nb,high\n", SCORES,
                           r"train\.csv:3: label column 'score' has value 'high', expected a float score"),
    "non-finite target": ("train.csv", "text,score\na,nan\n", SCORES, r"train\.csv:2: .*'nan', expected a float score"),
    "boolean target": ("train.jsonl", '{"text": "a", "score": true}\n', SCORES, r"train\.jsonl:1: .*True, expected a float"),
    "malformed JSON": ("train.jsonl", '{"text": "a", "label": "positive"}\n{"text": "b" "label": 1}\n', SENTIMENT,
                       r"train\.jsonl:2: not valid JSON at column 14 \(Expecting ',' delimiter\)"),
    "NaN in JSON": ("train.jsonl", '{"text": "a", "score": NaN}\n', SCORES, r"train\.jsonl:1: not valid JSON"),
    "JSON not an object": ("train.jsonl", '["a", "positive"]\n', SENTIMENT,
                           r"train\.jsonl:1: a JSON list, expected an object"),
    "JSON key missing": ("train.jsonl", '{"text": "a", "label": "positive"}\n{"txt": "b", "label": "negative"}\n',
                         SENTIMENT, r"train\.jsonl:2: missing column 'text'; the object has \['label', 'txt'\]"),
    "JSON text not text": ("train.jsonl", '{"text": 5, "label": "positive"}\n', SENTIMENT,
                           r"train\.jsonl:1: column 'text' holds int 5, expected text"),
    "JSON null text": ("train.jsonl", '{"text": null, "label": "positive"}\n', SENTIMENT,
                       r"train\.jsonl:1: column 'text' is empty"),
    "ragged row": ("train.csv", "text,label\ngood,positive\nbad, awful,negative\n", SENTIMENT,
                   r"train\.csv:3: row has 3 fields, the header has 2 .*quote a field that holds the separator"),
    "open quote": ("train.csv", 'text,label\n"never closed,positive\nok,negative\n', SENTIMENT,
                   r"train\.csv:2: malformed quoting in the row starting here"),
    "text after a closing quote": ("train.csv", 'text,label\n"a" b,positive\n', SENTIMENT,
                                   r"train\.csv:2: malformed quoting"),
    "duplicate header": ("train.csv", "text,text,label\na,b,positive\n", SENTIMENT,
                         r"train\.csv:1: the header names column 'text' more than once"),
    "empty file": ("train.csv", "", SENTIMENT, r"train\.csv: empty file; expected a header line"),
    "empty JSONL": ("train.jsonl", "\n\n", SENTIMENT, r"train\.jsonl: no examples in the train file"),
    "header only": ("train.tsv", "text\tlabel\n", SENTIMENT, r"train\.tsv: no examples in the train file"),
    "unknown suffix": ("train.txt", "text,label\n", SENTIMENT,
                       r"train\.txt: unknown file type '\.txt'; valid: \.csv, \.tsv, \.jsonl, \.parquet, or a directory"),
}


@pytest.mark.parametrize("case", ERRORS, ids=list(ERRORS))
def test_a_mistake_in_a_file_names_the_file_line_and_column(tmp_path, case):
    name, text, spec, message = ERRORS[case]
    path = write(tmp_path / name, text)
    with pytest.raises(UserError, match=message):
        train_split(spec, path)


def test_a_file_that_is_not_utf8_names_the_line_and_byte(tmp_path):
    path = write(tmp_path / "train.csv", "text,label\ncaf\u00e9,positive\n", encoding="latin-1")
    with pytest.raises(UserError, match=r"train\.csv:2: not UTF-8 text \(byte 0xe9 at column 4\)"):
        train_split(SENTIMENT, path)


def test_a_missing_file_names_its_key(tmp_path):
    path = write(tmp_path / "train.csv", "text,label\na,positive\n")
    with pytest.raises(MissingPath, match=r"data\.files\.validation: .*dev\.csv not found"):
        own_data_splits(SENTIMENT, {"train": str(path), "validation": str(tmp_path / "dev.csv")})


# ---------------------------------------------------------------------------------------------- config


FILES = {"train": "train.csv", "validation": "dev.csv"}
OWN = dict(source="files", files=FILES, text_columns=["text"], labels=["negative", "positive"])


def test_the_config_block_makes_the_task():
    spec = DataConfig(**OWN, name="reviews", label_column="stars").task_spec()
    assert (spec.name, spec.text_keys, spec.label_key, spec.label_list) == ("reviews", ("text",), "stars",
                                                                             ("negative", "positive"))
    assert spec.eval_splits == ("validation",) and spec.metrics == ("accuracy", "mcc")
    assert spec.main_metric == "accuracy" and spec.num_labels == 2
    pair = DataConfig(**{**OWN, "files": {**FILES, "test": "test.csv"}, "text_columns": ["q", "a"]}).task_spec()
    assert pair.text_keys == ("q", "a") and pair.eval_splits == ("validation", "test")
    regression = DataConfig(**{**OWN, "labels": None, "problem": "regression"}).task_spec()
    assert regression.is_regression and regression.num_labels == 1
    assert regression.metrics == ("pearson", "spearmanr", "mse") and regression.main_metric == "pearson"
    # YAML's integers are the files' text.
    assert DataConfig(**{**OWN, "labels": [0, 1]}).task_spec().label_list == ("0", "1")
    assert DataConfig(**{**OWN, "name": "x"}).loader_arguments()["files"] == FILES
    # results.json keeps the resolved config; it validates back to the same one (GLUE's too).
    for cfg in (DataConfig(**OWN, name="x"), DataConfig(task="rte")):
        assert DataConfig.model_validate(cfg.model_dump()) == cfg
    assert DataConfig(task="rte").loader_arguments()["files"] is None


CONFIG_ERRORS = {
    "unknown split": ({**OWN, "files": {**FILES, "tset": "t.csv"}},
                      r"unknown split data\.files\.tset \(did you mean 'test'\?\); valid: train, validation, test"),
    "no validation": ({**OWN, "files": {"train": "a.csv"}}, r"data\.files\.validation is required"),
    "no files": ({**OWN, "files": None}, r"data\.source: files needs data\.files"),
    "a GLUE task too": ({**OWN, "task": "sst2"}, r"data\.task names a GLUE task; with data\.source: files leave it unset"),
    "own keys with GLUE": ({"task": "sst2", "text_columns": ["text"]},
                           r"data\.text_columns describes your own data: set data\.source: files"),
    "no task": ({"source": "hub"}, r"set data\.task \(a GLUE task: cola, sst2"),
    "three texts": ({**OWN, "text_columns": ["a", "b", "c"]}, r"data\.text_columns must name one text column or two"),
    "no text column": ({**OWN, "text_columns": None}, r"data\.text_columns must name one"),
    "label is a text": ({**OWN, "label_column": "text"}, r"data\.label_column 'text' is also in data\.text_columns"),
    "labels for regression": ({**OWN, "problem": "regression"}, r"a regression problem has none"),
    "no labels": ({**OWN, "labels": None}, r"data\.labels must list at least two classes"),
    "one label": ({**OWN, "labels": ["yes"]}, r"data\.labels must list at least two classes"),
    "YAML booleans": ({**OWN, "labels": [True, False]}, r"label True is not text or an integer .*quote them"),
    "duplicate labels": ({**OWN, "labels": ["a", "b", "a"]}, r"label 'a' is listed more than once"),
    "GLUE name": ({**OWN, "name": "rte"}, r"data\.name 'rte' is a GLUE task's name"),
    "unknown problem": ({**OWN, "problem": "regresion"},
                        r"unknown data\.problem 'regresion' \(did you mean 'regression'\?\); valid: classification, "
                        r"regression, causal_lm"),
    "test and half of dev": ({**OWN, "files": {**FILES, "test": "t.csv"}, "split_dev_in_half": True},
                             r"data\.split_dev_in_half makes the test split .* use one of them"),
}


@pytest.mark.parametrize("case", CONFIG_ERRORS, ids=list(CONFIG_ERRORS))
def test_a_wrong_config_block_says_what_is_valid(case):
    values, message = CONFIG_ERRORS[case]
    with pytest.raises(ValueError, match=message):
        DataConfig(**values)


# ---------------------------------------------------------------------------------------------- metrics


def test_own_regression_reports_mse_and_the_mean_baseline():
    train, dev = np.array([1.0, 2.0, 6.0]), np.array([0.0, 4.0, 5.0])
    baseline = majority_baseline(SCORES, train, dev)
    assert baseline == {"pearson": 0.0, "spearmanr": 0.0, "mse": pytest.approx(np.mean((dev - 3.0) ** 2))}
    assert compute_metrics(SCORES, dev[:, None], dev)["mse"] == 0.0


def test_own_classification_reports_accuracy_and_mcc_against_the_majority_class():
    train, dev = np.array([1, 1, 0]), np.array([1, 0, 0, 0])
    assert majority_baseline(SENTIMENT, train, dev) == {"accuracy": 0.25, "mcc": 0.0}
    logits = np.eye(2)[[1, 0, 0, 1]]
    assert compute_metrics(SENTIMENT, logits, dev) == {"accuracy": 0.75, "mcc": pytest.approx(np.sqrt(1 / 3))}


def test_the_example_files_hold_the_same_reviews(tmp_path):
    """examples/data/reviews: the CSV and the JSON lines are one data set (the README says so)."""
    root = Path(__file__).resolve().parents[3] / "examples" / "data" / "reviews"
    jsonl = own_data_task("r", text_columns=("review",), label_column="sentiment", labels=("negative", "positive"),
                          eval_splits=("validation",))
    for split, stem in (("train", "train"), ("validation", "dev")):
        a = own_data_splits(SENTIMENT, both(root / f"{stem}.csv"))["train"]
        b = own_data_splits(jsonl, both(root / f"{stem}.jsonl"))["train"]
        assert a.texts == b.texts and a.labels.tolist() == b.labels.tolist()
        assert len(a) == {"train": 600, "validation": 200}[split]
    with (root / "train.csv").open(newline="") as f:
        assert any("," in row[1] for row in csv.reader(f))  # quoted commas in the shipped file


# ---------------------------------------------------------------------------------------------- Parquet

pa = pytest.importorskip("pyarrow")  # datasets' dependency, so installed with ft_framework
pq = pytest.importorskip("pyarrow.parquet")

REVIEW_ROWS = [("good food", "positive"), ("cold soup", "negative"), ("kind staff", "positive"),
               ("slow, rude, loud", "negative"), ('a "fine" view', "positive"), ("bad\nlines", "negative"),
               ("great tea", "positive")]


def write_parquet(path: Path, rows, row_group_size: int = 2, **extra_columns) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    columns = {"text": [t for t, _ in rows], "label": [label for _, label in rows], **extra_columns}
    pq.write_table(pa.table(columns), path, row_group_size=row_group_size)
    return path


def write_csv(path: Path, rows) -> Path:
    with path.open("w", newline="", encoding="utf-8") as f:
        csv.writer(f).writerows([("text", "label"), *rows])
    return path


def test_parquet_reads_the_rows_of_the_same_csv_a_row_group_at_a_time(tmp_path, monkeypatch):
    parquet = write_parquet(tmp_path / "train.parquet", REVIEW_ROWS, row_group_size=2,
                            pixels=[b"\x00" * 10] * len(REVIEW_ROWS))  # a column nobody asked for
    from_csv = train_split(SENTIMENT, write_csv(tmp_path / "train.csv", REVIEW_ROWS))
    from_parquet = train_split(SENTIMENT, parquet)
    assert from_parquet.texts == from_csv.texts and from_parquet.labels.tolist() == from_csv.labels.tolist()
    assert from_parquet.labels.tolist() == [1, 0, 1, 0, 1, 0, 1]

    # Row groups one at a time, only the columns asked for, never the whole file (a spy on pyarrow's reader).
    read: list[tuple[int, tuple[str, ...]]] = []
    real_read_row_group = pq.ParquetFile.read_row_group
    monkeypatch.setattr(pq.ParquetFile, "read_row_group", lambda self, i, columns=None, **kw: (
        read.append((i, tuple(columns))), real_read_row_group(self, i, columns=columns, **kw))[1])
    monkeypatch.setattr(pq.ParquetFile, "read", lambda *a, **kw: pytest.fail("read the whole file"))
    from ft_framework.data.readers import read_table
    table = read_table(parquet, "train", columns=("text", "label"))
    assert table.columns == ["text", "label", "pixels"]
    records = iter(table.records)
    assert next(records) == (f"{parquet} (row group 0, row 0)", {"text": "good food", "label": "positive"})
    assert read == [(0, ("text", "label"))]
    assert [where for where, _ in records][-1] == f"{parquet} (row group 3, row 6)"
    assert [i for i, _ in read] == [0, 1, 2, 3]


def test_a_hub_data_set_directory_gives_each_split_its_shards(tmp_path):
    """data/<split>-NNNNN-of-NNNNN.parquet, as the Hub lays a data set out: both splits name the same
    directory; a split's shards are read in order."""
    hub = tmp_path / "hub_download"
    write_parquet(hub / "data" / "train-00000-of-00002.parquet", REVIEW_ROWS[:3])
    write_parquet(hub / "data" / "train-00001-of-00002.parquet", REVIEW_ROWS[3:])
    write_parquet(hub / "data" / "validation-00000-of-00001.parquet", REVIEW_ROWS[:2])
    (hub / "README.md").write_text("---\nlicense: mit\n---\n")
    splits = own_data_splits(SENTIMENT, both(hub))
    assert splits["train"].texts == [[t for t, _ in REVIEW_ROWS]]
    assert splits["validation"].texts == [["good food", "cold soup"]]
    with pytest.raises(UserError, match=r"hub_download: no Parquet files of the test split: the names of its files "
                                        r"and directories give the splits train, validation; the test split is "
                                        r"named test or testing or eval or evaluation \(none of them"):
        spec = own_data_task("t", text_columns=("text",), label_column="label", labels=("negative", "positive"),
                             eval_splits=("validation", "test"))
        own_data_splits(spec, {**both(hub), "test": str(hub)})


def test_a_split_the_hub_calls_dev_is_the_validation_split(tmp_path):
    hub = tmp_path / "hub"
    write_parquet(hub / "data" / "train-00000-of-00001.parquet", REVIEW_ROWS)
    write_parquet(hub / "data" / "dev-00000-of-00001.parquet", REVIEW_ROWS[1:2])
    assert own_data_splits(SENTIMENT, both(hub))["validation"].texts == [["cold soup"]]
    write_parquet(hub / "data" / "val-00000-of-00001.parquet", REVIEW_ROWS[2:3])
    with pytest.raises(UserError, match=r"the validation split is named validation or valid or dev or val "
                                        r"\(dev and val: more than one"):
        own_data_splits(SENTIMENT, both(hub))


def test_a_directory_per_split_and_a_directory_without_split_names(tmp_path):
    per_split = tmp_path / "per_split"
    write_parquet(per_split / "train" / "0000.parquet", REVIEW_ROWS[:4])
    write_parquet(per_split / "train" / "0001.parquet", REVIEW_ROWS[4:])
    write_parquet(per_split / "validation" / "0000.parquet", REVIEW_ROWS[2:3])
    splits = own_data_splits(SENTIMENT, both(per_split))
    assert splits["train"].texts == [[t for t, _ in REVIEW_ROWS]] and splits["validation"].texts == [["kind staff"]]
    # A directory whose names name no split is the files of the split it is given as.
    plain = write_parquet(tmp_path / "mine" / "part-a.parquet", REVIEW_ROWS[:1]).parent
    write_parquet(plain / "part-b.parquet", REVIEW_ROWS[1:2])
    assert own_data_splits(SENTIMENT, {"train": str(per_split), "validation": str(plain)})["validation"].texts == [
        ["good food", "cold soup"]]


def test_the_shipped_parquet_example_holds_the_csv_reviews():
    """examples/data/reviews_parquet (configs/own_data_parquet.yaml): the CSV files' rows (its README says so),
    in several row groups."""
    root = Path(__file__).resolve().parents[3] / "examples" / "data"
    for split, stem in (("train", "train"), ("validation", "dev")):
        from_csv = own_data_splits(SENTIMENT, both(root / "reviews" / f"{stem}.csv"))["train"]
        from_parquet = own_data_splits(SENTIMENT, both(root / "reviews_parquet"))[split]
        assert from_parquet.texts == from_csv.texts and from_parquet.labels.tolist() == from_csv.labels.tolist()
    assert pq.ParquetFile(root / "reviews_parquet" / "data" / "train-00000-of-00001.parquet").num_row_groups == 5


def test_a_mistake_in_parquet_names_the_file_row_group_and_row(tmp_path):
    rows = REVIEW_ROWS[:5] + [("odd", "neutral")]
    path = write_parquet(tmp_path / "train.parquet", rows, row_group_size=2)
    with pytest.raises(UserError, match=r"train\.parquet \(row group 2, row 5\): unknown label 'neutral' in column "
                                        r"'label'"):
        train_split(SENTIMENT, path)
    nulls = tmp_path / "nulls.parquet"
    pq.write_table(pa.table({"text": ["a", None, "c"], "label": ["positive"] * 3}), nulls, row_group_size=2)
    with pytest.raises(UserError, match=r"nulls\.parquet \(row group 0, row 1\): column 'text' is empty"):
        train_split(SENTIMENT, nulls)
    numbers = tmp_path / "numbers.parquet"
    pq.write_table(pa.table({"text": [1, 2], "label": ["positive"] * 2}), numbers)
    with pytest.raises(UserError, match=r"numbers\.parquet \(row group 0, row 0\): column 'text' holds int 1, "
                                        "expected text"):
        train_split(SENTIMENT, numbers)


PARQUET_ERRORS = {
    "missing column": (lambda d: write_table(d / "train.parquet", {"txt": ["a"], "label": ["positive"]}),
                       r"train\.parquet: missing column 'text'; the columns are \['txt', 'label'\]"),
    "not Parquet": (lambda d: write(d / "train.parquet", "text,label\nhi,positive\n"),
                    r"train\.parquet: not a Parquet file that can be read \("),
    "shards with other columns": (lambda d: _shards_with_other_columns(d),
                                  r"train-00001-of-00002\.parquet: its columns \['text', 'stars'\] differ from "
                                  r".*train-00000-of-00002\.parquet's \['text', 'label'\]"),
    "a CSV among the shards": (lambda d: _csv_among_shards(d),
                               r"train-00001-of-00002\.csv: a \.csv file among the Parquet files of the train split"),
}


def write_table(path: Path, columns: dict) -> Path:
    pq.write_table(pa.table(columns), path)
    return path


def _shards_with_other_columns(d: Path) -> Path:
    write_parquet(d / "hub" / "data" / "train-00000-of-00002.parquet", REVIEW_ROWS)
    write_table(d / "hub" / "data" / "train-00001-of-00002.parquet", {"text": ["x"], "stars": [5]})
    return d / "hub"


def _csv_among_shards(d: Path) -> Path:
    write_parquet(d / "hub" / "data" / "train-00000-of-00002.parquet", REVIEW_ROWS)
    write_csv(d / "hub" / "data" / "train-00001-of-00002.csv", REVIEW_ROWS)
    return d / "hub"


@pytest.mark.parametrize("case", PARQUET_ERRORS, ids=list(PARQUET_ERRORS))
def test_a_wrong_parquet_file_or_directory_is_one_line_naming_it(tmp_path, case):
    make, message = PARQUET_ERRORS[case]
    path = make(tmp_path)
    with pytest.raises(UserError, match=message) as info:
        train_split(SENTIMENT, path)
    assert "\n" not in str(info.value)
