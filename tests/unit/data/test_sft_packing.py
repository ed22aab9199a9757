"""Packing (data/sft_packing.py) and SFT batches (data/sft_collate.py): best-fit decreasing against a
plain reference, the packed items, the restarting positions without a mask (transformers finds the
rows' bounds from them) and the dense block-diagonal causal mask (eager's fallback), and the loss of
packed batches, in both forms, equal to that of the same rows unpacked, on tiny models of every
architecture we support, with sdpa and eager attention, sliding windows included. (flex_attention on
this CPU: torch 2.13 has no backward for it there, and its forward compiles for a minute.)

The reference loss is written here by hand: the sum of each label token's cross-entropy (label t
predicted at position t - 1) over their count, token by token."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from sft_helpers import build_tiny_tokenizer, tiny_model, write_jsonl

from ft_framework.data.sft import SFTCollator, SFTSettings, attention_windows, load_sft_data
from ft_framework.data.sft_collate import packed_attention_mask
from ft_framework.data.sft_packing import best_fit_decreasing


def reference_bfd(lengths, capacity):
    """Best-fit decreasing, one row at a time: longest first (ties in file order), into the sequence
    with the least room that holds it (the oldest among equals), else a new one."""
    sequences, rooms = [], []
    for row in sorted(range(len(lengths)), key=lambda i: (-lengths[i], i)):
        fitting = [k for k, room in enumerate(rooms) if room >= lengths[row]]
        if fitting:
            best = min(fitting, key=lambda k: (rooms[k], k))
        else:
            best = len(sequences)
            sequences.append([])
            rooms.append(capacity)
        sequences[best].append(row)
        rooms[best] -= lengths[row]
    return sequences


@pytest.mark.parametrize("seed", range(6))
def test_best_fit_decreasing_is_the_plain_algorithm(seed):
    rng = np.random.default_rng(seed)
    capacity = int(rng.choice([8, 16, 50]))
    lengths = rng.integers(1, capacity + 1, size=int(rng.integers(1, 300)))
    if seed % 2:  # many ties and short rows: several of a length go into one sequence at once
        lengths = rng.choice([1, 2, 3, capacity // 2, capacity], size=len(lengths))
    order, offsets = best_fit_decreasing(lengths, capacity)
    ours = [order[offsets[k]:offsets[k + 1]].tolist() for k in range(len(offsets) - 1)]
    expected = reference_bfd(lengths.tolist(), capacity)
    assert sorted(ours, key=lambda s: s[0]) == sorted(expected, key=lambda s: s[0])
    assert all(lengths[s].sum() <= capacity for s in ours) and sorted(order.tolist()) == list(range(len(lengths)))


def test_best_fit_decreasing_refuses_rows_longer_than_the_sequence():
    with pytest.raises(ValueError, match="row lengths must be in 1..4"):
        best_fit_decreasing(np.array([2, 5]), 4)


def pair_rows(count, seed=0):
    rng = np.random.default_rng(seed)
    words = ["alpha", "beta", "gamma", "delta", "sigma", "omega"]
    return [{"prompt": " ".join(rng.choice(words, size=int(rng.integers(1, 5)))) + ":",
             "completion": " " + " ".join(rng.choice(words, size=int(rng.integers(1, 8))))} for _ in range(count)]


def load_packed(tmp_path, rows, capacity, tokenizer):
    path = write_jsonl(tmp_path / "train.jsonl", rows)
    return load_sft_data({"train": path, "validation": path}, tokenizer,
                         SFTSettings(max_seq_length=capacity, packing=True), cache_dir=tmp_path / "cache")


def test_packed_items_and_their_batch(tmp_path):
    tokenizer = build_tiny_tokenizer()
    data = load_packed(tmp_path, pair_rows(12), 96, tokenizer)
    packed, rows = data.train, data.train.rows
    assert data.stats["train"]["packed_sequences"] == len(packed) < len(rows)
    item = packed[0]
    members = [rows[int(r)] for r in packed.order[packed.offsets[0]:packed.offsets[1]]]
    assert item["sequence_lengths"] == [len(m["input_ids"]) for m in members]
    assert item["input_ids"] == sum((m["input_ids"] for m in members), [])
    assert item["labels"] == sum((m["labels"] for m in members), [])
    assert all(item["labels"][start] == -100 for start in np.cumsum([0] + item["sequence_lengths"][:-1]))
    assert sum(len(packed[k]["input_ids"]) for k in range(len(packed))) == data.stats["train"]["tokens"]

    assert "attention_mask" not in SFTCollator(tokenizer.pad_token_id)([packed[0], packed[len(packed) - 1]])
    batch = SFTCollator(tokenizer.pad_token_id, dense_packed_mask=True)([packed[0], packed[len(packed) - 1]])
    width = len(packed[0]["input_ids"])
    lengths = packed[len(packed) - 1]["sequence_lengths"]
    short = sum(lengths)
    assert batch["input_ids"].shape == batch["labels"].shape == batch["position_ids"].shape == (2, width)
    assert batch["input_ids"][1, short:].eq(tokenizer.pad_token_id).all() and batch["labels"][1, short:].eq(-100).all()
    expected_positions = [p for n in lengths for p in range(n)] + list(range(width - short))
    assert batch["position_ids"][1].tolist() == expected_positions
    mask = batch["attention_mask"]
    assert mask.shape == (2, 1, width, width) and mask.dtype == torch.float32
    allowed = mask[1, 0] == 0
    segment = np.repeat(np.arange(len(lengths) + 1), lengths + [width - short])
    for q in range(width):
        for k in range(width):
            assert allowed[q, k] == (segment[q] == segment[k] and k <= q), (q, k)
    assert (mask[~(mask == 0)] == torch.finfo(torch.float32).min).all()


def test_unpacked_batches_pad_on_the_right(tmp_path):
    tokenizer = build_tiny_tokenizer()
    items = [{"input_ids": [5, 6, 7], "labels": [-100, 6, 7]}, {"input_ids": [8], "labels": [-100]}]
    batch = SFTCollator(tokenizer.pad_token_id, pad_to_multiple_of=4)(items)
    pad = tokenizer.pad_token_id
    assert batch["input_ids"].tolist() == [[5, 6, 7, pad], [8, pad, pad, pad]]
    assert batch["labels"].tolist() == [[-100, 6, 7, -100], [-100, -100, -100, -100]]
    assert batch["attention_mask"].tolist() == [[1, 1, 1, 0], [1, 0, 0, 0]]
    assert batch["position_ids"][:, :1].tolist() == [[0], [0]] and batch["position_ids"][0, :3].tolist() == [0, 1, 2]


def test_a_window_limits_how_far_back_a_token_sees():
    mask = packed_attention_mask(torch.tensor([[0, 0, 0, 0, 1, 1]]), window=2)[0, 0] == 0
    assert mask.int().tolist() == [[1, 0, 0, 0, 0, 0], [1, 1, 0, 0, 0, 0], [0, 1, 1, 0, 0, 0], [0, 0, 1, 1, 0, 0],
                                   [0, 0, 0, 0, 1, 0], [0, 0, 0, 0, 1, 1]]


def loss_by_hand(logits: torch.Tensor, labels: torch.Tensor) -> tuple[float, int]:
    """(Σ -log p(label t | position t - 1), the count) over every label that is not -100, in float64."""
    total, count = 0.0, 0
    log_probs = torch.log_softmax(logits.double(), dim=-1)
    for b in range(labels.shape[0]):
        for t in range(1, labels.shape[1]):
            if labels[b, t] != -100:
                total -= log_probs[b, t - 1, labels[b, t]].item()
                count += 1
    return total, count


def batch_loss(model, collator, items, batch_size):
    total, count = 0.0, 0
    for start in range(0, len(items), batch_size):
        batch = collator(items[start:start + batch_size])
        labels = batch.pop("labels")
        with torch.no_grad():  # no cache: transformers reads packed rows' bounds only without one
            part = loss_by_hand(model(**batch, use_cache=False).logits, labels)
        total, count = total + part[0], count + part[1]
    return total / count


ARCHITECTURES = [("llama", "sdpa"), ("llama", "eager"), ("qwen2", "sdpa"), ("qwen2", "eager"), ("gpt2", "sdpa"),
                 ("gpt2", "eager"), ("qwen3", "sdpa"), ("mistral", "eager"), ("gemma2", "eager"),
                 ("gemma3_text", "sdpa"), ("gemma3_text", "eager"), ("phi3", "sdpa"), ("phi3", "eager")]


@pytest.mark.parametrize("dense", [False, True], ids=["position-ids", "dense-mask"])
@pytest.mark.parametrize("model_type, attention", ARCHITECTURES, ids=["-".join(a) for a in ARCHITECTURES])
def test_packed_batches_give_the_unpacked_loss(tmp_path, model_type, attention, dense):
    tokenizer = build_tiny_tokenizer()
    data = load_packed(tmp_path, pair_rows(10), 96, tokenizer)
    model = tiny_model(model_type, tokenizer, attention)
    collator = SFTCollator(tokenizer.pad_token_id, attention_windows=attention_windows(model.config),
                           dense_packed_mask=dense)
    rows = [data.train.rows[i] for i in range(len(data.train.rows))]
    packed = [data.train[k] for k in range(len(data.train))]
    unpacked = batch_loss(model, collator, rows, batch_size=3)
    assert batch_loss(model, collator, packed, batch_size=2) == pytest.approx(unpacked, rel=2e-6)


SLIDING = [("mistral", "sdpa", dict(sliding_window=12)), ("phi3", "eager", dict(sliding_window=12)),
           ("qwen2", "sdpa", dict(use_sliding_window=True, sliding_window=12, max_window_layers=1)),
           ("gemma2", "eager", dict(sliding_window=12)), ("gemma3_text", "sdpa", dict(sliding_window=12))]


@pytest.mark.parametrize("model_type, attention, config", SLIDING, ids=[s[0] for s in SLIDING])
def test_sliding_windows_hold_in_packed_batches(tmp_path, model_type, attention, config):
    """Rows longer than the window: the packed masks must slide as the model's own do."""
    tokenizer = build_tiny_tokenizer()
    data = load_packed(tmp_path, pair_rows(6, seed=1), 96, tokenizer)
    model = tiny_model(model_type, tokenizer, attention, **config)
    windows = attention_windows(model.config)
    assert windows is not None
    rows = [data.train.rows[i] for i in range(len(data.train.rows))]
    assert max(len(r["input_ids"]) for r in rows) > 12
    packed = [data.train[k] for k in range(len(data.train))]
    unpacked = batch_loss(model, SFTCollator(tokenizer.pad_token_id), rows, batch_size=3)
    assert batch_loss(model, SFTCollator(tokenizer.pad_token_id, attention_windows=windows, dense_packed_mask=True),
                      packed, batch_size=2) == pytest.approx(unpacked, rel=2e-6)
    # Without a mask transformers slides the windows itself.
    assert batch_loss(model, SFTCollator(tokenizer.pad_token_id), packed, batch_size=2) == pytest.approx(unpacked,
                                                                                                         rel=2e-6)
    # A dense mask without the windows sees further back than the model does.
    assert batch_loss(model, SFTCollator(tokenizer.pad_token_id, dense_packed_mask=True), packed,
                      batch_size=2) != pytest.approx(unpacked, rel=1e-3)
