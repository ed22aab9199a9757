"""The token cache (data/token_cache.py, as data/sft.py uses it): tokens computed once and read back by
a second run and by the other processes; keyed on the file's bytes, the tokenizer and template, and
the settings that change tokens; written whole or not at all; a damaged entry rebuilt with a warning;
memory-mapped, never copied into a pickle."""

from __future__ import annotations

import logging
import multiprocessing
import os
import pickle
import re

import numpy as np
import pytest

from sft_helpers import MARKED_CHATML, build_tiny_tokenizer, write_jsonl

from ft_framework.data import sft as sft_module
from ft_framework.data.sft import SFTSettings, load_sft_data
from ft_framework.data.sft_tokenize import RowTokenizer
from ft_framework.data.token_cache import HEADER, entry_name, open_entry
from ft_framework.errors import UserError

ROWS = [{"prompt": f"Question {i}:", "completion": f" answer {i}"} for i in range(7)]


def files(tmp_path, rows=ROWS):
    path = write_jsonl(tmp_path / "train.jsonl", rows)
    dev = write_jsonl(tmp_path / "dev.jsonl", rows[:3])
    return {"train": path, "validation": dev}


def load(tmp_path, tokenizer=None, *, rows=ROWS, cache=None, **kwargs):
    settings = SFTSettings(**{"max_seq_length": 64, **{k: kwargs.pop(k) for k in list(kwargs)
                                                       if k in SFTSettings.__dataclass_fields__}})
    return load_sft_data(files(tmp_path, rows), tokenizer or build_tiny_tokenizer(), settings,
                         cache_dir=cache or tmp_path / "cache", **kwargs)


def entries(cache):
    return sorted(p for p in cache.iterdir() if not p.name.startswith("."))


def items(dataset):
    return [dataset[i] for i in range(len(dataset))]


@pytest.fixture
def no_tokenizing(monkeypatch):
    """Makes any tokenization fail: what loads afterwards came from the cache."""
    def refuse(self, rows):
        raise AssertionError("tokenized although the cache holds the tokens")
    return lambda: monkeypatch.setattr(RowTokenizer, "tokenize", refuse)


def test_a_second_run_and_another_process_read_the_tokens(tmp_path, no_tokenizing):
    first = load(tmp_path)
    stamps = {p: p.stat().st_mtime_ns for entry in entries(tmp_path / "cache") for p in entry.iterdir()}
    assert len(entries(tmp_path / "cache")) == 2  # train and validation
    no_tokenizing()
    again = load(tmp_path)
    other = load(tmp_path, is_main=False)
    for data in (again, other):
        assert items(data.train) == items(first.train) and items(data.eval["validation"]) == items(
            first.eval["validation"])
        assert data.stats == first.stats
    assert {p: p.stat().st_mtime_ns for entry in entries(tmp_path / "cache") for p in entry.iterdir()} == stamps


def test_the_key_is_the_bytes_the_tokenizer_and_what_changes_tokens(tmp_path, no_tokenizing):
    cache = tmp_path / "cache"
    load(tmp_path)
    assert len(entries(cache)) == 2                   # train and validation
    load(tmp_path, packing=True)                      # packing happens after the cache
    assert len(entries(cache)) == 2
    # Each of these changes both splits' tokens, but the example limit only the train split's.
    changes = [(dict(max_seq_length=32), 2), (dict(train_on_prompt=True), 2), (dict(chat_template=MARKED_CHATML), 2),
               (dict(max_train_examples=5), 1)]
    count = 2
    for change, new in changes:
        load(tmp_path, **change)
        count += new
        assert len(entries(cache)) == count, change
    load(tmp_path, rows=ROWS[:-1] + [{"prompt": "Question 6:", "completion": " answer 7"}])  # one byte differs
    assert len(entries(cache)) == count + 1           # the train file changed; validation (rows 0-2) did not
    tokenizer = build_tiny_tokenizer()
    tokenizer.add_tokens(["answer"])
    load(tmp_path, tokenizer)
    assert len(entries(cache)) == count + 3
    no_tokenizing()
    load(tmp_path, max_seq_length=32, packing=True)  # every one of those is read back
    load(tmp_path, tokenizer)


@pytest.mark.parametrize("damage", ["flipped byte", "short file", "header not JSON", "header of another key",
                                    "missing array", "array is a named pipe", "header is a named pipe"])
def test_a_damaged_entry_is_rebuilt_with_a_warning(tmp_path, caplog, damage):
    expected = items(load(tmp_path).train)  # read before the damage: the arrays map the files
    entry = next(e for e in entries(tmp_path / "cache") if
                 '"split":"train"' in (e / HEADER).read_text())
    tokens = entry / "input_ids"
    if damage == "flipped byte":
        data = bytearray(tokens.read_bytes())
        data[4] ^= 1  # the second token's lowest bit: still a token of the vocabulary, only the checksum differs
        tokens.write_bytes(bytes(data))
    elif damage == "short file":
        tokens.write_bytes(tokens.read_bytes()[:-4])
    elif damage == "header not JSON":
        (entry / HEADER).write_text("{not json")
    elif damage == "header of another key":
        (entry / HEADER).write_text((entry / HEADER).read_text().replace('"max_seq_length":64', '"max_seq_length":65'))
    elif damage == "missing array":
        (entry / "target_mask").unlink()
    else:  # a pipe would block a read forever: it is refused unopened
        planted = entry / ("target_mask" if damage == "array is a named pipe" else HEADER)
        planted.unlink()
        os.mkfifo(planted)
    with caplog.at_level(logging.WARNING, logger="ft_framework.data.token_cache"):
        again = load(tmp_path)
    assert [r.getMessage() for r in caplog.records if "is damaged" in r.getMessage()] != []
    assert f"token cache entry {entry} is damaged" in caplog.text
    assert items(again.train) == expected


def test_the_other_processes_read_only_after_the_barrier(tmp_path):
    """A process that is not the main one waits at the barrier, then reads what the main one wrote
    meanwhile; with nothing written it stops in one line."""
    with pytest.raises(UserError, match=r"the token cache entry of the train split, .*, which the main process "
                                        r"prepared, cannot be read here \(.*\); every process must see the same "
                                        r"data\.token_cache_dir$"):
        load(tmp_path, is_main=False)
    written = {}
    data = load(tmp_path, is_main=False, barrier=lambda: written.update(main=load(tmp_path)))
    assert items(data.train) == items(written["main"].train)
    order = []
    load(tmp_path, barrier=lambda: order.append(len(entries(tmp_path / "cache"))))
    assert order == [2]  # the main process has written every split when it reaches the barrier


def test_a_failed_build_leaves_no_entry(tmp_path, monkeypatch):
    monkeypatch.setattr(sft_module, "CHUNK_ROWS", 2)
    rows = ROWS[:5] + [{"prompt": "bad", "completion": 3}]
    with pytest.raises(UserError, match=r"train\.jsonl:6: `completion` holds int 3"):
        load(tmp_path, rows=rows)
    assert os.listdir(tmp_path / "cache") == [] or all(name.endswith(".lock")
                                                       for name in os.listdir(tmp_path / "cache"))


def test_a_data_file_that_is_a_named_pipe_is_refused_unread(tmp_path):
    pipe = tmp_path / "train.jsonl"
    os.mkfifo(pipe)
    dev = write_jsonl(tmp_path / "dev.jsonl", ROWS)
    with pytest.raises(UserError, match=r"train\.jsonl is a named pipe, not a regular file: refused without reading"):
        load_sft_data({"train": pipe, "validation": dev}, build_tiny_tokenizer(), SFTSettings(max_seq_length=64),
                      cache_dir=tmp_path / "cache")


def test_a_killed_writers_leftovers_are_ignored(tmp_path):
    (tmp_path / "cache" / ".tmp-0123-999-abcd").mkdir(parents=True)
    (tmp_path / "cache" / ".tmp-0123-999-abcd" / "input_ids").write_bytes(b"\x00" * 12)
    data = load(tmp_path)
    assert len(data.train) == len(ROWS)


def test_tokens_are_memory_mapped_and_pickle_as_a_name(tmp_path):
    data = load(tmp_path)
    assert isinstance(data.train._arrays["input_ids"], np.memmap)
    pickled = pickle.dumps(data.train)
    assert len(pickled) < 2000
    assert items(pickle.loads(pickled)) == items(data.train)


def mapped_kib(path) -> int | None:
    """The resident KiB of this process's memory maps of `path` (None: the file is not mapped)."""
    found, total = False, 0
    current = None
    for line in open("/proc/self/smaps"):
        fields = line.split()
        if fields and re.fullmatch(r"[0-9a-f]+-[0-9a-f]+", fields[0]):  # a mapping's first line
            current = fields[5] if len(fields) >= 6 else None  # an anonymous one names no file
        elif fields and fields[0] == "Rss:" and current == str(path):
            found, total = True, total + int(fields[1])
    return total if found else None


@pytest.mark.skipif(not os.path.exists("/proc/self/smaps"), reason="reads Linux's /proc/self/smaps")
def test_the_writers_checks_map_no_token_page(tmp_path):
    """The checks before use read every token, through the file: a page read through the memory map
    would count in the process's RSS (1M rows: 0.8 GB more peak RSS for the main process)."""
    data = load(tmp_path)
    entry = data.train._entry
    opened = open_entry(entry.path, data.train._key, sft_module.ARRAYS, verify=True)
    sft_module._check_entry(opened, 300)
    assert mapped_kib(entry.path / "input_ids") == 0 and mapped_kib(entry.path / "target_mask") == 0
    assert data.train[0]["input_ids"] and mapped_kib(entry.path / "input_ids") > 0  # a read through the map counts
    assert entry_name(data.train._key) == entry.path.name


def _load_in_child(tmp_path, log, paths):
    real = RowTokenizer.tokenize

    def logged(self, rows):
        with open(log, "a") as f:
            f.write(f"{len(rows)}\n")
        return real(self, rows)

    RowTokenizer.tokenize = logged
    load_sft_data(paths, build_tiny_tokenizer(), SFTSettings(max_seq_length=64), cache_dir=tmp_path / "cache")


@pytest.mark.slow
def test_two_runs_starting_together_tokenize_once(tmp_path):
    log = tmp_path / "tokenized_by"
    paths = files(tmp_path, ROWS * 3000)  # written once, before either starts: both read the same files
    context = multiprocessing.get_context("fork")
    children = [context.Process(target=_load_in_child, args=(tmp_path, log, paths)) for _ in range(2)]
    for child in children:
        child.start()
    for child in children:
        child.join(120)
    assert [child.exitcode for child in children] == [0, 0]
    # Every row of each split tokenized once, whichever process did it (one may write train while
    # the other writes validation).
    assert sum(int(n) for n in log.read_text().split()) == len(ROWS) * 3000 + 3
    assert len(entries(tmp_path / "cache")) == 2
