"""Memory-lean activations: a model transform that replaces an activation written as separate ops by
the fused op computing the same function (``model.fused_activations``, on by default).

Why: autograd keeps what each op needs for backward. ``gelu_new`` (ALBERT, GPT-2, ...) is
``0.5 * x * (1 + tanh(sqrt(2/pi) * (x + 0.044715 * x**3)))``: written as separate ops it keeps x,
tanh's output and two products, four [tokens x intermediate] tensors per layer, and under CUDA
autocast three of them in fp32 (``pow`` runs in fp32 there). The fused tanh GELU,
``F.gelu(x, approximate="tanh")`` (transformers' ``gelu_pytorch_tanh``), computes the same formula
in one kernel and keeps x only. ALBERT-xxlarge, bf16, batch 32 x 128 tokens: 4.8 GiB less.

Only the forms whose outputs agree with the fused op within the dtype's rounding are replaced
(tests/unit/models/test_fused_activations.py: within 1e-6 of the input's magnitude in fp32, within one
bf16 ulp in bf16); an activation not listed in :data:`FUSED_FORMS` is left as it is. The run's log
and results.json name what was replaced; the memory plan applies the same transform
(strategies/memory_trace.py) so that it traces the model the run trains.
"""

from __future__ import annotations

from collections import Counter

from torch import Tensor, nn
from torch.nn import functional as F


class FusedTanhGELU(nn.Module):
    """``F.gelu(x, approximate="tanh")``: the tanh approximation of GELU in one kernel."""

    def __init__(self, replaces: str) -> None:
        super().__init__()
        self.replaces = replaces  # the activation's name in the model's config, for the record

    def forward(self, x: Tensor) -> Tensor:
        return F.gelu(x, approximate="tanh")

    def extra_repr(self) -> str:
        return f"replaces={self.replaces!r}"


def _separate_tanh_form(module: nn.Module) -> str | None:
    """The transformers activation name of `module` when it computes the tanh GELU as separate ops."""
    from transformers import activations  # slow: imported where used

    if type(module) is activations.NewGELUActivation:
        return "gelu_new"
    if type(module) is activations.FastGELUActivation:
        return "gelu_fast"
    tanh_cls = getattr(activations, "GELUTanh", None) or getattr(activations, "PytorchGELUTanh", None)
    if tanh_cls is not None and type(module) is tanh_cls and getattr(module, "act", None) is not None \
            and getattr(module.act, "__name__", "") == "_gelu_tanh_python":
        return "gelu_python_tanh"
    return None


FUSED_FORMS = ("gelu_new", "gelu_fast", "gelu_python_tanh")  # each becomes FusedTanhGELU


def fuse_activations(model: nn.Module) -> dict[str, int]:
    """Replaces, in place, every activation module of :data:`FUSED_FORMS` by :class:`FusedTanhGELU`;
    returns how many of each name were replaced (empty: nothing to do)."""
    replaced: Counter[str] = Counter()
    for parent in list(model.modules()):
        for child_name, child in list(parent.named_children()):
            form = _separate_tanh_form(child)
            if form is not None:
                setattr(parent, child_name, FusedTanhGELU(form))
                replaced[form] += 1
    return dict(replaced)


def describe_fused(replaced: dict[str, int]) -> str:
    """One phrase for the log: what the transform did."""
    if not replaced:
        return "no activation to fuse (none written as separate ops)"
    return ", ".join(f"{n} {name} module(s) -> fused tanh GELU" for name, n in sorted(replaced.items()))


__all__ = ["FUSED_FORMS", "FusedTanhGELU", "describe_fused", "fuse_activations"]
