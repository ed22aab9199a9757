"""The SFT quickstart's shipped task (resources/quickstart_sft/, builtin:quickstart_sft): the files are
what scripts/make_quickstart_sft.py writes, read as prompt/completion rows, and every completion is
the house style of its prompt's fields (the rule checked here from the rows alone)."""

from __future__ import annotations

import re
import runpy
from pathlib import Path

from ft_framework.data.sft_rows import PROMPT_COMPLETION, read_sft_rows
from ft_framework.resources import quickstart_sft_dir

REPO = Path(__file__).resolve().parents[3]
SCRIPT = runpy.run_path(str(REPO / "scripts" / "make_quickstart_sft.py"))
PROMPT = re.compile(r"Order: ((?:\w+: [^;\n]+)(?:; \w+: [^;\n]+){3})\nHouse style:")


def rows(split: str) -> list:
    return list(read_sft_rows(quickstart_sft_dir() / f"{split}.jsonl", split))


def test_the_shipped_files_are_the_scripts_output():
    train, validation = SCRIPT["make_rows"]()
    assert (quickstart_sft_dir() / "train.jsonl").read_text(encoding="utf-8") == SCRIPT["jsonl"](train)
    assert (quickstart_sft_dir() / "validation.jsonl").read_text(encoding="utf-8") == SCRIPT["jsonl"](validation)


def test_every_completion_is_the_house_style_of_its_prompt():
    for split, expected in (("train", 400), ("validation", 100)):
        found = rows(split)
        assert len(found) == expected and {r.shape for r in found} == {PROMPT_COMPLETION}
        orders = set()
        for r in found:
            fields = dict(pair.split(": ", 1) for pair in PROMPT.fullmatch(r.prompt).group(1).split("; "))
            assert sorted(fields) == ["color", "customer", "item", "qty"], r.where
            first, last = fields["customer"].split(" ")
            assert r.completion == f" {last}, {first}: {fields['qty']}x {fields['color']} {fields['item']}", r.where
            orders.add((first, last, fields["item"], fields["color"], fields["qty"]))
        assert len(orders) == expected  # every order once


def test_validation_repeats_no_training_order_and_a_quarter_names_unseen_people():
    train, validation = rows("train"), rows("validation")
    assert not {r.completion for r in train} & {r.completion for r in validation}
    seen = {name for r in train for name in re.findall(r"[A-Z][a-z]+", r.completion)}
    unseen = [r for r in validation if not set(re.findall(r"[A-Z][a-z]+", r.completion)) <= seen]
    assert len(unseen) == 25
