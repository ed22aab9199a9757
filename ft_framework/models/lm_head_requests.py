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
label tokens, or per token with greedy hits for evaluation) and :class:`ProbeLogProbs` (a forgetting
probe's log-probabilities, or its per-position loss and KL against a reference).
"""

from __future__ import annotations

import types
from typing import Any, Callable

import torch
import torch.nn.functional as F
from torch import nn

from ft_framework.data.sft_collate import IGNORE_INDEX

__all__ = ["CHUNK_LOGITS", "NextTokenLoss", "ProbeLogProbs", "REQUEST_KEY", "chunk_positions", "head_is_chunked",
           "install_head_requests"]

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


def _logits_of(hidden: torch.Tensor, head: nn.Linear | None) -> tuple[Logits, int]:
    """(rows -> their logits, the vocabulary size): through `head`, or `hidden` are the finished logits."""
    if head is None:
        return (lambda rows: rows), hidden.shape[-1]
    return (lambda rows: F.linear(rows, head.weight, head.bias)), head.out_features


def _chunks(rows: torch.Tensor, size: int) -> list[torch.Tensor]:
    # At least one (possibly empty) chunk: a micro-batch without label tokens still uses the head
    # (its gradient is zero, not missing, as data-parallel strategies expect).
    return list(rows.split(size)) if len(rows) else [rows]


class NextTokenLoss:
    """Position t predicts label t + 1; IGNORE_INDEX labels count nothing. The answer: the summed
    cross-entropy in fp32 (0-dim, differentiable), or with ``per_token`` (evaluation, no gradient)
    a (2, N) tensor, per label token in row-major order: its loss and whether the head's argmax is
    the label (1.0) or not. ``every_position``: the labels are taken to be label tokens at every
    position but each row's first (the memory plan's worst case; its fake tensors have no values
    to select label tokens by)."""

    def __init__(self, labels: torch.Tensor, *, per_token: bool = False, every_position: bool = False):
        self.labels, self.per_token, self.every_position = labels, per_token, every_position

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
        if head is None:  # finished logits
            return F.cross_entropy(rows.float(), wanted, reduction="sum")
        device = rows.device.type
        dtype = torch.get_autocast_dtype(device) if torch.is_autocast_enabled(device) else head.weight.dtype
        with torch.autocast(device, enabled=False):  # the function casts as autocast would, in backward too
            return _ChunkedCrossEntropy.apply(rows, wanted, head.weight, head.bias, dtype, size)


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
