"""The device-lean offload (strategy.offload_optimizer with training.precision bf16) on a tiny BERT:
the device holds the bf16 model and at most two gradients in flight (counted tensor by tensor on a
CPU device, where the same code path runs with host copies), micro-batches sum in fp32 on the host
(or in bf16 on the device when asked), and 20 steps end bit for bit where DeepSpeed ZeRO-2 with
optimizer offload ends with our optimizer (one rank, DS_ACCELERATOR=cpu)."""

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

HERE = Path(__file__).parent
sys.path.insert(0, str(HERE))
from lean_offload_common import batch, make_model_and_anchors, make_optimizer, train  # noqa: E402

from ft_framework.config.schema import StrategyConfig  # noqa: E402
from ft_framework.distributed.rendezvous import free_port  # noqa: E402
from ft_framework.errors import UserError  # noqa: E402
from ft_framework.strategies import OffloadedSingleDeviceStrategy  # noqa: E402
from ft_framework.strategies.offload import _bucket_norms, _total_norm  # noqa: E402
from ft_framework.strategies.offload_transport import MAX_GRADS_IN_FLIGHT  # noqa: E402

STATES = {"fp32_state": {}, "compact_state": {"state_dtype": "bfloat16"}}


def _lean(overlap: bool, state: str = "fp32_state", accumulate: str = "host"):
    strategy = OffloadedSingleDeviceStrategy("bf16", "cpu", overlap=overlap, worker_threads=1, bucket_mb=0.001,
                                             accumulate=accumulate)
    model, anchors = make_model_and_anchors()
    strategy.setup(model, lambda m: make_optimizer(m, anchors, **STATES[state]), anchors=anchors)
    return strategy


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


@pytest.mark.parametrize("state", list(STATES))
@pytest.mark.parametrize("overlap", [False, True], ids=["serial", "overlapped"])
def test_the_device_holds_the_bf16_model_and_at_most_two_gradients(overlap, state):
    strategy = _lean(overlap, state)
    model = strategy.unwrapped_model()
    numel = sum(p.numel() for p in model.parameters())
    largest_grad = max(p.numel() for p in model.parameters()) * 2
    seen = {"autocast": [], "grad_bytes": [], "hooks": 0}
    model.register_forward_pre_hook(lambda m, a: seen["autocast"].append(torch.is_autocast_enabled("cpu")))

    def spy(_p):  # runs after the strategy's hook on the same parameter (registered later)
        seen["hooks"] += 1
        seen["grad_bytes"].append(sum(_nbytes(t) for role, _, t in strategy.device_tensors() if role == "gradient"))

    for p in model.parameters():
        p.register_post_accumulate_grad_hook(spy)
    train(strategy, steps=3)
    strategy.close()
    tensors = strategy.device_tensors()
    weights = [t for role, _, t in tensors if role == "weight"]
    # No fp32 copy of any parameter on the device: every weight and floating buffer is bf16, the
    # weights are exactly 2 B/param, and no gradient is left there between steps.
    assert {t.dtype for t in weights} == {torch.bfloat16}
    assert sum(_nbytes(t) for t in weights) == 2 * numel
    assert all(not t.is_floating_point() or t.dtype == torch.bfloat16 for role, _, t in tensors if role == "buffer")
    assert not [n for role, n, _ in tensors if role == "gradient"]
    # The masters, their moments and theta* are the optimizer's, in host memory, and none is a
    # device tensor. With the compact state an anchored master keeps no fp32 weight: its data is its
    # bf16 landing buffer (the bf16 weight form); the new head keeps its fp32 master.
    device_ids = {id(t) for _, _, t in tensors} | {t.untyped_storage().data_ptr() for _, _, t in tensors}
    opt = strategy.optimizer
    for m in (p for g in opt.param_groups for p in g["params"]):
        assert m.untyped_storage().data_ptr() not in device_ids
        if state == "compact_state" and "anchor" in opt.state[m]:
            assert opt.has_bf16_weight(m) and m.dtype == torch.bfloat16
            assert m.data_ptr() == strategy._transport.landing[id(m)].data_ptr()
        else:
            assert m.dtype == torch.float32 and not opt.has_bf16_weight(m)
    # No autocast, and the gradients leave as they arrive: never more than two on the device.
    assert seen["autocast"] == [False] * 3 and seen["hooks"] == 3 * len(weights)
    assert max(seen["grad_bytes"]) <= MAX_GRADS_IN_FLIGHT * largest_grad


def _reference_accumulation(accumulate: str, steps: int = 3, accum: int = 2, state: str = "fp32_state",
                            max_grad_norm: float | None = None):
    """The same run written out by hand: a bf16 model, each micro-batch's gradient summed in fp32
    (host) or by autograd in bf16 (device), the optimizer stepping fp32 masters with the sum (clipped
    as clip_grad_norm_ clips: fp32 sums in place, bf16 gradients into fp32 copies) and the bf16
    model copying the masters, rounded. With the compact state the masters are fp32 weights written
    as theta* + delta (the fp32-weight form), whose rounding the bf16 weight form must store."""
    model, anchors = make_model_and_anchors()
    optimizer = make_optimizer(model, anchors, **STATES[state])
    for name, p in model.named_parameters():
        if name in anchors:
            optimizer.set_anchor(p, anchors[name])
    masters = [p for g in optimizer.param_groups for p in g["params"]]
    device_model, _ = make_model_and_anchors()
    device_model = device_model.bfloat16()
    device_params = dict(device_model.named_parameters())
    names = {id(p): n for n, p in model.named_parameters()}
    model_order = {n: i for i, n in enumerate(device_params)}
    norms = []
    for step in range(steps):
        full = batch(step)
        sums = {}
        for micro in range(accum):
            part = {k: v[micro::accum] for k, v in full.items()}
            loss = device_model(**part).loss
            (loss / accum if accum > 1 else loss).backward()
            if accumulate == "host" and accum > 1:
                for n, p in device_params.items():
                    sums[n] = p.grad.float() if n not in sums else sums[n].add_(p.grad)
                    p.grad = None
        if accumulate == "host" and accum > 1:
            grads = [sums[names[id(m)]] for m in masters]
        else:
            grads = [device_params[names[id(m)]].grad for m in masters]
        # summed in the model's order, as the strategy sums the norms
        in_model_order = sorted(range(len(masters)), key=lambda i: model_order[names[id(masters[i])]])
        norm = _total_norm(_bucket_norms([grads[i] for i in in_model_order]))
        coef = torch.clamp(max_grad_norm / (norm + 1e-6), max=1.0) if max_grad_norm else None
        if coef is not None and bool(coef < 1.0):
            exact = [g for g in grads if g.dtype == torch.float32]
            if exact:
                torch._foreach_mul_(exact, coef)
            grads = [g if g.dtype == torch.float32 else g.float().mul_(coef) for g in grads]
        norms.append(float(norm))
        optimizer.step_tensors(masters, grads, known_finite=True)
        with torch.no_grad():
            for m in masters:
                device_params[names[id(m)]].copy_(m)
                device_params[names[id(m)]].grad = None
    return device_model, dict(zip([names[id(m)] for m in masters], masters)), optimizer, norms


@pytest.mark.parametrize("accumulate", ["host", "device"])
def test_micro_batches_accumulate_where_configured(accumulate):
    """Two micro-batches per step: with accumulate=host the device keeps no gradient between them
    and the step reads their fp32 sum; with accumulate=device autograd sums them in bf16 there.
    Each equals the run written out by hand, bit for bit."""
    strategy = _lean(overlap=True, accumulate=accumulate)
    held = []
    original = strategy.backward

    def backward(loss, last_micro_batch=True):
        original(loss, last_micro_batch)
        if not last_micro_batch:
            held.append(sum(p.grad is not None for p in strategy.model.parameters()))

    strategy.backward = backward
    train(strategy, steps=3, accum=2)
    strategy.close()
    n_params = len(list(strategy.model.parameters()))
    assert held == ([0] * 3 if accumulate == "host" else [n_params] * 3)
    want_model, want_masters, _, _ = _reference_accumulation(accumulate)
    for (name, p), q in zip(strategy.model.named_parameters(), want_model.parameters()):
        assert torch.equal(p, q), name
    for name, m in strategy._named_masters():
        assert torch.equal(m, want_masters[name]), name


@pytest.mark.parametrize("max_grad_norm", [None, 0.05], ids=["unclipped", "clipped"])
@pytest.mark.parametrize("accum", [1, 2])
@pytest.mark.parametrize("overlap", [False, True], ids=["serial", "overlapped"])
def test_the_compact_state_writes_its_bf16_weights_in_place_as_the_fp32_weight_form_rounds_them(
        overlap, accum, max_grad_norm):
    """The bf16 weight form: the step reads each gradient in its landing buffer (or the fp32 sum
    of the micro-batches) and writes the new bf16 weight there, with no fp32 weight of an anchored
    parameter; the bf16 model, delta, m, v and the head's master are the bits of the same run
    written out by hand with fp32 masters rounded to bf16 after each step, clipped or not. The
    overlapped path does not speculate with it (nothing to roll back: the gradient is overwritten)."""
    strategy = _lean(overlap, "compact_state")
    train(strategy, steps=4, accum=accum, max_grad_norm=max_grad_norm)
    strategy.close()
    assert strategy.train_metrics()["offload_speculated_steps"] == 0
    assert strategy.train_metrics()["offload_rollbacks"] == 0
    want_model, want_masters, want_opt, norms = _reference_accumulation(
        "host", steps=4, accum=accum, state="compact_state", max_grad_norm=max_grad_norm)
    if max_grad_norm is not None:
        assert all(n > max_grad_norm for n in norms)  # every step clipped
    for (name, p), q in zip(strategy.model.named_parameters(), want_model.parameters()):
        assert torch.equal(p.view(torch.int16), q.view(torch.int16)), name
    opt = strategy.optimizer
    for name, m in strategy._named_masters():
        want = want_masters[name]
        for key in ("exp_avg", "exp_avg_sq", "delta"):
            if key in want_opt.state[want]:
                assert torch.equal(opt.state[m][key], want_opt.state[want][key]), (name, key)
        assert opt.has_bf16_weight(m) == ("delta" in want_opt.state[want]), name
        if not opt.has_bf16_weight(m):
            assert torch.equal(m, want), name  # the head's fp32 master


def test_fp32_precision_keeps_the_fp32_offload_and_a_bad_accumulate_is_one_line():
    fp32 = OffloadedSingleDeviceStrategy("fp32", "cpu")
    model, anchors = make_model_and_anchors()
    fp32.setup(model, lambda m: make_optimizer(m, anchors), anchors=anchors)
    # On a CPU the fp32 masters are the model's own parameters (nothing copied), as before.
    assert not fp32.lean and all(p.dtype == torch.float32 for p in fp32.model.parameters())
    assert all(dev is m for dev, m in fp32._pairs)
    with pytest.raises(UserError, match="accumulate must be one of host, device, got 'gpu'"):
        OffloadedSingleDeviceStrategy("bf16", "cpu", accumulate="gpu")
    with pytest.raises(ValueError, match="accumulate"):
        StrategyConfig(name="single", offload_optimizer={"accumulate": "gpu"})
    assert StrategyConfig(name="single", offload_optimizer={}).offload_optimizer.accumulate == "host"


@pytest.fixture(scope="module")
def deepspeed_run(tmp_path_factory):
    pytest.importorskip("deepspeed")
    out = tmp_path_factory.mktemp("lean_ds") / "zero2_offload.pt"
    env = {**os.environ, "OMP_NUM_THREADS": "1", "DS_ACCELERATOR": "cpu", "RANK": "0", "LOCAL_RANK": "0",
           "WORLD_SIZE": "1", "LOCAL_WORLD_SIZE": "1", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port())}
    run = subprocess.run([sys.executable, str(HERE / "lean_offload_ds_worker.py"), str(out)], env=env,
                         capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, (run.stdout + run.stderr)[-4000:]
    return torch.load(out, weights_only=True)


@pytest.mark.slow
@pytest.mark.parametrize("overlap", [False, True], ids=["serial", "overlapped"])
def test_lean_offload_ends_bit_for_bit_where_deepspeed_zero2_offload_ends(deepspeed_run, overlap):
    """20 bf16 steps of RecAdam with anchors: DeepSpeed's bf16 model, its fp32 masters from that
    model, bf16 gradients copied into fp32 host partitions, our kernel stepping them, the new
    weights copied back rounded to bf16. Ours performs the same operations in the same order per
    element, so weights, masters and moments are the same bits. One thread in both processes:
    LayerNorm's backward reduces over the batch in an order that depends on the thread count.
    The gradient norms are summed in another order (DeepSpeed per partition), so they agree to
    float rounding only; no clipping here, so nothing reads them."""
    ds = deepspeed_run
    assert ds["partition_devices"] == ["cpu"] and ds["impl"] == "cpu"
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        strategy = _lean(overlap)
        norms = train(strategy)
        strategy.close()
    finally:
        torch.set_num_threads(threads)
    assert norms == pytest.approx(ds["norms"], rel=1e-6, abs=0)
    for name, p in strategy.model.named_parameters():
        assert p.dtype == ds["weights"][name].dtype == torch.bfloat16
        assert torch.equal(p, ds["weights"][name]), name
    for name, m in strategy._named_masters():
        state = strategy.optimizer.state[m]
        assert torch.equal(m, ds["masters"][name]), name
        assert torch.equal(state["exp_avg"], ds["exp_avg"][name]), name
        assert torch.equal(state["exp_avg_sq"], ds["exp_avg_sq"][name]), name
