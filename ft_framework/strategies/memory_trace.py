"""Live tensor bytes, counted while torch runs, and the trace of one training micro-batch on fake
tensors: the activations a model keeps for backward, without allocating them.

The trace builds the model class of the run's task kind from its config on the meta device (with
the run's model transforms: models/fused_activations.py), gives it fake parameters of the run's
dtype, and runs forward and backward of the micro-batch and loss the kind makes for it
(`TaskKind.trace_batch`: a classifier's own loss on (B,) labels, a decoder's next-token loss on
(B, T) labels with its fp32 copy of the logits, ...) under ``FakeTensorMode`` with
:class:`LiveBytes` counting. The kind is handed in by the caller (a :class:`PlannedTask`): the
plan knows no kind. Fake tensors carry shapes, dtypes and storages but no data, so
ALBERT-xxlarge traces in seconds on a laptop. Torch's private names it needs, and CUDA's autocast
rules on CPU tensors, come from the one adapter, strategies/torch_tracing.py.

Dtypes follow the GPU's rules: a GPU run under autocast is traced under CUDA's autocast op lists
(``autocast_rules="cuda"``: pow, layer_norm, softmax and sum in fp32, matmuls in the 16-bit type,
weights cast once per forward and kept); a run without autocast traces its model in the dtype the
run gives it. The kernels are the CPU's. Where a GPU kernel keeps other tensors, the plan names the
GPU kernel it assumes: scaled-dot-product attention by CUDA's flash or memory-efficient kernel
(:data:`ASSUMED_ATTENTION_BACKEND`), which keeps the log-sum-exp and not the attention matrix, as
the CPU's flash kernel does when attention dropout is 0 (with dropout the CPU runs the math path,
which keeps the matrix and its mask; the GPU plan traces without attention dropout).
"""

from __future__ import annotations

import contextlib
import copy
import weakref
from dataclasses import dataclass
from typing import Any, Protocol, Sequence

import torch
from torch import nn
from torch.utils._pytree import tree_map_only

from ft_framework.models.activation_checkpointing import apply_activation_checkpointing
from ft_framework.models.fused_activations import fuse_activations
from ft_framework.models.lm_head_requests import install_head_requests
from ft_framework.models.loading import CAUSAL_LM_CLASS, ModelClass
from ft_framework.strategies.torch_tracing import (cuda_autocast_rules, dispatch_mode_base, fake_tensor_mode,
                                                   scalar_reads_answer_zero)

ASSUMED_ATTENTION_BACKEND = ("scaled-dot-product attention by a flash or memory-efficient kernel (keeps the "
                             "log-sum-exp, not the attention matrix nor a dropout mask)")


class PlannedTask(Protocol):
    """What the memory plan asks of the run's task kind (task_kinds/base.py's TaskKind has it all):
    the model class it loads, one training micro-batch with its loss to trace, what of the run's
    config that batch reads, the rows of what it keeps for the whole run (its probe's θ*) and of what
    a micro-batch holds beyond the trace (a decoder's KL anchor)."""

    @property
    def model_class(self) -> ModelClass: ...

    def trace_batch(self, arch: Any, *, batch_size: int, seq_len: int, device: str) -> Any:
        """An object with `inputs` (the model's keyword arguments) and `loss(outputs)`."""

    def trace_settings(self) -> tuple[Any, ...]: ...

    def memory_rows(self, arch: Any, *, world_size: int) -> Sequence[Any]:
        """Objects with `what`, `device_bytes` and `host_bytes`."""

    def step_rows(self, arch: Any, *, batch_size: int, seq_len: int) -> Sequence[Any]:
        """What a micro-batch holds beyond the traced step (a decoder's KL anchor), as memory_rows."""


def _live_bytes_mode_class():
    class LiveBytesMode(dispatch_mode_base()):
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


def build_model_on_meta(arch: Any, *, model_class: ModelClass, fused_activations: bool = False) -> nn.Module:
    """`model_class`'s model (its transformers Auto class, with the config values it sets) of config
    `arch`, on the meta device (no memory), with the run's activation transform when
    `fused_activations` (model.fused_activations). `arch` itself is left as it is."""
    import transformers  # slow: imported where used

    arch = copy.deepcopy(arch)
    for key, value in model_class.config_values:
        setattr(arch, key, value)
    with torch.device("meta"):
        model = getattr(transformers, model_class.auto_class).from_config(arch)
    if fused_activations:
        fuse_activations(model)
    if model_class.auto_class == CAUSAL_LM_CLASS:
        install_head_requests(model)  # as load_model does: the kind's trace batch may hand the head a request
    return model


_TRACES: dict[tuple, MicroBatchTrace] = {}  # a trace depends on its arguments only: plans and fits share them


def trace_micro_batch(arch: Any, *, batch_size: int, seq_len: int, param_dtype: torch.dtype,
                      autocast_dtype: torch.dtype | None, checkpointing: bool, keep_grads: bool,
                      task: PlannedTask, device: str = "cpu", autocast_rules: str = "cpu",
                      fused_activations: bool = False) -> MicroBatchTrace:
    """Traces forward and backward of `task`'s model of `arch` at (batch_size, seq_len) on fake
    tensors, with the micro-batch and loss `task` makes (its trace_batch).
    `autocast_dtype`: the forward runs under autocast to it (mixed precision with fp32 weights), by
    the op lists of `autocast_rules` ("cuda" for a GPU run, "cpu" for a CPU run).
    `fused_activations`: the model gets models/fused_activations.py's transform, as the run's does.
    `keep_grads` False drops each gradient as soon as it is accumulated, as a strategy does that
    moves gradients into its own buckets or partitions during backward (ZeRO, FSDP2, the
    overlapped offload): the trace then holds activations only."""
    if autocast_rules not in ("cpu", "cuda"):
        raise ValueError(f"autocast_rules: {autocast_rules!r}; valid: 'cpu', 'cuda'")
    key = (arch.to_json_string(), batch_size, seq_len, param_dtype, autocast_dtype, checkpointing, keep_grads,
           type(task).__module__, type(task).__qualname__, task.model_class, task.trace_settings(), device,
           autocast_rules if autocast_dtype is not None else None, fused_activations)
    if key not in _TRACES:
        _TRACES[key] = _trace(arch, batch_size=batch_size, seq_len=seq_len, param_dtype=param_dtype,
                              autocast_dtype=autocast_dtype, checkpointing=checkpointing, keep_grads=keep_grads,
                              task=task, device=device, autocast_rules=autocast_rules,
                              fused_activations=fused_activations)
    return _TRACES[key]


def _trace(arch: Any, *, batch_size: int, seq_len: int, param_dtype: torch.dtype, autocast_dtype: torch.dtype | None,
           checkpointing: bool, keep_grads: bool, task: PlannedTask, device: str, autocast_rules: str,
           fused_activations: bool) -> MicroBatchTrace:
    model = build_model_on_meta(arch, model_class=task.model_class, fused_activations=fused_activations)
    model.train()
    if checkpointing:
        apply_activation_checkpointing(model)
    with fake_tensor_mode(), live_bytes() as counter:
        _fake_parameters(model, param_dtype, device)
        params = [p for p in model.parameters() if p.requires_grad]
        param_bytes = counter.current
        if not keep_grads:
            for p in params:
                p.register_post_accumulate_grad_hook(_drop_grad)
        batch = task.trace_batch(arch, batch_size=batch_size, seq_len=seq_len, device=device)
        # CUDA's rules stay in force through backward: activation checkpointing recomputes under autocast
        with _cuda_rules(device, autocast_dtype, autocast_rules) as rules:
            with (torch.autocast(device_type=device, dtype=autocast_dtype) if autocast_dtype is not None
                  else contextlib.nullcontext()):
                outputs = model(**batch.inputs)
                # a loss that counts something (a decoder's label tokens) reads a fake tensor's value
                with scalar_reads_answer_zero():
                    loss = batch.loss(outputs)
                del outputs
            if rules is not None:
                rules.end_region()  # CUDA's weight-cast cache ends with the forward's autocast region
            loss.backward()
        del loss, batch
        grad_bytes = sum(p.grad.untyped_storage().nbytes() for p in params if p.grad is not None)
        return MicroBatchTrace(param_bytes=param_bytes, grad_bytes=grad_bytes, peak_bytes=counter.peak)


def _cuda_rules(device: str, dtype: torch.dtype | None, rules: str):
    """CUDA's autocast lists on the CPU when a GPU run's autocast is traced; otherwise nothing (the
    device's own lists apply)."""
    if dtype is not None and rules == "cuda" and device == "cpu":
        return cuda_autocast_rules(dtype)
    return contextlib.nullcontext()


def _drop_grad(param: torch.Tensor) -> None:
    param.grad = None


__all__ = ["ASSUMED_ATTENTION_BACKEND", "MicroBatchTrace", "PlannedTask", "build_model_on_meta", "live_bytes",
           "trace_micro_batch"]
