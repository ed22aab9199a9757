"""The loss our SFT pipeline computes (rows -> tokens -> collated batch -> a tiny model -> the model's
loss over our labels) against the loss computed by hand, token by token, for each row shape: the hand
side writes each row's tokens itself (the byte-level tokenizer maps each byte to one token; the
special tokens are looked up by name), picks the completion's positions itself, and runs the model
on each row alone."""

from __future__ import annotations

import math

import pytest
import torch

from sft_helpers import build_tiny_tokenizer, tiny_model, write_jsonl

from ft_framework.data.sft import SFTCollator, SFTSettings, load_sft_data

EOS, START = "<|im_end|>", "<|im_start|>"


def byte_symbols() -> dict[int, str]:
    """GPT-2's printable stand-in for each byte (byte-level BPE's alphabet)."""
    printable = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + \
        list(range(ord("®"), ord("ÿ") + 1))
    symbols, extra = {}, 0
    for byte in range(256):
        if byte in printable:
            symbols[byte] = chr(byte)
        else:
            symbols[byte] = chr(256 + extra)
            extra += 1
    return symbols


SYMBOLS = byte_symbols()


def by_hand(tokenizer, pieces: list[tuple[str, bool]]) -> tuple[list[int], list[int]]:
    """(tokens, the positions trained) of a row written as (text, trained) pieces: special tokens by
    name, any other text a token per UTF-8 byte."""
    ids, trained = [], []
    for text, is_target in pieces:
        if text in (EOS, START):
            new = [tokenizer.convert_tokens_to_ids(text)]
        else:
            new = [tokenizer.convert_tokens_to_ids(SYMBOLS[b]) for b in text.encode("utf-8")]
        if is_target:
            trained += range(len(ids), len(ids) + len(new))
        ids += new
    return ids, [t for t in trained if t > 0]


def chatml(messages) -> list[tuple[str, bool]]:
    pieces = []
    for m in messages:
        assistant = m["role"] == "assistant"
        pieces += [(START, False), (m["role"] + "\n", False), (m["content"], assistant), (EOS, assistant),
                   ("\n", assistant)]
    return pieces


PAIRS = [("What is 12 + 30?", " 42"), ("Say hi: ", "hi there"), ("Ünïcödé? ", "yes 🦊")]
TEXTS = ["A plain text row.", "Another, longer plain text row of training text."]
CHATS = [[{"role": "system", "content": "Be brief."}, {"role": "user", "content": "2+2?"},
          {"role": "assistant", "content": "4"}],
         [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello!"},
          {"role": "user", "content": "Bye"}, {"role": "assistant", "content": "Bye."}]]

SHAPES = {
    "prompt_completion": ([{"prompt": p, "completion": c} for p, c in PAIRS],
                          [[(p, False), (c, True), (EOS, True)] for p, c in PAIRS]),
    "text": ([{"text": t} for t in TEXTS], [[(t, True), (EOS, True)] for t in TEXTS]),
    "messages": ([{"messages": m} for m in CHATS], [chatml(m) for m in CHATS]),
}


def hand_loss(model, tokenizer, rows_by_hand) -> float:
    """Σ over the trained positions t of each row of -log p(token t | tokens before t) / their count,
    each row run alone, in float64."""
    total, count = 0.0, 0
    for pieces in rows_by_hand:
        ids, trained = by_hand(tokenizer, pieces)
        with torch.no_grad():
            logits = model(input_ids=torch.tensor([ids])).logits[0].double()
        for t in trained:
            total += -torch.log_softmax(logits[t - 1], dim=-1)[ids[t]].item()
            count += 1
    return total / count


@pytest.mark.parametrize("packing", [False, True], ids=["rows", "packed"])
@pytest.mark.parametrize("shape", SHAPES)
def test_the_pipeline_loss_is_the_loss_by_hand(tmp_path, shape, packing):
    tokenizer = build_tiny_tokenizer()
    rows, rows_by_hand = SHAPES[shape]
    path = write_jsonl(tmp_path / "train.jsonl", rows)
    data = load_sft_data({"train": path, "validation": path}, tokenizer,
                         SFTSettings(max_seq_length=128, packing=packing), cache_dir=tmp_path / "cache")
    model = tiny_model("llama", tokenizer)
    batch = SFTCollator(tokenizer.pad_token_id)([data.train[i] for i in range(len(data.train))])
    assert len(data.train) == (1 if packing else len(rows))
    labels = batch.pop("labels")
    with torch.no_grad():
        ours = model(**batch, labels=labels).loss.item()  # transformers' loss: labels shifted by one
    assert ours == pytest.approx(hand_loss(model, tokenizer, rows_by_hand), rel=1e-5)
    assert math.isfinite(ours)
