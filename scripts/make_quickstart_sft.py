"""Writes the SFT quickstart's task (ft_framework/resources/quickstart_sft/): orders rewritten in a
house style that we made up, as prompt/completion rows. Deterministic (seed 20260427): running it
again writes the same bytes.

    python scripts/make_quickstart_sft.py            # writes train.jsonl and validation.jsonl
    python scripts/make_quickstart_sft.py --check    # exits 1 when the shipped files differ

A row's prompt lists an order's four fields in a random order; its completion is the order in the
house style, always in one order and one shape:

    {"prompt": "Order: qty: 3; color: red; customer: Maria Lopez; item: lamp\\nHouse style:",
     "completion": " Lopez, Maria: 3x red lamp"}

Nothing about the style is said in the prompt, so a model can only learn it from the rows: it must
find each field by its key and copy it into its slot (surname first, the quantity with an "x").
No world knowledge is needed. A quarter of the validation rows name a person whose first or last
name no training row has, so copying, not memorising, is what scores.
"""

from __future__ import annotations

import argparse
import json
import random
import sys
from pathlib import Path

OUT = Path(__file__).resolve().parents[1] / "ft_framework" / "resources" / "quickstart_sft"
SEED = 20260427
N_TRAIN, N_VALIDATION = 400, 100

FIRST_NAMES = ["Maria", "John", "Aisha", "Pedro", "Yuki", "Olga", "Liam", "Fatima", "Chen", "Sofia", "Omar", "Emma",
               "Ivan", "Grace", "Noah", "Lena", "Ravi", "Clara", "Hugo", "Nadia", "Tom", "Alice", "Jonas", "Mei",
               "Diego", "Sara", "Felix", "Amara", "Leo", "Hannah", "Kofi", "Julia", "Marco", "Elena", "Sam", "Irene"]
LAST_NAMES = ["Lopez", "Smith", "Khan", "Silva", "Tanaka", "Petrova", "Murphy", "Haddad", "Wang", "Rossi", "Farah",
              "Brown", "Novak", "Kim", "Weber", "Jensen", "Patel", "Moreau", "Costa", "Nowak", "Baker", "Fischer",
              "Okafor", "Garcia", "Nakamura", "Berg", "Santos", "Ivanov", "Meyer", "Dubois", "Cohen", "Larsen",
              "Mensah", "Romero", "Keller", "Andersen"]
ITEMS = ["lamp", "chair", "table", "mug", "kettle", "towel", "pillow", "clock", "vase", "rug", "shelf", "basket",
         "mirror", "bowl", "stool", "blanket", "candle", "jar", "tray", "bench"]
COLORS = ["red", "blue", "green", "black", "white", "grey", "yellow", "pink", "brown", "orange"]
# First and last names that appear in validation rows only (the last six of each list).
HELD_OUT = 6


def order(rng: random.Random, first_names: list[str], last_names: list[str]) -> dict[str, str]:
    return {"first": rng.choice(first_names), "last": rng.choice(last_names), "item": rng.choice(ITEMS),
            "color": rng.choice(COLORS), "qty": str(rng.randint(1, 20))}


def row(rng: random.Random, fields: dict[str, str]) -> dict[str, str]:
    """The prompt (the four fields in a random order) and the house-style completion."""
    pairs = [("customer", f"{fields['first']} {fields['last']}"), ("item", fields["item"]),
             ("color", fields["color"]), ("qty", fields["qty"])]
    rng.shuffle(pairs)
    # "key: value": a value after a space is tokenized as it is in the completion, so it can be copied
    prompt = "Order: " + "; ".join(f"{key}: {value}" for key, value in pairs) + "\nHouse style:"
    completion = f" {fields['last']}, {fields['first']}: {fields['qty']}x {fields['color']} {fields['item']}"
    return {"prompt": prompt, "completion": completion}


def make_rows() -> tuple[list[dict[str, str]], list[dict[str, str]]]:
    rng = random.Random(SEED)
    seen: set[tuple[str, ...]] = set()

    def draw(n: int, first_names: list[str], last_names: list[str], keep=lambda f: True) -> list[dict[str, str]]:
        rows = []
        while len(rows) < n:
            fields = order(rng, first_names, last_names)
            key = tuple(fields.values())
            if key in seen or not keep(fields):
                continue  # every order once: no validation row repeats a training row
            seen.add(key)
            rows.append(row(rng, fields))
        return rows

    known_first, known_last = FIRST_NAMES[:-HELD_OUT], LAST_NAMES[:-HELD_OUT]
    train = draw(N_TRAIN, known_first, known_last)
    unseen = N_VALIDATION // 4
    validation = draw(N_VALIDATION - unseen, known_first, known_last)
    validation += draw(unseen, FIRST_NAMES, LAST_NAMES,
                       keep=lambda f: f["first"] not in known_first or f["last"] not in known_last)
    rng.shuffle(validation)
    return train, validation


def jsonl(rows: list[dict[str, str]]) -> str:
    return "".join(json.dumps(r, ensure_ascii=False) + "\n" for r in rows)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="compare with the shipped files instead of writing")
    args = parser.parse_args()
    train, validation = make_rows()
    files = {"train.jsonl": jsonl(train), "validation.jsonl": jsonl(validation)}
    if args.check:
        stale = [name for name, text in files.items() if (OUT / name).read_text(encoding="utf-8") != text]
        print("up to date" if not stale else f"differ from the script's output: {', '.join(stale)}")
        return 1 if stale else 0
    OUT.mkdir(parents=True, exist_ok=True)
    for name, text in files.items():
        (OUT / name).write_text(text, encoding="utf-8")
    print(f"wrote {len(train)} + {len(validation)} rows into {OUT}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
