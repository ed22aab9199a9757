"""Functional forgetting: how far the fine-tuned encoder's behaviour on held-out text has moved from
the pretrained model θ*'s (docs/forgetting_methods.md, "Functional forgetting").

- Representation drift: 1 − debiased linear CKA (Kornblith et al. 2019, with the unbiased HSIC of
  Song et al. 2012) between θ*'s and θ's mean-pooled hidden states on the probe text, for the last
  layer and averaged over the layers.
- MLM forgetting, when the checkpoint has a masked-language-model head: the MLM loss of θ's encoder
  under the *pretrained* head, minus θ*'s, on the probe text with fixed masks (He, Chen, Zhu 2023).

θ*'s side is computed once, from the checkpoint itself (so RI, re-init, Mixout and LoRA change
nothing about it), when the probe is built; θ's side at each measurement, through a `forward`
callable the caller supplies (the strategy's forward in a run: every rank runs its share of the probe,
padded like evaluation, and the features are gathered, so the result equals the one-process value).
"""

from __future__ import annotations

import copy
import logging
import math
import re
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Sequence

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from ft_framework.data.sharding import eval_shard, restore_order
from ft_framework.errors import UserError
from ft_framework.models.hub import check_model_source
from ft_framework.models.loading import fp32_load_argument, resolve_model_path
from ft_framework.user_files import NO_REMOTE_CODE

logger = logging.getLogger(__name__)

__all__ = ["CKA_DRIFT_LAST", "CKA_DRIFT_MEAN", "DEFAULT_PROBE_SOURCE", "DEFAULT_PROBE_WORDS", "FORGETTING_MEASURES",
           "MLM_FORGETTING", "EncoderForgettingProbe", "debiased_linear_cka", "default_probe_sentences",
           "mask_positions", "pretrained_mlm_head_parameters", "read_probe_file"]

# The names of the functional forgetting measures in metrics.jsonl, results.json and interpolation.json.
CKA_DRIFT_LAST = "cka_drift_last"
CKA_DRIFT_MEAN = "cka_drift_mean"
MLM_FORGETTING = "mlm_forgetting"
FORGETTING_MEASURES = (MLM_FORGETTING, CKA_DRIFT_LAST, CKA_DRIFT_MEAN)
DEFAULT_PROBE_SOURCE = "pydoc_data.topics (the Python documentation's topics, PSF licence)"
# The unbiased HSIC divides by n - 3 and n - 2.
MIN_PROBE_SENTENCES = 4
MASK_RATE = 0.15
_SENTENCE_END = re.compile(r"(?<=[.!?])\s+(?=[A-Z])")
_MARKUP = re.compile(r"[*=_`{}<>\[\]|]")
# Probe batches stay small so that each is cut close to its sentences' length (see ForgettingProbe).
_MAX_PROBE_BATCH = 16
# The default probe's sentence lengths in words: none is cut at the default max_length, and the
# probe's forward costs about half a quickstart training step (docs/benchmarks.md, "Functional
# forgetting: its cost against training").
DEFAULT_PROBE_WORDS = (8, 12)


# --------------------------------------------------------------------------------------------------
# Probe text
# --------------------------------------------------------------------------------------------------


def default_probe_sentences(num: int) -> list[str]:
    """The first `num` distinct prose sentences of Python's documentation topics (pydoc_data.topics,
    which every Python install has): topics in name order, paragraphs that are not indented code,
    split after . ! or ?; kept: DEFAULT_PROBE_WORDS words, ending with a period, no markup characters. A
    sentence the documentation repeats is taken once: a repeated row would be two examples that
    are one."""
    from pydoc_data.topics import topics

    shortest, longest = DEFAULT_PROBE_WORDS
    out: list[str] = []
    for name in sorted(topics):
        for paragraph in re.split(r"\n\s*\n", topics[name]):
            if paragraph.startswith((" ", "\t")) or ">>>" in paragraph or "::" in paragraph:
                continue
            for sentence in _SENTENCE_END.split(" ".join(paragraph.split())):
                if (shortest <= len(sentence.split()) <= longest and sentence.endswith(".")
                        and not _MARKUP.search(sentence) and sentence not in out):
                    out.append(sentence)
                    if len(out) == num:
                        return out
    return out


def read_probe_file(path: str, num: int) -> list[str]:
    """The first `num` non-empty lines of a UTF-8 text file, one sentence (or passage) per line."""
    file = Path(path)
    if not file.is_file():
        raise UserError(f"evaluation.forgetting.probe_file {path!r} is not a file; give a UTF-8 text file with "
                        "one sentence per line, or null for the shipped probe text")
    try:
        lines = [line.strip() for line in file.read_text(encoding="utf-8").splitlines()]
    except UnicodeDecodeError as exc:
        raise UserError(f"evaluation.forgetting.probe_file {path!r} is not UTF-8 text ({exc.reason} at byte "
                        f"{exc.start})") from None
    return [line for line in lines if line][:num]


# --------------------------------------------------------------------------------------------------
# CKA
# --------------------------------------------------------------------------------------------------


def _unbiased_hsic_terms(x: torch.Tensor, y: torch.Tensor) -> float:
    """n(n-3) times the unbiased HSIC of the linear kernels of centred x and y, from features
    (Nguyen, Raghu, Kornblith 2021, eq. 3): never forms an n×n matrix."""
    n = x.shape[0]
    sx, sy = x.square().sum(1), y.square().sum(1)
    return float((x.T @ y).square().sum() - n / (n - 2) * (sx @ sy) + sx.sum() * sy.sum() / ((n - 1) * (n - 2)))


def debiased_linear_cka(x: torch.Tensor, y: torch.Tensor) -> float:
    """Debiased linear CKA of two feature matrices (n examples × d features each), in float64."""
    n = x.shape[0]
    if n < MIN_PROBE_SENTENCES or y.shape[0] != n:
        raise ValueError(f"CKA needs the same n >= {MIN_PROBE_SENTENCES} rows in both, "
                         f"got {x.shape[0]} and {y.shape[0]}")
    x = x.double() - x.double().mean(0)
    y = y.double() - y.double().mean(0)
    denominator = _unbiased_hsic_terms(x, x) * _unbiased_hsic_terms(y, y)
    if denominator <= 0.0:  # a constant feature matrix (or one at the estimator's noise floor)
        return float("nan")
    return _unbiased_hsic_terms(x, y) / math.sqrt(denominator)


# --------------------------------------------------------------------------------------------------
# Masks
# --------------------------------------------------------------------------------------------------


def mask_positions(special: torch.Tensor, sentence_indices: Sequence[int], seed: int) -> torch.Tensor:
    """Which tokens to mask: token j of sentence i is masked when u(seed, i, j) < 0.15, u a uniform
    number drawn from a generator seeded with (seed, i), so the masks depend on neither the batch
    nor the rank. Special tokens and padding (`special`: True there) are never masked; a sentence
    with none drawn masks its token of smallest u."""
    length = special.shape[1]
    u = torch.from_numpy(np.stack([np.random.default_rng([seed, i]).random(length) for i in sentence_indices]))
    u = u.masked_fill(special, 2.0)
    masked = u < MASK_RATE
    first = u.argmin(1)
    none = ~masked.any(1) & (u.gather(1, first[:, None]).squeeze(1) < 2.0)
    masked[none, first[none]] = True
    return masked


# --------------------------------------------------------------------------------------------------
# The probe
# --------------------------------------------------------------------------------------------------


@dataclass
class _Outputs:
    """One rank's share: mean-pooled features per layer (rows of its sentences), MLM loss sums."""

    indices: list[int]
    features: list[torch.Tensor]
    mlm_loss_sum: float
    mlm_tokens: int


def _mean_pool(hidden: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
    mask = attention_mask.to(torch.float64)[..., None]
    return (hidden.double() * mask).sum(1) / mask.sum(1)


def _mlm_head(mlm_model: nn.Module, missing_keys: Sequence[str]) -> tuple[nn.Module | None, str]:
    """The pretrained MLM head of a *ForMaskedLM model, or None and why not."""
    heads = [(name, module) for name, module in mlm_model.named_children() if name != mlm_model.base_model_prefix]
    if len(heads) != 1:
        return None, f"its masked-LM class {type(mlm_model).__name__} has no single head module"
    name, head = heads[0]
    if any(key.startswith(name + ".") for key in missing_keys):
        return None, "the checkpoint has no masked-LM head weights"
    return head, ""


class EncoderForgettingProbe:
    """θ*'s features and MLM loss on the probe text, kept to compare θ with at each measurement
    (a models/probes.py ForgettingProbe)."""

    measures = FORGETTING_MEASURES

    def __init__(self, *, sentences: list[str], source: str, tokenizer: Any, model_name_or_path: str,
                 max_length: int, mask_seed: int, batch_size: int, rank: int, world_size: int,
                 device: torch.device, gather: Callable[[Any], list[Any]]):
        if len(sentences) < MIN_PROBE_SENTENCES:
            raise UserError(f"the forgetting probe text ({source}) has {len(sentences)} sentence(s); it needs at "
                            f"least {MIN_PROBE_SENTENCES} (evaluation.forgetting.num_sentences, probe_file)")
        started = time.perf_counter()
        self.source, self.num_sentences, self.max_length = source, len(sentences), max_length
        self.batch_size, self.device, self.gather = min(batch_size, _MAX_PROBE_BATCH), device, gather
        enc = tokenizer(sentences, padding="max_length", truncation=True, max_length=max_length,
                        return_special_tokens_mask=True, return_tensors="pt")
        # Shortest first (stable): a batch of similar lengths is cut to its longest sentence, which
        # halves the cost on typical prose. Sentence i is the i-th in this order (its masks follow it).
        order = torch.argsort(enc["attention_mask"].sum(1), stable=True)
        enc = {k: v[order] for k, v in enc.items()}
        self.sentences = [sentences[i] for i in order.tolist()]
        special = enc.pop("special_tokens_mask").bool() | (enc["attention_mask"] == 0)
        self.shard = eval_shard(len(sentences), rank, world_size)
        self.inputs = {k: v[self.shard.padded] for k, v in enc.items()}
        masked = mask_positions(special[self.shard.padded], self.shard.padded, mask_seed)
        self.mlm_labels = enc["input_ids"][self.shard.padded].masked_fill(~masked, -100)
        self.masked_ids = self.inputs["input_ids"].masked_fill(masked, tokenizer.mask_token_id) \
            if tokenizer.mask_token_id is not None else None
        # θ* from the checkpoint itself, in fp32; the global random state is left as it was.
        with torch.random.fork_rng(devices=[]):
            reference, self.head, self.mlm_skipped = self._load_reference(model_name_or_path)
        if self.masked_ids is None and self.head is not None:
            self.head, self.mlm_skipped = None, "the tokenizer has no mask token"
        if self.head is None:
            logger.info("forgetting: no MLM forgetting for %s (%s); representation drift only",
                        model_name_or_path, self.mlm_skipped)
        reference.to(device).eval()
        pretrained = self._measure_share(lambda batch: reference(**batch))
        self.pretrained_features, self.pretrained_mlm_loss = self._gathered(pretrained)
        del reference  # the head (and the tensor tied to it) is all that stays
        self.seconds = time.perf_counter() - started  # what measuring costs, reported in results.json

    # θ*'s side comes from the checkpoint, read when the probe is built: the run's model adds nothing
    # to it, and the run's directory keeps nothing of it.
    def reference_from_model(self, forward: Callable[[dict[str, torch.Tensor]], Any], keep_in: Path | None, *,
                             is_main: bool, barrier: Callable[[], None]) -> None:
        return None

    def reference_from_run(self, saved_in: Path, keep_in: Path | None, *, is_main: bool,
                           barrier: Callable[[], None]) -> None:
        return None

    def keeps_reference(self, directory: Path) -> bool:
        return False

    def _load_reference(self, model_name_or_path: str) -> tuple[nn.Module, nn.Module | None, str]:
        from transformers import AutoModel, AutoModelForMaskedLM
        from transformers.utils import logging as hf_logging

        path = resolve_model_path(model_name_or_path)
        local_only = check_model_source(path, key="model.name_or_path")
        # A checkpoint without a masked-LM head would be reported as "newly initialized" weights: the
        # run says once, below, that it skips MLM forgetting instead.
        verbosity = hf_logging.get_verbosity()
        hf_logging.set_verbosity_error()
        try:
            return self._load_reference_from(path, local_only, AutoModel, AutoModelForMaskedLM)
        finally:
            hf_logging.set_verbosity(verbosity)

    def _load_reference_from(self, path: str, local_only: bool, auto_model: Any,
                             auto_mlm: Any) -> tuple[nn.Module, nn.Module | None, str]:
        try:
            mlm, info = auto_mlm.from_pretrained(path, local_files_only=local_only, output_loading_info=True,
                                                 **fp32_load_argument(), **NO_REMOTE_CODE)
        except ValueError as exc:  # an architecture with no masked-LM class
            return (auto_model.from_pretrained(path, local_files_only=local_only, **fp32_load_argument(),
                                               **NO_REMOTE_CODE),
                    None, f"no masked-LM class ({str(exc).splitlines()[0][:80]})")
        head, why = _mlm_head(mlm, info["missing_keys"])
        if head is None:
            return mlm.base_model, None, why
        head.requires_grad_(False)
        head.to(self.device).eval()
        return mlm.base_model, head, ""

    @torch.no_grad()
    def _measure_share(self, forward: Callable[[dict[str, torch.Tensor]], Any]) -> _Outputs:
        """This rank's padded share through `forward`, batch by batch; the padding is dropped."""
        layers: list[list[torch.Tensor]] = []  # per layer, per batch
        loss_sum, tokens = 0.0, 0
        for start in range(0, len(self.shard.padded), self.batch_size):
            rows = slice(start, start + self.batch_size)
            real = max(0, min(self.shard.num_real - start, self.batch_size))  # padding rows: not counted
            width = int(self.inputs["attention_mask"][rows].sum(1).max())  # the rest is padding everywhere
            batch = {k: v[rows, :width].to(self.device) for k, v in self.inputs.items()}
            hidden = forward({**batch, "output_hidden_states": True}).hidden_states
            pooled = [_mean_pool(h, batch["attention_mask"]).cpu()[:real] for h in hidden[1:]]
            layers = layers or [[] for _ in pooled]
            for per_layer, p in zip(layers, pooled):
                per_layer.append(p)
            if self.head is not None:
                masked = {**batch, "input_ids": self.masked_ids[rows, :width].to(self.device),
                          "output_hidden_states": True}
                last = forward(masked).hidden_states[-1]
                logits = self.head(last.float())
                labels = self.mlm_labels[rows, :width][:real].to(self.device)
                loss_sum += float(F.cross_entropy(logits[:real].flatten(0, 1), labels.flatten(), ignore_index=-100,
                                                  reduction="sum"))
                tokens += int((labels != -100).sum())
        return _Outputs(self.shard.indices, [torch.cat(p) for p in layers], loss_sum, tokens)

    def _gathered(self, share: _Outputs) -> tuple[list[torch.Tensor], float | None]:
        """Every rank's share, in sentence order (every rank gets the whole)."""
        shares = self.gather(share)
        order = torch.from_numpy(restore_order([s.indices for s in shares]))
        features = [torch.cat([s.features[layer] for s in shares])[order] for layer in range(len(share.features))]
        tokens = sum(s.mlm_tokens for s in shares)
        mlm = sum(s.mlm_loss_sum for s in shares) / tokens if self.head is not None and tokens else None
        return features, mlm

    def measure(self, forward: Callable[[dict[str, torch.Tensor]], Any]) -> dict[str, float]:
        """θ's forgetting on the probe text: `forward(batch)` runs θ and returns its outputs
        (with hidden_states). Collective when `gather` is: every rank calls it."""
        started = time.perf_counter()
        features, mlm = self._gathered(self._measure_share(forward))
        drifts = [1.0 - debiased_linear_cka(p, f) for p, f in zip(self.pretrained_features, features)]
        out = {CKA_DRIFT_LAST: drifts[-1], CKA_DRIFT_MEAN: float(np.mean(drifts))}
        if mlm is not None:
            out.update(mlm_loss=mlm, mlm_loss_pretrained=self.pretrained_mlm_loss,
                       **{MLM_FORGETTING: mlm - self.pretrained_mlm_loss})
        self.seconds += time.perf_counter() - started
        return out

    def describe(self) -> dict[str, Any]:
        """What results.json says about the probe."""
        return {"source": self.source, "sentences": self.num_sentences, "max_length": self.max_length,
                "seconds": round(self.seconds, 3), "mlm": self.head is not None,
                **({"mlm_skipped": self.mlm_skipped} if self.head is None else {})}


def pretrained_mlm_head_parameters(arch: Any) -> int:
    """Parameters of the masked-LM head that the probe keeps for a run of architecture `arch` (its
    tied decoder weight included: the reference model's, a tensor of its own), counted on the meta
    device; 0 for an architecture without one."""
    from transformers import AutoModelForMaskedLM  # slow: imported where used

    try:
        with torch.device("meta"):
            mlm = AutoModelForMaskedLM.from_config(copy.deepcopy(arch))
    except ValueError:  # an architecture with no masked-LM class
        return 0
    head, _ = _mlm_head(mlm, [])
    return 0 if head is None else sum(p.numel() for p in head.parameters())
