"""The compact optimizer state (state_dtype bfloat16, optim/compact.py): each step against a float64
reference with the same stochastic-rounding bits, the C++ copy of counter_rng against the Python
owner, SIMD levels against scalar, C++ against torch, the v ratchet, unbiasedness, checkpoints."""

import pytest
import torch

from ft_framework import counter_rng
from ft_framework.config import apply_overrides, validate_config
from ft_framework.errors import UserError
from ft_framework.optim import build_optimizer
from ft_framework.optim import cpu as cpu_kernel
from ft_framework.optim.compact import rounding_bits, rounding_key, stochastic_round_bf16
from optim_reference import Reference
from rule_hparams import RULE_HPARAMS as HPARAMS
from simd_levels import SIMD_LEVELS, level_or_skip

PATHS = ["torch"] + SIMD_LEVELS
SEED = 1234
STATE_KEYS = ("exp_avg", "exp_avg_sq", "delta", "step")
ANCHORED, HEAD = 1037, 53  # sizes that leave tails at every vector width


def _bf16_ulp(x: torch.Tensor) -> torch.Tensor:
    """The bf16 spacing at |x| (float64)."""
    exponent = torch.frexp(x.abs().clamp_min(1e-38).float())[1].double()
    return torch.pow(2.0, exponent - 8)


def _compact_pair(rule: str, path: str, seed: int = SEED, masters: str = "delta", **extra):
    """An anchored parameter and a head without theta*, with a compact-state optimizer on `path`;
    masters "param": the anchored parameter is its own master (as under DeepSpeed), no delta."""
    if path != "torch":
        level_or_skip(path)
        cpu_kernel.set_simd_level(path)
    gen = torch.Generator().manual_seed(7)
    theta0 = torch.randn(ANCHORED, generator=gen) * 0.05
    anchored = torch.nn.Parameter(theta0.clone())
    head = torch.nn.Parameter(torch.randn(HEAD, generator=gen) * 0.05)
    opt = build_optimizer(rule, [{"params": [anchored], "anchors": [theta0]}, {"params": [head]}],
                          impl="torch" if path == "torch" else "cpu", state_dtype="bfloat16",
                          anchor_dtype="bfloat16", rounding_seed=seed, **{**HPARAMS[rule], **extra})
    if masters == "param":
        opt.keep_masters_in_params()
    return anchored, head, opt


@pytest.mark.usefixtures("restore_level")
@pytest.mark.parametrize("masters", ["delta", "param"])
@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("rule", sorted(HPARAMS))
def test_each_step_matches_a_float64_reference_with_the_same_rounding_bits(rule, path, masters):
    """masters "delta": the anchored master is delta, checked relative to |delta|; "param" (the
    master DeepSpeed owns): theta itself, relative to |theta|, with the pull reading theta - theta*."""
    anchored, head, opt = _compact_pair(rule, path, masters=masters)
    head.grad_dtype = None  # allow a bf16 gradient on the fp32 head (the kernel reads bf16 gradients)
    gen = torch.Generator().manual_seed(11)
    anchor = opt.state[anchored]["anchor"].double()
    for t in range(1, 26):
        anchored.grad = torch.randn(ANCHORED, generator=gen) * 10 ** (-t / 10)
        head.grad = torch.randn(HEAD, generator=gen).to(torch.bfloat16)
        before = {}
        for p in (anchored, head):
            s = opt.init_state(p)
            ref = Reference(rule, p.detach() if "delta" not in s else anchor + s["delta"].double(),
                            anchor if p is anchored else None, **HPARAMS[rule])
            ref.m, ref.v, ref.t = s["exp_avg"].double(), s["exp_avg_sq"].double(), t - 1
            old = s["delta"].double().clone() if "delta" in s else p.detach().double().clone()
            # the fp32 m' = beta1 m + (1 - beta1) g carries a few ulp of its terms (they may cancel)
            m_terms = 0.9 * ref.m.abs() + 0.1 * p.grad.double().abs()
            ref.step(p.grad)
            before[p] = (ref, old, m_terms)
        opt.step()
        for p, index_base in ((anchored, 0), (head, ANCHORED)):
            ref, old, m_terms = before[p]
            s = opt.state[p]
            if p is anchored and masters == "delta":
                assert "delta" in s
                got, want = s["delta"].double(), ref.theta - anchor
                # theta is written as theta* + delta, rounded once
                torch.testing.assert_close(p.detach(), (anchor + s["delta"].double()).float(), rtol=0, atol=0)
            else:
                assert "delta" not in s
                got, want = p.detach().double(), ref.theta
            change = (want - old).abs()
            # relative to |delta| (the master's own rounding) plus a few fp32 ulp of the step's change
            assert ((got - want).abs() <= 2.4e-7 * want.abs() + 4e-6 * change + 1e-30).all(), (t, p.numel())
            assert ((s["exp_avg"].double() - ref.m).abs() <= _bf16_ulp(ref.m) + 2.4e-7 * m_terms).all()
            bits = rounding_bits(SEED, t, index_base, p.numel())
            v_ref = stochastic_round_bf16(ref.v.float(), bits).double()
            same = s["exp_avg_sq"].double() == v_ref
            # the float64 v and the kernel's fp32 v round alike except within an fp32 ulp of a bf16 step
            assert same.float().mean() >= 0.99, (t, same.float().mean())
            assert ((s["exp_avg_sq"].double() - v_ref).abs() <= _bf16_ulp(ref.v)).all()


def test_the_kernel_copy_of_counter_rng_constants_is_the_owners():
    if not cpu_kernel.kernel_available():
        pytest.skip("C++ kernel not built")
    from ft_framework import _cpu_kernel

    assert _cpu_kernel.rng_constants() == (counter_rng.LOWBIAS32_MUL1, counter_rng.LOWBIAS32_MUL2)


@pytest.mark.usefixtures("restore_level")
@pytest.mark.parametrize("level", SIMD_LEVELS)
def test_kernel_rounding_bits_equal_counter_rng_bit_for_bit(level):
    level_or_skip(level)
    from ft_framework import _cpu_kernel

    cpu_kernel.set_simd_level(level)
    for seed, step in ((0, 1), (SEED, 2**33 + 5)):
        key = rounding_key(seed, step)
        # 2**32 - 5: a vector straddles the index's low word wrapping (its high word changes inside)
        for base in (0, 3, 2**32 - 5, 2**45 + 17):
            got = torch.tensor(_cpu_kernel.sr_bits(key, base, 77), dtype=torch.int64)
            torch.testing.assert_close(got, rounding_bits(seed, step, base, 77), rtol=0, atol=0)


def _compact_run(rule: str, path: str, steps: int = 30, **extra) -> list[torch.Tensor]:
    """delta (the weights again where the parameter is the master), m, v of the anchored parameter
    and the head's weights, m, v after `steps` steps."""
    anchored, head, opt = _compact_pair(rule, path, **extra)
    gen = torch.Generator().manual_seed(3)
    for t in range(steps):
        # Gradient scales from 1e-3 to 1e3: the moments cross many bf16 binades (and v's
        # rounding bits decide), so a one-ulp difference anywhere would show in the stored bits.
        anchored.grad = torch.randn(ANCHORED, generator=gen) * 10.0 ** ((t % 7) - 3)
        head.grad = torch.randn(HEAD, generator=gen)
        opt.step()
    a, h = opt.state[anchored], opt.state[head]
    return [a.get("delta", anchored.detach()), a["exp_avg"], a["exp_avg_sq"], anchored.detach(), head.detach(),
            h["exp_avg"], h["exp_avg_sq"]]


@pytest.mark.usefixtures("restore_level")
@pytest.mark.parametrize("masters", ["delta", "param"])
@pytest.mark.parametrize("path", ["torch", "avx2", "avx512"])
@pytest.mark.parametrize("rule", sorted(HPARAMS))
def test_every_simd_level_and_the_torch_path_equal_scalar_bit_for_bit(rule, path, masters):
    """The compact program uses only correctly rounded operations (no fused multiply-add, no
    reciprocal estimate; cpp/step_body.h, optim/torch_step.py), so every path stores the same bits,
    tails included (ANCHORED and HEAD leave tails at every vector width). Pre-step decay (bertadam
    with a pre-decay, prior_wd) and post-decay both run in this set; so do both masters of an
    anchored parameter (delta, or the parameter itself as under DeepSpeed)."""
    level_or_skip("scalar")
    want = _compact_run(rule, "scalar", masters=masters)
    if path != "torch":
        level_or_skip(path)
    got = _compact_run(rule, path, masters=masters)
    for name, g, w in zip(("delta", "m", "v", "theta", "head", "head m", "head v"), got, want):
        assert g.dtype == w.dtype, name
        assert torch.equal(g.view(torch.int16 if g.dtype == torch.bfloat16 else torch.int32),
                           w.view(torch.int16 if w.dtype == torch.bfloat16 else torch.int32)), (name, path)


@pytest.mark.parametrize("impl", ["torch", "cpu"])
def test_stochastic_rounding_of_v_escapes_the_round_to_nearest_ratchet(impl):
    """beta2 = 0.999, the gradient's RMS falls 10x over 3000 steps and stays 2000 more: v rounded to
    nearest cannot shrink ((1 - beta2) v is below half a bf16 step) and ends 17x too large; the
    compact state's v ends within 3% of the float64 reference."""
    if impl == "cpu" and not cpu_kernel.kernel_available():
        pytest.skip("C++ kernel not built")
    n, beta2, fall, hold = 2048, 0.999, 3000, 2000
    p = torch.nn.Parameter(torch.zeros(n))
    opt = build_optimizer("adamw", [{"params": [p]}], impl=impl, state_dtype="bfloat16", anchor_dtype="bfloat16",
                          lr=0.0, weight_decay=0.0, betas=(0.9, beta2), rounding_seed=SEED)
    gen = torch.Generator().manual_seed(0)
    v64 = torch.zeros(n, dtype=torch.float64)
    v_nearest = torch.zeros(n, dtype=torch.bfloat16)
    for t in range(fall + hold):
        g = torch.randn(n, generator=gen) * 10 ** (-min(t, fall) / fall)
        p.grad = g
        opt.step()
        v64 = beta2 * v64 + (1 - beta2) * g.double() ** 2
        v_nearest = (beta2 * v_nearest.float() + (1 - beta2) * g * g).to(torch.bfloat16)
    ratio_sr = opt.state[p]["exp_avg_sq"].double().mean() / v64.mean()
    ratio_nearest = v_nearest.double().mean() / v64.mean()
    assert abs(ratio_sr - 1) < 0.03, ratio_sr
    assert ratio_nearest > 5, ratio_nearest  # the criterion above fails round-to-nearest


def test_stochastic_rounding_is_unbiased_across_seeds():
    seeds, n = 512, 4096
    gen = torch.Generator().manual_seed(5)
    x = torch.rand(n, generator=gen, dtype=torch.float64).mul(3).exp().float()  # spans several binades
    total = torch.zeros(n, dtype=torch.float64)
    for seed in range(seeds):
        total += stochastic_round_bf16(x, rounding_bits(seed, 1, 0, n)).double()
    mean = total / seeds
    down = x.to(torch.bfloat16)
    down = torch.where(down.double() > x.double(), torch.nextafter(down, torch.zeros_like(down)), down).double()
    ulp = _bf16_ulp(x.double())
    prob_up = (x.double() - down) / ulp
    std_err = ulp * torch.sqrt(prob_up * (1 - prob_up) / seeds)
    z = (mean - x.double()) / std_err.clamp_min(ulp / seeds)
    assert z.abs().max() < 5.5, z.abs().max()
    assert abs(z.mean()) < 5 / n**0.5, z.mean()  # no bias in aggregate either


@pytest.mark.parametrize("impl", ["torch", "cpu"])
def test_checkpoint_round_trip_keeps_the_compact_state_and_refuses_fp32_to_bf16(impl):
    if impl == "cpu" and not cpu_kernel.kernel_available():
        pytest.skip("C++ kernel not built")
    anchored, head, opt = _compact_pair("recadam", "torch" if impl == "torch" else cpu_kernel.simd_level())
    for _ in range(3):
        anchored.grad, head.grad = torch.ones(ANCHORED), torch.ones(HEAD)
        opt.step()
    saved = opt.state_dict()
    anchored2, head2, opt2 = _compact_pair("recadam", "torch" if impl == "torch" else cpu_kernel.simd_level())
    opt2.load_state_dict(saved)
    for key in ("exp_avg", "exp_avg_sq", "delta", "anchor"):
        got, want = opt2.state[anchored2][key], opt.state[anchored][key]
        assert got.dtype == want.dtype and torch.equal(got, want), key
    assert opt2.state[anchored2]["exp_avg"].dtype == torch.bfloat16

    full = build_optimizer("recadam", [{"params": [anchored2], "anchors": [anchored2.detach().clone()]},
                                       {"params": [head2]}], impl=impl, **HPARAMS["recadam"])
    # bf16 moments widen exactly: a compact checkpoint resumes in fp32
    full.load_state_dict(saved)
    assert full.state[anchored2]["exp_avg"].dtype == torch.float32 and "delta" not in full.state[anchored2]
    with pytest.raises(UserError, match="not exact"):
        opt2.load_state_dict(full.state_dict())  # fp32 moments into bf16: refused


COMPACT_CONFIG = {
    "model": {"name_or_path": "some/model"}, "data": {"task": "rte"},
    "optimizer": {"hparams": {"lr": 2e-5}, "anchor_dtype": "bfloat16", "state_dtype": "bfloat16"},
    "schedule": {"warmup_ratio": 0.1}, "training": {"max_steps": 100},
}


@pytest.mark.parametrize("overrides, message", [
    ([], None),
    (["optimizer.anchor_dtype=float32"], "set optimizer.anchor_dtype: bfloat16 too"),
    (["strategy.offload_optimizer.overlap=false"], None),
    (["strategy.name=ddp"], None),
    (["strategy.name=fsdp"], None),
    (["strategy.name=fsdp", "strategy.fsdp.cpu_offload=true"], None),
    (["strategy.offload_optimizer.overlap=true"], None),
    (["strategy.name=deepspeed"], None),
    (["strategy.name=deepspeed", "strategy.deepspeed.zero_stage=0"], None),
    (["strategy.name=deepspeed", "strategy.deepspeed.zero_stage=1", "strategy.deepspeed.offload_optimizer=true"],
     None),
    (["strategy.name=deepspeed", "strategy.deepspeed.zero_stage=3"],
     r"optimizer.state_dtype bfloat16 is not built for DeepSpeed ZeRO-3 .*; valid: strategy.deepspeed.zero_stage 0, "
     r"1 or 2, strategy.name single, ddp or fsdp, or optimizer.state_dtype float32$"),
])
def test_config_refuses_what_the_compact_state_does_not_run_in_one_line(overrides, message):
    data = apply_overrides(COMPACT_CONFIG, overrides)
    if message is None:
        cfg = validate_config(data)
        assert cfg.optimizer.optimizer_kwargs()["state_dtype"] == "bfloat16"
        return
    with pytest.raises(ValueError, match=message):
        validate_config(data)


@pytest.mark.parametrize("impl", ["torch", "cpu"])
def test_step_tensors_equals_step_and_a_rollback_restores_the_state_bit_for_bit(impl):
    """The serial offload's per-tensor steps are step()'s, bit for bit; a non-finite gradient leaves
    its tensor untouched; a step taken with keep_undo rolls back to the state before it, bit for
    bit, and its redo equals the step; a step taken without it cannot be rolled back."""
    path = "torch" if impl == "torch" else (cpu_kernel.simd_level() if cpu_kernel.kernel_available() else None)
    if path is None:
        pytest.skip("C++ kernel not built")
    (a1, h1, whole), (a2, h2, split) = _compact_pair("recadam", path), _compact_pair("recadam", path)
    gen = torch.Generator().manual_seed(2)
    for _ in range(4):
        ga, gh = torch.randn(ANCHORED, generator=gen), torch.randn(HEAD, generator=gen)
        a1.grad, h1.grad = ga, gh
        whole.step()
        assert split.step_tensors([h2], [gh]) != [None] and split.step_tensors([a2], [ga]) != [None]
    for key in ("exp_avg", "exp_avg_sq", "delta"):
        assert torch.equal(whole.state[a1][key], split.state[a2][key]), key
    assert torch.equal(a1, a2) and torch.equal(h1, h2)
    before = a2.detach().clone()
    assert split.step_tensors([a2], [torch.full((ANCHORED,), float("nan"))]) == [None]
    assert torch.equal(a2, before)
    with pytest.raises(RuntimeError, match="without keep_undo"):
        split.rollback_tensors([a2], [ga], [None])

    def snapshot():
        return [x.clone() for x in (a2.detach(), h2.detach(), *(split.state[a2][k] for k in STATE_KEYS),
                                    *(split.state[h2][k] for k in STATE_KEYS if k != "delta"))]

    ga, gh = torch.randn(ANCHORED, generator=gen), torch.randn(HEAD, generator=gen)
    saved = snapshot()
    used = split.step_tensors([a2, h2], [ga, gh], keep_undo=True)
    assert not torch.equal(a2.detach(), saved[0])
    split.rollback_tensors([a2, h2], [ga, gh], used)
    for got, want in zip(snapshot(), saved):
        assert torch.equal(got, want)
    # The redo rounds with the same bits (the step count went back): it equals step().
    split.step_tensors([a2, h2], [ga, gh], keep_undo=True)
    a1.grad, h1.grad = ga, gh
    whole.step()
    assert torch.equal(a1, a2) and torch.equal(h1, h2)
    for key in STATE_KEYS:
        assert torch.equal(whole.state[a1][key], split.state[a2][key]), key


def test_compact_kernel_is_identical_under_any_thread_count():
    if not cpu_kernel.kernel_available():
        pytest.skip("C++ kernel not built")
    from ft_framework.optim.coefficients import StepCoefficients

    n = (1 << 15) + 33  # over the parallel threshold, with a tail
    gen = torch.Generator().manual_seed(0)
    anchor = (torch.randn(n, generator=gen) * 0.02).to(torch.bfloat16)
    base = (torch.randn(n, generator=gen) * 1e-3, torch.randn(n, generator=gen),
            torch.randn(n, generator=gen).to(torch.bfloat16), torch.rand(n, generator=gen).to(torch.bfloat16))
    c = StepCoefficients(beta1=0.9, beta2=0.999, eps=1e-6, step_size=1e-3, post_pull=0.05, post_decay=1e-4)
    results = []
    for threads in (1, 2, 3, 7):
        delta, g, m, v = (t.clone() for t in base)
        p = torch.empty(n)
        cpu_kernel.fused_step_compact(p, g, m, v, delta, anchor, c, rounding_key(SEED, 5), 12345, num_threads=threads)
        results.append((p, delta, m, v))
    for other in results[1:]:
        for a, b in zip(results[0], other):
            assert torch.equal(a, b)


def _train_compact(impl: str, strategy, max_grad_norm: float | None = None, steps: int = 5):
    """A small MLP with theta* on all but its last weight, RecAdam in the compact state, `steps` steps."""
    from torch import nn

    from ft_framework.optim.groups import build_param_groups

    if impl == "cpu" and not cpu_kernel.kernel_available():
        pytest.skip("C++ kernel not built")
    torch.manual_seed(5)
    model = nn.Sequential(nn.Linear(6, 33), nn.Tanh(), nn.Linear(33, 17), nn.Tanh(), nn.Linear(17, 2))
    pretrained = {n: p.detach() + 0.05 for n, p in model.named_parameters() if n != "4.weight"}
    strategy.setup(model, lambda m: build_optimizer(
        "recadam", build_param_groups(m, pretrained, lr=1e-2, weight_decay=0.01, attach_anchors=False),
        impl=impl, state_dtype="bfloat16", anchor_dtype="bfloat16", rounding_seed=SEED, anneal_k=0.5,
        anneal_t0=3, pretrain_cof=5.0), anchors=pretrained)
    gen = torch.Generator().manual_seed(9)
    for _ in range(steps):
        x, y = torch.randn(16, 6, generator=gen), torch.randn(16, 2, generator=gen)
        strategy.backward(torch.nn.functional.mse_loss(strategy.forward({"input": x}), y))
        strategy.clip_and_step(max_grad_norm)
    strategy.close()
    return strategy


def _assert_same_compact_state(a, b) -> None:
    for p, q in zip(a.model.parameters(), b.model.parameters()):
        assert torch.equal(p, q)
        for key in STATE_KEYS:
            if key in b.optimizer.state[q]:
                assert torch.equal(a.optimizer.state[p][key], b.optimizer.state[q][key]), key
    assert any("delta" in s for s in b.optimizer.state.values())


@pytest.mark.parametrize("impl", ["torch", "cpu"])
def test_serial_offload_with_the_compact_state_equals_the_single_device_strategy(impl):
    from ft_framework.strategies import OffloadedSingleDeviceStrategy, SingleDeviceStrategy

    # No clipping: the two strategies clip with different (equally exact) ops.
    _assert_same_compact_state(_train_compact(impl, OffloadedSingleDeviceStrategy("fp32", "cpu")),
                               _train_compact(impl, SingleDeviceStrategy("fp32", "cpu")))


@pytest.mark.parametrize("impl", ["torch", "cpu"])
@pytest.mark.parametrize("max_grad_norm, rollbacks", [(None, 0), (1e-3, 1)])
def test_overlapped_offload_with_the_compact_state_equals_the_serial_offload(impl, max_grad_norm, rollbacks):
    """The overlapped offload steps each bucket speculatively during backward, keeping undo copies.
    With no clipping every speculative step stands. With a tiny max_grad_norm every step clips: the
    first step's speculative steps are rolled back from their copies and redone on the clipped
    gradients, and the offload then stops speculating while steps clip (later steps run after
    backward). Either way the run equals the serial offload's bit for bit."""
    from ft_framework.strategies import OffloadedSingleDeviceStrategy

    serial = _train_compact(impl, OffloadedSingleDeviceStrategy("fp32", "cpu"), max_grad_norm)
    overlap = _train_compact(impl, OffloadedSingleDeviceStrategy("fp32", "cpu", overlap=True, worker_threads=1,
                                                                 bucket_mb=1e-3), max_grad_norm)
    assert overlap.train_metrics()["offload_rollbacks"] == rollbacks
    _assert_same_compact_state(overlap, serial)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_compact_state_on_cuda_rounds_with_the_same_bits_as_on_cpu():
    results = []
    for device in ("cpu", "cuda"):
        gen = torch.Generator().manual_seed(7)
        theta0 = torch.randn(ANCHORED, generator=gen) * 0.05
        p = torch.nn.Parameter(theta0.clone().to(device))
        opt = build_optimizer("recadam", [{"params": [p], "anchors": [theta0.to(device)]}], impl="torch",
                              state_dtype="bfloat16", anchor_dtype="bfloat16", rounding_seed=SEED, **HPARAMS["recadam"])
        for _ in range(10):
            p.grad = torch.randn(ANCHORED, generator=gen).to(device)
            opt.step()
        s = opt.state[p]
        results.append([s[k].cpu() for k in ("delta", "exp_avg", "exp_avg_sq")])
    # Every operation of the compact program is correctly rounded on both devices (optim/torch_step.py).
    for name, cpu, cuda in zip(("delta", "exp_avg", "exp_avg_sq"), *results):
        assert torch.equal(cuda, cpu), name
