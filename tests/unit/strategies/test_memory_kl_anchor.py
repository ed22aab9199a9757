"""The memory plan of a decoder run with the KL anchor (loss.kl_to_pretrained): rows for θ*'s stored
targets in each micro-batch and for what the KL holds beyond the next-token loss (in the chunked head:
the ids widened to int64, the tail's log-sum-exp, a second fp32 chunk of logits; on the whole logits:
three fp32 copies of the label tokens' logits), by their formula, and against real steps."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

from ft_framework.config import validate_config
from ft_framework.data.sft_collate import ANCHOR_KEYS
from ft_framework.models import lm_head_requests
from ft_framework.strategies import memory_trace
from ft_framework.strategies.memory_fit import plan_run
from ft_framework.strategies.memory_plan import ALLOCATOR_SLACK
from ft_framework.task_kinds import build_task_kind

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[3] / "benchmarks"))
import memory_plan as bench  # noqa: E402  (benchmarks/memory_plan.py: the measured run)
from test_memory_decoder import VOCAB, decoder_cfg, decoder_dir  # noqa: E402

K = 8


def with_anchor(cfg, beta: float, k: int = K):
    data = {key: value for key, value in cfg.to_dict().items() if key != "task_overrides" and value is not None}
    data["loss"] = {**data.get("loss", {}), "kl_to_pretrained": beta, "kl_top_k": k}
    return validate_config(data)


def plans(cfg, *, on_gpu: bool = False, k: int = K):
    """The plans of `cfg` without (β = 0) and with the anchor (β = 0.5, θ*'s top `k`)."""
    return [plan_run(c, task=build_task_kind(c), world_size=1, on_gpu=on_gpu)
            for c in (with_anchor(cfg, 0.0, k), with_anchor(cfg, 0.5, k))]


@pytest.mark.parametrize("chunked", [True, False])
def test_the_anchor_adds_its_rows_and_exactly_their_bytes(tmp_path, monkeypatch, chunked):
    """Batch 3 x 64 tokens: 3 * 63 = 189 label tokens, k = 8 of a 2048-id vocabulary, chunks of 40
    positions. In the batch: int32 ids and fp32 log-probabilities (k each) and the fp32 tail, 68 bytes
    a token. Chunked head: int64 ids and the tail's log-sum-exp, 68 bytes a token; one more fp32
    chunk of logits (40 x 2048 x 4) with the chunk's p*_k and log p*_k (2 x 40 x 8 x 4) and the
    tail's two (2 x 40 x 4). Whole logits: 3 x 189 x 2048 x 4."""
    monkeypatch.setattr(lm_head_requests, "CHUNK_LOGITS", 40 * VOCAB)
    monkeypatch.setattr(memory_trace, "_TRACES", {})  # traces made here are this test's (the chunk size)
    cfg = decoder_cfg(decoder_dir(tmp_path), chunked_loss=chunked, per_device_batch_size=3)
    off, on = plans(cfg)
    tokens = 3 * 63
    added = tokens * 68 + (tokens * 68 + 40 * VOCAB * 4 + 2 * 40 * 8 * 4 + 2 * 40 * 4 if chunked
                           else 3 * tokens * VOCAB * 4)
    assert on.live_bytes - off.live_bytes == added
    new = [row for row in on.tensors if row.what.startswith("KL anchor")]
    assert [row.what for row in off.tensors] == [row.what for row in on.tensors if row not in new]
    assert len(new) == (3 if chunked else 2) and sum(row.device_bytes for row in new) == added
    assert all(row.cpu_bytes == 0 for row in new)  # the batch and the head's buffers are the device's
    off_gpu, on_gpu = plans(cfg, on_gpu=True)
    assert on_gpu.device_peak - off_gpu.device_peak == pytest.approx(added * (1 + ALLOCATOR_SLACK))


def test_k_beyond_the_vocabulary_stores_the_vocabulary_and_no_tail(tmp_path):
    cfg = decoder_cfg(decoder_dir(tmp_path), per_device_batch_size=4)
    off, on = plans(cfg, k=VOCAB + 5)
    tokens = 4 * 63
    chunk = tokens * VOCAB * 4 + 2 * tokens * VOCAB * 4  # one chunk of every token: the logits, p* and log p*
    assert on.live_bytes - off.live_bytes == tokens * (8 * VOCAB + 4) + tokens * (8 * VOCAB + 4) + chunk


def anchored_batch(random_batch):
    """benchmarks/memory_plan.py's batch (every position a label token) with θ*'s stored targets as the
    collator hands them over: int32 ids, fp32 log-probabilities and tail, one row per label token."""

    def batch(model_class, arch, size, seq_len, generator):
        inputs = random_batch(model_class, arch, size, seq_len, generator)
        logp = torch.log_softmax(torch.randn(size * (seq_len - 1), arch.vocab_size, generator=generator), -1)
        top = logp.topk(K, -1)
        ids, logp_k, tail = ANCHOR_KEYS
        return {**inputs, ids: top.indices.to(torch.int32), logp_k: top.values.clone(),
                tail: torch.log1p(-top.values.exp().sum(-1))}

    return batch


@pytest.mark.parametrize("chunked", [True, False])
def test_a_measured_step_with_the_anchor_stays_within_its_plan(tmp_path, monkeypatch, chunked):
    """Two real optimizer steps of a tiny Llama with the causal LM kind's loss and the KL anchor: the
    plan is within 10% of the live-bytes peak (as without the anchor: test_memory_decoder.py), and
    what the anchor adds to the peak is at most what its rows add, and within 2% of it (measured:
    1.58 MB of 1.59 MB chunked, 4.63 MB of 4.66 MB on the whole logits)."""
    cfg = decoder_cfg(decoder_dir(tmp_path), chunked_loss=chunked, per_device_batch_size=3)
    off, on = plans(cfg)
    measured_off, _ = bench.measured_run(with_anchor(cfg, 0.0))
    monkeypatch.setattr(bench, "random_batch", anchored_batch(bench.random_batch))
    measured_on, _ = bench.measured_run(with_anchor(cfg, 0.5))
    assert on.live_bytes == pytest.approx(measured_on["live_peak"], rel=0.10)
    added = measured_on["live_peak"] - measured_off["live_peak"]
    assert added <= on.live_bytes - off.live_bytes and added == pytest.approx(on.live_bytes - off.live_bytes, rel=0.02)
