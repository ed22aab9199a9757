"""data.replay's draw (data/replay.py) and file (data/general_text.py): how many rows a step takes,
which (the keyed draw against counter_rng's Python-int hash), which rank takes which (the ranks'
union is the one-process step), the file's documents tokenized once through the token cache with
every token a label, and the one-line refusals of a file that holds no general text."""

from __future__ import annotations

import json

import numpy as np
import pytest
from sft_helpers import build_tiny_tokenizer

from ft_framework.counter_rng import STREAM_REPLAY_ROWS, lowbias32_int, stream_key
from ft_framework.data.replay import ReplayMix, rank_micro_batches, replay_rows_per_step, step_rows
from ft_framework.data.general_text import load_replay
from ft_framework.data.sft_collate import IGNORE_INDEX
from ft_framework.errors import UserError


@pytest.mark.parametrize(("task_rows", "fraction", "want"), [
    (8, 0.2, 2), (8, 0.5, 8), (6, 0.25, 2), (32, 0.1, 4), (1, 0.01, 1), (4, 0.01, 1), (3, 0.9, 27), (5, 0.375, 3),
    (6, 0.2, 2)])
def test_the_replay_rows_of_a_step_are_the_fractions_share_of_its_rows(task_rows, fraction, want):
    # round(f / (1 - f) x T), halves up (6 x 1/4 = 1.5 -> 2), at least one.
    assert replay_rows_per_step(task_rows, fraction) == want


def test_a_fraction_outside_the_open_interval_is_refused():
    for fraction in (0.0, 1.0, -0.1):
        with pytest.raises(ValueError, match="0 < fraction < 1"):
            replay_rows_per_step(8, fraction)


@pytest.mark.parametrize(("num_rows", "count", "seed", "step"),
                         [(23, 5, 2, 0), (7, 3, 0, 11), (100_003, 9, 2**40, 2**33)])
def test_the_rows_of_a_step_are_the_keyed_draw(num_rows, count, seed, step):
    key = stream_key(seed, STREAM_REPLAY_ROWS, step)
    want = [(lowbias32_int(lowbias32_int(key ^ slot)) * num_rows) >> 32 for slot in range(count)]
    got = step_rows(num_rows, count, seed, step)
    assert got.tolist() == want and got.dtype == np.int64
    assert step_rows(num_rows, count, seed, step).tolist() == want                   # the same whenever asked
    assert step_rows(num_rows, count + 4, seed, step)[:count].tolist() == want       # slot s is slot s
    assert step_rows(num_rows, count, seed, step + 1).tolist() != want or num_rows == 1


def test_the_draw_covers_the_rows_evenly():
    rows = np.concatenate([step_rows(10, 64, 5, step) for step in range(200)])
    counts = np.bincount(rows, minlength=10)
    assert counts.min() > 1100 and counts.max() < 1460  # 1280 each; 4 sigma is about +-140


@pytest.mark.parametrize(("count", "world_size", "batch_size"),
                         [(5, 2, 4), (5, 2, 2), (1, 2, 4), (7, 3, 2), (8, 1, 3)])
def test_each_rank_takes_its_slots_and_the_ranks_together_take_the_step(count, world_size, batch_size):
    rows = list(range(100, 100 + count))
    per_rank = [rank_micro_batches(rows, rank=r, world_size=world_size, batch_size=batch_size)
                for r in range(world_size)]
    assert len({len(batches) for batches in per_rank}) == 1                       # ranks stay in step
    assert all(len(b) <= batch_size for batches in per_rank for b in batches)
    assert sorted(row for batches in per_rank for b in batches for row in b) == rows
    for rank, batches in enumerate(per_rank):
        assert [row for b in batches for row in b] == rows[rank::world_size]
    # One process with the whole batch takes every slot in order.
    alone = rank_micro_batches(rows, rank=0, world_size=1, batch_size=batch_size * world_size)
    assert [row for b in alone for row in b] == rows


def write_documents(path, lines):
    path.write_text("".join(line + "\n" for line in lines))
    return path


def test_a_text_file_is_one_document_a_line_every_token_a_label(tmp_path):
    tokenizer = build_tiny_tokenizer()
    docs = ["a first document", "", "   ", "the second one, longer than the window: " + "x" * 40, "third"]
    file = write_documents(tmp_path / "general.txt", docs)
    mix = load_replay(file, 0.2, tokenizer, 24, task_rows_per_step=8, seed=3, cache_dir=tmp_path / "cache")
    kept = [d for d in docs if d.strip()]
    assert len(mix.rows) == 3 and mix.rows_per_step == 2
    for row, doc in zip((mix.rows[i] for i in range(3)), kept):
        ids = tokenizer(doc + tokenizer.eos_token)["input_ids"][:24]
        assert row["input_ids"] == ids
        assert row["labels"] == [IGNORE_INDEX] + ids[1:]  # every token but the first is predicted
    assert mix.source["rows_in_file"] == 3 and mix.source["truncated"] == 1 and mix.source["fraction"] == 0.2
    assert mix.source["file"] == str(file) and len(mix.source["sha256"]) == 64
    # Tokenized once: a second load reads the cache entry (the tokenizer is not called again).
    entries = sorted(p.name for p in (tmp_path / "cache").iterdir())
    again = load_replay(file, 0.2, tokenizer, 24, task_rows_per_step=8, seed=3, cache_dir=tmp_path / "cache")
    assert sorted(p.name for p in (tmp_path / "cache").iterdir()) == entries
    assert [again.rows[i] for i in range(3)] == [mix.rows[i] for i in range(3)]
    # Another window is another entry.
    load_replay(file, 0.2, tokenizer, 12, task_rows_per_step=8, seed=3, cache_dir=tmp_path / "cache")
    assert len(list((tmp_path / "cache").iterdir())) > len(entries)


def test_a_jsonl_file_reads_its_text_field(tmp_path):
    tokenizer = build_tiny_tokenizer()
    file = tmp_path / "general.jsonl"
    file.write_text("".join(json.dumps({"text": t, "id": i}) + "\n" for i, t in enumerate(["one", "two words"])))
    mix = load_replay(file, 0.5, tokenizer, 32, task_rows_per_step=3, seed=0, cache_dir=tmp_path / "cache")
    assert [mix.rows[i]["input_ids"] for i in range(2)] == [tokenizer(t + tokenizer.eos_token)["input_ids"]
                                                          for t in ("one", "two words")]
    assert mix.rows_per_step == 3


def test_a_micro_batch_without_rows_holds_one_padding_row_with_no_label(tmp_path):
    tokenizer = build_tiny_tokenizer()
    file = write_documents(tmp_path / "g.txt", ["alpha", "beta"])
    mix = load_replay(file, 0.5, tokenizer, 32, task_rows_per_step=1, seed=0, cache_dir=tmp_path / "cache")
    assert mix.items([]) == [{"input_ids": mix.rows[0]["input_ids"][:1], "labels": [IGNORE_INDEX]}]
    assert mix.items([1, 1]) == [mix.rows[1], mix.rows[1]]
    assert isinstance(mix, ReplayMix) and mix.record(0)["rows_used"] == 0


@pytest.mark.parametrize(("name", "content", "message"), [
    ("empty.txt", "", "holds no text"),
    ("blank.txt", "\n  \n\n", "holds no text"),
    ("empty.jsonl", "", "holds no text"),
    ("pairs.jsonl", json.dumps({"prompt": "a", "completion": "b"}) + "\n", "a `text` field only"),
    ("other.jsonl", json.dumps({"body": "a"}) + "\n", "general.*|text"),
    ("columns.csv", "body\nhello\n", "hold no `text`"),
    ("latin1.txt", None, "not UTF-8"),
])
def test_a_file_without_general_text_is_refused_in_one_line(tmp_path, name, content, message):
    file = tmp_path / name
    if content is None:
        file.write_bytes("caf\xe9\n".encode("latin-1"))
    else:
        file.write_text(content)
    with pytest.raises(UserError, match=message) as caught:
        load_replay(file, 0.2, build_tiny_tokenizer(), 16, task_rows_per_step=4, seed=0, cache_dir=tmp_path / "cache")
    assert "\n" not in str(caught.value)


def test_a_directory_is_refused(tmp_path):
    with pytest.raises(UserError, match="data.replay.file: .* is not a file"):
        load_replay(tmp_path, 0.2, build_tiny_tokenizer(), 16, task_rows_per_step=4, seed=0,
                    cache_dir=tmp_path / "cache")
