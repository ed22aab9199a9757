"""The one adapter to torch's private and dispatcher-level names that the memory plan's trace uses:
``FakeTensorMode`` (``torch._subclasses``), ``TorchDispatchMode`` (``torch.utils._python_dispatch``),
``torch._C._ExcludeDispatchKeyGuard``, ``aten._local_scalar_dense`` (a tensor's value read as a
Python number), and kernels registered on aten operators at the AutocastCPU dispatch key with
``torch.library``. The torch versions they were checked on are :data:`CHECKED_TORCH`; another torch
is refused in one line.

Why CUDA's autocast rules on the CPU: the plan traces a GPU run on fake CPU tensors (a CPU build of
torch cannot run autograd or slicing on fake CUDA tensors, and ``torch.autocast("cuda")`` turns
itself off without CUDA). Autocast's op lists differ by device: CUDA runs ``pow``, ``layer_norm``,
``softmax`` and ``sum`` in fp32 where the CPU keeps the 16-bit type, and what a model saves for
backward follows. :func:`cuda_autocast_rules` makes ``torch.autocast("cpu")`` apply CUDA's lists,
inside the trace only, by registering Python kernels at AutocastCPU that cast as CUDA's autocast
does (``aten/src/ATen/autocast_mode.cpp``, AutocastCUDA registrations), weight-cast cache included;
leaving the context removes them and the CPU's own kernels are back.
"""

from __future__ import annotations

import contextlib
import warnings
from collections.abc import Iterator
from typing import Any

import torch

from ft_framework.errors import UserError

CHECKED_TORCH = ((2, 6), (2, 13))  # every name above, as used here

# CUDA autocast's op lists (torch 2.6-2.13, AutocastCUDA in aten/src/ATen/autocast_mode.cpp; the
# user-facing summary is torch's "CUDA Ops that can autocast to ..." reference). Overload names as
# the dispatcher spells them.
CUDA_LOWER_PRECISION = (
    "_convolution.deprecated", "_convolution", "conv1d", "conv2d", "conv3d", "conv_tbc", "conv_transpose1d",
    "conv_transpose2d.input", "conv_transpose3d.input", "convolution", "prelu", "addmm", "addmv", "addr", "matmul",
    "einsum", "mm", "mv", "linalg_vecdot", "linear", "addbmm", "baddbmm", "bmm", "chain_matmul", "linalg_multi_dot",
    "_thnn_fused_lstm_cell", "_thnn_fused_gru_cell", "lstm_cell", "gru_cell", "rnn_tanh_cell", "rnn_relu_cell",
    "_scaled_dot_product_flash_attention", "scaled_dot_product_attention")
CUDA_FP32 = (
    "acos", "asin", "cosh", "erfinv", "exp", "expm1", "log", "log10", "log2", "log1p", "reciprocal", "rsqrt", "sinh",
    "tan", "pow.Tensor_Scalar", "pow.Tensor_Tensor", "pow.Scalar", "softplus", "layer_norm", "native_layer_norm",
    "group_norm", "frobenius_norm.dim", "nuclear_norm", "nuclear_norm.dim", "cosine_similarity", "poisson_nll_loss",
    "cosine_embedding_loss", "nll_loss", "nll_loss2d", "hinge_embedding_loss", "kl_div", "l1_loss", "smooth_l1_loss",
    "huber_loss", "mse_loss", "margin_ranking_loss", "multilabel_margin_loss", "soft_margin_loss",
    "triplet_margin_loss", "multi_margin_loss", "binary_cross_entropy_with_logits", "dist", "pdist", "cdist",
    "renorm", "logsumexp")
# fp32 unless the call names a dtype: the op runs with dtype=float32 (its output is fp32)
CUDA_FP32_SET_OPT_DTYPE = (
    "prod", "prod.dim_int", "softmax.int", "log_softmax.int", "cumprod", "cumsum", "linalg_vector_norm",
    "linalg_matrix_norm", "linalg_matrix_norm.str_ord", "sum", "sum.dim_IntList")
CUDA_PROMOTE = ("addcdiv", "addcmul", "atan2", "bilinear", "cross", "dot", "vdot", "grid_sampler", "index_put",
                "tensordot", "scatter_add", "cat", "stack", "index_copy")
# Ops the CPU's autocast casts and CUDA's does not: under the CUDA rules they run as called.
CPU_ONLY = ("mkldnn_rnn_layer", "_native_multi_head_attention", "avg_pool3d", "binary_cross_entropy", "polar",
            "quantile", "nanquantile", "stft", "trace", "view_as_complex", "max_pool3d", "adaptive_avg_pool3d",
            "cross_entropy_loss", "ctc_loss.IntList", "ctc_loss.Tensor")
_POLICIES = {**{op: "lower" for op in CUDA_LOWER_PRECISION}, **{op: "fp32" for op in CUDA_FP32},
             **{op: "fp32_set_opt_dtype" for op in CUDA_FP32_SET_OPT_DTYPE},
             **{op: "promote" for op in CUDA_PROMOTE}, **{op: "as_called" for op in CPU_ONLY}}


def torch_version() -> tuple[int, int]:
    major, minor = torch.__version__.split("+")[0].split(".")[:2]
    return int(major), int(minor)


def check_torch() -> None:
    low, high = CHECKED_TORCH
    if not low <= torch_version() <= high:
        raise UserError(f"the memory plan traces with torch's private FakeTensorMode and autocast dispatch keys, "
                        f"checked on torch {low[0]}.{low[1]} to {high[0]}.{high[1]}; this is torch "
                        f"{torch.__version__}: install a torch in that range or extend CHECKED_TORCH after checking")


def fake_tensor_mode():
    """A new ``FakeTensorMode``: tensors with shapes, dtypes and storages but no data."""
    check_torch()
    from torch._subclasses.fake_tensor import FakeTensorMode
    return FakeTensorMode()


def dispatch_mode_base() -> type:
    """``TorchDispatchMode``, the base class of a mode that sees every aten call."""
    check_torch()
    from torch.utils._python_dispatch import TorchDispatchMode
    return TorchDispatchMode


@contextlib.contextmanager
def scalar_reads_answer_zero() -> Iterator[None]:
    """Inside (and inside a ``FakeTensorMode``): reading a tensor's value as a Python number
    (``int(t)``, ``float(t)``, ``t.item()``: ``aten._local_scalar_dense``) answers 0 of its type
    instead of raising, as a fake tensor has no value. For code whose scalar reads only report (the
    causal LM loss counts its label tokens); never around code whose control flow reads one."""

    class ZeroScalars(dispatch_mode_base()):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if func is torch.ops.aten._local_scalar_dense.default:
                dtype = args[0].dtype
                return False if dtype == torch.bool else 0.0 if dtype.is_floating_point else 0
            return func(*args, **(kwargs or {}))

    with ZeroScalars():
        yield


def _op(name: str):
    packet, _, overload = name.partition(".")
    return getattr(getattr(torch.ops.aten, packet), overload or "default")


def _exists(name: str) -> bool:
    packet, _, overload = name.partition(".")
    return hasattr(torch.ops.aten, packet) and hasattr(getattr(torch.ops.aten, packet), overload or "default")


class _CudaAutocastKernels:
    """The AutocastCPU kernels that cast as CUDA's autocast does, to `low` (bf16 or fp16)."""

    def __init__(self, low: torch.dtype) -> None:
        self.low = low
        self.cache: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}  # id(weight) -> (weight, its cast)
        self.caching = True

    def end_region(self) -> None:
        """The forward's autocast region ended: CUDA clears its weight-cast cache there. Casts made
        later (activation checkpointing's recompute in backward, each block its own short region)
        are not kept beyond their use."""
        self.cache.clear()
        self.caching = False

    def eligible(self, value: Any) -> bool:
        """What autocast casts: a floating tensor other than fp64 (on the autocast device)."""
        return (isinstance(value, torch.Tensor) and value.is_floating_point() and value.dtype != torch.float64)

    def cast(self, value: Any, dtype: torch.dtype) -> Any:
        if isinstance(value, (list, tuple)):
            return type(value)(self.cast(v, dtype) for v in value)
        if not self.eligible(value) or value.dtype == dtype:
            return value
        # CUDA's cached_cast: an fp32 leaf that requires grad (a weight) is cast to the lower precision
        # once per autocast region, and the copy is kept until the region ends.
        if (self.caching and dtype == self.low and value.dtype == torch.float32 and value.requires_grad
                and value.is_leaf and not value._is_view()):
            hit = self.cache.get(id(value))
            if hit is None or hit[0] is not value:
                hit = self.cache[id(value)] = (value, value.to(dtype))
            return hit[1]
        return value.to(dtype)

    def widest(self, args: tuple, kwargs: dict) -> torch.dtype:
        dtype = self.low
        for value in [*args, *kwargs.values()]:
            for v in value if isinstance(value, (list, tuple)) else (value,):
                if self.eligible(v):
                    dtype = torch.promote_types(dtype, v.dtype)
        return dtype

    def kernel(self, name: str, policy: str):
        op = _op(name)
        names = [a.name for a in op._schema.arguments]
        dtype_at = names.index("dtype") if "dtype" in names else len(names)

        def run(*args, **kwargs):
            with torch._C._ExcludeDispatchKeyGuard(torch._C.DispatchKeySet(torch._C.DispatchKey.AutocastCPU)):
                if policy == "as_called":
                    return op(*args, **kwargs)
                if policy == "fp32_set_opt_dtype":  # a dtype the call names, by keyword or position, stands
                    if dtype_at < len(args):
                        if self.eligible(args[0]) and args[dtype_at] is None:
                            args = (*args[:dtype_at], torch.float32, *args[dtype_at + 1:])
                    elif self.eligible(args[0]) and kwargs.get("dtype") is None:
                        kwargs["dtype"] = torch.float32
                    return op(*args, **kwargs)
                to = {"lower": self.low, "fp32": torch.float32}.get(policy) or self.widest(args, kwargs)
                return op(*self.cast(args, to), **{k: self.cast(v, to) for k, v in kwargs.items()})

        return run


@contextlib.contextmanager
def cuda_autocast_rules(low: torch.dtype) -> Iterator[_CudaAutocastKernels]:
    """Inside: ``torch.autocast("cpu", dtype=low)`` casts by CUDA's op lists (above), weight-cast
    cache included, instead of the CPU's. Keep it open through backward (activation checkpointing
    recomputes under autocast) and call ``end_region()`` on what it yields when the forward's
    autocast region ends. The kernels are removed on leaving."""
    check_torch()
    kernels = _CudaAutocastKernels(low)
    library = torch.library.Library("aten", "IMPL")
    try:
        with warnings.catch_warnings():  # overriding the CPU's own autocast kernels is the point
            warnings.simplefilter("ignore")
            for name, policy in _POLICIES.items():
                if _exists(name):
                    library.impl(name, kernels.kernel(name, policy), "AutocastCPU")
        yield kernels
    finally:
        kernels.cache.clear()
        library._destroy()


__all__ = ["CHECKED_TORCH", "CUDA_FP32", "CUDA_FP32_SET_OPT_DTYPE", "CUDA_LOWER_PRECISION", "CUDA_PROMOTE",
           "check_torch", "cuda_autocast_rules", "dispatch_mode_base", "fake_tensor_mode", "scalar_reads_answer_zero"]
