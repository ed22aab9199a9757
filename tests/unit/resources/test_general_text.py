"""The shipped general text (resources/general_text/, `builtin:general_text`): what
scripts/build_general_text.py writes with the Python its provenance names (byte for byte), prose one
document a line, and disjoint from what forgetting is measured on: no sentence of pydoc_data.topics (all of
them, split as the forgetting probe splits them: so the shipped probe's at every num_sentences) and no
choice of the shipped wordnet_gloss benchmark."""

from __future__ import annotations

import hashlib
import json
import re
import runpy
import sys
from pathlib import Path

import pytest
from pydoc_data.topics import topics

from ft_framework import resources
from ft_framework.models import forgetting
from ft_framework.models.forgetting import default_probe_sentences

REPO = Path(__file__).resolve().parents[3]
SCRIPT = runpy.run_path(str(REPO / "scripts" / "build_general_text.py"))
FOLDER = resources.general_text_file("general_text").parent
TEXT = resources.general_text_file("general_text").read_text(encoding="utf-8")
LINES = TEXT.splitlines()
PROVENANCE = json.loads((FOLDER / "provenance.json").read_text(encoding="utf-8"))
WORDNET_ROWS = [json.loads(line) for line in
                (resources.benchmarks_dir() / "wordnet_gloss" / "wordnet_gloss.jsonl").read_text().splitlines()]


def comparable(sentence: str) -> str:
    return " ".join(re.findall(r"[a-z0-9]+", sentence.lower()))


def line_sentences(line: str) -> list[str]:
    return forgetting._SENTENCE_END.split(line)


def test_the_provenance_names_the_shipped_text_and_the_python_that_wrote_it():
    data = resources.general_text_file("general_text").read_bytes()
    assert PROVENANCE["general_text.txt_sha256"] == hashlib.sha256(data).hexdigest()
    assert PROVENANCE["documents"] == len(LINES) == data.count(b"\n") == SCRIPT["MAX_DOCUMENTS"]
    assert PROVENANCE["words"] == len(TEXT.split())
    assert PROVENANCE["seed"] == SCRIPT["SEED"] and PROVENANCE["source"]["python"] == "3.11.7"
    assert len(data) < 300_000
    licence = (FOLDER / "LICENSE").read_text(encoding="utf-8")
    assert "PYTHON SOFTWARE FOUNDATION LICENSE VERSION 2" in licence
    assert "2022, 2023 Python Software Foundation;\nAll Rights Reserved" in licence  # the notice it keeps


def test_the_shipped_files_are_what_the_script_writes():
    running = ".".join(map(str, sys.version_info[:3]))
    recorded = PROVENANCE["source"]["python"]
    if (running, sys.implementation.name) != (recorded, PROVENANCE["source"]["implementation"]):
        pytest.skip(f"the text was read from the docstrings of {PROVENANCE['source']['implementation']} {recorded}'s "
                    f"standard library; this is {sys.implementation.name} {running}, whose docstrings differ")
    for name, data in SCRIPT["build"]().items():
        assert (FOLDER / name).read_bytes() == data, name


def test_one_prose_document_a_line_each_once():
    assert len(set(LINES)) == len(LINES) and all(LINES)
    for line in LINES:
        assert line == " ".join(line.split()), line  # no tab, no doubled or edge space
        assert line[0].isupper() and line.endswith(".") and len(line.split()) >= SCRIPT["MIN_WORDS"], line
        assert not re.search(r">>>|::|[`*=_{}<>\[\]|#\\]|https?:|\w\(\)|copyright|licen[cs]e", line,
                             re.IGNORECASE), line


def test_no_line_shares_a_sentence_with_any_of_the_probe_sources_topics():
    """Every sentence of every paragraph of every topic (the probe reads the first num_sentences of these),
    exactly and on lower-case letters and digits."""
    exact, loose = set(), set()
    for text in topics.values():
        for paragraph in re.split(r"\n\s*\n", text):
            for sentence in forgetting._SENTENCE_END.split(" ".join(paragraph.split())):
                exact.add(sentence)
                loose.add(comparable(sentence))
    assert len(exact) > 3000
    for line in LINES:
        for sentence in line_sentences(line):
            assert sentence not in exact and comparable(sentence) not in loose, (sentence, line)


def test_no_line_holds_a_sentence_of_the_default_probe_at_any_size():
    every = default_probe_sentences(10 ** 6)  # num_sentences has no upper bound: the whole list
    assert len(every) > 200 and default_probe_sentences(24) == every[:24]
    for sentence in every:
        assert sentence not in TEXT, sentence


def test_no_line_shares_a_sentence_or_holds_a_longer_gloss_with_wordnet_gloss():
    choices = {comparable(choice) for row in WORDNET_ROWS for choice in row["choices"]}
    phrases = [c for c in choices if len(c.split()) >= SCRIPT["GLOSS_PHRASE_WORDS"]]
    assert len(choices) > 250 and len(phrases) > 200
    for line in LINES:
        assert not {comparable(s) for s in line_sentences(line)} & choices, line
        words = f" {comparable(line)} "
        assert not [p for p in phrases if f" {p} " in words], line


def test_the_rule_on_hand_written_docstrings():
    """Code, lists, doctests, markup and authorship dropped; a paragraph's lines joined; and a paragraph
    dropped when one of its sentences is a measured one."""
    doc = ("Return the thing that the caller asked for, or None when it is missing.\n\n"
           "This second paragraph spans\ntwo lines and reads as plain English prose.\n\n"
           "    indented = code(example)\n\n"
           "key: a parameter list entry that runs on for ten words or more.\n\n"
           ">>> print('a doctest line that is long enough to count here')\n\n"
           "Copyright 2001 by Somebody Who Wrote This Module For The Library.\n\n"
           "Short one.")
    assert SCRIPT["prose_paragraphs"](doc) == [
        "Return the thing that the caller asked for, or None when it is missing.",
        "This second paragraph spans two lines and reads as plain English prose."]


def test_a_paragraph_with_a_measured_sentence_or_gloss_is_dropped(tmp_path):
    kept = "The first paragraph is kept because none of its sentences is measured anywhere."
    probe = "It names a sentence of the topics. Nothing else in it is measured by anything."
    gloss = "This paragraph holds a long thin piece of something that the benchmark asks about."
    (tmp_path / "module.py").write_text(f'"""{kept}\n\n{probe}\n\n{gloss}"""\n', encoding="utf-8")
    (tmp_path / "test").mkdir()
    (tmp_path / "test" / "test_module.py").write_text(f'"""{kept} Read from a test suite."""\n', encoding="utf-8")
    topics_ = {"topic": "Some prose.\n\nIt  names a sentence\nof the topics. More prose follows."}
    rows = [{"choices": ["a long thin piece", "ox"]}]
    assert SCRIPT["make_documents"](tmp_path, topics_, rows) == [kept]
