"""The memory plan of a decoder LM (data.problem: causal_lm): the model its task kind loads (a causal
LM, every parameter anchored), a causal LM batch and the next-token loss on fp32 logits, traced
and compared with the live bytes of a real step; the forgetting probe's row; ft-plan on it."""

from __future__ import annotations

import contextlib
import io
import json
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from ft_framework import cli
from ft_framework.config import validate_config
from ft_framework.strategies.memory_fit import load_architecture, plan_run
from ft_framework.models.lm_forgetting import LMForgettingProbe, lm_probe_reference_bytes
from ft_framework.models.probes import build_probe
from ft_framework.strategies.memory_plan import model_shape
from ft_framework.strategies.memory_trace import trace_micro_batch
from ft_framework.task_kinds import build_task_kind

sys.path.insert(0, str(Path(__file__).resolve().parents[3] / "benchmarks"))
sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
import memory_plan as bench  # noqa: E402  (benchmarks/memory_plan.py: the measured run)
from tiny_llm import build_tiny_llm_dir  # noqa: E402

# A decoder whose vocabulary is large against its width, as an LLM's is (Llama-3: 128256 x 4096):
# the logits over the vocabulary are then the step's largest activation.
VOCAB = 2048


def decoder_dir(path: Path, model_type: str = "llama", **extra) -> Path:
    from transformers import AutoConfig

    tied = model_type != "mistral"
    AutoConfig.for_model(model_type, vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                         tie_word_embeddings=tied, **extra).to_json_file(path / "config.json")
    return path  # the architecture only: no weights


def decoder_cfg(model_dir, *, strategy=None, forgetting=False, **training):
    return validate_config({
        "model": {"name_or_path": str(model_dir)},
        "data": {"problem": "causal_lm", "source": "builtin:quickstart_sft", "max_seq_length": 64},
        "optimizer": {"name": "recadam", "hparams": {"lr": 2e-5}},
        "schedule": {"warmup_steps": 0},
        "evaluation": {"forgetting": {"enabled": forgetting, "num_sentences": 7}},
        "training": {"max_steps": 2, "per_device_batch_size": 4, "device": "cpu", **training},
        "strategy": strategy or {"name": "single"},
    })


@pytest.mark.parametrize("model_type,precision,checkpointing", [
    ("llama", "fp32", False),       # tied embeddings
    ("mistral", "fp32", True),      # an output layer of its own
    ("llama", "bf16", True),        # the device-lean offload: the bf16 model, bf16 logits widened by the loss
])
def test_decoder_plan_is_within_10_percent_of_a_measured_step(tmp_path, model_type, precision, checkpointing):
    """The plan's live tensors (a CPU run: device and host together) against the live-bytes peak of
    two real optimizer steps of the same model with the causal LM kind's own batch and loss."""
    strategy = {"name": "single", "offload_optimizer": {"overlap": False}} if precision == "bf16" else None
    cfg = decoder_cfg(decoder_dir(tmp_path, model_type), strategy=strategy, precision=precision,
                      activation_checkpointing=checkpointing)
    plan = plan_run(cfg, task=build_task_kind(cfg), world_size=1, on_gpu=False)
    measured, _ = bench.measured_run(cfg)
    assert plan.live_bytes == pytest.approx(measured["live_peak"], rel=0.10)


def test_the_trace_holds_the_fp32_logits_of_the_whole_logits_loss(tmp_path):
    """bf16 weights (the device-lean offload), training.chunked_loss off: the loss widens the logits
    to fp32 and keeps their log-softmax for backward, two B x (T-1) x vocabulary fp32 tensors,
    besides the bf16 logits."""
    cfg = decoder_cfg(decoder_dir(tmp_path), chunked_loss=False)
    arch = load_architecture(cfg.model).config
    kind = build_task_kind(cfg)
    assert kind.model_class.auto_class == "AutoModelForCausalLM"
    batch, seq = 4, 64
    trace = trace_micro_batch(arch, batch_size=batch, seq_len=seq, param_dtype=torch.bfloat16, autocast_dtype=None,
                              checkpointing=True, keep_grads=False, task=kind)
    logits = batch * seq * VOCAB
    assert trace.above_params >= logits * 2 + 2 * batch * (seq - 1) * VOCAB * 4


def test_the_chunked_loss_traces_one_chunk_of_logits(tmp_path, monkeypatch):
    """training.chunked_loss (the default): the trace's loss is the head's own, a chunk of 16
    positions at a time here, so it holds no B x T x vocabulary tensor: far less than the whole
    logits' loss at the same batch, and less than one bf16 copy of the whole logits above the rest."""
    from ft_framework.models import lm_head_requests

    monkeypatch.setattr(lm_head_requests, "CHUNK_LOGITS", 16 * VOCAB)
    arch_dir = decoder_dir(tmp_path)
    batch, seq = 5, 64  # a batch no other test traces (traces are cached by their settings)
    traces = {}
    for chunked in (True, False):
        cfg = decoder_cfg(arch_dir, chunked_loss=chunked)
        traces[chunked] = trace_micro_batch(load_architecture(cfg.model).config, batch_size=batch, seq_len=seq,
                                            param_dtype=torch.bfloat16, autocast_dtype=None, checkpointing=True,
                                            keep_grads=False, task=build_task_kind(cfg))
    logits = batch * seq * VOCAB
    assert traces[False].above_params - traces[True].above_params >= 2 * batch * (seq - 1) * VOCAB * 4
    assert traces[True].above_params < logits * 2 + 2 * VOCAB * 64 * 2  # + the head's gradient in bf16


def test_a_decoders_shape_anchors_every_parameter_and_counts_tied_weights_once(tmp_path):
    from transformers import AutoModelForCausalLM

    cfg = decoder_cfg(decoder_dir(tmp_path))
    arch = load_architecture(cfg.model).config
    kind = build_task_kind(cfg)
    shape = model_shape(arch, model_class=kind.model_class)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(arch)
    assert shape.num_params == sum(p.numel() for p in model.parameters()) == shape.num_anchored
    assert shape.largest_param == VOCAB * 64
    # what the decoder's kind keeps besides: nothing, or with its probe theta*'s answers (no MLM head)
    assert kind.memory_rows(arch, world_size=1) == []
    probing = build_task_kind(decoder_cfg(tmp_path, forgetting=True))
    assert [(r.what.split(" (")[0], r.device_bytes) for r in probing.memory_rows(arch, world_size=1)] == [
        ("theta*'s answers to the forgetting probe", 0.0)]


def test_the_forgetting_probe_row_is_what_the_probe_keeps_of_theta_star(tmp_path):
    """models/lm_forgetting.py keeps, for each of the rank's probe sentences, theta*'s fp32
    log-probabilities of every predicted position and its float64 pooled hidden states: the plan's
    host row against the tensors a real probe keeps (the tiny tokenizer writes a token per byte, so
    every probe sentence is cut at max_length)."""
    from ft_framework.config.schema import ForgettingConfig

    model_dir = build_tiny_llm_dir(tmp_path / "llama", "llama")
    forgetting = ForgettingConfig(num_sentences=7, max_length=16)
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(model_dir).eval()
    arch = model.config
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    for rank, world in ((0, 1), (0, 2), (1, 2)):
        probe = build_probe(LMForgettingProbe, forgetting, tokenizer=tokenizer, batch_size=4, rank=rank,
                            world_size=world)
        probe.reference_from_model(lambda batch: model(**batch), None, is_main=True, barrier=lambda: None)
        kept = sum(t.nbytes for t in probe.reference.logprobs + probe.reference.features)
        planned = lm_probe_reference_bytes(arch, forgetting, world_size=world)
        assert kept <= planned and (rank == 1 or kept == planned)  # the last rank's share may be one short
    expected = 4 * (15 * arch.vocab_size * 4 + arch.num_hidden_layers * arch.hidden_size * 8)
    assert lm_probe_reference_bytes(arch, forgetting, world_size=2) == expected


def test_the_decoders_plan_has_the_probe_row_on_the_host_and_no_mlm_head(tmp_path):
    model_dir = decoder_dir(tmp_path)
    plan = plan_run((planned := decoder_cfg(model_dir, forgetting=True, device="cuda")), task=build_task_kind(planned), world_size=2, on_gpu=True)
    rows = {r.what: r for r in plan.rows}
    probe = [r for w, r in rows.items() if w.startswith("theta*'s answers to the forgetting probe")]
    assert len(probe) == 1 and probe[0].device_bytes == 0
    assert probe[0].cpu_bytes == 4 * (31 * VOCAB * 4 + 2 * 64 * 8)  # 7 sentences over 2 ranks, max_length 32
    assert not any(w.startswith("MLM head") for w in rows)
    off = plan_run((planned := decoder_cfg(model_dir, forgetting=False, device="cuda")), task=build_task_kind(planned), world_size=2, on_gpu=True)
    assert not any(r.what.startswith("theta*'s answers") for r in off.rows)


def test_cuda_rules_keep_a_dtype_named_by_position_and_widen_an_unnamed_one():
    """CUDA's fp32_set_opt_dtype ops (softmax, log_softmax, sum...): a call that names its dtype runs
    as called, by keyword or by position (a decoder's eager attention calls softmax(x, -1,
    dtype=float32), which reaches the kernel positionally); without one, fp32."""
    from ft_framework.strategies.torch_tracing import cuda_autocast_rules

    x = torch.randn(2, 8).bfloat16()
    with cuda_autocast_rules(torch.bfloat16), torch.autocast("cpu", dtype=torch.bfloat16):
        assert F.softmax(x, dim=-1, dtype=torch.float32).dtype == torch.float32
        assert torch.ops.aten.softmax.int(x, -1, torch.float32).dtype == torch.float32
        assert torch.ops.aten.softmax.int(x, -1, torch.bfloat16).dtype == torch.bfloat16
        assert torch.softmax(x, -1).dtype == torch.float32
        assert torch.ops.aten.sum.dim_IntList(x, [1], False, dtype=torch.bfloat16).dtype == torch.bfloat16
        assert torch.ops.aten.sum.dim_IntList(x, [1], False).dtype == torch.float32


def test_a_gemma2_gpu_plan_traces_its_eager_attention_under_cuda_rules(tmp_path):
    """Gemma-2's eager attention widens its softmax by a dtype given positionally."""
    model_dir = decoder_dir(tmp_path, "gemma2", head_dim=16, query_pre_attn_scalar=16, sliding_window=32)
    plan = plan_run((planned := decoder_cfg(model_dir, device="cuda", precision="bf16")), task=build_task_kind(planned), world_size=1, on_gpu=True)
    assert plan.device_peak > 0


def ft_plan(*argv):
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        code = cli.plan_main(list(argv))
    return code, out.getvalue(), err.getvalue()


def test_ft_plan_on_a_causal_lm_config_prints_the_peaks_and_host_bytes_per_parameter(tmp_path):
    import yaml

    model_dir = decoder_dir(tmp_path)
    config = tmp_path / "sft.yaml"
    config.write_text(yaml.safe_dump({
        "model": {"name_or_path": str(model_dir)},
        "data": {"problem": "causal_lm", "source": "builtin:quickstart_sft", "max_seq_length": 64},
        "optimizer": {"name": "recadam", "hparams": {"lr": 2e-5}, "anchor_dtype": "bfloat16",
                      "state_dtype": "bfloat16"},
        "schedule": {"warmup_steps": 0},
        "training": {"max_steps": 2, "per_device_batch_size": 4, "precision": "bf16"},
        "strategy": {"name": "single", "offload_optimizer": {"overlap": False}}}))
    code, out, err = ft_plan("--config", str(config))
    assert code == 0, err
    assert "theta*'s answers to the forgetting probe" in out
    assert "host bytes per parameter" in out
    code, out, _ = ft_plan("--config", str(config), "--json")
    rank = json.loads(out)["per_rank"][0]
    assert rank["num_params"] > 0
    assert rank["host_bytes_per_param"] == pytest.approx(rank["host_peak_bytes"] / rank["num_params"])


@pytest.mark.slow
def test_fit_reaches_bf16_the_compact_state_and_the_offload_in_that_order(tmp_path):
    """From an fp32 run on the device (no checkpointing, fp32 optimizer state): with a budget that
    the compact state on the device fits, the search stops there; with one only the offload fits,
    it keeps every stage before it."""
    from ft_framework.strategies.memory_fit import fit_to_budget

    model_dir = decoder_dir(tmp_path)
    base = dict(device="cuda", per_device_batch_size=2, gradient_accumulation_steps=2)
    cfg = decoder_cfg(model_dir, **base)
    compact_settings = dict(activation_checkpointing=True, precision="bf16")

    def peak(strategy=None, compact=False, **training):
        run = decoder_cfg(model_dir, strategy=strategy, **{**base, **training})
        if compact:
            run = run.model_copy(update={"optimizer": run.optimizer.model_copy(
                update={"anchor_dtype": "bfloat16", "state_dtype": "bfloat16"})})
        return plan_run(run, task=build_task_kind(run), world_size=1, on_gpu=True).device_peak

    bf16 = peak(per_device_batch_size=1, gradient_accumulation_steps=4, **compact_settings)
    compact = peak(compact=True, per_device_batch_size=1, gradient_accumulation_steps=4, **compact_settings)
    offload = peak({"name": "single", "offload_optimizer": {"overlap": True}}, compact=True,
                   per_device_batch_size=1, gradient_accumulation_steps=4, **compact_settings)
    assert offload < compact < bf16
    fit = fit_to_budget(cfg, task=build_task_kind(cfg), budget_bytes=(compact + bf16) / 2, world_size=1, on_gpu=True)
    assert fit is not None and fit.plan.device_peak <= (compact + bf16) / 2
    assert {"training.activation_checkpointing=true", "training.precision=bf16", "optimizer.anchor_dtype=bfloat16",
            "optimizer.state_dtype=bfloat16"} <= set(fit.overrides)
    assert not any(o.startswith("strategy.offload_optimizer") for o in fit.overrides)
    fit = fit_to_budget(cfg, task=build_task_kind(cfg), budget_bytes=(offload + compact) / 2, world_size=1, on_gpu=True)
    assert fit is not None and "strategy.offload_optimizer={overlap: true}" in fit.overrides
    assert "optimizer.state_dtype=bfloat16" in fit.overrides and "training.precision=bf16" in fit.overrides


@pytest.mark.slow
def test_the_llama_8b_recipe_fits_24_gib_as_ft_plan_fit_prints_it():
    """configs/llama3_8b_sft_recadam.yaml: planned from the shipped architecture of Llama-3.1-8B
    (8,030,261,248 parameters, the published count): the device-lean offload with the compact state,
    checkpointing and the chunked loss fits 24 GiB at four 2048-token sequences per micro-batch (the
    whole logits' loss with packing's dense mask: one); ft-plan --fit prints the device and host
    peaks and the host bytes per parameter."""
    recipe = str(Path(__file__).resolve().parents[3] / "configs" / "llama3_8b_sft_recadam.yaml")
    code, out, err = ft_plan("--config", recipe, "--gpu-memory", "24GiB", "--fit")
    assert code == 0, err
    assert "meta-llama/Llama-3.1-8B-Instruct's published architecture" in out
    assert "budget 24.0 GiB: fits" in out and "fits as configured" in out
    assert "host bytes per parameter (8.03 B parameters)" in out
    code, out, _ = ft_plan("--config", recipe, "--gpu-memory", "24GiB", "--json")
    rank = json.loads(out)["per_rank"][0]
    assert rank["num_params"] == 8_030_261_248
    assert rank["device_peak_bytes"] <= 24 * 2**30
    # The next micro-batch of the same step (8 x 2) does not fit: the recipe's micro-batch is the largest.
    code, out, _ = ft_plan("--config", recipe, "--gpu-memory", "24GiB", "--json", "training.per_device_batch_size=8",
                           "training.gradient_accumulation_steps=2")
    assert json.loads(out)["fits"] is False
    # Before: the whole logits in the loss and packing's dense mask fit one sequence, not two.
    before = ("training.chunked_loss=false", "model.attn_implementation=eager")
    code, out, _ = ft_plan("--config", recipe, "--gpu-memory", "24GiB", "--fit", "training.per_device_batch_size=16",
                           "training.gradient_accumulation_steps=1", *before)
    assert "fits with: training.per_device_batch_size=1 training.gradient_accumulation_steps=16" in out
    code, out, _ = ft_plan("--config", recipe, "--gpu-memory", "24GiB", "--fit", "training.per_device_batch_size=16",
                           "training.gradient_accumulation_steps=1")
    assert "fits with: training.per_device_batch_size=4 training.gradient_accumulation_steps=4" in out


def test_the_published_decoder_architectures_have_their_published_parameter_counts():
    from transformers import AutoModelForCausalLM

    from ft_framework.config.schema import ModelConfig

    llama, qwen, small = 8_030_261_248, 7_615_616_512, 1_235_814_400  # the model cards' counts
    for hub_id, count in (("meta-llama/Llama-3.1-8B", llama), ("meta-llama/Llama-3.1-8B-Instruct", llama),
                          ("Qwen/Qwen2.5-7B", qwen), ("Qwen/Qwen2.5-7B-Instruct", qwen),
                          ("meta-llama/Llama-3.2-1B", small), ("meta-llama/Llama-3.2-1B-Instruct", small)):
        arch = load_architecture(ModelConfig(name_or_path=hub_id))
        assert "published architecture" in arch.source
        with torch.device("meta"):
            model = AutoModelForCausalLM.from_config(arch.config)
        assert sum(p.numel() for p in model.parameters()) == count, hub_id


@pytest.mark.slow
def test_a_decoder_run_over_its_budget_is_refused_in_one_line_naming_what_fits(tmp_path):
    """training.memory_budget_gib on a causal LM run (the old plan built a classifier of 0 labels
    and crashed): refused before anything loads, with the micro-batch that fits."""
    from ft_framework.errors import UserError
    from ft_framework.strategies.memory_fit import check_memory_budget

    model_dir = decoder_dir(tmp_path)
    peaks = {b: plan_run((planned := decoder_cfg(model_dir, per_device_batch_size=b)), task=build_task_kind(planned), world_size=1, on_gpu=False).device_peak
             for b in (4, 8)}
    budget_gib = (peaks[4] + peaks[8]) / 2 / 2**30
    cfg = decoder_cfg(model_dir, per_device_batch_size=8, memory_budget_gib=budget_gib)
    with pytest.raises(UserError) as caught:
        check_memory_budget(cfg, task=build_task_kind(cfg), world_size=1, on_gpu=False)
    message = str(caught.value)
    assert len(message.splitlines()) == 1 and message.startswith("training.memory_budget_gib")
    assert "training.per_device_batch_size=4 training.gradient_accumulation_steps=2" in message
