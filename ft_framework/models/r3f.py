"""R3F (Aghajanyan et al. 2020, "Better Fine-Tuning by Reducing Representational Collapse"), as
fairseq's ``sentence_prediction_r3f`` criterion computes it:

    loss = task_loss(f(x)) + weight · mean_i [ KL(p_i ‖ q_i) + KL(q_i ‖ p_i) ]

p_i = softmax(f(x_i)), q_i = softmax(f(x_i + z_i)), z added to the word embeddings' output,
uniform in [−σ, σ] (or normal N(0, σ²)); the KL terms in fp32, summed over classes, averaged over
the micro-batch's examples. With the task loss a mean over the examples this is fairseq's
per-sentence sum divided by the sentence count, so ``weight`` is fairseq's ``--r3f-lambda``.

One model call computes both passes (`attach_r3f` replaces the model's ``forward``), so every
strategy's wrapper (DDP, DeepSpeed, FSDP2) sees one forward per backward. The noise comes from the
counter-based generator keyed on (seed, STREAM_R3F_NOISE, step, element) with the element
((example index · max_seq_length + position) · hidden + dim): the same on a replayed step, on any
split of the batch over ranks and in an activation-checkpointing recomputation.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from ft_framework import counter_rng

# The batch keys that carry what the noise is keyed on; the model never receives them.
EXAMPLE_INDEX_KEY = "r3f_example_index"
STEP_KEY = "r3f_step"


@dataclass(frozen=True)
class R3FSettings:
    weight: float
    noise: str          # "uniform" or "normal"
    sigma: float
    seed: int
    max_seq_length: int


def tag_batch(batch: dict[str, torch.Tensor], example_indices: list[int], step: int) -> dict[str, torch.Tensor]:
    """`batch` with the training-set indices of its examples and the optimizer step added."""
    return {**batch, EXAMPLE_INDEX_KEY: torch.tensor(example_indices, dtype=torch.int64),
            STEP_KEY: torch.tensor(step, dtype=torch.int64)}


def element_indices(example_indices: torch.Tensor, seq_len: int, hidden: int, max_seq_length: int) -> torch.Tensor:
    """The generator's element index of each (example, position, dim): independent of padding and sharding."""
    position = torch.arange(seq_len, dtype=torch.int64, device=example_indices.device)
    dim = torch.arange(hidden, dtype=torch.int64, device=example_indices.device)
    token = example_indices[:, None] * max_seq_length + position[None, :]
    return token[:, :, None] * hidden + dim[None, None, :]


def embedding_noise(settings: R3FSettings, step: int, example_indices: torch.Tensor, seq_len: int,
                    hidden: int) -> torch.Tensor:
    """float32 noise of shape (batch, seq_len, hidden). Normal noise is Box–Muller on two disjoint
    index sets of the same stream: even elements 2k and odd elements 2k + 1."""
    index = element_indices(example_indices, seq_len, hidden, settings.max_seq_length)
    if settings.noise == "uniform":
        u = counter_rng.uniform(settings.seed, counter_rng.STREAM_R3F_NOISE, step, index)
        return (2.0 * u - 1.0) * settings.sigma
    u1 = counter_rng.uniform(settings.seed, counter_rng.STREAM_R3F_NOISE, step, 2 * index)
    u2 = counter_rng.uniform(settings.seed, counter_rng.STREAM_R3F_NOISE, step, 2 * index + 1)
    return torch.sqrt(-2.0 * torch.log(u1)) * torch.cos(2.0 * math.pi * u2) * settings.sigma


def symmetric_kl(logits_p: torch.Tensor, logits_q: torch.Tensor) -> torch.Tensor:
    """mean over rows of KL(p‖q) + KL(q‖p), p and q the softmaxes of the rows, in fp32 (or wider)."""
    dtype = torch.promote_types(logits_p.dtype, torch.float32)
    log_p = F.log_softmax(logits_p.to(dtype), dim=-1)
    log_q = F.log_softmax(logits_q.to(dtype), dim=-1)
    per_row = ((log_p.exp() - log_q.exp()) * (log_p - log_q)).sum(dim=-1)
    return per_row.mean()


class R3FObjective:
    """The replaced forward and the noise hook of one model, plus the window of KL values for the logs."""

    def __init__(self, model: nn.Module, settings: R3FSettings):
        self.settings = settings
        self._forward = model.forward
        self._noise_key: tuple[int, torch.Tensor] | None = None
        self._kl_sum = 0.0
        self._kl_count = 0
        model.get_input_embeddings().register_forward_hook(self._add_noise)

    def _add_noise(self, module: nn.Module, inputs: Any, output: torch.Tensor) -> torch.Tensor | None:
        if self._noise_key is None:
            return None
        step, examples = self._noise_key
        noise = embedding_noise(self.settings, step, examples, output.shape[1], output.shape[2])
        return output + noise.to(output.dtype)

    def forward(self, *args, **kwargs):
        examples = kwargs.pop(EXAMPLE_INDEX_KEY, None)
        step = kwargs.pop(STEP_KEY, None)
        clean = self._forward(*args, **kwargs)
        if examples is None:  # evaluation, probes, the Fisher pass: the plain model
            return clean
        noised_kwargs = {k: v for k, v in kwargs.items() if k != "labels"}
        self._noise_key = (int(step), examples)
        try:
            noised = self._forward(*args, **noised_kwargs)
        finally:
            self._noise_key = None
        kl = symmetric_kl(clean.logits, noised.logits)
        self._kl_sum += float(kl.detach())
        self._kl_count += 1
        clean.loss = clean.loss + self.settings.weight * kl
        return clean

    def pop_metrics(self) -> dict[str, float]:
        """The mean symmetric KL of this rank's micro-batches since the last call (``r3f_kl``)."""
        if not self._kl_count:
            return {}
        record = {"r3f_kl": self._kl_sum / self._kl_count}
        self._kl_sum, self._kl_count = 0.0, 0
        return record


def attach_r3f(model: nn.Module, settings: R3FSettings) -> R3FObjective:
    """Makes `model`'s forward compute R3F's loss when its batch carries tag_batch's keys."""
    objective = R3FObjective(model, settings)
    model.forward = objective.forward
    return objective
