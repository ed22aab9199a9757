"""What the offload tells about itself and the settings of its gradient transport (issue 41):

- how many steps speculated during backward (`offload_speculated_steps`, beside the rollbacks);
- the copy window of the device-lean transport: `strategy.offload_optimizer.copies_in_flight`
  (validated, used by the memory plan's row), and the time backward's thread waits in the
  gradient hook for room in it (`CopyWindow`, read as `strategy.copy_waits`);
- `abandon_step`: a backward that raised half-way (an out-of-memory probe of a batch search) is
  undone, so the same strategy takes its next step as if it had never run."""

import sys
import threading
import time
from pathlib import Path

import pytest
import torch

HERE = Path(__file__).parent
sys.path.insert(0, str(HERE))
from lean_offload_common import batch, make_model_and_anchors, make_optimizer, train  # noqa: E402

from ft_framework.config.errors import ConfigError  # noqa: E402
from ft_framework.config.schema import StrategyConfig  # noqa: E402
from ft_framework.errors import UserError  # noqa: E402
from ft_framework.strategies import OffloadedSingleDeviceStrategy, build_strategy  # noqa: E402
from ft_framework.strategies.offload_transport import MAX_GRADS_IN_FLIGHT, CopyWindow  # noqa: E402


def _lean(overlap: bool = True, **kw) -> OffloadedSingleDeviceStrategy:
    strategy = OffloadedSingleDeviceStrategy("bf16", "cpu", overlap=overlap, worker_threads=1, bucket_mb=0.001, **kw)
    model, anchors = make_model_and_anchors()
    strategy.setup(model, lambda m: make_optimizer(m, anchors), anchors=anchors)
    return strategy


def _step(strategy, step: int, max_grad_norm: float | None) -> float:
    strategy.backward(strategy.forward(batch(step)).loss)
    return strategy.clip_and_step(max_grad_norm)


def test_speculated_steps_count_the_steps_that_stepped_during_backward():
    """Clipping at every step (a norm limit far below the gradients') leaves speculation on for
    the first step only, which is rolled back; a limit that never fires speculates every step."""
    clipping = _lean()
    norms = [_step(clipping, s, 1e-6) for s in range(4)]
    assert min(norms) > 1e-6
    assert clipping.train_metrics() == {"offload_rollbacks": 1, "offload_skipped_steps": 0,
                                        "offload_speculated_steps": 1}
    never = _lean()
    for s in range(4):
        _step(never, s, 1e6)
    assert never.train_metrics()["offload_speculated_steps"] == 4 and never.rollbacks == 0
    serial = _lean(overlap=False)
    _step(serial, 0, 1e6)
    assert serial.train_metrics()["offload_speculated_steps"] == 0
    for s in (clipping, never, serial):
        s.close()


class _CopyDone:
    """A copy's completion as a CUDA event exposes it (`synchronize()` returns once it is done),
    finished by another thread after `seconds`: the side stream's copy on a machine without one."""

    def __init__(self, seconds: float):
        self._done = threading.Event()
        threading.Timer(seconds, self._done.set).start()

    def synchronize(self) -> None:
        self._done.wait()


def test_the_copy_window_holds_the_hook_until_the_oldest_copy_is_done_and_counts_the_wait():
    window = CopyWindow(2)
    window.add(_CopyDone(0.15))
    window.add(_CopyDone(0.0))
    window.make_room()  # two in flight: waits for the older one
    assert window.waits == 1 and window.wait_seconds >= 0.1
    window.add(_CopyDone(0.0))
    time.sleep(0.01)
    window.make_room()  # the oldest left is done: no time to speak of, but a full window is a wait
    assert window.waits == 2 and window.wait_seconds < 0.15 + 0.1
    wide = CopyWindow(3)
    wide.add(_CopyDone(0.15))
    wide.add(_CopyDone(0.15))
    wide.make_room()  # room for a third: no wait
    assert wide.waits == 0 and wide.wait_seconds == 0.0
    with pytest.raises(ValueError, match=">= 1"):
        CopyWindow(0)


def test_copies_in_flight_is_a_setting_of_the_lean_offload_and_of_its_memory_plan(tmp_path):
    section = StrategyConfig(name="single", offload_optimizer={"overlap": True, "copies_in_flight": 3})
    training = type("T", (), {"precision": "bf16", "device": "cpu"})()
    strategy = build_strategy(section, training)
    assert strategy.copies_in_flight == 3
    model, anchors = make_model_and_anchors()
    strategy.setup(model, lambda m: make_optimizer(m, anchors), anchors=anchors)
    assert strategy._transport.window.size == 3 and strategy.copy_waits == (0, 0.0)  # a CPU copies at once
    strategy.close()
    default = StrategyConfig(name="single", offload_optimizer={"overlap": True})
    assert build_strategy(default, training).copies_in_flight == MAX_GRADS_IN_FLIGHT
    with pytest.raises(ValueError, match="copies_in_flight"):
        StrategyConfig(name="single", offload_optimizer={"copies_in_flight": 0})
    with pytest.raises(UserError, match="copies_in_flight must be an integer >= 1"):
        OffloadedSingleDeviceStrategy("bf16", "cpu", copies_in_flight=0)


def test_the_memory_plan_counts_the_window_it_is_given(tmp_path):
    from transformers import BertConfig

    from ft_framework.config import load_config
    from ft_framework.strategies.memory_plan import plan_peak
    from ft_framework.task_kinds import build_task_kind

    import yaml

    arch = BertConfig(vocab_size=96, hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
                      intermediate_size=37, max_position_embeddings=64)
    rows = {}
    for window in (None, 5):
        offload = {"overlap": True, **({"copies_in_flight": window} if window else {})}
        cfg = {"model": {"name_or_path": "some/model"}, "data": {"task": "rte", "max_seq_length": 16},
               "optimizer": {"hparams": {"lr": 2e-5}}, "schedule": {"warmup_ratio": 0.1},
               "training": {"max_steps": 10, "precision": "bf16", "per_device_batch_size": 2},
               "strategy": {"name": "single", "offload_optimizer": offload}}
        path = tmp_path / f"run_{window}.yaml"
        path.write_text(yaml.safe_dump(cfg))
        run_cfg = load_config(path, [], check_paths=False)
        plan = plan_peak(run_cfg, arch, task=build_task_kind(run_cfg), world_size=1, on_gpu=True)
        rows[window] = next(r for r in plan.rows if r.what.startswith("gradients in flight to the host"))
    assert f"at most {MAX_GRADS_IN_FLIGHT} of" in rows[None].what and "at most 5 of" in rows[5].what
    assert rows[5].device_bytes == rows[None].device_bytes * 5 / MAX_GRADS_IN_FLIGHT > 0


def _masters(strategy) -> list[torch.Tensor]:
    return [m.detach().clone() for _, m in strategy._pairs]


@pytest.mark.parametrize("overlap", [True, False], ids=["overlapped", "serial"])
def test_a_backward_that_raised_is_abandoned_and_the_next_step_runs_as_if_it_never_had(overlap):
    """The backward of step 1 raises once half of the gradients are final (the worker has stepped
    some of their buckets); abandon_step rolls them back, and steps 1-2 then end where a strategy
    that never saw the failed backward ends (within the rollback's few ulp)."""
    reference = _lean(overlap)
    train(reference, steps=3)
    strategy = _lean(overlap)
    train(strategy, steps=1)
    before = _masters(strategy)
    params = list(strategy.unwrapped_model().parameters())
    seen = []

    def fail_half_way(grad):
        seen.append(1)
        if len(seen) == len(params) // 2:
            raise torch.OutOfMemoryError("simulated: out of memory half-way through backward")
        return grad

    handles = [p.register_hook(fail_half_way) for p in params if p.requires_grad]
    with pytest.raises(torch.OutOfMemoryError):
        strategy.backward(strategy.forward(batch(1)).loss)
    for h in handles:
        h.remove()
    if overlap:
        strategy._queue.join()
        assert strategy._speculated or strategy.speculated_steps == 0  # the worker had stepped some buckets
    strategy.abandon_step()
    for a, b in zip(_masters(strategy), before):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-9)
    assert not [p for p in params if p.grad is not None]
    for step in (1, 2):
        strategy.backward(strategy.forward(batch(step)).loss)
        strategy.clip_and_step(None)
    for (_, a), (_, b) in zip(strategy._pairs, reference._pairs):
        torch.testing.assert_close(a.detach(), b.detach(), rtol=1e-5, atol=1e-7)
    assert strategy.train_metrics() == reference.train_metrics()
    strategy.close()
    reference.close()
