"""The KL anchor to θ* (loss.kl_to_pretrained: β): a decoder's SFT loss plus β · KL(p_θ* ‖ p_θ) at
its trained tokens (the label positions the next-token loss trains), without a second model.

θ*'s distributions come from one pass over the training rows before the first step, at θ*, through
the strategy's forward (every strategy), and are kept in the token cache (data/token_cache.py: an
entry written once, atomically, verified before use, memory-mapped; plain arrays and a JSON header,
nothing unpickled), keyed on the model's weights (a LoRA model at θ*: its base model's, every seed's
adapters computing nothing yet), the training data's tokens and k. Per trained
token the entry holds θ*'s k most likely ids, their log-probabilities and the log of the mass
outside them (the tail); per training row, where its tokens start. A training item then carries the
stored targets of its rows' trained tokens (:class:`AnchoredTrainData`: looked up by example index,
so packing, shuffling, sharding over ranks and a resume all see the same targets), the collator
stacks them in the batch's label order, and the LM head's loss request adds the KL
(models/lm_head_requests.py: chunked, no whole logits; or from the whole logits, the same value).

The approximation: KL over θ*'s top k ids and one tail bucket (the rest of the vocabulary, p*'s mass
1 − Σ_k p*_k against p_θ's mass on the same ids). By the chain rule of the KL,
KL_full = KL_approx + p*_tail · KL(p*|tail ‖ p_θ|tail) ≥ KL_approx: exact when k covers the vocabulary
(or the tail has no mass), otherwise what it drops is how θ spreads the tail's mass among the tail's ids.

    anchor = KLAnchor(train_key, model, k=32, cache_dir=..., settings=...)    # before the wrap
    record = anchor.prepare(data, forward=strategy.forward, collate=..., run=run_context)   # before step 1
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Mapping, Sequence

import numpy as np
import torch
import xxhash
from torch import nn
from torch.utils.data import Dataset

from ft_framework.data.sft_collate import ANCHOR_KEYS, IGNORE_INDEX
from ft_framework.data.sharding import eval_shard
from ft_framework.data.token_cache import (FORMAT_VERSION, CacheEntry, DamagedEntry, EntryWriter, array_blocks,
                                           entry_name, open_entry, prepare_entry)
from ft_framework.errors import UserError
from ft_framework.models.lm_head_requests import REQUEST_KEY, AnchorTargets, TopKDistribution
from ft_framework.models.lora import unadapted_state

__all__ = ["ANCHOR_ARRAYS", "AnchoredTrainData", "KLAnchor", "anchor_batch_bytes", "anchor_targets",
           "model_fingerprint"]

logger = logging.getLogger(__name__)

# An entry's arrays: per trained token (rows in order, each row's tokens in order) k ids and their
# log-probabilities (flat, k per token) and the tail's log-mass; per training row, where its trained
# tokens start (rows + 1 offsets, in tokens).
ANCHOR_ARRAYS = {"ids": np.int32, "logp": np.float32, "tail_logp": np.float32, "offsets": np.int64}
# What an entry is, in its key (another layout of this kind of entry gets another version).
_ENTRY_KIND, _VERSION = "kl_anchor_top_k", 1
# The model inputs of the pass (the labels only pick the positions).
_MODEL_KEYS = ("input_ids", "attention_mask", "position_ids")


def anchor_batch_bytes(tokens: int, k: int, vocab_size: int) -> int:
    """The stored targets a micro-batch of `tokens` trained tokens carries (the collator stacks the
    entry's arrays as they are: ANCHOR_ARRAYS' dtypes), θ*'s top `k` (at most the vocabulary)."""
    k = min(k, vocab_size)
    return tokens * (k * (np.dtype(ANCHOR_ARRAYS["ids"]).itemsize + np.dtype(ANCHOR_ARRAYS["logp"]).itemsize)
                     + np.dtype(ANCHOR_ARRAYS["tail_logp"]).itemsize)


def model_fingerprint(model: nn.Module) -> str:
    """The xxh3-128 hash of `model`'s state (every tensor state_dict names: its name, dtype, shape and
    bytes) and its class: θ* as the pass sees it. Taken before the strategy's wrap (whole tensors).
    A LoRA model whose adapters do not change its function (B zero, peft's initialisation) is hashed
    as its base model before the wrap: its randomly initialised A (each seed's own) leaves θ*'s
    distributions the base model's, so every seed, and a full fine-tune of that model, shares one entry."""
    unadapted = unadapted_state(model)
    kind, state = unadapted if unadapted is not None else (type(model).__name__, model.state_dict(keep_vars=False))
    digest = xxhash.xxh3_128(kind.encode())
    for name, tensor in state.items():
        t = tensor.detach().cpu().contiguous()
        digest.update(f"{name}:{t.dtype}:{tuple(t.shape)}".encode())
        digest.update(t.view(torch.uint8).numpy().data if t.numel() else b"")
    return digest.hexdigest()


def anchor_targets(batch: Mapping[str, Any]) -> AnchorTargets | None:
    """The stored targets a collated batch carries (None: it carries none). Tails that hold no mass at
    all (k covers the vocabulary: -inf) are no tail: their term is 0 either way."""
    if ANCHOR_KEYS[0] not in batch:
        return None
    ids, logp, tail = (batch[key] for key in ANCHOR_KEYS)
    return AnchorTargets(ids.long(), logp, None if bool(torch.isneginf(tail).all()) and len(tail) else tail)


class AnchoredTrainData(Dataset):
    """The training items (rows, or packed sequences of rows: data/sft.py), each with the stored
    targets of its rows' trained tokens, in the item's label order."""

    def __init__(self, train: Dataset, entry: CacheEntry):
        self.train, self.entry = train, entry
        self.k = int(entry.facts["k"])

    def __len__(self) -> int:
        return len(self.train)

    def __getitem__(self, index: int) -> dict[str, Any]:
        item = self.train[index]
        arrays, k = self.entry.arrays, self.k
        parts = [(int(arrays["offsets"][r]), int(arrays["offsets"][r + 1])) for r in self.train.rows_of(index)]
        ids, logp, tail = ANCHOR_KEYS
        item[ids] = np.concatenate([arrays["ids"][s * k:e * k] for s, e in parts]).reshape(-1, k)
        item[logp] = np.concatenate([arrays["logp"][s * k:e * k] for s, e in parts]).reshape(-1, k)
        item[tail] = np.concatenate([arrays["tail_logp"][s:e] for s, e in parts])
        return item

    def __getattr__(self, name: str) -> Any:  # the wrapped data's own facts (lengths, rows, ...)
        if name in ("train", "entry"):
            raise AttributeError(name)
        return getattr(self.train, name)


@dataclass
class _Pass:
    """One rank's part of the pass and, on the writer, the rows gathered from every rank."""

    rows: Any          # the training rows (data/sft.py's SFTDataset)
    k: int
    forward: Callable[[dict[str, Any]], Any]
    collate: Callable[[list[dict[str, Any]]], dict[str, Any]]
    device: torch.device
    batch_size: int
    rank: int
    world_size: int
    gather: Callable[[Any], list[Any]]

    @torch.no_grad()
    def run(self, writer: EntryWriter | None) -> dict[str, Any]:
        """Every rank runs it (each forward and gather is collective); the writer's arrays get the rows
        in order. Returns the facts of the entry."""
        started = time.perf_counter()
        shard = eval_shard(len(self.rows), self.rank, self.world_size)
        tokens, width = 0, None
        if writer is not None:
            writer.append(offsets=np.zeros(1, dtype=np.int64))
        for start in range(0, len(shard.padded), self.batch_size):
            indices = shard.padded[start:start + self.batch_size]
            real = indices[:max(0, min(shard.num_real - start, len(indices)))]
            items = [self.rows[i] for i in indices]
            batch = self.collate([{"input_ids": it["input_ids"], "labels": it["labels"]} for it in items])
            inputs = {key: value.to(self.device) for key, value in batch.items() if key in _MODEL_KEYS}
            inputs.update(use_cache=False, **{REQUEST_KEY: TopKDistribution(batch["labels"], self.k)})
            answer = self.forward(inputs).logits.cpu()
            counts = (batch["labels"][:, 1:] != IGNORE_INDEX).sum(1).tolist()
            per_row = answer.split(counts)
            mine = [(i, per_row[j].numpy()) for j, i in enumerate(real)]
            gathered = sorted((row for part in self.gather(mine) for row in part), key=lambda row: row[0])
            if writer is None:
                continue
            for _, values in gathered:
                width = (values.shape[1] - 1) // 2
                writer.append(ids=values[:, :width].astype(np.int32).reshape(-1),
                              logp=values[:, width:2 * width].reshape(-1), tail_logp=values[:, -1],
                              offsets=np.array([tokens + len(values)], dtype=np.int64))
                tokens += len(values)
        return {"k": width if width is not None else self.k, "rows": len(self.rows), "tokens": tokens,
                "seconds": round(time.perf_counter() - started, 3)}


class KLAnchor:
    """loss.kl_to_pretrained's stored targets for one run: the cache entry's key (the model's weights
    as loaded, the training rows' token-cache key, k, what changes the forward's numbers) and, once
    :meth:`prepare` ran, the entry."""

    def __init__(self, beta: float, k: int, *, model: nn.Module, train_key: Mapping[str, Any], cache_dir: Path,
                 forward_settings: Mapping[str, Any]):
        self.beta, self.k, self.cache_dir = beta, k, cache_dir
        self.vocab_size = model.get_output_embeddings().out_features if model.get_output_embeddings() is not None \
            else model.config.vocab_size
        self.key = {"format": FORMAT_VERSION, "kind": _ENTRY_KIND, "version": _VERSION, "k": k,
                    "model": model_fingerprint(model), "data": dict(train_key), "forward": dict(forward_settings)}
        self.record: dict[str, Any] | None = None

    @property
    def path(self) -> Path:
        return self.cache_dir / entry_name(self.key)

    def prepare(self, data: Any, *, forward: Callable[[dict[str, Any]], Any], collate: Callable,
                device: torch.device, batch_size: int, rank: int, world_size: int, is_main: bool,
                barrier: Callable[[], None], gather: Callable[[Any], list[Any]]) -> dict[str, Any]:
        """The entry of this run's key, reused or made by the pass (collective: every rank calls it,
        with the model at θ*: before the first step and before a resume loads its checkpoint); then
        `data.train` carries the stored targets. Returns the record results.json keeps."""
        rows = data.train.rows
        work = _Pass(rows, min(self.k, self.vocab_size), forward, collate, device, batch_size, rank, world_size,
                     gather)
        expected = rows.target_counts()
        made: dict[str, Any] = {}

        def build(writer: EntryWriter) -> dict[str, Any]:
            gather(True)  # the other ranks join the pass
            made.update(work.run(writer))
            return dict(made)

        if is_main:
            self.cache_dir.mkdir(parents=True, exist_ok=True)
            prepare_entry(self.cache_dir, self.key, ANCHOR_ARRAYS, build,
                          check=lambda entry: _check_entry(entry, expected, min(self.k, self.vocab_size),
                                                           self.vocab_size))
            if not made:
                gather(False)
        elif any(gather(False)):
            work.run(None)
        barrier()
        try:
            entry = open_entry(self.path, self.key, ANCHOR_ARRAYS, verify=False)
        except (FileNotFoundError, DamagedEntry) as exc:
            raise UserError(f"the KL anchor's token cache entry {self.path}, which the main process prepared, cannot "
                            f"be read here ({exc}); every process must see the same data.token_cache_dir") from None
        data.train = AnchoredTrainData(data.train, entry)
        facts = entry.facts
        nbytes = sum(array.nbytes for array in entry.arrays.values())
        self.record = {"beta": self.beta, "k": self.k, "stored_k": int(facts["k"]), "tokens": int(facts["tokens"]),
                       "cache_bytes": int(nbytes), "pass_seconds": float(made.get("seconds", 0.0)),
                       "reused": not made, "entry": str(self.path)}
        if is_main:
            logger.info("KL anchor: %s θ*'s top-%d at %d trained tokens (%.1f MB) %s", "computed" if made else "reused",
                        int(facts["k"]), int(facts["tokens"]), nbytes / 1e6,
                        f"in {made['seconds']:.1f} s" if made else f"from {self.path}")
        return self.record


def _check_entry(entry: CacheEntry, expected: np.ndarray, k: int, vocab_size: int) -> None:
    """An entry's arrays agree with each other, with the training rows' trained tokens and with k."""
    arrays, facts = entry.arrays, entry.facts
    for name in ("k", "rows", "tokens"):
        if not isinstance(facts.get(name), int):
            raise DamagedEntry(f"its count {name!r} is missing")
    tokens = facts["tokens"]
    if facts["k"] != k or facts["rows"] != len(expected):
        raise DamagedEntry(f"it holds top-{facts['k']} of {facts['rows']} rows, expected top-{k} of {len(expected)}")
    offsets = arrays["offsets"]
    if len(offsets) != len(expected) + 1 or offsets[0] != 0 or not np.array_equal(np.diff(offsets), expected):
        raise DamagedEntry("its rows' offsets disagree with the training rows' trained tokens")
    if offsets[-1] != tokens or len(arrays["tail_logp"]) != tokens or len(arrays["ids"]) != tokens * k \
            or len(arrays["logp"]) != tokens * k:
        raise DamagedEntry("its arrays' lengths disagree with its token count")
    # Read in blocks, not through the maps: the writer's process keeps no page of them mapped.
    if any(block.min() < 0 or block.max() >= vocab_size for block in array_blocks(entry, "ids") if len(block)):
        raise DamagedEntry(f"it holds ids outside the model's {vocab_size}")
