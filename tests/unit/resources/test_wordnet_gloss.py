"""The shipped lm-eval task wordnet_gloss (resources/benchmarks/wordnet_gloss/): its rows are what
scripts/build_wordnet_benchmark.py writes from WordNet 3.0 (rebuilt where Debian's wordnet-base is
installed), the provenance record names their checksum and source, the licence ships beside them, the
rows follow the script's rule, and lm-eval reads the task from the package by name, offline."""

from __future__ import annotations

import hashlib
import json
import runpy
from collections import Counter
from pathlib import Path

import pytest

from ft_framework.resources import benchmarks_dir

REPO = Path(__file__).resolve().parents[3]
SCRIPT = runpy.run_path(str(REPO / "scripts" / "build_wordnet_benchmark.py"))
TASK_DIR = benchmarks_dir() / "wordnet_gloss"
PROVENANCE = json.loads((TASK_DIR / "provenance.json").read_text(encoding="utf-8"))
ROWS = [json.loads(line) for line in (TASK_DIR / "wordnet_gloss.jsonl").read_text(encoding="utf-8").splitlines()]


def test_the_provenance_record_names_the_shipped_rows_checksum_and_source():
    rows = (TASK_DIR / "wordnet_gloss.jsonl").read_bytes()
    assert PROVENANCE["wordnet_gloss.jsonl_sha256"] == hashlib.sha256(rows).hexdigest()
    assert PROVENANCE["items"] == len(ROWS) == rows.count(b"\n")
    assert PROVENANCE["source"]["package"] == "wordnet-base" and PROVENANCE["source"]["version"] == "1:3.0-37"
    assert set(PROVENANCE["source"]["files_sha256"]) == set(SCRIPT["SOURCE_FILES"])
    assert (PROVENANCE["seed"], PROVENANCE["min_tagged_senses"]) == (SCRIPT["SEED"], SCRIPT["MIN_TAGGED_SENSES"])
    licence = (TASK_DIR / "LICENSE").read_text(encoding="utf-8")
    assert "WordNet 3.0 Copyright 2006 by Princeton University." in licence
    assert "Permission to use, copy, modify and distribute this software" in licence


def test_the_shipped_files_are_what_the_script_writes_from_wordnet_base():
    wordnet = SCRIPT["WORDNET"]
    if not (wordnet / "data.noun").is_file():
        pytest.skip(f"{wordnet}/data.noun is not here (apt-get install wordnet-base rebuilds the task)")
    installed = {name: hashlib.sha256((wordnet / name).read_bytes()).hexdigest() for name in SCRIPT["SOURCE_FILES"]}
    if installed != PROVENANCE["source"]["files_sha256"]:
        pytest.skip(f"the installed {wordnet} is not the WordNet the task was built from (provenance.json)")
    files = SCRIPT["build"](version=PROVENANCE["source"]["version"])
    for name, data in files.items():
        assert (TASK_DIR / name).read_bytes() == data, name


def test_each_row_holds_its_words_answer_among_three_other_words_answers():
    words = [row["word"] for row in ROWS]
    assert len(set(words)) == len(words) > 250
    answers = {row["word"]: row["choices"][row["label"]] for row in ROWS}
    for row in ROWS:
        assert len(row["choices"]) == len(set(row["choices"])) == 4, row["word"]
        distractors = [c for i, c in enumerate(row["choices"]) if i != row["label"]]
        assert set(distractors) <= set(answers.values()) - {answers[row["word"]]}, row["word"]
        assert not any(SCRIPT["names_word"](choice, row["word"]) for choice in row["choices"]), row["word"]
        assert all('"' not in choice and choice == choice.strip() for choice in row["choices"]), row["word"]
    # every answer position within one of a quarter of the rows
    counts = Counter(row["label"] for row in ROWS)
    assert set(counts) == {0, 1, 2, 3} and max(counts.values()) - min(counts.values()) <= 1


def test_the_rule_on_hand_written_wordnet_lines():
    """Sense counts from cntlist.rev, the most frequent sense's gloss from index.noun's first synset,
    examples cut, a word whose gloss names it dropped."""
    cntlist = "\n".join([*(f"bank%1:14:0{i}:: {i + 1} {9 - i}" for i in range(5)), "bank%2:38:00:: 1 3",
                         *(f"tie%1:06:0{i}:: {i + 1} 2" for i in range(5)), "cat%1:05:00:: 1 30",
                         *(f"Mars%1:17:0{i}:: {i + 1} 1" for i in range(5))])
    assert SCRIPT["tagged_noun_senses"](cntlist) == {"bank": 5, "tie": 5, "cat": 1, "Mars": 5}
    index = "  1 This license line\nbank n 2 1 @ 2 1 00000002 00000001  \ntie n 1 0 1 0 00000003  \n"
    assert SCRIPT["noun_synsets"](index) == {"bank": ["00000002", "00000001"], "tie": ["00000003"]}
    data = ('00000001 14 n 01 bank 0 000 | a long pile or ridge; "a bank of earth"  \n'
            '00000002 14 n 01 bank 1 000 | a financial institution that accepts deposits  \n'
            '00000003 06 n 01 tie 0 000 | a tie that holds things together; "tie it"  \n')
    assert SCRIPT["glosses"](data, {"00000001", "00000003"}) == {"00000001": "a long pile or ridge",
                                                                  "00000003": "a tie that holds things together"}
    assert SCRIPT["names_word"]("Tie that binds", "tie") and not SCRIPT["names_word"]("a tiepin", "tie")


def test_lm_eval_reads_the_task_from_the_package_by_name_offline(monkeypatch, tmp_path):
    """From another working directory and with the hub off: the rows are found beside the YAML."""
    pytest.importorskip("lm_eval")
    from lm_eval.tasks import TaskManager

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    monkeypatch.chdir(tmp_path)
    task = TaskManager(include_path=[str(benchmarks_dir())], include_defaults=False).load(
        ["wordnet_gloss"])["tasks"]["wordnet_gloss"]
    docs = list(task.test_docs())
    assert docs == ROWS
    assert task.doc_to_text(docs[0]) == f'Question: What does the word "{ROWS[0]["word"]}" mean?\nAnswer:'
    assert task.doc_to_choice(docs[0]) == ROWS[0]["choices"] and task.doc_to_target(docs[0]) == ROWS[0]["label"]
