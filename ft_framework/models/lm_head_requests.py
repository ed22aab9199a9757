"""A decoder's next-token quantities computed from its last hidden states a chunk of positions at a
time, inside its LM head's forward, so that the whole (batch, length, vocabulary) logits never exist.

For a decoder with a large vocabulary the loss's input is the largest activation: Llama-3's logits
are 2048 x 128,256 values per sequence, 1 GiB in fp32, and the loss's log-softmax and backward's
gradient are as large again. A head request replaces them: the model is called with
``lm_head_request=<request>`` (see :func:`install_head_requests`); its LM head then runs the
request on the hidden states instead of returning logits, and the request's answer comes back as
the output's ``logits``. A request takes only the positions it needs (a training loss only the
label tokens: prompts and padding cost nothing) and computes their logits :data:`CHUNK_LOGITS`
values at a time; the training loss's backward recomputes each chunk (an autograd function that
keeps the label rows, the weight and each row's log-sum-exp) and adds the chunks' weight gradients
into one buffer in place.

The request runs inside the head module's forward, so every strategy's hooks see an ordinary head
call: FSDP2's root group is unsharded then, DeepSpeed ZeRO-3 gathers the head's weight for its
forward and again, through its backward hooks on the head's output, for the chunks' recomputation;
tied embeddings are the same parameter, as without requests. A head that is not a plain Linear, or
a model that changes the logits after its head (a final soft-cap, a logit scale), computes its logits
as before and the request takes them as they are (the same answers, the old memory).

Requests (one model call each): :class:`NextTokenLoss` (the summed next-token cross-entropy of the
label tokens, or per token with greedy hits for evaluation; with :class:`AnchorTargets`, also the
summed KL anchor to θ*'s stored top-k distributions, loss.kl_to_pretrained), :class:`TopKDistribution`
(θ*'s top-k and tail mass at each label position, the KL anchor's pass) and :class:`ProbeLogProbs`
(a forgetting probe's log-probabilities, or its per-position loss and KL against a reference).
"""

from __future__ import annotations

import types
from dataclasses import dataclass
from typing import Any, Callable

import torch
import torch.nn.functional as F
from torch import nn

from ft_framework.data.sft_collate import IGNORE_INDEX

__all__ = ["AnchorTargets", "CHUNK_LOGITS", "NextTokenLoss", "ProbeLogProbs", "REQUEST_KEY", "TopKDistribution",
           "anchor_head_bytes", "anchor_kl", "anchor_kl_bytes", "chunk_positions", "head_is_chunked",
           "install_head_requests", "label_rows"]

# One chunk's logits, in values: 2^25 (128 MiB in fp32), 261 positions of Llama-3's vocabulary.
CHUNK_LOGITS = 1 << 25
REQUEST_KEY = "lm_head_request"  # the model forward's keyword argument
# Config attributes of models that change the logits after their head (Gemma 2's final soft-cap,
# Cohere's logit scale, Granite's logit divisor): their requests take the finished logits.
_AFTER_HEAD_KEYS = ("final_logit_softcapping", "logit_scale", "logits_scaling")

Logits = Callable[[torch.Tensor], torch.Tensor]  # (rows, hidden) -> (rows, vocabulary)


def chunk_positions(vocab_size: int) -> int:
    """Positions per chunk for a vocabulary of `vocab_size`."""
    return max(1, CHUNK_LOGITS // vocab_size)


def anchor_head_bytes(tokens: int, k: int, vocab_size: int) -> tuple[int, int]:
    """What the chunked head's loss with the KL anchor (_ChunkedCrossEntropyKL) holds beyond the plain
    chunked loss at backward's peak, for `tokens` label tokens and θ*'s top `k`: (kept from forward
    to backward: the ids widened to int64 and each row's log-sum-exp over the tail; in one chunk of
    backward: the recomputed fp32 logits beside their gradient, which the plain loss computes in
    their place, and the chunk's p*_k and log p*_k, with a tail also p*_tail and log p*_tail, fp32)."""
    k = min(k, vocab_size)
    rows = min(chunk_positions(vocab_size), tokens)
    tail = 2 * 4 * rows if k < vocab_size else 0
    return tokens * (8 * k + 4), rows * vocab_size * 4 + 2 * 4 * rows * k + tail


def _logits_of(hidden: torch.Tensor, head: nn.Linear | None) -> tuple[Logits, int]:
    """(rows -> their logits, the vocabulary size): through `head`, or `hidden` are the finished logits."""
    if head is None:
        return (lambda rows: rows), hidden.shape[-1]
    return (lambda rows: F.linear(rows, head.weight, head.bias)), head.out_features


def _chunks(rows: torch.Tensor, size: int) -> list[torch.Tensor]:
    # At least one (possibly empty) chunk: a micro-batch without label tokens still uses the head
    # (its gradient is zero, not missing, as data-parallel strategies expect).
    return list(rows.split(size)) if len(rows) else [rows]


def label_rows(values: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """The rows of `values` (B, T, ...) at the label positions of `labels` (B, T), in row-major order:
    position t predicts label t + 1."""
    return values[NextTokenLoss(labels).targets(values.device) != IGNORE_INDEX]


@dataclass(frozen=True)
class AnchorTargets:
    """θ*'s stored next-token distribution at each label position of a batch, in row-major order (the
    KL anchor, models/kl_anchor.py): its top-k token ids ``ids`` (N, k, int64), their log-probabilities
    ``logp`` (N, k, fp32), and ``tail_logp`` (N, fp32), the log of the mass outside the top k (None
    when k is the whole vocabulary: no tail)."""

    ids: torch.Tensor
    logp: torch.Tensor
    tail_logp: torch.Tensor | None

    def to(self, device: torch.device) -> "AnchorTargets":
        return AnchorTargets(self.ids.to(device), self.logp.to(device),
                             None if self.tail_logp is None else self.tail_logp.to(device))

    def split(self, size: int) -> list["AnchorTargets"]:
        tails = [None] * len(_chunks(self.ids, size)) if self.tail_logp is None else _chunks(self.tail_logp, size)
        return [AnchorTargets(i, p, t) for i, p, t in zip(_chunks(self.ids, size), _chunks(self.logp, size), tails)]

    def weights(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
        """(p*_k, log p*_k, p*_tail, log p*_tail), each log-probability 0 where its probability is 0 (so
        that 0 · log 0 counts 0, not NaN)."""
        p = self.logp.exp()
        logp = torch.where(p > 0, self.logp, torch.zeros_like(self.logp))
        if self.tail_logp is None:
            return p, logp, None, None
        pt = self.tail_logp.exp()
        return p, logp, pt, torch.where(pt > 0, self.tail_logp, torch.zeros_like(self.tail_logp))


def anchor_kl(logits: torch.Tensor, anchor: AnchorTargets) -> torch.Tensor:
    """Σ over rows of KL_approx(p* ‖ softmax(logits)) (fp32, differentiable: the plain formula autograd
    differentiates; the whole logits' path and the reference of the chunked one): over θ*'s top-k ids
    and one tail bucket, the rest of the vocabulary,
    Σ_k p*_k (log p*_k − log p_k) + p*_tail (log p*_tail − log p_tail), p_tail = 1 − Σ_k p_k."""
    z = logits.float()
    p, logp, pt, tail = anchor.weights()
    lse = torch.logsumexp(z, -1)
    total = (p * (logp - z.gather(1, anchor.ids) + lse[:, None])).sum()
    if pt is not None:  # the tail's log-mass from the logits outside the top k (log space: no cancellation)
        lse_tail = torch.logsumexp(z.scatter(1, anchor.ids, float("-inf")), -1)
        total = total + (pt * (tail - lse_tail + lse)).sum()
    return total


def anchor_kl_bytes(tokens: int, vocab_size: int) -> int:
    """What :func:`anchor_kl` on the whole logits (training.chunked_loss off) holds beyond the
    next-token loss at the step's peak, for `tokens` label tokens: three fp32 copies of their rows
    of logits (the widened rows and the rows without θ*'s top k, kept for backward, and their
    gradient). Measured on a tiny Llama step, fp32 and bf16 logits: 2.96 copies."""
    return 3 * tokens * vocab_size * 4


class NextTokenLoss:
    """Position t predicts label t + 1; IGNORE_INDEX labels count nothing. The answer: the summed
    cross-entropy in fp32 (0-dim, differentiable), or with ``per_token`` (evaluation, no gradient)
    a (2, N) tensor, per label token in row-major order: its loss and whether the head's argmax is
    the label (1.0) or not. ``every_position``: the labels are taken to be label tokens at every
    position but each row's first (the memory plan's worst case; its fake tensors have no values
    to select label tokens by). ``anchor`` (training only): θ*'s stored distributions at the label
    tokens; the answer is then (2,): the summed cross-entropy and the summed :func:`anchor_kl`."""

    def __init__(self, labels: torch.Tensor, *, per_token: bool = False, every_position: bool = False,
                 anchor: AnchorTargets | None = None):
        self.labels, self.per_token, self.every_position, self.anchor = labels, per_token, every_position, anchor

    def targets(self, device: torch.device) -> torch.Tensor:
        """(B, T): the label each position predicts (IGNORE_INDEX: none)."""
        return F.pad(self.labels[:, 1:], (0, 1), value=IGNORE_INDEX).to(device)

    def __call__(self, hidden: torch.Tensor, head: nn.Linear | None) -> torch.Tensor:
        logits, vocab_size = _logits_of(hidden, head)
        if self.every_position:
            rows, wanted = hidden[:, :-1].flatten(0, 1), self.labels[:, 1:].flatten().to(hidden.device)
        else:
            targets = self.targets(hidden.device)
            keep = targets != IGNORE_INDEX
            rows, wanted = hidden[keep], targets[keep]
        size = chunk_positions(vocab_size)
        if self.per_token:
            with torch.no_grad():
                parts = []
                for h, y in zip(_chunks(rows, size), _chunks(wanted, size)):
                    z = logits(h).float()
                    parts.append(torch.stack([F.cross_entropy(z, y, reduction="none"), (z.argmax(-1) == y).float()]))
                return torch.cat(parts, dim=1)
        anchor = None if self.anchor is None else self.anchor.to(rows.device)
        if anchor is not None and len(anchor.ids) != len(rows):
            raise ValueError(f"the KL anchor's stored targets cover {len(anchor.ids)} label tokens, the batch has "
                             f"{len(rows)}")
        if head is None:  # finished logits
            loss = F.cross_entropy(rows.float(), wanted, reduction="sum")
            return loss if anchor is None else torch.stack([loss, anchor_kl(rows, anchor)])
        device = rows.device.type
        dtype = torch.get_autocast_dtype(device) if torch.is_autocast_enabled(device) else head.weight.dtype
        with torch.autocast(device, enabled=False):  # the function casts as autocast would, in backward too
            if anchor is None:
                return _ChunkedCrossEntropy.apply(rows, wanted, head.weight, head.bias, dtype, size)
            return _ChunkedCrossEntropyKL.apply(rows, wanted, head.weight, head.bias, dtype, size, anchor.ids,
                                                anchor.logp, anchor.tail_logp)


class _ChunkedCrossEntropy(torch.autograd.Function):
    """Σ over rows of -log softmax(rows @ weight.T + bias)[wanted], in fp32, `size` rows at a time
    (the logits in `dtype`, as the head computes them, then widened). Backward recomputes each chunk's
    logits and adds its weight gradient into one buffer in place (autograd would hold a second
    vocabulary x hidden gradient per chunk while adding): it keeps the rows and the weight only."""

    @staticmethod
    def forward(ctx, rows, wanted, weight, bias, dtype, size):
        w, b = weight.to(dtype), None if bias is None else bias.to(dtype)
        total = torch.zeros((), dtype=torch.float32, device=rows.device)
        lse = torch.empty(len(rows), dtype=torch.float32, device=rows.device)  # each row's log-sum-exp
        start = 0
        for h, y in zip(_chunks(rows, size), _chunks(wanted, size)):
            z = F.linear(h.to(dtype), w, b).float()
            lse[start:start + len(h)] = torch.logsumexp(z, -1)
            total += (lse[start:start + len(h)] - z.gather(1, y[:, None])[:, 0]).sum()
            start += len(h)
        ctx.save_for_backward(rows, wanted, weight, bias, lse)
        ctx.dtype, ctx.size = dtype, size
        return total

    @staticmethod
    def backward(ctx, grad_total):
        rows, wanted, weight, bias, lse = ctx.saved_tensors
        dtype, size = ctx.dtype, ctx.size
        w, b = weight.to(dtype), None if bias is None else bias.to(dtype)
        grad_rows = torch.empty_like(rows) if ctx.needs_input_grad[0] else None
        grad_weight = torch.zeros_like(weight) if ctx.needs_input_grad[2] else None
        grad_bias = torch.zeros_like(bias) if bias is not None and ctx.needs_input_grad[3] else None
        start = 0
        for h, y in zip(_chunks(rows, size), _chunks(wanted, size)):
            hd = h.to(dtype)
            # d/dz of logsumexp(z) - z[y]: softmax(z) - onehot(y), times the incoming gradient; in
            # place on the recomputed fp32 logits (softmax from forward's log-sum-exp)
            g = F.linear(hd, w, b).float()
            g.sub_(lse[start:start + len(h), None]).exp_()
            g[torch.arange(len(y), device=g.device), y] -= 1.0
            g = g.mul_(grad_total).to(dtype)
            if grad_rows is not None:
                grad_rows[start:start + len(h)] = g @ w
            if grad_weight is not None:  # in the weight's dtype (fp32 weights under autocast: no 16-bit copy)
                grad_weight.addmm_(g.t().to(weight.dtype), h.to(weight.dtype))
            if grad_bias is not None:
                grad_bias.add_(g.sum(0).to(bias.dtype))
            start += len(h)
        return grad_rows, None, grad_weight, grad_bias, None, None


class _ChunkedCrossEntropyKL(torch.autograd.Function):
    """(Σ cross-entropy, Σ anchor_kl) over rows, computed as _ChunkedCrossEntropy computes the first:
    `size` rows at a time, each chunk's logits recomputed in backward, the weight's gradient added
    into one buffer. Forward keeps each row's log-sum-exp over the vocabulary and over the tail (the
    ids outside θ*'s top k). The gradient of the KL at logit j of a row: softmax_j − p*_j for a top-k
    id j, softmax_j − p*_tail · exp(z_j − lse_tail) for the others."""

    @staticmethod
    def forward(ctx, rows, wanted, weight, bias, dtype, size, ids, logp, tail_logp):
        w, b = weight.to(dtype), None if bias is None else bias.to(dtype)
        anchor = AnchorTargets(ids, logp, tail_logp)
        ce = torch.zeros((), dtype=torch.float32, device=rows.device)
        kl = torch.zeros((), dtype=torch.float32, device=rows.device)
        lse = torch.empty(len(rows), dtype=torch.float32, device=rows.device)
        lse_tail = torch.empty(len(rows), dtype=torch.float32, device=rows.device)
        start = 0
        for h, y, a in zip(_chunks(rows, size), _chunks(wanted, size), anchor.split(size)):
            z = F.linear(h.to(dtype), w, b).float()
            here = slice(start, start + len(h))
            lse[here] = torch.logsumexp(z, -1)
            ce += (lse[here] - z.gather(1, y[:, None])[:, 0]).sum()
            p, lp, pt, tail = a.weights()
            kl += (p * (lp - z.gather(1, a.ids) + lse[here, None])).sum()
            if pt is not None:
                lse_tail[here] = torch.logsumexp(z.scatter_(1, a.ids, float("-inf")), -1)
                kl += (pt * (tail - lse_tail[here] + lse[here])).sum()
            start += len(h)
        ctx.save_for_backward(rows, wanted, weight, bias, lse, lse_tail, ids, logp, tail_logp)
        ctx.dtype, ctx.size = dtype, size
        return torch.stack([ce, kl])

    @staticmethod
    def backward(ctx, grad_out):
        rows, wanted, weight, bias, lse, lse_tail, ids, logp, tail_logp = ctx.saved_tensors
        dtype, size = ctx.dtype, ctx.size
        g_ce, g_kl = grad_out[0], grad_out[1]
        w, b = weight.to(dtype), None if bias is None else bias.to(dtype)
        grad_rows = torch.empty_like(rows) if ctx.needs_input_grad[0] else None
        grad_weight = torch.zeros_like(weight) if ctx.needs_input_grad[2] else None
        grad_bias = torch.zeros_like(bias) if bias is not None and ctx.needs_input_grad[3] else None
        start = 0
        for h, y, a in zip(_chunks(rows, size), _chunks(wanted, size), AnchorTargets(ids, logp, tail_logp).split(size)):
            hd = h.to(dtype)
            here = slice(start, start + len(h))
            z = F.linear(hd, w, b).float()
            g = (z - lse[here, None]).exp_().mul_(g_ce + g_kl)  # softmax, from both terms
            g[torch.arange(len(y), device=g.device), y] -= g_ce
            p, _, pt, _ = a.weights()
            g.scatter_add_(1, a.ids, -g_kl * p)
            if pt is not None:  # the tail bucket's pull, on the ids outside the top k only
                z.sub_(lse_tail[here, None]).exp_().mul_(-g_kl * pt[:, None])
                g.add_(z.scatter_(1, a.ids, 0.0))
            g = g.to(dtype)
            if grad_rows is not None:
                grad_rows[here] = g @ w
            if grad_weight is not None:
                grad_weight.addmm_(g.t().to(weight.dtype), h.to(weight.dtype))
            if grad_bias is not None:
                grad_bias.add_(g.sum(0).to(bias.dtype))
            start += len(h)
        return grad_rows, None, grad_weight, grad_bias, None, None, None, None, None


class TopKDistribution:
    """The KL anchor's pass (no gradient): at each label position of `labels` (as NextTokenLoss takes
    them), in row-major order, the model's `k` most likely next tokens, their fp32 log-probabilities
    and the log of the mass outside them. The answer: (N, 2k + 1) fp32, [ids | log-probabilities |
    tail], the ids exact (a vocabulary below 2^24); k is at most the vocabulary, and when it is the
    whole vocabulary the tail column is -inf (no mass)."""

    def __init__(self, labels: torch.Tensor, k: int):
        self.labels, self.k = labels, k

    def __call__(self, hidden: torch.Tensor, head: nn.Linear | None) -> torch.Tensor:
        logits, vocab_size = _logits_of(hidden, head)
        if vocab_size >= 1 << 24:
            raise ValueError(f"a vocabulary of {vocab_size} ids cannot be answered as fp32 ids")
        k = min(self.k, vocab_size)
        with torch.no_grad():
            rows = label_rows(hidden, self.labels)
            parts = []
            for h in _chunks(rows, chunk_positions(vocab_size)):
                z = logits(h).float()
                lse = torch.logsumexp(z, -1)
                top, ids = z.topk(k, dim=-1)
                tail = torch.full_like(lse, float("-inf"))
                if k < vocab_size:
                    tail = torch.logsumexp(z.scatter_(1, ids, float("-inf")), -1) - lse
                parts.append(torch.cat([ids.float(), top - lse[:, None], tail[:, None]], dim=1))
            return torch.cat(parts, dim=0)


class ProbeLogProbs:
    """A forgetting probe's batch (no gradient): in each of the first `rows` rows, every position but
    a row's last (its length from `attention_mask`) predicts the next token of `input_ids`. The
    answer, positions in row-major order: without `reference`, their fp32 log-probabilities (N,
    vocabulary); with `reference` (N, vocabulary: θ*'s log-probabilities of the same positions), a
    (2, N) tensor: each position's next-token loss and KL(p_ref ‖ p) over the whole vocabulary."""

    def __init__(self, input_ids: torch.Tensor, attention_mask: torch.Tensor, rows: int,
                 reference: torch.Tensor | None = None):
        self.input_ids, self.attention_mask, self.rows, self.reference = input_ids, attention_mask, rows, reference

    def __call__(self, hidden: torch.Tensor, head: nn.Linear | None) -> torch.Tensor:
        logits, vocab_size = _logits_of(hidden, head)
        with torch.no_grad():
            lengths = self.attention_mask.sum(1).to(hidden.device)
            width = hidden.shape[1]
            predicted = torch.arange(width, device=hidden.device)[None, :] < (lengths - 1)[:, None]
            predicted[self.rows:] = False
            targets = F.pad(self.input_ids[:, 1:], (0, 1)).to(hidden.device)[predicted]
            rows = hidden[predicted]
            size = chunk_positions(vocab_size)
            reference = None if self.reference is None else self.reference.to(hidden.device)
            parts = []
            for start, h in zip(range(0, max(1, len(rows)), size), _chunks(rows, size)):
                logp = F.log_softmax(logits(h).float(), dim=-1)
                nll = -logp.gather(1, targets[start:start + len(h), None])[:, 0]
                if reference is None:
                    parts.append(logp)
                else:
                    ref = reference[start:start + len(h)]
                    parts.append(torch.stack([nll, (ref.exp() * (ref - logp)).sum(-1)]))
            return torch.cat(parts, dim=0 if reference is None else 1)


def head_is_chunked(model: nn.Module) -> bool:
    """Whether `model`'s requests run inside its head on the hidden states (else on finished logits)."""
    head = model.get_output_embeddings()
    return (type(head) is nn.Linear
            and not any(getattr(model.config, key, None) is not None for key in _AFTER_HEAD_KEYS))


def _head_forward(head: nn.Linear, hidden: torch.Tensor) -> torch.Tensor:
    request = head.__dict__.get("_ft_request")
    if request is None:
        return nn.Linear.forward(head, hidden)
    head._ft_request = None  # the model calls its head once per forward
    return request(hidden, head)


def install_head_requests(model: nn.Module) -> bool:
    """Makes `model` (a transformers causal LM) take ``lm_head_request=<request>`` in its forward;
    without it the model is unchanged. Returns whether requests run inside the head (chunked)."""
    if "_ft_plain_forward" in model.__dict__:
        return head_is_chunked(model)
    chunked = head_is_chunked(model)
    head = model.get_output_embeddings()
    plain = model.forward
    model._ft_plain_forward = plain

    def forward(*args: Any, lm_head_request: Callable | None = None, **kwargs: Any) -> Any:
        if lm_head_request is None:
            return plain(*args, **kwargs)
        if not chunked:
            out = plain(*args, **kwargs)
            out.logits = lm_head_request(out.logits, None)
            return out
        head._ft_request = lm_head_request
        try:
            return plain(*args, **kwargs)
        finally:
            head._ft_request = None

    model.forward = forward
    if chunked:
        head.forward = types.MethodType(_head_forward, head)
    return chunked
