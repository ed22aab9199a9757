"""CUDA's autocast rules on CPU tensors (strategies/torch_tracing.py): what a tiny model saves for
backward, op by op, has the dtypes of torch's CUDA autocast op reference, and the CPU's own rules
are back once the context is left."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from ft_framework.errors import UserError
from ft_framework.strategies import torch_tracing
from ft_framework.strategies.torch_tracing import cuda_autocast_rules

F32, BF16, F16 = torch.float32, torch.bfloat16, torch.float16


class Tiny(nn.Module):
    """One op of each kind the table checks, fp32 weights (mixed precision)."""

    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(8, 8)
        self.norm = nn.LayerNorm(8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.norm(self.linear(x))                      # addmm: lower precision; layer_norm: fp32
        t = torch.tanh(torch.pow(h, 3.0))                  # pow: fp32; tanh: not listed (runs in its input's type)
        e = torch.exp(torch.softmax(t, dim=-1))            # softmax: fp32 (set dtype); exp: fp32
        m = torch.bmm(e.unsqueeze(0), e.unsqueeze(0).transpose(1, 2))   # bmm: lower precision
        return m.sum()                                     # sum: fp32 (set dtype)


def saved_dtypes(loss: torch.Tensor) -> dict[str, dict[str, torch.dtype]]:
    """{autograd node: {saved tensor: dtype}} over the graph of `loss` (nodes that save a tensor)."""
    table, seen, stack = {}, set(), [loss.grad_fn]
    while stack:
        node = stack.pop()
        if node is None or node in seen:
            continue
        seen.add(node)
        saved = {name[len("_saved_"):]: getattr(node, name).dtype for name in dir(node)
                 if name.startswith("_saved_") and isinstance(getattr(node, name), torch.Tensor)}
        if saved:
            table[node.name()] = saved
        stack += [next_node for next_node, _ in node.next_functions]
    return table


# Written from torch's CUDA autocast op reference: addmm and bmm in the lower precision (their inputs
# saved cast), layer_norm, pow, softmax and exp in fp32, tanh in the type it is given (fp32 here,
# pow's output).
def cuda_table(low: torch.dtype) -> dict[str, dict[str, torch.dtype]]:
    return {"AddmmBackward0": {"mat1": low, "mat2": low},
            "NativeLayerNormBackward0": {"input": F32, "weight": F32, "bias": F32, "result1": F32, "result2": F32},
            "PowBackward0": {"self": F32},
            "TanhBackward0": {"result": F32},
            "SoftmaxBackward0": {"result": F32},
            "ExpBackward0": {"result": F32},
            "BmmBackward0": {"self": low, "mat2": low}}


def run(low: torch.dtype, cuda_rules: bool) -> tuple[torch.Tensor, dict]:
    torch.manual_seed(0)
    model, x = Tiny(), torch.randn(4, 8, requires_grad=True)  # addmm then saves the weight too
    if cuda_rules:
        with cuda_autocast_rules(low), torch.autocast("cpu", dtype=low):
            loss = model(x)
    else:
        with torch.autocast("cpu", dtype=low):
            loss = model(x)
    return loss, saved_dtypes(loss)


@pytest.mark.parametrize("low", [BF16, F16])
def test_saved_dtypes_per_op_follow_cudas_autocast_lists(low):
    loss, table = run(low, cuda_rules=True)
    assert table == cuda_table(low)
    assert loss.dtype == F32  # sum ran with dtype=float32
    loss.backward()           # the graph is a real one


def test_the_cpu_rules_are_back_after_the_trace():
    _, cuda = run(BF16, cuda_rules=True)
    _, cpu = run(BF16, cuda_rules=False)
    # the CPU's autocast keeps layer_norm, pow and softmax in bf16: the reason the plan needs CUDA's
    assert cpu["PowBackward0"] == {"self": BF16} and cpu["SoftmaxBackward0"] == {"result": BF16}
    assert cpu["NativeLayerNormBackward0"]["input"] == BF16
    assert cuda != cpu


def test_promote_ops_run_in_the_widest_input_type():
    a, b = torch.randn(3, dtype=BF16), torch.randn(3)
    with cuda_autocast_rules(BF16), torch.autocast("cpu", dtype=BF16):
        assert torch.addcmul(a, b, b).dtype == F32 and torch.cat([a, b]).dtype == F32
        assert torch.cat([a, a]).dtype == BF16


def test_a_weight_is_cast_once_per_autocast_region():
    weight, x = nn.Parameter(torch.randn(8, 8)), torch.randn(2, 8, requires_grad=True)
    with cuda_autocast_rules(BF16), torch.autocast("cpu", dtype=BF16):
        first, second = x @ weight, x @ weight
        a, b = first.grad_fn._saved_mat2, second.grad_fn._saved_mat2  # mm saves the cast weight
    assert a.dtype == BF16 and a.data_ptr() == b.data_ptr()  # CUDA's weight-cast cache: one copy


def test_another_torch_is_refused_in_one_line(monkeypatch):
    monkeypatch.setattr(torch_tracing, "torch_version", lambda: (3, 0))
    with pytest.raises(UserError, match=r"checked on torch 2\.6 to 2\.13; this is torch"):
        with cuda_autocast_rules(BF16):
            pass


def test_activation_checkpointing_recomputes_under_the_same_rules():
    """Backward recomputes a checkpointed block under autocast: the rules must still be CUDA's there
    (torch.utils.checkpoint refuses a recomputation whose saved dtypes differ)."""
    from torch.utils.checkpoint import checkpoint

    torch.manual_seed(0)
    model, x = Tiny(), torch.randn(4, 8, requires_grad=True)
    with cuda_autocast_rules(BF16) as rules:
        with torch.autocast("cpu", dtype=BF16):
            loss = checkpoint(model, x, use_reentrant=False)
        rules.end_region()
        loss.backward()
    assert x.grad is not None and model.linear.weight.grad.dtype == F32


def test_the_plans_trace_of_a_checkpointed_model_under_cudas_rules():
    """What ft-plan --fit tries for a GPU run in bf16: activation checkpointing under autocast."""
    from transformers import BertConfig

    from ft_framework.strategies.memory_trace import trace_micro_batch
    from tiny_run import two_label_classifier_kind

    arch = BertConfig(vocab_size=100, hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
                      intermediate_size=64, hidden_act="gelu_new")
    kw = dict(batch_size=4, seq_len=16, param_dtype=F32, autocast_dtype=BF16, keep_grads=True, autocast_rules="cuda",
              task=two_label_classifier_kind())
    plain = trace_micro_batch(arch, checkpointing=False, **kw)
    checkpointed = trace_micro_batch(arch, checkpointing=True, **kw)
    assert checkpointed.above_params < plain.above_params
