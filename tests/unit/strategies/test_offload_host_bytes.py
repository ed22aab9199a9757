"""Host memory of the device-lean offload with the compact state (issue 43): every tensor the strategy
keeps in host memory for the step, counted storage by storage on a tiny decoder and a tiny BERT,
is at most 12 bytes per parameter with theta* (16 with the fp32 sums of accumulation), serial and
overlapped, and is what the memory plan's rows say, byte for byte."""

import sys
from pathlib import Path

import pytest
import torch

from ft_framework.checkpointing import dcp_io

HERE = Path(__file__).parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(HERE.parents[1]))
from lean_offload_common import make_model_and_anchors, make_optimizer  # noqa: E402
from tiny_llm import build_tiny_tokenizer, tiny_llm_config  # noqa: E402

from ft_framework.config import validate_config  # noqa: E402
from ft_framework.strategies import OffloadedSingleDeviceStrategy  # noqa: E402
from ft_framework.strategies.memory_plan import plan_memory  # noqa: E402

STEPS = 3


def _decoder_and_anchors():
    """A tiny Qwen2 causal LM (tied embeddings, every weight anchored, as a decoder's are) and its
    theta*: the weights nudged away, so that the pull does work."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(tiny_llm_config("qwen2", build_tiny_tokenizer()))
    gen = torch.Generator().manual_seed(1)
    anchors = {n: (p.detach() + 0.01 * torch.randn(p.shape, generator=gen)).clone()
               for n, p in model.named_parameters()}
    return model, anchors


def _decoder_batch(step: int, vocab: int) -> dict:
    gen = torch.Generator().manual_seed(200 + step)
    ids = torch.randint(0, vocab, (4, 24), generator=gen)
    return {"input_ids": ids, "attention_mask": torch.ones_like(ids), "labels": ids}


def _encoder_batch(step: int, vocab: int) -> dict:
    gen = torch.Generator().manual_seed(300 + step)
    return {"input_ids": torch.randint(1, vocab, (4, 16), generator=gen),
            "attention_mask": torch.ones(4, 16, dtype=torch.long),
            "labels": torch.randint(0, 2, (4,), generator=gen)}


MODELS = {"decoder": (_decoder_and_anchors, _decoder_batch), "encoder": (make_model_and_anchors, _encoder_batch)}


def _trained(kind: str, overlap: bool, accum: int, max_grad_norm: float | None = 0.5):
    """The device-lean offload with the compact state after STEPS steps of `accum` micro-batches."""
    build, make_batch = MODELS[kind]
    model, anchors = build()
    vocab = model.config.vocab_size
    strategy = OffloadedSingleDeviceStrategy("bf16", "cpu", overlap=overlap, worker_threads=1, bucket_mb=0.001)
    strategy.setup(model, lambda m: make_optimizer(m, anchors, state_dtype="bfloat16"), anchors=anchors)
    for step in range(STEPS):
        for micro in range(accum):
            loss = strategy.forward(make_batch(step * accum + micro, vocab)).loss
            strategy.backward(loss / accum, last_micro_batch=micro == accum - 1)
        strategy.clip_and_step(max_grad_norm)
    strategy.close()
    return strategy


def host_bytes(strategy) -> tuple[int, int]:
    """(bytes of the per-element host tensors, bytes of the 0-d step counts), each storage once."""
    per_element, counts = {}, {}
    for _role, _name, t in strategy.host_tensors():
        storage = t.untyped_storage()
        (counts if t.dim() == 0 else per_element)[storage.data_ptr()] = storage.nbytes()
    return sum(per_element.values()), sum(counts.values())


def _run_cfg(overlap: bool, accum: int):
    return validate_config({
        "model": {"name_or_path": "some/model"}, "data": {"task": "rte"},
        "optimizer": {"name": "recadam", "hparams": {"lr": 2e-3, "pretrain_cof": 50.0}, "anchor_dtype": "bfloat16",
                      "state_dtype": "bfloat16"},
        "schedule": {"warmup_steps": 0},
        "training": {"max_steps": STEPS, "precision": "bf16", "gradient_accumulation_steps": accum, "device": "cpu"},
        "strategy": {"name": "single", "offload_optimizer": {"overlap": overlap}},
    })


@pytest.mark.parametrize("accum", [1, 2])
@pytest.mark.parametrize("overlap", [False, True], ids=["serial", "overlapped"])
@pytest.mark.parametrize("kind", list(MODELS))
def test_host_bytes_per_parameter_are_at_most_12_and_16_with_accumulation_and_the_plan_says_so(kind, overlap, accum):
    strategy = _trained(kind, overlap, accum)
    model = strategy.unwrapped_model()
    params = sum(p.numel() for p in model.parameters())
    opt = strategy.optimizer
    anchored = sum(m.numel() for _, m in strategy._named_masters() if "anchor" in opt.state[m])
    per_element, counts = host_bytes(strategy)
    limit = 12 if accum == 1 else 16
    # theta* included: a decoder anchors every weight (12 / 16 exactly), an encoder all but its head
    assert per_element <= limit * params, (per_element / params, limit)
    if kind == "decoder":
        assert anchored == params and per_element == limit * params
    # besides: 4 bytes of step count per tensor, not per parameter
    assert counts == 4 * len(strategy._named_masters())
    # no fp32 copy of an anchored weight anywhere in host memory
    for role, name, t in strategy.host_tensors():
        if role == "master" and "anchor" in opt.state[dict(strategy._named_masters())[name]]:
            assert t.dtype == torch.bfloat16, name
    # the plan's model-state rows (what ft-train logs at start): the same host bytes, and the bf16
    # model the only device copy
    rows = plan_memory(_run_cfg(overlap, accum), world_size=1, num_params=params, num_anchored=anchored)
    assert sum(r.cpu_bytes for r in rows) == per_element
    assert sum(r.device_bytes for r in rows) == 2 * params
    assert sum(t.numel() * t.element_size() for role, _, t in strategy.device_tensors() if role == "weight") \
        == 2 * params


def test_the_plan_rows_of_the_bf16_weight_form_by_hand():
    """Per parameter, 1000 of them, 800 with theta*: landing buffers 2 (gradient in, weight out),
    moments 4, delta 4 and theta* 2 of the anchored, the head's fp32 master 4; no undo copies when
    overlapped (it does not speculate); accumulation adds the fp32 sums, 4."""
    for overlap in (False, True):
        rows = {r.what: r.cpu_bytes for r in plan_memory(_run_cfg(overlap, 1), world_size=1, num_params=1000,
                                                          num_anchored=800)}
        assert rows == {
            "parameters (bf16 model, the only device copy)": 0.0,
            "gradients in, new weights out (bf16 host landing buffers: the step writes each weight in its "
            "gradient's place)": 2000,
            "fp32 master weights of the parameters without theta* (the anchored: theta* + delta)": 800,
            "Adam moments (exp_avg, exp_avg_sq in bf16)": 4000,
            "delta = theta - theta* (fp32 master of the anchored)": 3200,
            "anchors theta*": 1600}
        assert sum(rows.values()) == 11600  # 11.6 B/param; 12 where every weight has theta*
    accumulating = plan_memory(_run_cfg(True, 4), world_size=1, num_params=1000, num_anchored=1000)
    assert sum(r.cpu_bytes for r in accumulating) == 16000


def _steps(strategy, kind: str, first: int, count: int) -> None:
    _, make_batch = MODELS[kind]
    vocab = strategy.unwrapped_model().config.vocab_size
    for step in range(first, first + count):
        strategy.backward(strategy.forward(make_batch(step, vocab)).loss)
        strategy.clip_and_step(0.5)


def _lean_compact(kind: str, overlap: bool = False):
    build, _ = MODELS[kind]
    model, anchors = build()
    strategy = OffloadedSingleDeviceStrategy("bf16", "cpu", overlap=overlap, worker_threads=1, bucket_mb=0.001)
    strategy.setup(model, lambda m: make_optimizer(m, anchors, state_dtype="bfloat16"), anchors=anchors)
    return strategy


@pytest.mark.parametrize("kind", list(MODELS))
def test_a_checkpoint_saves_theta_star_plus_delta_as_the_master_and_resumes_bit_for_bit(kind, tmp_path):
    """The bf16 weight form keeps no fp32 weight of an anchored parameter: its checkpoint's master is
    theta* + delta, formed for the save (what ft-export and a DeepSpeed resume read), and delta
    itself is saved. A run cut after 2 steps and resumed from its checkpoint in a fresh process's
    strategy ends as the uninterrupted run: the bf16 model, delta, m and v bit for bit."""
    from ft_framework.checkpointing.layout import read_fields

    whole = _lean_compact(kind)
    _steps(whole, kind, 0, 2)
    whole.save_checkpoint(tmp_path / "ckpt")
    saved = read_fields(tmp_path / "ckpt", fields=["master", "delta", "anchor"])
    for name, m in whole._named_masters():
        state = whole.optimizer.state[m]
        if whole.optimizer.has_bf16_weight(m):
            want = (state["anchor"].float() + state["delta"]).view(m.shape)
            assert torch.equal(saved[name]["master"], want) and torch.equal(saved[name]["delta"], state["delta"])
        else:
            assert torch.equal(saved[name]["master"], m.detach())
    _steps(whole, kind, 2, 2)
    whole.close()
    resumed = _lean_compact(kind)
    resumed.load_checkpoint(tmp_path / "ckpt")
    _steps(resumed, kind, 2, 2)
    resumed.close()
    for (name, p), q in zip(resumed.model.named_parameters(), whole.model.parameters()):
        assert torch.equal(p, q), name
    for (name, m), (_, w) in zip(resumed._named_masters(), whole._named_masters()):
        for key, value in whole.optimizer.state[w].items():
            assert torch.equal(resumed.optimizer.state[m][key], value), (name, key)


def test_the_staging_ring_holds_a_few_tensors_and_reuses_a_buffer_once_its_copy_has_run():
    """The fp32 state's new weights on their way to a GPU (offload_transport.StagingRing): two
    buffers of the largest parameter, whatever the number of tensors; a buffer is rounded into again
    only after the event of its last copy was waited for (on CPU, events that record the waits)."""
    from ft_framework.strategies.offload_transport import StagingRing

    waited, sent = [], []

    class Event:
        def __init__(self, index):
            self.index = index

        def synchronize(self):
            waited.append(self.index)

    def send(staged):
        sent.append((staged.data_ptr(), staged.clone()))
        return Event(len(sent) - 1)

    ring = StagingRing(2, numel=10, dtype=torch.bfloat16, pin=False)
    weights = [torch.full((3 + k,), 1.0 + k / 3) for k in range(6)]
    for w in weights:
        ring.stage(w, send)
    assert ring.host_bytes() == 2 * 10 * 2
    assert waited == [0, 1, 2, 3]  # the third copy waited for the first's, and so on
    assert len({ptr for ptr, _ in sent}) == 2
    for (_, staged), w in zip(sent, weights):
        assert staged.dtype == torch.bfloat16 and torch.equal(staged, w.to(torch.bfloat16))


def test_the_plan_keeps_room_for_the_fp32_masters_a_checkpoint_save_forms(monkeypatch):
    """The bf16 weight form keeps no fp32 weight, so a save forms theta* + delta, one parameter's at
    a time as DCP's writer reaches it (4 B per element of the largest parameter; under a torch whose
    writer was not checked for that, 4 B per anchored parameter, all formed first): on a GPU in host
    memory; on a CPU run (one memory) what it needs beyond the step's activations and gradients in
    flight, freed by then. Only where the run can save; the fp32 state keeps its masters and forms
    nothing. The staging row: none with the compact state, a ring of two of the largest parameter
    with the fp32 state on a GPU."""
    from ft_framework.strategies.memory_plan import model_shape, plan_peak
    from ft_framework.task_kinds import build_task_kind

    arch = make_model_and_anchors()[0].config

    def plan(on_gpu: bool, state: str = "bfloat16", **checkpoint):
        data = _run_cfg(overlap=True, accum=1).model_dump()
        data["checkpoint"] = {**data["checkpoint"], **checkpoint}
        data["optimizer"]["state_dtype"] = state
        data["data"]["max_seq_length"] = 16  # the tiny BERT's positions
        data["training"]["per_device_batch_size"] = 4
        cfg = validate_config(data)
        kind = build_task_kind(cfg)
        shape = model_shape(arch, model_class=kind.model_class)
        return {r.what.split(" (")[0]: r for r in plan_peak(cfg, arch, task=kind, world_size=1, on_gpu=on_gpu).rows}, shape

    save = "fp32 weights theta* + delta formed while a checkpoint saves"
    gpu, shape = plan(True)
    assert gpu[save].cpu_bytes == 4 * shape.largest_param and gpu[save].device_bytes == 0
    assert gpu["staging of the new weights for the device: none"].cpu_bytes == 0
    cpu, _ = plan(False, every_steps=5)
    step = cpu["activations"].device_bytes + cpu["gradients in flight to the host"].device_bytes
    assert cpu[save].cpu_bytes == max(0.0, 4 * shape.largest_param - step)
    monkeypatch.setattr(dcp_io, "STREAMED_FORMS_TORCH", ((1, 0), (1, 0)))
    assert plan(True)[0][save].cpu_bytes == 4 * shape.num_anchored
    assert plan(False, every_steps=5)[0][save].cpu_bytes == max(0.0, 4 * shape.num_anchored - step)
    monkeypatch.undo()
    assert save not in plan(True, on_signal="exit")[0]  # no save: no row
    fp32, _ = plan(True, state="float32")
    assert save not in fp32
    ring = [r for what, r in fp32.items() if what.startswith("staging")]
    assert [r.cpu_bytes for r in ring] == [2 * shape.largest_param * 2]
