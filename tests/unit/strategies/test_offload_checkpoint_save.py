"""A checkpoint save of the device-lean offload's bf16 weight form (issue 43). An anchored parameter
keeps no fp32 weight, and the checkpoint stores fp32 masters: each master theta* + delta is formed
when DCP's writer reaches it and freed once written (Fragment.form, checkpointing/dcp_io.py). So a
save holds one parameter's fp32 master at a time, not 4 bytes per anchored parameter, and the
checkpoint is the one that forming every master before the save wrote: the same data file, byte for
byte, and the same index."""

import os
import sys
import weakref
from pathlib import Path

import pytest
import torch
from torch.utils._pytree import tree_leaves

HERE = Path(__file__).parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(HERE.parents[1]))
from lean_offload_common import make_optimizer  # noqa: E402
from tiny_llm import build_tiny_tokenizer, tiny_llm_config  # noqa: E402

from ft_framework.checkpointing import dcp_io  # noqa: E402
from ft_framework.checkpointing.dcp_read import read_metadata  # noqa: E402
from ft_framework.checkpointing.layout import read_fields, save_sharded  # noqa: E402
from ft_framework.strategies import OffloadedSingleDeviceStrategy  # noqa: E402
from ft_framework.strategies.torch_tracing import dispatch_mode_base  # noqa: E402

LAYERS = 8  # many tensors, none of them a large share of the model


def _trained_decoder():
    """The device-lean offload with the compact state on a tiny Qwen2 of LAYERS layers (every weight
    anchored), after 2 steps: delta, m and v hold values of their own."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    config = tiny_llm_config("qwen2", build_tiny_tokenizer())
    config.num_hidden_layers = LAYERS
    config.layer_types = ["full_attention"] * LAYERS
    model = AutoModelForCausalLM.from_config(config)
    gen = torch.Generator().manual_seed(1)
    anchors = {n: (p.detach() + 0.01 * torch.randn(p.shape, generator=gen)).clone()
               for n, p in model.named_parameters()}
    strategy = OffloadedSingleDeviceStrategy("bf16", "cpu", worker_threads=1)
    strategy.setup(model, lambda m: make_optimizer(m, anchors, state_dtype="bfloat16"), anchors=anchors)
    for step in range(2):
        ids = torch.randint(0, config.vocab_size, (4, 24), generator=torch.Generator().manual_seed(200 + step))
        strategy.backward(strategy.forward({"input_ids": ids, "attention_mask": torch.ones_like(ids),
                                            "labels": ids}).loss)
        strategy.clip_and_step(0.5)
    return strategy


class _EagerForm:
    """The strategy's checkpoint view as the save took it before: every fp32 master theta* + delta
    formed at once, as live tensors, before DCP writes any."""

    def __init__(self, inner):
        self.inner = inner

    def __getattr__(self, name):
        return getattr(self.inner, name)

    def fragments(self):
        return [f.with_value() for f in self.inner.fragments()]


class _Fp32Held(dispatch_mode_base()):
    """The fp32 bytes the host storages made by operators while it is on hold (an operator's output
    whose storage none of its inputs has: not a view or an in-place result of the live state), each
    counted as it is now (a storage freed, or resized to nothing, holds none); `peak`: the most
    after any operator."""

    def __init__(self):
        super().__init__()
        self.made: dict[int, weakref.ref] = {}
        self.peak = 0

    def held(self) -> int:
        return sum(s.nbytes() for ref in self.made.values() if (s := ref()) is not None)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        inputs = {id(t.untyped_storage()) for t in tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)}
        for t in tree_leaves(out):
            if isinstance(t, torch.Tensor) and t.dtype == torch.float32 and t.device.type == "cpu":
                storage = t.untyped_storage()
                if id(storage) in inputs:
                    continue
                ref = self.made.get(id(storage))
                if ref is None or ref() is not storage:
                    self.made[id(storage)] = weakref.ref(storage)
        self.peak = max(self.peak, self.held())
        return out


@pytest.fixture(scope="module")
def trained():
    strategy = _trained_decoder()
    yield strategy
    strategy.close()


def _anchored_sizes(strategy) -> list[int]:
    return [m.numel() for _, m in strategy._named_masters() if strategy.optimizer.has_bf16_weight(m)]


def test_the_checkpoint_is_the_one_the_eager_form_wrote(trained, tmp_path):
    """Saved both ways: every file the same (the data file byte for byte), DCP's index the same
    (every key, chunk, offset and length in the file; only the save's random id differs), and every
    field of every parameter read back equal, the masters theta* + delta in fp32."""
    save_sharded(tmp_path / "formed", trained.checkpointable())
    save_sharded(tmp_path / "eager", _EagerForm(trained.checkpointable()))
    files = sorted(str(p.relative_to(tmp_path / "formed")) for p in (tmp_path / "formed").rglob("*") if p.is_file())
    assert files == sorted(str(p.relative_to(tmp_path / "eager")) for p in (tmp_path / "eager").rglob("*")
                           if p.is_file())
    for name in files:
        if name != ".metadata":
            assert (tmp_path / "formed" / name).read_bytes() == (tmp_path / "eager" / name).read_bytes(), name
    formed, eager = (read_metadata(tmp_path / d / ".metadata") for d in ("formed", "eager"))
    assert formed.state_dict_metadata == eager.state_dict_metadata
    assert formed.storage_data == eager.storage_data
    formed, eager = read_fields(tmp_path / "formed"), read_fields(tmp_path / "eager")
    assert formed.keys() == eager.keys()
    for name, fields in eager.items():
        assert formed[name].keys() == fields.keys()
        for field, value in fields.items():
            assert formed[name][field].dtype == value.dtype and torch.equal(formed[name][field], value), (name, field)
    for name, m in trained._named_masters():
        state = trained.optimizer.state[m]
        assert torch.equal(formed[name]["master"], (state["anchor"].float() + state["delta"]).view(m.shape)), name


def test_a_save_holds_one_fp32_master_at_a_time(trained, tmp_path):
    """The fp32 bytes made while the save runs peak at the largest anchored parameter's master
    (WRITER_THREADS of them), not the model's 4 B per anchored parameter, which forming them all
    before the save holds (counted the same way); none is left once the save returns."""
    sizes = _anchored_sizes(trained)
    assert len(sizes) == len(trained._named_masters()) > 40 and max(sizes) < sum(sizes) / 3
    with _Fp32Held() as formed:
        trained.save_checkpoint(tmp_path / "formed")
    assert 0 < formed.peak <= dcp_io.WRITER_THREADS * 4 * max(sizes), (formed.peak, 4 * max(sizes), 4 * sum(sizes))
    assert formed.held() == 0
    with _Fp32Held() as eager:
        save_sharded(tmp_path / "eager", _EagerForm(trained.checkpointable()))
    assert eager.peak >= 4 * sum(sizes)


def test_under_an_unchecked_torch_the_save_forms_every_master_first(trained, tmp_path, monkeypatch):
    """Freeing a formed value when the writer asks for the next relies on DCP's writer writing each
    value before it resolves the next, read and tested on STREAMED_FORMS_TORCH only. Under another
    torch the save forms every master before DCP starts (as the eager form did) and writes the same
    checkpoint."""
    monkeypatch.setattr(dcp_io, "STREAMED_FORMS_TORCH", ((1, 0), (1, 0)))
    assert not dcp_io.streams_formed_values()
    sizes = _anchored_sizes(trained)
    with _Fp32Held() as held:
        trained.save_checkpoint(tmp_path / "unchecked")
    assert held.peak >= 4 * sum(sizes)
    monkeypatch.undo()
    assert dcp_io.streams_formed_values()  # the torch the suite runs on is a checked one
    trained.save_checkpoint(tmp_path / "streamed")
    unchecked, streamed = read_fields(tmp_path / "unchecked"), read_fields(tmp_path / "streamed")
    assert unchecked.keys() == streamed.keys()
    for name, fields in streamed.items():
        for field, value in fields.items():
            assert torch.equal(unchecked[name][field], value), (name, field)


def test_the_writer_copies_nothing_ahead_where_values_are_formed(tmp_path):
    """DCP's writer on a machine with CUDA resolves about 10 MB of values before writing them unless
    told to copy nothing ahead: the layout's writer is told so where a save forms values, and keeps
    DCP's copy-ahead (device tensors copied while earlier ones are written) where it forms none."""
    assert dcp_io.file_writer(tmp_path, formed=True).per_thread_copy_ahead == 0
    assert dcp_io.file_writer(tmp_path, formed=False).per_thread_copy_ahead > 0
    assert dcp_io.file_writer(tmp_path, formed=True).thread_count == dcp_io.WRITER_THREADS == 1
