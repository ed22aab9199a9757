"""Writes the shipped general text (ft_framework/resources/general_text/): prose paragraphs of the docstrings
of Python's standard library, one document a line, for optimizer.importance.source and data.replay.file
(`builtin:general_text`). Deterministic (seed 20261207): the same Python writes the same bytes.

    python scripts/build_general_text.py            # writes general_text.txt, LICENSE, provenance.json
    python scripts/build_general_text.py --check    # exits 1 when the shipped files differ

The docstrings are read from the source files of the running Python's standard library (parsed with
`ast`, never imported), so another Python version writes other text: provenance.json records the
version that wrote the shipped file, and runs read the shipped file, never a rebuilt one.

The rule, in order:

1. The files: every .py file under the standard library's directory, in path order, except the test
   suites, IDLE, lib2to3, turtledemo, ensurepip, distutils, site-packages, pydoc_data (the forgetting
   probe's source) and the modules that Python's licence page lists under licences of their own
   (EXCLUDED_FILES): what remains is the PSF's, under the licence in LICENSE.
2. The paragraphs: each docstring of a module, class or function (`ast.get_docstring`, cleaned), split
   at blank lines; a paragraph is kept when it is prose: no line indented or starting like a list item
   or a `name: value` entry, no code or markup characters, no doctest, URL, call or dotted name, no
   copyright or authorship line, a capital first letter, a final period and MIN_WORDS words or more.
   Its lines are joined by single spaces: one document.
3. Disjoint from what forgetting is measured on: a paragraph is dropped when any of its sentences
   (split after . ! or ? before a capital, as the probe splits) equals, compared on lower-case letters
   and digits only, any sentence of any paragraph of pydoc_data.topics (all of them: the probe reads the
   first num_sentences of these, whatever num_sentences is), or any choice of the shipped wordnet_gloss
   benchmark; or when it contains a gloss of WordNet's of GLOSS_PHRASE_WORDS words or more.
4. Each document once; shuffled by the seed (so the first lines, which a Fisher pass of a few batches
   reads, come from all over the library), the first MAX_DOCUMENTS kept.
"""

from __future__ import annotations

import argparse
import ast
import hashlib
import json
import random
import re
import sys
import sysconfig
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
OUT = REPO / "ft_framework" / "resources" / "general_text"
WORDNET_ROWS = REPO / "ft_framework" / "resources" / "benchmarks" / "wordnet_gloss" / "wordnet_gloss.jsonl"
TEXT_FILE = "general_text.txt"
SEED = 20261207
MIN_WORDS = 10
MAX_DOCUMENTS = 2000
GLOSS_PHRASE_WORDS = 3
EXCLUDED_DIRS = frozenset({"test", "tests", "idlelib", "lib2to3", "turtledemo", "ensurepip", "distutils",
                           "site-packages", "pydoc_data", "__pycache__"})
# Python's licence page ("Licenses and Acknowledgements for Incorporated Software") names these modules'
# own licences (asynchat/asyncore, http.cookies, trace, uu, xmlrpc); this.py is the Zen of Python, rot13.
EXCLUDED_FILES = frozenset({"asynchat.py", "asyncore.py", "http/cookies.py", "trace.py", "uu.py", "xmlrpc/__init__.py",
                            "xmlrpc/client.py", "xmlrpc/server.py", "this.py"})
SENTENCE_END = re.compile(r"(?<=[.!?])\s+(?=[A-Z])")
# Code, markup, doctests, URLs, calls (f()), dotted names (os.path) and ellipses are not prose.
NOT_PROSE = re.compile(r"[*=_`{}<>\[\]|#\\@$~^]|>>>|::|--|\.\.\.|https?:|www\.|\w\(\)|\b\w+\.[a-z_]\w*\b")
NOT_OURS = re.compile(r"copyright|licen[cs]e|author|\(c\)|XXX|TODO", re.IGNORECASE)
LIST_LINE = re.compile(r"^(?:[-+*o] |\d+[.)] |\S+\s*:)")
WORDS = re.compile(r"[a-z0-9]+")


def comparable(sentence: str) -> str:
    """A sentence as the disjointness rule compares it: its lower-case letters and digits, one space apart."""
    return " ".join(WORDS.findall(sentence.lower()))


def sentences(paragraph: str) -> list[str]:
    return SENTENCE_END.split(" ".join(paragraph.split()))


def stdlib_files(stdlib: Path) -> list[Path]:
    """The standard library's .py files that rule 1 reads, relative to `stdlib`, in path order."""
    files = []
    for path in sorted(stdlib.rglob("*.py")):
        relative = path.relative_to(stdlib)
        if (EXCLUDED_DIRS.intersection(relative.parts[:-1]) or relative.parts[0].startswith("config-")
                or relative.as_posix() in EXCLUDED_FILES or relative.name.startswith("_sysconfigdata")):
            continue
        files.append(relative)
    return files


def docstrings(source: str) -> list[str]:
    """The cleaned docstrings of a module's source: the module's, then each class's and function's, in
    the order ast.walk visits them."""
    nodes = (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)
    found = (ast.get_docstring(node, clean=True) for node in ast.walk(ast.parse(source)) if isinstance(node, nodes))
    return [doc for doc in found if doc]


def prose_paragraphs(docstring: str) -> list[str]:
    """Rule 2: the docstring's prose paragraphs, each as one line."""
    kept = []
    for paragraph in re.split(r"\n\s*\n", docstring.strip()):
        lines = paragraph.split("\n")
        if any(line[:1].isspace() or LIST_LINE.match(line) for line in lines):
            continue
        text = " ".join(paragraph.split())
        if (NOT_PROSE.search(text) or NOT_OURS.search(text) or not text[:1].isupper() or not text.endswith(".")
                or len(text.split()) < MIN_WORDS):
            continue
        kept.append(text)
    return kept


def measured_sentences(topics: dict[str, str], wordnet_rows: list[dict]) -> tuple[set[str], list[str]]:
    """Rule 3's sets: every sentence of every paragraph of the topics and every wordnet_gloss choice (as
    `comparable` writes them), and the glosses long enough to be refused inside a document."""
    refused = {comparable(s) for text in topics.values() for paragraph in re.split(r"\n\s*\n", text)
               for s in sentences(paragraph)}
    glosses = sorted({comparable(choice) for row in wordnet_rows for choice in row["choices"]})
    refused.update(glosses)
    return refused, [g for g in glosses if len(g.split()) >= GLOSS_PHRASE_WORDS]


def make_documents(stdlib: Path, topics: dict[str, str], wordnet_rows: list[dict]) -> list[str]:
    refused, gloss_phrases = measured_sentences(topics, wordnet_rows)
    documents: dict[str, None] = {}  # each once, in reading order
    for relative in stdlib_files(stdlib):
        for docstring in docstrings((stdlib / relative).read_text(encoding="utf-8")):
            for text in prose_paragraphs(docstring):
                words = f" {comparable(text)} "
                if any(comparable(s) in refused for s in sentences(text)) or \
                        any(f" {gloss} " in words for gloss in gloss_phrases):
                    continue
                documents.setdefault(text)
    ordered = list(documents)
    random.Random(SEED).shuffle(ordered)
    return ordered[:MAX_DOCUMENTS]


def build(stdlib: Path | None = None) -> dict[str, bytes]:
    """The files the resource ships that this script writes, by name: the text, the licence, the provenance."""
    from pydoc_data.topics import topics

    stdlib = Path(sysconfig.get_paths()["stdlib"]) if stdlib is None else stdlib
    wordnet_rows = [json.loads(line) for line in WORDNET_ROWS.read_text(encoding="utf-8").splitlines()]
    files = stdlib_files(stdlib)
    sources = hashlib.sha256()
    for relative in files:
        sources.update(relative.as_posix().encode() + b"\0" + (stdlib / relative).read_bytes() + b"\0")
    documents = make_documents(stdlib, topics, wordnet_rows)
    text = "".join(document + "\n" for document in documents).encode("utf-8")
    provenance = {
        "resource": "general_text",
        "source": {"python": ".".join(map(str, sys.version_info[:3])), "implementation": sys.implementation.name,
                   "files_read": len(files), "files_sha256": sources.hexdigest(),
                   "licence": "PSF License Version 2 (LICENSE beside this file)"},
        "disjoint_from": {"pydoc_data.topics_sha256": hashlib.sha256(repr(sorted(topics.items())).encode()).hexdigest(),
                          "wordnet_gloss.jsonl_sha256": hashlib.sha256(WORDNET_ROWS.read_bytes()).hexdigest()},
        "script": "scripts/build_general_text.py",
        "seed": SEED, "min_words": MIN_WORDS, "max_documents": MAX_DOCUMENTS,
        "documents": len(documents), "words": sum(len(d.split()) for d in documents),
        f"{TEXT_FILE}_sha256": hashlib.sha256(text).hexdigest(),
    }
    return {TEXT_FILE: text, "LICENSE": (stdlib / "LICENSE.txt").read_bytes(),
            "provenance.json": (json.dumps(provenance, indent=2, sort_keys=True) + "\n").encode("utf-8")}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--check", action="store_true", help="compare with the shipped files instead of writing")
    args = parser.parse_args(argv)
    files = build()
    if args.check:
        differ = [name for name, data in files.items() if (OUT / name).read_bytes() != data]
        for name in differ:
            print(f"{OUT / name} differs from what the script writes with Python {sys.version.split()[0]}",
                  file=sys.stderr)
        return 1 if differ else 0
    OUT.mkdir(parents=True, exist_ok=True)
    for name, data in files.items():
        (OUT / name).write_bytes(data)
    record = json.loads(files["provenance.json"])
    print(f"wrote {len(files)} files to {OUT} ({record['documents']} documents, {record['words']} words, "
          f"{len(files[TEXT_FILE])} bytes, Python {record['source']['python']})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
