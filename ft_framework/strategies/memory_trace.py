"""Live tensor bytes, counted while torch runs, and the trace of one training micro-batch on fake
tensors: the activations a model keeps for backward, without allocating them.

This module is the one adapter to torch's private tracing names (``FakeTensorMode`` from
``torch._subclasses``, ``TorchDispatchMode`` from ``torch.utils._python_dispatch``); the range of
torch versions they were checked on is :data:`CHECKED_TORCH`.

The trace builds the model from its config on the meta device, gives it fake parameters of the
run's dtype, and runs forward and backward (the sequence-classification loss the trainer uses)
under ``FakeTensorMode`` with :class:`LiveBytes` counting. Fake tensors carry shapes, dtypes and
storages but no data, so ALBERT-xxlarge traces in seconds on a laptop.

The trace runs torch's CPU kernels. Where a GPU kernel keeps other tensors, the plan names the
GPU kernel it assumes: scaled-dot-product attention by CUDA's flash or memory-efficient kernel
(:data:`ASSUMED_ATTENTION_BACKEND`), which keeps the log-sum-exp and not the attention matrix, as
the CPU's flash kernel does when attention dropout is 0 (with dropout the CPU runs the math path,
which keeps the matrix and its mask; the GPU plan traces without attention dropout). Fake CUDA tensors would name the
GPU's kernels, but indexing one fails on a CPU build of torch (``PyTorch is not linked with
support for cuda devices``), and every model indexes its position ids.
"""

from __future__ import annotations

import contextlib
import weakref
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from torch.utils._pytree import tree_map_only

from ft_framework.errors import UserError
from ft_framework.models.activation_checkpointing import apply_activation_checkpointing

CHECKED_TORCH = ((2, 6), (2, 13))  # FakeTensorMode and TorchDispatchMode as used here
ASSUMED_ATTENTION_BACKEND = ("scaled-dot-product attention by a flash or memory-efficient kernel (keeps the "
                             "log-sum-exp, not the attention matrix nor a dropout mask)")


def _torch_version() -> tuple[int, int]:
    major, minor = torch.__version__.split("+")[0].split(".")[:2]
    return int(major), int(minor)


def _private_torch():
    """FakeTensorMode and TorchDispatchMode, after checking torch's version against CHECKED_TORCH."""
    low, high = CHECKED_TORCH
    if not low <= _torch_version() <= high:
        raise UserError(f"the memory plan traces with torch's private FakeTensorMode, checked on torch "
                        f"{low[0]}.{low[1]} to {high[0]}.{high[1]}; this is torch {torch.__version__}: "
                        "install a torch in that range or extend CHECKED_TORCH after checking")
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.utils._python_dispatch import TorchDispatchMode
    return FakeTensorMode, TorchDispatchMode


def _live_bytes_mode_class():
    _, TorchDispatchMode = _private_torch()

    class LiveBytesMode(TorchDispatchMode):
        """Counts the bytes of every storage that an operator returns, once per storage (views
        share theirs), until its last reference dies. Thread-local, like every dispatch mode:
        tensors made by other threads are not counted."""

        def __init__(self) -> None:
            super().__init__()
            self._sizes: dict[int, int] = {}
            self.current = 0
            self.peak = 0

        def _count(self, tensor: torch.Tensor) -> None:
            storage = tensor.untyped_storage()
            key = id(storage)  # the storage's Python object lives as long as the storage
            if key in self._sizes:
                return
            size = storage.nbytes()
            self._sizes[key] = size
            self.current += size
            self.peak = max(self.peak, self.current)
            weakref.finalize(storage, self._release, key)

        def _release(self, key: int) -> None:
            self.current -= self._sizes.pop(key, 0)

        def reset_peak(self) -> None:
            self.peak = self.current

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            tree_map_only(torch.Tensor, self._count, out)
            return out

    return LiveBytesMode


def live_bytes():
    """A dispatch mode counting live tensor bytes: ``with live_bytes() as counter: ...`` then
    ``counter.current``, ``counter.peak`` and ``counter.reset_peak()``."""
    return _live_bytes_mode_class()()


@dataclass(frozen=True)
class MicroBatchTrace:
    """Bytes of one micro-batch's forward and backward, as traced."""

    param_bytes: int      # the parameters, in the traced dtype
    grad_bytes: int       # the gradients that backward leaves (0 when they are dropped at once)
    peak_bytes: int       # the peak of live bytes during forward and backward, parameters included

    @property
    def above_params(self) -> int:
        """Activations and the gradients alive at the peak."""
        return self.peak_bytes - self.param_bytes


def _fake_parameters(model: nn.Module, dtype: torch.dtype, device: str) -> None:
    """Replaces the meta parameters and buffers by fake ones on `device` (inside FakeTensorMode;
    ``module.to`` cannot move meta tensors there). Parameters take `dtype`, buffers keep theirs."""
    for module in model.modules():
        for name, param in list(module._parameters.items()):
            if param is not None:
                module._parameters[name] = nn.Parameter(torch.empty(param.shape, dtype=dtype, device=device),
                                                        requires_grad=param.requires_grad)
        for name, buf in list(module._buffers.items()):
            if buf is not None:
                module._buffers[name] = torch.zeros(buf.shape, dtype=buf.dtype, device=device)


def build_model_on_meta(arch: Any, *, num_labels: int) -> nn.Module:
    """The sequence-classification model of config `arch`, on the meta device (no memory)."""
    from transformers import AutoModelForSequenceClassification  # slow: imported where used

    arch.num_labels = num_labels
    with torch.device("meta"):
        return AutoModelForSequenceClassification.from_config(arch)


_TRACES: dict[tuple, MicroBatchTrace] = {}  # a trace depends on its arguments only: plans and fits share them


def trace_micro_batch(arch: Any, *, batch_size: int, seq_len: int, param_dtype: torch.dtype,
                      autocast_dtype: torch.dtype | None, checkpointing: bool, keep_grads: bool,
                      num_labels: int = 2, device: str = "cpu") -> MicroBatchTrace:
    """Traces forward and backward of `arch`'s classifier at (batch_size, seq_len) on fake tensors.
    `autocast_dtype`: the forward runs under autocast to it (mixed precision with fp32 weights).
    `keep_grads` False drops each gradient as soon as it is accumulated, as a strategy does that
    moves gradients into its own buckets or partitions during backward (ZeRO, FSDP2, the
    overlapped offload): the trace then holds activations only."""
    key = (arch.to_json_string(), batch_size, seq_len, param_dtype, autocast_dtype, checkpointing, keep_grads,
           num_labels, device)
    if key not in _TRACES:
        _TRACES[key] = _trace(arch, batch_size=batch_size, seq_len=seq_len, param_dtype=param_dtype,
                              autocast_dtype=autocast_dtype, checkpointing=checkpointing, keep_grads=keep_grads,
                              num_labels=num_labels, device=device)
    return _TRACES[key]


def _trace(arch: Any, *, batch_size: int, seq_len: int, param_dtype: torch.dtype, autocast_dtype: torch.dtype | None,
           checkpointing: bool, keep_grads: bool, num_labels: int, device: str) -> MicroBatchTrace:
    FakeTensorMode, _ = _private_torch()
    model = build_model_on_meta(arch, num_labels=num_labels)
    model.train()
    if checkpointing:
        apply_activation_checkpointing(model)
    with FakeTensorMode(), live_bytes() as counter:
        _fake_parameters(model, param_dtype, device)
        params = [p for p in model.parameters() if p.requires_grad]
        param_bytes = counter.current
        if not keep_grads:
            for p in params:
                p.register_post_accumulate_grad_hook(_drop_grad)
        vocab = arch.vocab_size
        batch = {"input_ids": torch.randint(0, vocab, (batch_size, seq_len), device=device),
                 "attention_mask": torch.ones(batch_size, seq_len, dtype=torch.long, device=device),
                 "labels": torch.randint(0, num_labels, (batch_size,), device=device)}
        cast = (torch.autocast(device_type=device, dtype=autocast_dtype) if autocast_dtype is not None
                else contextlib.nullcontext())
        with cast:
            loss = model(**batch).loss
        loss.backward()
        del loss, batch
        grad_bytes = sum(p.grad.untyped_storage().nbytes() for p in params if p.grad is not None)
        return MicroBatchTrace(param_bytes=param_bytes, grad_bytes=grad_bytes, peak_bytes=counter.peak)


def _drop_grad(param: torch.Tensor) -> None:
    param.grad = None


__all__ = ["ASSUMED_ATTENTION_BACKEND", "CHECKED_TORCH", "MicroBatchTrace", "build_model_on_meta",
           "live_bytes", "trace_micro_batch"]
