"""The Triton step (impl="triton", optim/triton_step.py) under TRITON_INTERPRET=1 on CPU tensors, bit
for bit against the C++ kernel's scalar level and the torch path: every rule (a user's too), the
fp32 and the compact state, awkward sizes, chunk boundaries, many tensors, mixed dtypes. A variant
with one fused multiply-add must differ (the comparison has teeth). The interpreter computes one
numpy op per Triton op, so the compiled kernel's two GPU hazards (approximate sqrt and division,
FMA contraction) are what sqrt_rn, div_rn and enable_fp_fusion=False rule out; the GPU suite
(benchmarks/gpu_suite.py part a) checks the compiled kernel on a device."""

import re

import pytest
import torch

from ft_framework.optim import AnchoredOptimizer, build_optimizer
from ft_framework.optim import cpu as cpu_kernel
from ft_framework.optim import triton_step
from ft_framework.optim.coefficients import StepCoefficients
from ft_framework.optim.compact import rounding_key
from ft_framework.optim.programs import resolve_impl
from ft_framework.optim.triton_step import TritonProgram
from rule_hparams import RULE_HPARAMS as HPARAMS

pytestmark = [
    pytest.mark.skipif(triton_step.triton is None, reason="triton is not installed (pip install triton)"),
    pytest.mark.skipif(not cpu_kernel.kernel_available(), reason="C++ kernel not built"),
    pytest.mark.usefixtures("restore_level", "interpret"),
]

# 65537: one tensor past the 64 Ki chunk, so a program starts at an offset inside a tensor.
ANCHORED_SIZES = (1, 7, 65537)
HEAD_SIZES = (3, 33)
STEPS = 2
# Every stage of the program at once (pre-decay, pre- and post-pull, post-decay, debiasing).
ALL_STAGES = StepCoefficients(beta1=0.9, beta2=0.999, eps=1e-8, step_size=1e-3, denom_scale=1.3, pre_decay=1e-4,
                              pre_pull=0.01, post_pull=0.02, post_decay=1e-3)


@pytest.fixture
def interpret(monkeypatch):
    monkeypatch.setenv(triton_step.INTERPRET_ENV_VAR, "1")


class HalfPullRule(AnchoredOptimizer):
    """A user's rule: only coefficients, so every program, Triton's included, runs it."""

    def __init__(self, params, lr: float = 1e-3, impl: str = "auto", **state):
        super().__init__(params, dict(lr=lr), impl=impl, **state)

    def coefficients(self, group, step, has_anchor):
        return StepCoefficients(beta1=0.8, beta2=0.99, eps=1e-6, step_size=group["lr"],
                                post_pull=0.05 if has_anchor else 0.0, post_decay=1e-3)


def _optimizer(rule: str, groups, impl: str, compact: bool):
    state = dict(state_dtype="bfloat16", anchor_dtype="bfloat16", rounding_seed=99) if compact else {}
    if rule == "user":
        return HalfPullRule(groups, impl=impl, **state)
    return build_optimizer(rule, groups, impl=impl, **HPARAMS[rule], **state)


def _run(rule: str, impl: str, compact: bool) -> list[torch.Tensor]:
    if impl == "cpu":
        cpu_kernel.set_simd_level("scalar")
    gen = torch.Generator().manual_seed(5)
    thetas = [torch.randn(n, generator=gen) * 0.05 for n in ANCHORED_SIZES]
    anchored = [torch.nn.Parameter(t + torch.randn(t.shape, generator=gen) * 1e-3) for t in thetas]
    head = [torch.nn.Parameter(torch.randn(n, generator=gen) * 0.05) for n in HEAD_SIZES]
    opt = _optimizer(rule, [{"params": anchored, "anchors": thetas}, {"params": head}], impl, compact)
    assert opt.impl == impl
    params = anchored + head
    for _ in range(STEPS):
        for p in params:
            p.grad = torch.randn(p.shape, generator=gen)
        opt.step()
    keys = ("exp_avg", "exp_avg_sq", "delta")
    return [x.detach().clone() for p in params
            for x in (p, *(opt.state[p][k] for k in keys if k in opt.state[p]))]


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.int16 if t.element_size() == 2 else torch.int32)


def _same_bits(got, want) -> bool:
    return len(got) == len(want) and all(g.dtype == w.dtype and torch.equal(_bits(g), _bits(w))
                                         for g, w in zip(got, want))


@pytest.mark.parametrize("compact", [False, True], ids=["fp32", "compact"])
@pytest.mark.parametrize("rule", sorted(HPARAMS) + ["user"])
def test_every_rule_equals_the_scalar_kernel_and_the_torch_path(rule, compact):
    want = _run(rule, "cpu", compact)
    assert _same_bits(_run(rule, "triton", compact), want)
    assert _same_bits(_run(rule, "torch", compact), want)


def _rows(sizes, gen, compact: bool, masters: str = "delta"):
    """(param, grad, m, v, anchor, delta) per size, with mixed dtypes: gradients and anchors
    alternate between fp32 and bf16; every third tensor has no anchor."""
    rows = []
    for i, n in enumerate(sizes):
        grad = torch.randn(n, generator=gen)
        grad = grad.bfloat16() if i % 2 else grad
        anchor = None if i % 3 == 2 else torch.randn(n, generator=gen) * 0.05
        if anchor is not None and (compact or i % 4 == 1):
            anchor = anchor.bfloat16()
        param = torch.randn(n, generator=gen) * 0.05 if anchor is None else \
            anchor.float() + torch.randn(n, generator=gen) * 1e-3
        m = torch.randn(n, generator=gen) * 1e-3
        v = torch.rand(n, generator=gen) * 1e-5
        delta = None
        if compact:
            m, v = m.bfloat16(), v.bfloat16()
            if anchor is not None and masters == "delta":
                delta = param - anchor.float()
                param = anchor.float() + delta
        rows.append((param, grad, m, v, anchor, delta))
    return rows


def _clone(rows):
    return [tuple(None if x is None else x.clone() for x in row) for row in rows]


def _step_rows(program, rows, compact: bool, c=ALL_STAGES) -> None:
    if compact:
        bases = [1000 + 70000 * i for i in range(len(rows))]
        program.step_compact([(p, g, m, v, d, a, b) for (p, g, m, v, a, d), b in zip(rows, bases)], c, 7, 3)
    else:
        program.step([(p, g, m, v, a) for p, g, m, v, a, _ in rows], c)


def _kernel_rows(rows, compact: bool, c=ALL_STAGES) -> None:
    cpu_kernel.set_simd_level("scalar")
    if compact:
        bases = [1000 + 70000 * i for i in range(len(rows))]
        cpu_kernel.fused_step_compact_many([(p, g, m, v, d, a, b) for (p, g, m, v, a, d), b in zip(rows, bases)],
                                           c, rounding_key(7, 3))
    else:
        cpu_kernel.fused_step_many([(p, g, m, v, a) for p, g, m, v, a, _ in rows], c)


def _flat(rows):
    return [x for row in rows for x in row if x is not None]


@pytest.mark.parametrize("state", ["fp32", "compact-delta", "compact-param"])
def test_many_tensors_of_mixed_dtypes_across_chunk_boundaries_in_one_launch(state):
    """40 tensors whose sizes end just before, on and just after chunk boundaries of a 64-element
    chunk (so each boundary case is a tensor of its own), gradients and anchors of both dtypes."""
    compact = state != "fp32"
    gen = torch.Generator().manual_seed(3)
    sizes = [1, 63, 64, 65, 127, 128, 129, 7, 1000, 3] * 4
    rows = _rows(sizes, gen, compact, masters=state.split("-")[-1])
    want = _clone(rows)
    _kernel_rows(want, compact)
    _step_rows(TritonProgram(chunk=64, block=16), rows, compact)
    assert _same_bits(_flat(rows), _flat(want))


def _bf16_form_rows(sizes, gen, bf16_grads: bool):
    """Rows of the bf16 weight form (master or None, grad, m, v, delta, anchor, base, weight): every
    third tensor the head (an fp32 master, no anchor), the others delta masters with no fp32 weight;
    with bf16_grads each gradient is its weight buffer (written in place)."""
    rows = []
    for i, (param, grad, m, v, anchor, delta) in enumerate(_rows(sizes, gen, compact=True)):
        weight = torch.empty(param.shape, dtype=torch.bfloat16)
        if bf16_grads:
            weight.copy_(grad)
            grad = weight
        else:
            grad = grad.float()
        rows.append((None if delta is not None else param, grad, m, v, delta, anchor, 1000 + 70000 * i, weight))
    return rows


def _clone_bf16_form(rows):
    out = []
    for master, grad, m, v, delta, anchor, base, weight in rows:
        weight2 = weight.clone()
        grad2 = weight2 if grad is weight else grad.clone()
        out.append((None if master is None else master.clone(), grad2, m.clone(), v.clone(),
                    None if delta is None else delta.clone(), anchor if anchor is None else anchor.clone(), base,
                    weight2))
    return out


@pytest.mark.parametrize("bf16_grads", [True, False], ids=["bf16_grad_in_place", "fp32_grad"])
def test_the_bf16_weight_form_across_chunk_boundaries_equals_the_kernel(bf16_grads):
    """The bf16 weight form (the device-lean offload's): 40 tensors across the boundaries of a
    64-element chunk, anchors of both dtypes, heads with fp32 masters beside delta masters without
    one; the weights, written over the bf16 gradients or beside fp32 ones, and every state are the
    scalar kernel's bits."""
    gen = torch.Generator().manual_seed(8)
    sizes = [1, 63, 64, 65, 127, 128, 129, 7, 1000, 3] * 4
    rows = _bf16_form_rows(sizes, gen, bf16_grads)
    want = _clone_bf16_form(rows)
    cpu_kernel.set_simd_level("scalar")
    cpu_kernel.fused_step_compact_bf16_many(want, ALL_STAGES, rounding_key(7, 3))
    TritonProgram(chunk=64, block=16).step_compact_bf16(rows, ALL_STAGES, 7, 3)
    flat = [x for row in rows for x in row if isinstance(x, torch.Tensor)]
    assert _same_bits(flat, [x for row in want for x in row if isinstance(x, torch.Tensor)])


@pytest.mark.parametrize("compact", [False, True], ids=["fp32", "compact"])
def test_a_fused_multiply_add_is_caught(compact):
    """The mutation the exact program forbids, m = fma(1 - beta1, g, beta1 m), stores other bits."""
    gen = torch.Generator().manual_seed(4)
    rows = _rows([4096, 7], gen, compact)
    want = _clone(rows)
    _kernel_rows(want, compact)
    exact, fused = _clone(rows), _clone(rows)
    _step_rows(TritonProgram(), exact, compact)
    _step_rows(TritonProgram(fused_mutant=True), fused, compact)
    assert _same_bits(_flat(exact), _flat(want))
    assert not _same_bits(_flat(fused), _flat(want))


def test_tables_are_cached_by_addresses_and_sizes_and_a_new_lr_reuses_them():
    gen = torch.Generator().manual_seed(6)
    rows = _rows([5, 70, 130], gen, compact=False)
    program = TritonProgram(chunk=64)
    _step_rows(program, rows, False)
    cached = dict(program._tables._cache)
    _step_rows(program, rows, False, c=StepCoefficients(beta1=0.9, beta2=0.999, eps=1e-8, step_size=5e-4))
    assert program._tables._cache.keys() == cached.keys()  # hyper-parameters are arguments, not table keys
    assert all(program._tables._cache[k][0] is cached[k][0] for k in cached)  # not rebuilt
    moved = [(p.clone(), g, m, v, a, d) for p, g, m, v, a, d in rows]  # the parameters at new addresses
    _step_rows(program, moved, False)
    assert len(program._tables._cache) == 2 * len(cached)  # one launch (and table) per kind of tensor


def test_auto_never_picks_the_interpreter_and_an_explicit_request_checks_the_tensors():
    cpu_p = torch.zeros(4)
    assert resolve_impl("auto", [cpu_p]) == "cpu"
    assert resolve_impl("triton", [cpu_p]) == "triton"  # CPU tensors: the interpreter takes them
    with pytest.raises(TypeError, match="impl='triton' cannot take these parameters: parameter has dtype "
                                        "torch.float64"):
        resolve_impl("triton", [torch.zeros(4, dtype=torch.float64)])


def test_without_triton_the_request_says_what_to_install(monkeypatch):
    monkeypatch.setattr(triton_step, "triton", None)
    with pytest.raises(RuntimeError, match="impl='triton' needs the triton package"):
        build_optimizer("adamw", [torch.nn.Parameter(torch.zeros(2))], impl="triton")


def _ptx(compact: bool, fused_mutant: bool = False, aligned: bool = True, weight_out: bool = False,
         importance: bool = False) -> str:
    """The kernel compiled for an H100 (sm_90) with the options a GPU launch uses, on this CPU
    (Triton's compiler and its bundled ptxas need no device)."""
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    signature = {name: "*i64" for name in ("addresses", "numels", "bases", "chunk_tensor", "chunk_start")}
    signature.update({name: "fp32" for name in ("beta1", "beta2", "one_minus_beta1", "one_minus_beta2", "eps",
                                                "denom_scale", "step_size", "pre_decay", "pre_pull", "post_pull",
                                                "post_decay")})
    signature["sr_key"] = "i32"
    constants = dict(GRAD_BF16=True, ANCHOR_BF16=compact, HAS_ANCHOR=True, HAS_IMPORTANCE=importance,
                     HAS_PRE=True, HAS_POST_DECAY=True,
                     COMPACT=compact, DELTA_MASTER=compact, WEIGHT_OUT=weight_out, FUSED_MUTANT=fused_mutant,
                     CHUNK_ELEMS=triton_step.CHUNK, BLOCK=triton_step.GPU_BLOCK, ALIGNED=aligned)
    signature.update({name: "constexpr" for name in constants})
    options = triton_step._launch_options(interpret=False)
    kernel = triton_step.triton.compile(ASTSource(triton_step._jitted(False), signature, constants),
                                        target=GPUTarget("cuda", 90, 32), options=options)
    return kernel.asm["ptx"]


@pytest.mark.parametrize("compact, weight_out, importance",
                         [(False, False, False), (True, False, False), (True, True, False), (False, False, True),
                          (True, False, True)],
                         ids=["fp32", "compact", "compact-bf16-weight", "fp32-importance", "compact-importance"])
def test_the_compiled_kernel_rounds_every_operation_once(compact, weight_out, importance, monkeypatch):
    """What the interpreter cannot show: on the GPU, Triton contracts a*b + c into an FMA unless
    launched with enable_fp_fusion=False (64 fma in this kernel without it), and its plain / and
    sqrt are approximate. The PTX of every stage holds only correctly rounded ops; the fused
    variant shows up."""
    monkeypatch.setenv(triton_step.INTERPRET_ENV_VAR, "0")
    ptx = _ptx(compact, weight_out=weight_out, importance=importance)
    assert not re.findall(r"\bfma\.", ptx)
    assert not re.findall(r"\b(mul|add|sub)\.f32", ptx)  # no .rn: ptxas may contract them
    assert re.findall(r"\bdiv\.rn\.f32", ptx) and not re.findall(r"\bdiv\.(full|approx)", ptx)
    assert re.findall(r"\bsqrt\.rn\.f32", ptx) and not re.findall(r"\bsqrt\.approx", ptx)
    assert re.findall(r"\bfma\.", _ptx(compact, fused_mutant=True, weight_out=weight_out, importance=importance))
    # The weighted pulls' clamp: min(w * F~, 1) keeps a NaN (min.NaN), as the C++ min(1, x) does.
    assert bool(re.findall(r"\bmin\.NaN\.f32", ptx)) == importance


def _global_accesses(ptx: str) -> dict[str, int]:
    counts: dict[str, int] = {}
    for op in re.findall(r"\b((?:ld|st)\.global[\w.]*)", ptx):
        counts[op] = counts.get(op, 0) + 1
    return counts


@pytest.mark.parametrize("compact", [False, True], ids=["fp32", "compact"])
def test_aligned_addresses_are_loaded_and_stored_16_bytes_at_a_time(compact, monkeypatch):
    """Addresses read from the int64 table tell the compiler nothing about alignment: without the
    hints (ALIGNED, given when every address is a multiple of 16 bytes) every load and store is one
    element wide; with them the whole blocks use 16-byte vector accesses (v4.b32: 4 fp32 or 8 bf16
    per instruction), and the partial last block stays element-wise under its mask."""
    monkeypatch.setenv(triton_step.INTERPRET_ENV_VAR, "0")
    plain, hinted = _global_accesses(_ptx(compact, aligned=False)), _global_accesses(_ptx(compact, aligned=True))
    assert not [op for op in plain if ".v2" in op or ".v4" in op], plain
    assert hinted.get("ld.global.v4.b32", 0) >= 5 and hinted.get("st.global.v4.b32", 0) >= 3, hinted


def test_the_alignment_hint_is_given_only_where_it_holds():
    gen = torch.Generator().manual_seed(0)
    whole = torch.randn(64, generator=gen)
    row = (whole, whole.clone(), whole.clone(), whole.clone(), None, None)
    assert triton_step._aligned([row], chunk=64, block=16)
    assert not triton_step._aligned([row], chunk=64, block=24)  # a block would start off a multiple
    shifted = (whole[1:], *(x[1:] for x in row[1:4]), None, None)  # 4 bytes past an aligned address
    assert not triton_step._aligned([row, shifted], chunk=64, block=16)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_auto_picks_triton_on_cuda(monkeypatch):
    monkeypatch.setenv(triton_step.INTERPRET_ENV_VAR, "0")
    assert build_optimizer("adamw", [torch.nn.Parameter(torch.zeros(2, device="cuda"))]).impl == "triton"
