"""Functional forgetting of a decoder LM: how far the fine-tuned model's answers to held-out general
text have moved from the pretrained model θ*'s (docs/forgetting_methods.md, "Decoder LLMs").

- LM loss gained (Kalajdzievski 2024; Bethune et al. 2025): the next-token loss of θ on the probe
  text minus θ*'s.
- KL from θ* (Shenfeld et al. 2025): the mean over the probe's predicted positions of the exact
  next-token KL(p_θ* ‖ p_θ), summed over the whole vocabulary.
- Representation drift: 1 − debiased linear CKA of the mean-pooled hidden states, last layer and
  mean over layers, as for an encoder (models/forgetting.py).

θ*'s side is the run's own model before its first step (`reference_from_model`), measured through the
same forward, precision and sharding as every later measurement, so no second copy of the model
is ever loaded (an 8B decoder would need 32 GB of host memory for one). It is kept on each rank for
its share of the probe (θ*'s log-probabilities: positions × vocabulary × 4 bytes) and written into
the run's output directory, one safetensors file per rank, so that a resumed run, on any number of
ranks, reads it back (`reference_from_run`) instead of meeting a model that has moved.
"""

from __future__ import annotations

import json
import math
import logging
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import numpy as np
import torch
import torch.nn.functional as F

from ft_framework.data.sharding import eval_shard, restore_order
from ft_framework.errors import UserError
from ft_framework.user_files import MissingFile, open_binary, read_json, refused_entries
from ft_framework.models.lm_head_requests import REQUEST_KEY, ProbeLogProbs
from ft_framework.models.forgetting import CKA_DRIFT_LAST, CKA_DRIFT_MEAN, MIN_PROBE_SENTENCES, debiased_linear_cka

logger = logging.getLogger(__name__)

__all__ = ["KL_FROM_PRETRAINED", "LM_FORGETTING_MEASURES", "LM_LOSS_GAINED", "LMForgettingProbe",
           "lm_probe_reference_bytes"]

# The names of a decoder's forgetting measures in metrics.jsonl and results.json.
LM_LOSS_GAINED = "lm_loss_gained"
KL_FROM_PRETRAINED = "kl_from_pretrained"
LM_FORGETTING_MEASURES = (LM_LOSS_GAINED, KL_FROM_PRETRAINED, CKA_DRIFT_LAST, CKA_DRIFT_MEAN)
_MAX_PROBE_BATCH = 16
_META_FILE = "probe.json"


@dataclass
class _Share:
    """One rank's answers to its real probe sentences (padding dropped), per sentence index."""

    indices: list[int]
    features: list[torch.Tensor]           # per sentence: (layers, hidden) mean-pooled, float64
    logprobs: list[torch.Tensor] | None    # per sentence: (predicted positions, vocab) fp32; θ*'s only
    loss_sums: list[float]                 # per sentence: summed next-token loss
    kl_sums: list[float]                   # per sentence: summed KL against the reference (0 for θ*)
    positions: list[int]                   # per sentence: predicted positions


class LMForgettingProbe:
    """θ*'s answers to the probe text, kept to compare θ's with at each measurement (a
    models/probes.py ForgettingProbe)."""

    measures = LM_FORGETTING_MEASURES

    def __init__(self, *, sentences: list[str], source: str, tokenizer: Any, max_length: int, batch_size: int,
                 rank: int, world_size: int, device: torch.device, gather: Callable[[Any], list[Any]],
                 chunked: bool = False):
        if len(sentences) < MIN_PROBE_SENTENCES:
            raise UserError(f"the forgetting probe text ({source}) has {len(sentences)} sentence(s); it needs at "
                            f"least {MIN_PROBE_SENTENCES} (evaluation.forgetting.num_sentences, probe_file)")
        self.source, self.num_sentences, self.max_length = source, len(sentences), max_length
        self.batch_size, self.device, self.gather = min(batch_size, _MAX_PROBE_BATCH), device, gather
        self.rank, self.world_size = rank, world_size
        # chunked: the model's head answers a ProbeLogProbs request (models/lm_head_requests.py), a
        # chunk of predicted positions at a time, instead of returning the batch's whole logits.
        self.chunked = chunked
        pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
        enc = tokenizer(sentences, truncation=True, max_length=max_length)
        ids = enc["input_ids"]
        short = [i for i, row in enumerate(ids) if len(row) < 2]
        if short:
            raise UserError(f"forgetting probe sentence {short[0] + 1} of {source} is under 2 tokens: nothing to "
                            "predict; give longer sentences (evaluation.forgetting.probe_file)")
        # Shortest first (stable), so a batch is cut close to its sentences' length.
        order = sorted(range(len(ids)), key=lambda i: len(ids[i]))
        self.sentences = [sentences[i] for i in order]
        ids = [ids[i] for i in order]
        width = max(len(row) for row in ids)
        self.input_ids = torch.full((len(ids), width), pad, dtype=torch.long)
        self.attention_mask = torch.zeros((len(ids), width), dtype=torch.long)
        for i, row in enumerate(ids):
            self.input_ids[i, :len(row)] = torch.tensor(row)
            self.attention_mask[i, :len(row)] = 1
        self.shard = eval_shard(len(ids), rank, world_size)
        self.reference: _Share | None = None
        self.reference_loss: float | None = None
        self.seconds = 0.0

    # ---- θ*'s side ------------------------------------------------------------------------------
    def reference_from_model(self, forward: Callable[[dict[str, torch.Tensor]], Any], keep_in: Path | None, *,
                             is_main: bool, barrier: Callable[[], None]) -> None:
        """θ*'s answers, from the model `forward` runs now (the run's before its first step),
        written into `keep_in` when given (collective)."""
        started = time.perf_counter()
        self.reference = self._measure_share(forward, reference=None)
        self.reference_loss = self._gathered_loss(self.reference)
        self.seconds += time.perf_counter() - started
        if keep_in is not None:
            self._save_reference(keep_in, is_main=is_main, barrier=barrier)

    def reference_from_run(self, saved_in: Path, keep_in: Path | None, *, is_main: bool,
                           barrier: Callable[[], None]) -> None:
        """θ*'s answers as the run's first attempt wrote them into `saved_in`, on any number of
        ranks; written into `keep_in` too when that is another directory (a run resumed from
        another run's checkpoint keeps its own copy for its own resumes). Collective."""
        self._load_reference(saved_in)
        if keep_in is not None and saved_in.resolve() != keep_in.resolve():
            self._save_reference(keep_in, is_main=is_main, barrier=barrier)

    def keeps_reference(self, directory: Path) -> bool:
        return (directory / _META_FILE).is_file()

    def _save_reference(self, directory: Path, *, is_main: bool, barrier: Callable[[], None]) -> None:
        """Every rank writes its share (its own sentences) into `directory`; the main rank the probe's
        description. Collective (the barrier)."""
        from safetensors.torch import save_file

        share = self._require_reference()
        if is_main:
            directory.mkdir(parents=True, exist_ok=True)
        barrier()
        tensors = {}
        for k, i in enumerate(share.indices):
            tensors[f"{i}.features"] = share.features[k].contiguous()
            tensors[f"{i}.logprobs"] = share.logprobs[k].contiguous()
            tensors[f"{i}.loss"] = torch.tensor([share.loss_sums[k], float(share.positions[k])], dtype=torch.float64)
        partial = directory / f".rank{self.rank}.safetensors.partial"
        save_file(tensors, str(partial))
        partial.replace(directory / f"rank{self.rank}.safetensors")
        if is_main:
            (directory / _META_FILE).write_text(json.dumps(self._identity(), indent=1))
        barrier()

    def _load_reference(self, directory: Path) -> None:
        """This rank's share of θ*'s answers, saved by the run's first attempt on any number of ranks.
        The files are data a user hands us (user_files.py): regular files inside `directory`, the
        tensors read by safetensors (no pickle)."""
        from safetensors.torch import load as load_tensors

        missing = UserError(f"{directory}: θ*'s answers to the forgetting probe are missing (the run wrote them "
                            "before its first step); a resumed run cannot measure forgetting without them: start "
                            "the run fresh, or set evaluation.forgetting.enabled=false")
        if not directory.is_dir() or refused_entries(directory):
            raise missing
        files = sorted(p.name for p in directory.glob("rank*.safetensors"))
        try:
            saved = read_json(directory / _META_FILE, root=directory, entry="the probe's description")
        except MissingFile:
            raise missing from None
        if not files:
            raise missing
        if saved != self._identity():
            raise UserError(f"{directory}/{_META_FILE}: the saved forgetting probe ({saved.get('source')}, "
                            f"{saved.get('sentences')} sentences, max_length {saved.get('max_length')}) is not this "
                            "run's probe; keep evaluation.forgetting as the run started, or start fresh")
        wanted = set(self.shard.indices)
        found: dict[int, tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = {}
        for name in files:
            with open_binary(directory / name, root=directory, entry="a rank's share of θ*'s answers") as f:
                try:
                    tensors = load_tensors(f.read())
                except Exception as exc:  # safetensors' own error: the file is damaged
                    raise UserError(f"{directory / name}: not a readable safetensors file ({exc}); start the run "
                                    "fresh, or set evaluation.forgetting.enabled=false") from None
            for i in wanted:
                if all(f"{i}.{what}" in tensors for what in ("features", "logprobs", "loss")):
                    found[i] = (tensors[f"{i}.features"], tensors[f"{i}.logprobs"], tensors[f"{i}.loss"])
        missing = sorted(wanted - set(found))
        if missing:
            raise UserError(f"{directory}: θ*'s answers to probe sentence(s) {missing[:5]} are missing; start the run "
                            "fresh, or set evaluation.forgetting.enabled=false")
        indices = self.shard.indices
        self.reference = _Share(indices, [found[i][0] for i in indices], [found[i][1] for i in indices],
                                [float(found[i][2][0]) for i in indices], [0.0] * len(indices),
                                [int(found[i][2][1]) for i in indices])
        self.reference_loss = self._gathered_loss(self.reference)

    def _identity(self) -> dict[str, Any]:
        return {"source": self.source, "sentences": self.num_sentences, "max_length": self.max_length,
                "tokens": int(self.attention_mask.sum())}

    def _require_reference(self) -> _Share:
        if self.reference is None:
            raise RuntimeError("the probe has no reference: reference_from_model() or reference_from_run() first")
        return self.reference

    # ---- θ's side -------------------------------------------------------------------------------
    @torch.no_grad()
    def _measure_share(self, forward: Callable[[dict[str, torch.Tensor]], Any], reference: _Share | None) -> _Share:
        """This rank's padded share through `forward`, batch by batch; the padding rows are dropped.
        With `reference`, each predicted position's KL(p_ref ‖ p) is summed instead of keeping p."""
        padded = self.shard.padded
        features: list[torch.Tensor] = []
        logprobs: list[torch.Tensor] | None = [] if reference is None else None
        loss_sums, kl_sums, positions = [], [], []
        for start in range(0, len(padded), self.batch_size):
            rows = padded[start:start + self.batch_size]
            real = max(0, min(self.shard.num_real - start, len(rows)))
            mask = self.attention_mask[rows]
            width = int(mask.sum(1).max())
            batch = {"input_ids": self.input_ids[rows, :width].to(self.device),
                     "attention_mask": mask[:, :width].to(self.device), "output_hidden_states": True, "use_cache": False}
            first = len(features)  # the batch's first sentence's place in the share (and in the reference's)
            if self.chunked:
                answers = torch.cat(reference.logprobs[first:first + real]) if reference is not None and real else None
                batch[REQUEST_KEY] = ProbeLogProbs(batch["input_ids"], batch["attention_mask"], real, answers)
            out = forward(batch)
            hidden = [h.double() for h in out.hidden_states[1:]]
            logits = out.logits.float()
            start = 0  # a chunked answer's first position of the sentence
            for r in range(real):
                k = len(features)
                length = int(mask[r].sum())
                pooled = torch.stack([h[r, :length].mean(0) for h in hidden]).cpu()
                positions.append(length - 1)
                features.append(pooled)
                targets = batch["input_ids"][r, 1:length]
                if self.chunked and reference is not None:  # (2, N): each position's loss and KL
                    loss_sums.append(float(logits[0, start:start + length - 1].sum()))
                    kl_sums.append(float(logits[1, start:start + length - 1].sum()))
                    start += length - 1
                    continue
                if self.chunked:  # (N, vocabulary): the log-probabilities
                    logp = logits[start:start + length - 1]
                    start += length - 1
                else:
                    logp = F.log_softmax(logits[r, :length - 1], dim=-1)
                loss_sums.append(float(-logp.gather(1, targets[:, None]).sum()))
                if reference is None:
                    logprobs.append(logp.cpu())
                    kl_sums.append(0.0)
                else:
                    ref = reference.logprobs[k].to(logp.device)
                    kl_sums.append(float((ref.exp() * (ref - logp)).sum()))
        return _Share(list(self.shard.indices), features, logprobs, loss_sums, kl_sums, positions)

    def _gathered_loss(self, share: _Share) -> float:
        shares = self.gather((sum(share.loss_sums), sum(share.positions)))
        return sum(s for s, _ in shares) / sum(n for _, n in shares)

    def measure(self, forward: Callable[[dict[str, torch.Tensor]], Any]) -> dict[str, float]:
        """θ's forgetting on the probe text: `forward(batch)` runs θ (collective when `gather` is)."""
        started = time.perf_counter()
        reference = self._require_reference()
        share = self._measure_share(forward, reference)
        shares = self.gather((share.indices, share.features, reference.features, sum(share.loss_sums),
                              sum(share.kl_sums), sum(share.positions)))
        order = torch.from_numpy(restore_order([s[0] for s in shares]))
        theta = torch.stack([f for s in shares for f in s[1]])[order]
        theta_star = torch.stack([f for s in shares for f in s[2]])[order]
        positions = sum(s[5] for s in shares)
        lm_loss = sum(s[3] for s in shares) / positions
        drifts = [1.0 - debiased_linear_cka(theta_star[:, layer], theta[:, layer]) for layer in range(theta.shape[1])]
        self.seconds += time.perf_counter() - started
        return {LM_LOSS_GAINED: lm_loss - self.reference_loss, KL_FROM_PRETRAINED: sum(s[4] for s in shares) / positions,
                "lm_loss": lm_loss, "lm_loss_pretrained": self.reference_loss,
                CKA_DRIFT_LAST: drifts[-1], CKA_DRIFT_MEAN: float(np.mean(drifts))}

    def describe(self) -> dict[str, Any]:
        """What results.json says about the probe."""
        return {"source": self.source, "sentences": self.num_sentences, "max_length": self.max_length,
                "seconds": round(self.seconds, 3), "measures": list(LM_FORGETTING_MEASURES),
                "reference": "the run's model before its first step"}


def lm_probe_reference_bytes(arch: Any, forgetting: Any, *, world_size: int) -> float:
    """What the probe keeps of theta*'s answers on each rank for the whole run, in host
    memory: for each of the rank's probe sentences (evaluation.forgetting.num_sentences, dealt over
    the ranks), the log-probabilities of every predicted position (at most max_length - 1) over the
    vocabulary in fp32, and the mean-pooled hidden state of every layer in float64."""
    sentences = math.ceil(forgetting.num_sentences / world_size)
    logprobs = (forgetting.max_length - 1) * arch.vocab_size * 4
    features = arch.num_hidden_layers * arch.hidden_size * 8
    return float(sentences * (logprobs + features))
