"""The offloaded single-device strategy (strategy.offload_optimizer): the step overlapped with
backward (speculative, rolled back when clipping fires or a gradient is not finite) ends where the
serial offloaded step ends, within 1e-6 (relative), for every registered rule; the config picks
it (tests/recipes/test_offload_run.py runs it in the trainer)."""

from types import SimpleNamespace

import pytest
import torch
from pydantic import ValidationError
from torch import nn

from ft_framework.config.errors import format_validation_error
from ft_framework.config.schema import StrategyConfig
from ft_framework.optim import available_optimizers, build_optimizer
from ft_framework.optim.base import IMPORTANCE
from ft_framework.optim.registry import optimizer_factory
from ft_framework.optim.groups import build_param_groups
from ft_framework.errors import UserError
from ft_framework.strategies import OffloadedSingleDeviceStrategy, SingleDeviceStrategy, build_strategy
from ft_framework.strategies.offload import DEFAULT_BUCKET_MB

HPARAMS = {
    "recadam": dict(lr=1e-2, weight_decay=0.01, anneal_fun="sigmoid", anneal_k=0.5, anneal_t0=3,
                    pretrain_cof=5.0),
    "adamw": dict(lr=1e-2, weight_decay=0.05),
    "bertadam": dict(lr=1e-2, weight_decay=0.05),
    "prior_wd": dict(lr=1e-2, weight_decay=0.5),
    "ewc": dict(lr=1e-2, weight_decay=0.05, ewc_lambda=20.0),
}
# Per step, the loss multiplier (the gradient norm scales with it). With max_grad_norm 1, steps 0
# and 6 clip and step 3 gets a NaN in one tensor's gradient (skipped). A step after one that
# clipped or was skipped does not speculate (1, 4); the others do, so 0, 3 and 6 roll back.
LOSS_SCALES = [3.0, 0.2, 0.3, 0.2, 0.3, 0.2, 2.5]
NAN_STEP = 3
CLIPPED = [0, 6]
MAX_NORM = 1.0


def _close(actual, expected, what, rel=1e-6):
    """Element by element: |actual - expected| <= rel * (|expected| + max |expected|)."""
    scale = expected.abs().max().clamp_min(1e-30).double()
    err = (actual.double() - expected.double()).abs()
    assert bool((err <= rel * (expected.double().abs() + scale)).all()), f"{what}: max error {float(err.max())}"


def _model():
    torch.manual_seed(5)
    return nn.Sequential(nn.Linear(6, 33), nn.Tanh(), nn.Linear(33, 17), nn.Tanh(), nn.Linear(17, 2))


def _train(rule, strategy, steps=len(LOSS_SCALES), scales=LOSS_SCALES, nan_step=NAN_STEP, max_norm=MAX_NORM,
           importance: bool | None = None, **optimizer_kw):
    model = _model()
    pretrained = {n: p.detach() + 0.05 for n, p in model.named_parameters() if n != "4.weight"}
    hparams = {**HPARAMS.get(rule, dict(lr=1e-2)), **optimizer_kw}
    group_hparams = dict(lr=hparams.pop("lr"), weight_decay=hparams.pop("weight_decay", 0.0))
    strategy.setup(model, lambda m: build_optimizer(
        rule, build_param_groups(m, pretrained, **group_hparams, no_decay_bias_and_norm=False, attach_anchors=False),
        impl="auto", **hparams), anchors=pretrained)
    if importance is None:  # a rule that needs F~ (EWC) always has one
        importance = getattr(optimizer_factory(rule), "needs_importance", False)
    if importance:  # F~ in every anchored state, every fifth element so large that its pull lands on theta*
        gen = torch.Generator().manual_seed(4)
        for group in strategy.optimizer.param_groups:
            for q in group["params"]:
                if "anchor" in strategy.optimizer.state[q]:
                    f = torch.rand(q.shape, generator=gen) * 2
                    f.view(-1)[::5] = 1.0e6
                    strategy.optimizer.state[q][IMPORTANCE] = f.bfloat16()
    gen = torch.Generator().manual_seed(9)
    norms = []
    for step in range(steps):
        x, y = torch.randn(16, 6, generator=gen), torch.randn(16, 2, generator=gen)
        loss = scales[step] * nn.functional.mse_loss(strategy.forward({"input": x}), y)
        handle = None
        if step == nan_step:  # one tensor's gradient turns NaN, the others stay finite
            handle = strategy.model[2].weight.register_hook(lambda g: g.index_fill(1, torch.tensor([3]), float("nan")))
        strategy.backward(loss)
        if handle is not None:
            handle.remove()
        norms.append(strategy.clip_and_step(max_norm))
    strategy.close()
    return strategy, norms



def _forward_kw(self, batch):
    # The model's dtype: bf16 under the device-lean offload (which runs without autocast).
    return self.model(batch["input"].to(next(self.model.parameters()).dtype))


@pytest.fixture(autouse=True)
def _keyword_forward(monkeypatch):
    # The strategies call model(**batch); the test model takes one tensor.
    for cls in (SingleDeviceStrategy, OffloadedSingleDeviceStrategy):
        monkeypatch.setattr(cls, "forward", _forward_kw)


# Hand-offs to the worker: one per tensor, a few tensors each (the test model's tensors hold
# 8 B to 792 B of gradient), and one for all of them at the end of backward (the default here).
BUCKETS_MB = {"per_tensor": 1e-9, "a_few_tensors": 0.0005, "one_for_all": 4.0}


@pytest.mark.parametrize("rule", ["recadam", "prior_wd", "ewc"])
def test_overlapped_equals_serial_with_an_importance_that_pulls_elements_onto_theta_star(rule):
    """A pull weighted by F~ that puts elements onto theta* has no inverse: the overlapped offload's
    speculative steps restore those tensors from copies when clipping fires or a gradient is not
    finite, and end where the serial offload does."""
    serial, serial_norms = _train(rule, OffloadedSingleDeviceStrategy("fp32", "cpu", overlap=False), importance=True)
    overlap, norms = _train(rule, OffloadedSingleDeviceStrategy("fp32", "cpu", overlap=True, worker_threads=1),
                            importance=True)
    assert overlap.rollbacks == 3 and overlap.skipped_steps == serial.skipped_steps == 1
    torch.testing.assert_close(torch.tensor(norms), torch.tensor(serial_norms), rtol=1e-6, atol=0, equal_nan=True)
    for (name, p), q in zip(overlap.model.named_parameters(), serial.model.parameters()):
        _close(p.detach(), q.detach(), f"{rule} {name}")
        s, r = overlap.optimizer.state[p], serial.optimizer.state[q]
        assert set(s) == set(r) and float(s["step"]) == float(r["step"]) == len(LOSS_SCALES) - 1
        for key in ("exp_avg", "exp_avg_sq"):
            _close(s[key], r[key], f"{rule} {name} {key}")


@pytest.mark.parametrize("bucket", list(BUCKETS_MB))
@pytest.mark.parametrize("rule", available_optimizers())
def test_overlapped_equals_serial_with_clipping_and_a_nan_step(rule, bucket):
    serial, serial_norms = _train(rule, OffloadedSingleDeviceStrategy("fp32", "cpu", overlap=False))
    strategy = OffloadedSingleDeviceStrategy("fp32", "cpu", overlap=True, worker_threads=1, bucket_mb=BUCKETS_MB[bucket])
    sizes = []
    hand_over = strategy._hand_over
    strategy._hand_over = lambda: (sizes.append(len(strategy._bucket)), hand_over())[1]
    overlap, norms = _train(rule, strategy)
    per_backward = [n for n in sizes if n]  # the end-of-backward call finds an empty bucket after a full one
    tensors = len(list(overlap.model.parameters()))
    assert sum(per_backward) == tensors * len(LOSS_SCALES)
    expected = {"per_tensor": {1}, "one_for_all": {tensors}}.get(bucket)
    assert set(per_backward) == expected if expected else 1 < len(per_backward) / len(LOSS_SCALES) < tensors
    fired = [i for i, n in enumerate(serial_norms) if n > MAX_NORM]
    assert fired == CLIPPED and not torch.isfinite(torch.tensor(serial_norms[NAN_STEP]))
    assert overlap.rollbacks == 3 and overlap.skipped_steps == serial.skipped_steps == 1
    assert serial.rollbacks == 0
    # steps 0, 2, 3, 5 and 6 speculate (none after the clip at 0 or the NaN at 3); 0, 3 and 6 roll back
    assert overlap.train_metrics() == {"offload_rollbacks": 3, "offload_skipped_steps": 1, "offload_speculated_steps": 5}
    # The first step's norm is the same bits; later ones see weights a rollback moved by a few ulp.
    assert norms[0] == serial_norms[0]
    torch.testing.assert_close(torch.tensor(norms), torch.tensor(serial_norms), rtol=1e-6, atol=0, equal_nan=True)
    for (name, p), q in zip(overlap.model.named_parameters(), serial.model.parameters()):
        _close(p.detach(), q.detach(), f"{rule} {name}")
        s, r = overlap.optimizer.state[p], serial.optimizer.state[q]
        assert set(s) == set(r) and float(s["step"]) == float(r["step"]) == len(LOSS_SCALES) - 1
        for key in ("exp_avg", "exp_avg_sq", "anchor"):
            if key in r:
                _close(s[key], r[key], f"{rule} {name} {key}")


@pytest.mark.parametrize("bucket", list(BUCKETS_MB))
def test_overlapped_equals_serial_bit_for_bit_when_every_step_is_kept(bucket):
    """No clipping and no NaN: every speculative step stands, and each tensor's step is the
    serial step's element program on the same gradient and coefficients, however the tensors were
    bucketed: the same bits, with the same norms."""
    scales = [0.2, 0.3, 0.25, 0.2]
    for rule in available_optimizers():
        serial, serial_norms = _train(rule, OffloadedSingleDeviceStrategy("fp32", "cpu", overlap=False),
                                      steps=len(scales), scales=scales, nan_step=None)
        overlap, norms = _train(rule, OffloadedSingleDeviceStrategy("fp32", "cpu", overlap=True, worker_threads=1,
                                                                    bucket_mb=BUCKETS_MB[bucket]),
                                steps=len(scales), scales=scales, nan_step=None)
        assert max(serial_norms) < MAX_NORM and norms == serial_norms
        assert overlap.rollbacks == overlap.skipped_steps == 0
        for (name, p), q in zip(overlap.model.named_parameters(), serial.model.parameters()):
            assert torch.equal(p, q), f"{rule} {name}"
            s, r = overlap.optimizer.state[p], serial.optimizer.state[q]
            assert set(s) == set(r) and float(s["step"]) == float(r["step"]) == len(scales)
            for key in ("exp_avg", "exp_avg_sq", "anchor"):
                if key in r:
                    assert torch.equal(s[key], r[key]), f"{rule} {name} {key}"


def test_serial_offload_equals_the_single_device_strategy():
    steps = NAN_STEP  # the plain strategy steps with NaN; up to there they must agree bit for bit
    serial, _ = _train("recadam", OffloadedSingleDeviceStrategy("fp32", "cpu"), steps=steps)
    plain, _ = _train("recadam", SingleDeviceStrategy("fp32", "cpu"), steps=steps)
    for p, q in zip(serial.model.parameters(), plain.model.parameters()):
        assert torch.equal(p, q)


def test_config_selects_and_checks_the_offloaded_strategy():
    training = load_config_defaults_training()
    cfg = StrategyConfig(name="single", offload_optimizer={"overlap": True, "worker_threads": 1})
    strategy = build_strategy(cfg, training)
    assert isinstance(strategy, OffloadedSingleDeviceStrategy) and strategy.overlap and strategy.worker_threads == 1
    assert type(build_strategy(StrategyConfig(name="single"), training)) is SingleDeviceStrategy
    with pytest.raises(ValueError, match="offload_optimizer is read only when strategy.name is 'single'"):
        StrategyConfig(name="ddp", offload_optimizer={"overlap": True})
    with pytest.raises(ValueError, match="overlaps"):
        StrategyConfig(name="single", offload_optimizer={"overlaps": True})
    cfg = StrategyConfig(name="single", offload_optimizer={"overlap": True, "bucket_mb": 0.5})
    assert build_strategy(cfg, training).bucket_bytes == 2**19
    assert StrategyConfig(name="single", offload_optimizer={}).offload_optimizer.bucket_mb == DEFAULT_BUCKET_MB
    # The user's message names the key, the value and what is valid.
    for bad, valid in ((0, "greater than 0"), (-1, "greater than 0"), ("big", "a valid number")):
        with pytest.raises(ValidationError) as info:
            StrategyConfig(name="single", offload_optimizer={"bucket_mb": bad})
        message = format_validation_error(info.value, "")
        assert f"offload_optimizer.bucket_mb: Input should be {valid}" in message, message
        assert f"(got {bad!r})" in message, message
    with pytest.raises(UserError, match="bucket_mb must be > 0, got -1"):
        OffloadedSingleDeviceStrategy("fp32", "cpu", overlap=True, bucket_mb=-1)


def load_config_defaults_training():
    return SimpleNamespace(precision="fp32", device="cpu")


def test_an_lr_set_after_backward_redoes_the_speculative_step():
    """The speculative step ran with the lr of backward's time; a schedule (or the user) that
    sets another before clip_and_step gets the serial result: the step is rolled back and redone."""
    def train(strategy):
        model = _model()
        anchors = {n: p.detach() + 0.05 for n, p in model.named_parameters()}
        strategy.setup(model, lambda m: build_optimizer(
            "recadam", build_param_groups(m, anchors, lr=1e-2, weight_decay=0.01, no_decay_bias_and_norm=False,
                                          attach_anchors=False), impl="cpu", anneal_fun="sigmoid", anneal_k=0.5,
            anneal_t0=3, pretrain_cof=5.0), anchors=anchors)
        gen = torch.Generator().manual_seed(9)
        for step in range(3):
            x, y = torch.randn(16, 6, generator=gen), torch.randn(16, 2, generator=gen)
            strategy.backward(0.2 * nn.functional.mse_loss(strategy.forward({"input": x}), y))
            if step == 1:
                if strategy.overlap:
                    strategy._queue.join()  # every speculative step has run, with the old lr
                for group in strategy.optimizer.param_groups:
                    group["lr"] = 3e-3
            strategy.clip_and_step(None)
        strategy.close()
        return strategy

    serial = train(OffloadedSingleDeviceStrategy("fp32", "cpu", overlap=False))
    overlap = train(OffloadedSingleDeviceStrategy("fp32", "cpu", overlap=True, worker_threads=1, bucket_mb=0.0005))
    assert overlap.rollbacks == 1 and overlap.skipped_steps == 0
    for (name, p), q in zip(overlap.model.named_parameters(), serial.model.parameters()):
        _close(p.detach(), q.detach(), name)


@pytest.mark.parametrize("state_dtype", ["float32", "bfloat16"])
def test_lean_overlapped_equals_serial_with_clipping_and_a_nan_step(state_dtype):
    """bf16: the device-lean offload (a bf16 model, gradients moved to host memory as they arrive)
    rolls back and redoes as the fp32 path does, and ends where its serial path ends: the bf16
    weights bit for bit, the fp32 masters within 1e-6. With the compact state (the bf16 weight form)
    it does not speculate, so nothing is rolled back and it ends on the serial path's bits."""
    compact = state_dtype == "bfloat16"
    extra = dict(state_dtype="bfloat16", anchor_dtype="bfloat16") if compact else {}
    serial, serial_norms = _train("recadam", OffloadedSingleDeviceStrategy("bf16", "cpu"), **extra)
    overlap, norms = _train("recadam", OffloadedSingleDeviceStrategy("bf16", "cpu", overlap=True, worker_threads=1,
                                                                     bucket_mb=0.0005), **extra)
    assert overlap.lean and serial.lean and overlap.bf16_weights == serial.bf16_weights == compact
    assert overlap.rollbacks == (0 if compact else 3) and overlap.skipped_steps == serial.skipped_steps == 1
    assert (overlap.speculated_steps == 0) == compact
    torch.testing.assert_close(torch.tensor(norms), torch.tensor(serial_norms), rtol=1e-6, atol=0, equal_nan=True)
    for (name, p), q in zip(overlap.model.named_parameters(), serial.model.parameters()):
        assert p.dtype == torch.bfloat16 and torch.equal(p, q), name
    for (name, m), (_, r) in zip(overlap._named_masters(), serial._named_masters()):
        if compact and overlap.optimizer.has_bf16_weight(m):
            for key in ("delta", "exp_avg", "exp_avg_sq"):
                assert torch.equal(overlap.optimizer.state[m][key], serial.optimizer.state[r][key]), (name, key)
            continue
        assert m.dtype == torch.float32
        _close(m.detach(), r.detach(), name)
