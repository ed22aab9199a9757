"""Writes the shipped lm-evaluation-harness task wordnet_gloss (ft_framework/resources/benchmarks/wordnet_gloss/):
"what does this word mean", four glosses to choose from, built from WordNet 3.0 as Debian's `wordnet-base`
package ships it (/usr/share/wordnet). Deterministic (seed 20261206): running it again writes the same bytes.

    apt-get install wordnet-base
    python scripts/build_wordnet_benchmark.py            # writes wordnet_gloss.jsonl, LICENSE, provenance.json
    python scripts/build_wordnet_benchmark.py --check    # exits 1 when the shipped files differ

The rule, in order:

1. The words: the noun lemmas of cntlist.rev (the number of times each sense was tagged in Princeton's
   semantic concordances) that are one lower-case word (letters only: no proper noun, no collocation) and
   have at least MIN_TAGGED_SENSES noun senses listed there: common nouns, each with several meanings.
2. A word's answer: the gloss of its first noun sense (index.noun lists a lemma's synsets most frequent
   first, the order cntlist's sense numbers give), its definition only (the examples in quotes cut).
   A word whose answer names the word itself is dropped: the choice would give itself away.
3. Its three distractors: answers of other words (so every gloss is one of a common noun's first sense),
   drawn by the seed, each distinct, none a gloss of any noun sense of the word and none naming the word.
4. The answer's position: each of the four positions equally often (to within one), shuffled by the seed;
   the items themselves in an order shuffled by the seed, so that `limit: N` takes a random sample.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import random
import re
import subprocess
import sys
from pathlib import Path

OUT = Path(__file__).resolve().parents[1] / "ft_framework" / "resources" / "benchmarks" / "wordnet_gloss"
WORDNET = Path("/usr/share/wordnet")
COPYRIGHT = Path("/usr/share/doc/wordnet-base/copyright")
SOURCE_PACKAGE = "wordnet-base"
SOURCE_FILES = ("cntlist.rev", "index.noun", "data.noun")
SEED = 20261206
MIN_TAGGED_SENSES = 5
N_CHOICES = 4
WORD = re.compile(r"[a-z]+")


def tagged_noun_senses(cntlist_rev: str) -> dict[str, int]:
    """lemma -> how many of its noun senses cntlist.rev lists (sense keys `lemma%1:...`: ss_type 1, a noun)."""
    senses: dict[str, int] = {}
    for line in cntlist_rev.splitlines():
        sense_key, _sense_number, _tag_count = line.split(" ")
        lemma, lex_sense = sense_key.split("%", 1)
        if lex_sense.startswith("1:"):
            senses[lemma] = senses.get(lemma, 0) + 1
    return senses


def noun_synsets(index_noun: str) -> dict[str, list[str]]:
    """lemma -> its noun synsets' offsets, most frequent sense first (index.noun; license lines start with spaces)."""
    synsets = {}
    for line in index_noun.splitlines():
        if line.startswith("  "):
            continue
        fields = line.split()
        lemma, synset_count, pointer_count = fields[0], int(fields[2]), int(fields[3])
        # lemma pos synset_cnt p_cnt [ptr_symbol...] sense_cnt tagsense_cnt synset_offset...
        synsets[lemma] = fields[6 + pointer_count:6 + pointer_count + synset_count]
    return synsets


def definition(gloss: str) -> str:
    """A data.noun gloss without its examples: the text before the first quoted example, less its `;`."""
    return gloss.split('"', 1)[0].strip().rstrip(";").strip()


def glosses(data_noun: str, wanted: set[str]) -> dict[str, str]:
    """synset offset -> its gloss's definition, for the offsets in `wanted` (the gloss follows ` | `)."""
    found = {}
    for line in data_noun.splitlines():
        offset = line[:8]
        if offset in wanted:
            found[offset] = definition(line.split(" | ", 1)[1])
    return found


def names_word(text: str, word: str) -> bool:
    return re.search(rf"\b{re.escape(word)}\b", text, flags=re.IGNORECASE) is not None


def make_items(cntlist_rev: str, index_noun: str, data_noun: str) -> list[dict]:
    rng = random.Random(SEED)
    senses = tagged_noun_senses(cntlist_rev)
    synsets = noun_synsets(index_noun)
    words = sorted(w for w, n in senses.items() if n >= MIN_TAGGED_SENSES and WORD.fullmatch(w) and w in synsets)
    gloss_of = glosses(data_noun, {offset for w in words for offset in synsets[w]})
    answers = {w: gloss_of[synsets[w][0]] for w in words}
    words = [w for w in words if not names_word(answers[w], w)]

    positions = [i % N_CHOICES for i in range(len(words))]
    rng.shuffle(positions)
    items = []
    for word, position in zip(words, positions):
        own = {gloss_of[offset] for offset in synsets[word]}
        pool = sorted({answers[w] for w in words if w != word} - own)
        pool = [g for g in pool if not names_word(g, word)]
        distractors = rng.sample(pool, N_CHOICES - 1)
        choices = distractors[:position] + [answers[word]] + distractors[position:]
        items.append({"word": word, "synset": synsets[word][0], "choices": choices, "label": position})
    rng.shuffle(items)
    return items


def jsonl(items: list[dict]) -> str:
    return "".join(json.dumps(item, ensure_ascii=False, sort_keys=True) + "\n" for item in items)


def wordnet_licence(copyright_text: str) -> str:
    """The `License: WordNet3.0` paragraph of Debian's copyright file, as plain text."""
    block = copyright_text.split("License: WordNet3.0\n", 1)[1].split("\n\n", 1)[0]
    lines = [line[1:] if line.startswith(" ") else line for line in block.splitlines()]
    return "WordNet 3.0 license (Princeton University)\n\n" + "\n".join("" if l == "." else l for l in lines) + "\n"


def source_version() -> str:
    return subprocess.run(["dpkg-query", "-W", "-f=${Version}", SOURCE_PACKAGE], capture_output=True, text=True,
                          check=True).stdout.strip()


def build(wordnet: Path = WORDNET, copyright_file: Path = COPYRIGHT, version: str | None = None) -> dict[str, bytes]:
    """The files the task ships that this script writes, by name: the items, the licence, the provenance."""
    sources = {name: (wordnet / name).read_bytes() for name in SOURCE_FILES}
    text = {name: data.decode("utf-8") for name, data in sources.items()}
    items_text = jsonl(make_items(text["cntlist.rev"], text["index.noun"], text["data.noun"])).encode("utf-8")
    provenance = {
        "task": "wordnet_gloss",
        "source": {"package": SOURCE_PACKAGE, "version": version or source_version(), "directory": str(WORDNET),
                   "files_sha256": {name: hashlib.sha256(data).hexdigest() for name, data in sources.items()},
                   "licence": "WordNet 3.0 (LICENSE beside this file)"},
        "script": "scripts/build_wordnet_benchmark.py",
        "seed": SEED, "min_tagged_senses": MIN_TAGGED_SENSES, "choices": N_CHOICES,
        "items": items_text.count(b"\n"),
        "wordnet_gloss.jsonl_sha256": hashlib.sha256(items_text).hexdigest(),
    }
    return {"wordnet_gloss.jsonl": items_text,
            "LICENSE": wordnet_licence(copyright_file.read_text(encoding="utf-8")).encode("utf-8"),
            "provenance.json": (json.dumps(provenance, indent=2, sort_keys=True) + "\n").encode("utf-8")}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--check", action="store_true", help="compare with the shipped files instead of writing")
    args = parser.parse_args(argv)
    if not (WORDNET / "data.noun").is_file():
        print(f"build_wordnet_benchmark.py: {WORDNET}/data.noun not found; apt-get install {SOURCE_PACKAGE}",
              file=sys.stderr)
        return 2
    try:
        version = source_version()
    except (OSError, subprocess.CalledProcessError) as error:  # no dpkg-query, or not the Debian package
        print(f"build_wordnet_benchmark.py: cannot read {SOURCE_PACKAGE}'s version with dpkg-query ({error})",
              file=sys.stderr)
        return 2
    files = build(version=version)
    if args.check:
        differ = [name for name, data in files.items() if (OUT / name).read_bytes() != data]
        for name in differ:
            print(f"{OUT / name} differs from what the script writes", file=sys.stderr)
        return 1 if differ else 0
    OUT.mkdir(parents=True, exist_ok=True)
    for name, data in files.items():
        (OUT / name).write_bytes(data)
    print(f"wrote {len(files)} files to {OUT} ({json.loads(files['provenance.json'])['items']} items)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
