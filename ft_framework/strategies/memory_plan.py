"""Per-rank memory plan of a run, on the device and on the host, before any weight is loaded.

:func:`plan_memory` gives the model states: parameters, gradients, optimizer state and anchors,
for the chosen strategy. :func:`plan_peak` adds what the peak of a training step holds besides:
the activations of one micro-batch (traced on fake tensors by memory_trace.py, at the run's
batch, sequence length, dtype and checkpointing), the strategy's gradient buckets, the optimizer
step's temporaries and, on a GPU, the CUDA context and the caching allocator's slack. Each
constant below names where it comes from (docs/memory.md)."""

from __future__ import annotations

import copy
from dataclasses import dataclass, field
from typing import Any

import torch

from ft_framework.checkpointing import dcp_io
from ft_framework.models.activation_checkpointing import apply_activation_checkpointing, checkpointed_blocks
from ft_framework.models.loading import ModelClass
from ft_framework.strategies.memory_trace import (ASSUMED_ATTENTION_BACKEND, MicroBatchTrace, PlannedTask,
                                                   build_model_on_meta, trace_micro_batch)
from ft_framework.strategies.offload_transport import MAX_GRADS_IN_FLIGHT

GIB = 1024**3
MIB = 1024**2
# The CUDA context of one process (driver, cuBLAS/cuDNN handles, kernels loaded lazily): about
# 500 MiB with CUDA 12 and torch 2.x as commonly reported; NOT measured on our GPUs yet (no GPU has
# been lent). torch.cuda.max_memory_allocated does not count it; nvidia-smi does.
CUDA_CONTEXT_BYTES = 512 * MIB
# The caching allocator keeps freed blocks for reuse, so what it reserves exceeds what is live:
# planned as this fraction of the live peak. Measured on one H200 (GPU suite part e, ALBERT-xxlarge,
# bf16, batch 32): max_memory_reserved / max_memory_allocated was 1.021 (our overlapped offload) and
# 1.054 (DeepSpeed ZeRO-2 offload); the plan takes the larger.
ALLOCATOR_SLACK = 0.054
# The memory of a training process that is not tensors: the code of Python, torch, transformers and
# ft_framework faulted in, the interpreter's objects, kernels' thread pools and scratch buffers.
# Measured: the resident set of a process after importing them and one training step of a tiny
# BERT, 499 MiB (torch 2.13 CPU, transformers 5.24, Python 3.11, this project's AMD EPYC host;
# `python benchmarks/memory_plan.py --runtime` measures it again). The issue that asked for this row
# measured about 0.5 GiB above the live tensors of a RoBERTa-base-size run with the allocator policy
# of run/allocator.py (without it, glibc's fragmentation added about 1 GiB more).
HOST_RUNTIME_BYTES = 499 * MIB
# DeepSpeed's default zero_optimization.reduce_bucket_size (elements; deepspeed/runtime/zero/config.py):
# ZeRO-1/2 with contiguous gradients (on by default, forced by offload) keep one bucket of it in
# the gradients' dtype during backward, two with overlap_comm.
DEEPSPEED_REDUCE_BUCKET_ELEMENTS = 500_000_000
# ZeRO-1/2 reduces its last gradient bucket in backward's epilogue (deepspeed/runtime/zero/
# stage_1_and_2.py, DeepSpeed 0.19: average_tensor -> allreduce_and_scatter -> allreduce_bucket)
# by flattening the bucket's gradients into a new tensor (one copy) while the gradients autograd
# made for that bucket are still alive (a second), each min(reduce_bucket_size, parameters)
# elements. The activations are freed by then, so the plan takes the larger of the two. Measured
# with the live-bytes tracker on BERT-base, ZeRO-2 offload, 2 ranks (benchmarks/memory_plan.py):
# a 417 MiB flattened copy and 0.41 GiB of gradients live at the peak, with or without checkpointing.
# Counted with the offloaded optimizer, where it was measured.
DEEPSPEED_BUCKET_EPILOGUE_COPIES = 2
# optim/torch_step.py (the torch implementation, a GPU's): full-size foreach temporaries of the group
# being stepped (p - a, the change, the pre-decayed weights). The C++ CPU step allocates none.
TORCH_STEP_TEMPORARIES = 3
# FSDP2 unshards a block for its forward and prefetches the next one: two blocks' worth of full
# parameters (and in backward their full gradients before the reduce-scatter).
FSDP_UNSHARDED_BLOCKS = 2


@dataclass(frozen=True)
class PlanRow:
    what: str
    device_bytes: float
    cpu_bytes: float


# The row of theta*'s anchors, which the importance F~ (optim/importance.py) is placed beside.
_ANCHOR_ROW = "anchors theta*"
# F~'s bytes per anchored element (bf16).
IMPORTANCE_BYTES = 2


def plan_memory(run_cfg, *, world_size: int, num_params: int, num_anchored: int,
                device_is_host: bool = False) -> list[PlanRow]:
    """Rows for the run's strategy (single, ddp, deepspeed, fsdp). `device_is_host`: a CPU run, where
    the offloaded single-device strategy's parameters and gradients are the masters' own."""
    rows = _state_rows(run_cfg, world_size=world_size, num_params=num_params, num_anchored=num_anchored,
                       device_is_host=device_is_host)
    if run_cfg.optimizer.importance is None:
        return rows
    # F~ is optimizer state like theta*: sharded and offloaded with it, 2 bytes per element.
    anchor_bytes = 2 if run_cfg.optimizer.anchor_dtype == "bfloat16" else 4
    at = next(i for i, r in enumerate(rows) if r.what == _ANCHOR_ROW)
    scale = IMPORTANCE_BYTES / anchor_bytes
    importance = PlanRow("importance F~ of theta* (bf16)", rows[at].device_bytes * scale, rows[at].cpu_bytes * scale)
    return rows[:at + 1] + [importance] + rows[at + 1:]


def _state_rows(run_cfg, *, world_size: int, num_params: int, num_anchored: int,
                device_is_host: bool) -> list[PlanRow]:
    precision = run_cfg.training.precision
    mixed = precision in ("bf16", "fp16")
    anchor_bytes = 2 if run_cfg.optimizer.anchor_dtype == "bfloat16" else 4
    P, A, W = num_params, num_anchored, world_size
    strategy = run_cfg.strategy
    compact = run_cfg.optimizer.state_dtype == "bfloat16"  # the compact state (optim/compact.py)
    if strategy.name == "deepspeed":
        ds = strategy.deepspeed
        stage, off_opt, off_par = ds.zero_stage, ds.offload_optimizer, ds.offload_param
        weight_bytes = 2 if mixed else 4
        shard = W if stage >= 1 else 1
        rows = [PlanRow("parameters (model copy)", *_place(P * weight_bytes / (W if stage == 3 else 1), off_par))]
        if off_opt:  # the gradients go straight to the host partition; the new weights come back through a copy
            rows += [PlanRow("gradients (fp32 partition for the CPU step)", 0.0, P * 4 / shard),
                     PlanRow("weights partition in the model's dtype (copied back after the step)", 0.0,
                             P * weight_bytes / shard)]
        else:
            rows.append(PlanRow("gradients", P * weight_bytes / (W if stage >= 2 else 1), 0.0))
        if stage >= 1 or mixed:
            rows.append(PlanRow("fp32 master weights", *_place(P * 4 / shard, off_opt)))
        # The compact state keeps no delta here: DeepSpeed's fp32 partitions are the masters.
        rows += [PlanRow("Adam moments (exp_avg, exp_avg_sq" + (" in bf16)" if compact else ")"),
                         *_place(2 * P * (2 if compact else 4) / shard, off_opt)),
                 PlanRow(_ANCHOR_ROW, *_place(A * anchor_bytes / shard, off_opt))]
        return rows
    moment_rows = ([PlanRow("Adam moments (exp_avg, exp_avg_sq in bf16)", 2 * P * 2, 0.0),
                    PlanRow("delta = theta - theta* (fp32 master of the anchored)", A * 4, 0.0)]
                   if compact else [PlanRow("Adam moments (exp_avg, exp_avg_sq)", 2 * P * 4, 0.0)])
    if strategy.name == "fsdp":
        off = strategy.fsdp.cpu_offload
        return [PlanRow("parameters (fp32 shards)", *_place(P * 4 / W, off)),
                PlanRow("gradients (fp32 shards)", *_place(P * 4 / W, off)),
                *[PlanRow(r.what, *_place(r.device_bytes / W, off)) for r in moment_rows],
                PlanRow(_ANCHOR_ROW, *_place(A * anchor_bytes / W, off))]
    offload = strategy.offload_optimizer if strategy.name == "single" else None
    if offload is not None:  # fp32 masters, their gradients and the state in host memory (offload.py)
        # The device-lean offload with the compact state runs the bf16 weight form (offload.py): an
        # anchored parameter keeps no fp32 weight (theta* + delta), the step writes the new bf16 weight
        # into the gradient's landing buffer, and the overlapped path does not speculate.
        bf16_form = mixed and compact
        # A speculative compact step keeps copies of the old bf16 m and v and the old fp32 master
        # (AnchoredOptimizer._keep_undo): what its rollback restores, stochastic rounding having no inverse.
        undo = [PlanRow("undo copies of speculative steps (bf16 m, v and the fp32 master)", 0.0, P * 8)] \
            if compact and offload.overlap and not bf16_form else []
        # A pull weighted by F~ may put an element onto theta*, which no inverse undoes: the fp32
        # state keeps copies of m, v and the weight of the anchored parameters instead.
        if not compact and offload.overlap and run_cfg.optimizer.importance is not None:
            undo = [PlanRow("undo copies of importance-weighted speculative steps (fp32 m, v and weight)", 0.0,
                            A * 12)]
        if bf16_form:
            master = PlanRow("fp32 master weights of the parameters without theta* (the anchored: theta* + delta)",
                             0.0, (P - A) * 4)
        else:
            master = PlanRow("fp32 master weights" + (" (theta* + delta for the anchored)" if compact else ""), 0.0,
                             P * 4)
        host_state = [master, *[PlanRow(r.what, 0.0, r.device_bytes) for r in moment_rows],
                      PlanRow(_ANCHOR_ROW, 0.0, A * anchor_bytes), *undo]
        if mixed:  # device-lean: the 16-bit model only; each gradient leaves the device as it is final
            low = _dtype_of(precision).itemsize
            accumulating = run_cfg.training.gradient_accumulation_steps > 1
            on_device = offload.accumulate == "device" and accumulating
            landing = (f"gradients in, new weights out ({precision} host landing buffers: the step writes each "
                       "weight in its gradient's place)" if bf16_form else
                       f"gradients ({precision}, host landing buffers)")
            rows = [PlanRow(f"parameters ({precision} model, the only device copy)", P * low, 0.0),
                    PlanRow(landing, 0.0, P * low)]
            if on_device:
                rows.append(PlanRow(f"gradients accumulated on the device ({precision}, between micro-batches)",
                                    P * low, 0.0))
            elif accumulating:
                rows.append(PlanRow("gradients accumulated in fp32 on the host (between micro-batches)", 0.0, P * 4))
            return rows + host_state
        copies = 0.0 if device_is_host else P * 4
        return [PlanRow("parameters (fp32 device copies of the masters)", copies, 0.0),
                PlanRow("gradients", 0.0 if offload.overlap and not device_is_host else P * 4, 0.0),
                host_state[0],
                PlanRow("gradients (fp32 host copy for the CPU step)", 0.0, copies),
                *host_state[1:]]
    if compact:
        return [PlanRow("parameters (theta* + delta for the anchored)", P * 4, 0.0), PlanRow("gradients", P * 4, 0.0),
                *moment_rows, PlanRow(_ANCHOR_ROW, A * anchor_bytes, 0.0)]
    # single / ddp: everything replicated on the device (autocast does not change storage)
    return [PlanRow("parameters", P * 4, 0.0), PlanRow("gradients", P * 4, 0.0),
            PlanRow("Adam moments (exp_avg, exp_avg_sq)", 2 * P * 4, 0.0),
            PlanRow(_ANCHOR_ROW, A * anchor_bytes, 0.0)]


def _place(nbytes: float, on_cpu: bool) -> tuple[float, float]:
    return (0.0, nbytes) if on_cpu else (nbytes, 0.0)


def format_memory_plan(rows: list[PlanRow], *, strategy: str, world_size: int) -> str:
    width = max(len(r.what) for r in rows + [PlanRow("total", 0, 0)])
    lines = [f"memory plan per rank ({strategy}, {world_size} rank(s); activations not included)",
             f"{'':{width}}  {'device GiB':>10}  {'CPU GiB':>8}"]
    for r in rows:
        lines.append(f"{r.what:{width}}  {r.device_bytes / GIB:10.3f}  {r.cpu_bytes / GIB:8.3f}")
    lines.append(f"{'total':{width}}  {sum(r.device_bytes for r in rows) / GIB:10.3f}  "
                 f"{sum(r.cpu_bytes for r in rows) / GIB:8.3f}")
    return "\n".join(lines)


@dataclass(frozen=True)
class ModelShape:
    """What the plan needs of a model: its parameter counts, from the meta device."""

    num_params: int
    num_anchored: int       # every parameter but a new classification head (theta* exists for them)
    largest_block: int      # parameters of the largest transformer block (FSDP2 unshards by block)
    largest_param: int      # elements of the largest parameter tensor (DeepSpeed's offload staging)


def model_shape(arch: Any, *, model_class: ModelClass) -> ModelShape:
    """The counts of `model_class`'s model of `arch` (the task kind's: a classifier with a new head,
    or a causal LM whose every parameter has theta*; tied weights once)."""
    model = build_model_on_meta(arch, model_class=model_class)
    head = {id(p) for name, p in model.named_parameters() if model_class.new_head and _is_head(name)}
    params = list(model.parameters())
    apply_activation_checkpointing(model)  # on the meta model: it finds the transformer blocks
    blocks = checkpointed_blocks(model)
    return ModelShape(num_params=sum(p.numel() for p in params),
                      num_anchored=sum(p.numel() for p in params if id(p) not in head),
                      largest_block=max((sum(p.numel() for p in b.parameters()) for b in blocks), default=0),
                      largest_param=max(p.numel() for p in params))


def _is_head(name: str) -> bool:
    """The sequence-classification head transformers adds: its parameters have no pretrained value."""
    return name.split(".")[0] in ("classifier", "score")


@dataclass(frozen=True)
class PeakPlan:
    """A rank's planned peak in bytes: `tensors` (what is live at the peak) and `runtime` (the CUDA
    context and the allocator's slack, on a GPU) add up to `device_peak` and `host_peak`."""

    tensors: list[PlanRow]
    runtime: list[PlanRow]
    on_gpu: bool
    assumptions: list[str] = field(default_factory=list)
    num_params: int = 0     # the model's parameters (tied weights once)

    @property
    def rows(self) -> list[PlanRow]:
        return self.tensors + self.runtime

    @property
    def device_peak(self) -> float:
        return sum(r.device_bytes for r in self.rows)

    @property
    def host_peak(self) -> float:
        return sum(r.cpu_bytes for r in self.rows)

    @property
    def process_bytes(self) -> float:
        """A CPU run's whole process (device and host are one memory, the runtime included): what its
        peak resident set should be."""
        return self.device_peak + self.host_peak

    @property
    def host_bytes_per_param(self) -> float:
        """The host peak over the model's parameters (on a CPU run: the whole process's)."""
        host = self.host_peak if self.on_gpu else self.process_bytes
        return host / self.num_params if self.num_params else 0.0

    @property
    def live_bytes(self) -> float:
        """Tensor bytes live at the peak, without the runtime rows (what torch.cuda.max_memory_allocated
        reports on a GPU); on a CPU run device and host together (one memory)."""
        device = sum(r.device_bytes for r in self.tensors)
        return device if self.on_gpu else device + sum(r.cpu_bytes for r in self.tensors)


def _dtype_of(precision: str) -> torch.dtype:
    return {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}[precision]


def plan_peak(run_cfg, arch: Any, *, task: PlannedTask, world_size: int, on_gpu: bool,
              shape: ModelShape | None = None) -> PeakPlan:
    """The peak of one training step per rank: model states (:func:`plan_memory`), the traced
    activations of one micro-batch of `task`'s model class and loss (the run's task kind: its
    trace_batch), buckets and step temporaries, what the kind keeps (its memory_rows: the
    forgetting probe's θ*) and what its micro-batch holds beyond the trace (its step_rows: the KL
    anchor's targets and buffers), and on a GPU the CUDA context and the allocator's slack. On a CPU run
    "device" and "host" are the same memory: add them."""
    shape = shape or model_shape(arch, model_class=task.model_class)
    P, W = shape.num_params, world_size
    training, strategy = run_cfg.training, run_cfg.strategy
    mixed = training.precision in ("bf16", "fp16")
    low = _dtype_of(training.precision)
    rows = plan_memory(run_cfg, world_size=W, num_params=P, num_anchored=shape.num_anchored, device_is_host=not on_gpu)
    offload = strategy.offload_optimizer if strategy.name == "single" else None
    extra: list[PlanRow] = []
    step_temporaries = bucket_epilogue = checkpoint_masters = 0.0
    if strategy.name == "deepspeed":
        ds = strategy.deepspeed
        zero = dict((ds.config or {}).get("zero_optimization", {}))
        bucket = float(zero.get("reduce_bucket_size", DEEPSPEED_REDUCE_BUCKET_ELEMENTS))
        overlap_comm = bool(zero.get("overlap_comm", ds.zero_stage == 3))
        grad_bytes = low.itemsize if mixed else 4
        if ds.zero_stage in (1, 2):
            extra.append(PlanRow("gradient reduce bucket (DeepSpeed reduce_bucket_size)",
                                 bucket * grad_bytes * (2 if overlap_comm else 1), 0.0))
        if ds.offload_optimizer and ds.zero_stage in (1, 2):
            # stage_1_and_2.py: temp_grad_buffer_for_{gpu,cpu}_offload, one largest parameter each; and
            # the largest parameter's gradient outlives the trace's peak (measured: benchmarks/memory_plan.py)
            largest = shape.largest_param * grad_bytes
            extra += [PlanRow("DeepSpeed offload staging buffers (the largest parameter, each side)", largest, largest),
                      PlanRow("the largest parameter's gradient, held until its bucket is reduced", largest, 0.0)]
            # beyond the largest gradient's row, which is part of what the reduce holds
            bucket_epilogue = min(bucket, P) * grad_bytes * DEEPSPEED_BUCKET_EPILOGUE_COPIES - largest
        trace_kw = dict(param_dtype=low if mixed else torch.float32, autocast_dtype=None, keep_grads=False)
        if not ds.offload_optimizer and on_gpu:
            step_temporaries = TORCH_STEP_TEMPORARIES * 4 * shape.num_anchored / (W if ds.zero_stage else 1)
    elif strategy.name == "fsdp":
        fsdp = strategy.fsdp
        compute = low if fsdp.mixed_precision else torch.float32
        extra.append(PlanRow("unsharded blocks (FSDP2 all-gather, with prefetch) and their gradients",
                             FSDP_UNSHARDED_BLOCKS * shape.largest_block * (compute.itemsize + 4), 0.0))
        trace_kw = dict(param_dtype=compute, autocast_dtype=None, keep_grads=False)
        if not fsdp.cpu_offload and on_gpu:
            step_temporaries = TORCH_STEP_TEMPORARIES * 4 * shape.num_anchored / W
    elif offload is not None and mixed:  # the device-lean offload: the 16-bit model, no autocast
        trace_kw = dict(param_dtype=low, autocast_dtype=None, keep_grads=False)
        window = offload.copies_in_flight or MAX_GRADS_IN_FLIGHT  # offload_optimizer.copies_in_flight
        extra.append(PlanRow(f"gradients in flight to the host (at most {window} of the largest "
                             "parameter)", window * shape.largest_param * low.itemsize, 0.0))
        extra.append(_lean_staging_row(run_cfg, shape, window, low.itemsize, on_gpu))
        if run_cfg.optimizer.state_dtype == "bfloat16" and _saves_checkpoints(run_cfg):
            # The bf16 weight form keeps no fp32 weight: a save forms theta* + delta for the checkpoint's
            # master weights, one at a time as DCP's writer reaches them (dcp_io.py; under a torch
            # whose writer was not checked for that, all of them before it starts).
            checkpoint_masters = 4.0 * (dcp_io.WRITER_THREADS * shape.largest_param if dcp_io.streams_formed_values()
                                        else shape.num_anchored)
    else:
        overlap = offload is not None and offload.overlap
        # fp32 weights; with bf16/fp16 the forward runs under autocast, by CUDA's op lists on a GPU
        trace_kw = dict(param_dtype=torch.float32, autocast_dtype=low if mixed else None, keep_grads=not overlap,
                        autocast_rules="cuda" if on_gpu else "cpu")
        if overlap:
            extra.append(PlanRow("gradient bucket handed to the CPU worker (offload bucket_mb)",
                                 offload.bucket_mb * MIB, 0.0))
        if strategy.name == "ddp":
            extra.append(PlanRow("DDP gradient buckets (a copy of the gradients)", P * 4, 0.0))
        if offload is None and on_gpu:
            step_temporaries = TORCH_STEP_TEMPORARIES * 4 * shape.num_anchored
    if on_gpu:
        arch = _without_attention_dropout(arch)
    trace = trace_micro_batch(arch, batch_size=training.per_device_batch_size, seq_len=run_cfg.data.max_seq_length,
                              checkpointing=training.activation_checkpointing, task=task,
                              fused_activations=run_cfg.model.fused_activations, **trace_kw)
    activations = _beyond_states(trace, step_temporaries)
    extra.insert(0, PlanRow(_activation_row_name(trace_kw["keep_grads"], step_temporaries), activations, 0.0))
    if bucket_epilogue:
        extra.append(PlanRow("DeepSpeed last bucket reduce after backward (its gradients + their flattened copy), "
                             "beyond the activations", max(0.0, bucket_epilogue - activations), 0.0))
    if checkpoint_masters:
        # A save runs between steps: on a CPU run (one memory) it needs what it holds beyond the step's
        # activations and gradients in flight, freed by then; on a GPU all of it, in host memory.
        step_bytes = sum(r.device_bytes for r in extra)
        extra.append(PlanRow("fp32 weights theta* + delta formed while a checkpoint saves (the anchored keep none; "
                             + ("one parameter's at a time" if dcp_io.streams_formed_values() else "all at once")
                             + (")" if on_gpu else "), beyond the step's activations and gradients in flight"), 0.0,
                             checkpoint_masters if on_gpu else max(0.0, checkpoint_masters - step_bytes)))
    if strategy.name == "deepspeed" and strategy.deepspeed.zero_stage == 3:
        # the trace held every parameter; stage 3 holds its partition (a row above) and what it gathers
        extra.append(PlanRow("parameters gathered by ZeRO-3 (prefetch)", shape.largest_block * low.itemsize, 0.0))
    extra += [PlanRow(row.what, row.device_bytes, row.host_bytes) for row in task.memory_rows(arch, world_size=W)]
    # The kind's micro-batch beyond the trace (the KL anchor's targets and buffers), alive at the peak.
    extra += [PlanRow(row.what, row.device_bytes, row.host_bytes)
              for row in task.step_rows(arch, batch_size=training.per_device_batch_size,
                                        seq_len=run_cfg.data.max_seq_length)]
    if on_gpu and offload is None:
        # A checkpoint can be saved at any step (checkpoint.every_steps, on a signal): DCP's writer
        # copies the rank's device tensors to host memory and holds them until its file is written.
        # (The offload saves its host masters and state; its device weights are copies, not saved.)
        saved = sum(r.device_bytes for r in rows if "gradient" not in r.what)
        extra.append(PlanRow("host copy of the device state while DCP saves a checkpoint", 0.0, saved))
    attention = (f"attention: {ASSUMED_ATTENTION_BACKEND}" if on_gpu else
                 "attention: the CPU's kernels (with attention dropout, the math path keeps the attention matrix)")
    assumptions = [attention, "sequences padded to data.max_seq_length (dynamic padding can only need less)"]
    runtime = [PlanRow("process runtime: Python, torch, transformers code and non-tensor memory (measured)", 0.0,
                       HOST_RUNTIME_BYTES)]
    if on_gpu:
        live = sum(r.device_bytes for r in rows + extra)
        runtime += [PlanRow(f"caching allocator slack ({ALLOCATOR_SLACK:.1%} of the live peak; measured on an H200)",
                           ALLOCATOR_SLACK * live, 0.0),
                   PlanRow("CUDA context (about 0.5 GiB; not measured here)", CUDA_CONTEXT_BYTES, 0.0)]
    return PeakPlan(tensors=rows + extra, runtime=runtime, on_gpu=on_gpu, assumptions=assumptions,
                    num_params=P)


def _lean_staging_row(run_cfg, shape: ModelShape, window: int, low_bytes: int, on_gpu: bool) -> PlanRow:
    """The device-lean offload's staging of new weights on their way to the device: with the compact
    state none (the bf16 landing buffers go as they are), on a CPU device none (a copy), else a
    ring of `window` host buffers of the largest parameter (offload_transport.StagingRing)."""
    if run_cfg.optimizer.state_dtype == "bfloat16":
        return PlanRow("staging of the new weights for the device: none (the landing buffers go)", 0.0, 0.0)
    if not on_gpu:
        return PlanRow("staging of the new weights for the device: none (a CPU device copies)", 0.0, 0.0)
    return PlanRow(f"staging of the new weights for the device ({window} pinned buffers of the largest parameter)",
                   0.0, window * shape.largest_param * low_bytes)


def _saves_checkpoints(run_cfg) -> bool:
    """Whether the run may save a checkpoint while it trains: periodically, at its best evaluation,
    for its export, or when a signal stops it (checkpoint.on_signal: save, the default)."""
    ckpt = run_cfg.checkpoint
    return bool(ckpt.every_steps or ckpt.export_dir or run_cfg.evaluation.select_best or ckpt.on_signal == "save")


def _without_attention_dropout(arch: Any) -> Any:
    """A copy of `arch` without attention dropout. CUDA's flash and memory-efficient kernels apply
    dropout without keeping a mask or the attention matrix; the CPU's flash kernel, which the trace
    runs, takes no dropout (with it the math path runs and keeps both), so the trace leaves it out."""
    arch = copy.deepcopy(arch)
    for name in ("attention_probs_dropout_prob", "attention_dropout"):
        if getattr(arch, name, None):
            setattr(arch, name, 0.0)
    return arch


def _activation_row_name(keep_grads: bool, step_temporaries: float) -> str:
    what = "activations at the peak, beyond the gradients (traced)" if keep_grads else "activations (traced)"
    return what + (" or the torch step's temporaries" if step_temporaries else "")


def _beyond_states(trace: MicroBatchTrace, step_temporaries: float) -> float:
    """What the peak holds beyond the model-state rows: the traced bytes above the parameters less
    the gradients (a row of their own), or the optimizer step's temporaries when those are more
    (the step runs once backward has freed the activations)."""
    return max(trace.above_params - trace.grad_bytes, step_temporaries, 0.0)



def format_bytes(n: float) -> str:
    """GiB with one decimal, or MiB below a tenth of a GiB (small models: the digits that matter)."""
    return f"{n / GIB:.1f} GiB" if n >= GIB / 10 else f"{n / MIB:.1f} MiB"


def format_peak_plan(plan: PeakPlan, *, title: str) -> str:
    """The plan as a table: each row's device and host GiB, then the peaks and the assumptions."""
    device, host = ("device GiB", "host GiB") if plan.on_gpu else ("memory GiB", "(same) GiB")
    width = max(len(r.what) for r in plan.rows + [PlanRow("peak per rank", 0, 0)])
    lines = [title, f"{'':{width}}  {device:>10}  {host:>10}"]
    for r in plan.rows:
        lines.append(f"{r.what:{width}}  {r.device_bytes / GIB:10.3f}  {r.cpu_bytes / GIB:10.3f}")
    lines.append(f"{'peak per rank':{width}}  {plan.device_peak / GIB:10.3f}  {plan.host_peak / GIB:10.3f}")
    lines.append(format_peaks(plan))
    lines += [f"assumed: {a}" for a in plan.assumptions]
    return "\n".join(lines)


def format_peaks(plan: PeakPlan) -> str:
    """One line: the peaks and the host bytes per parameter."""
    count = f"{plan.num_params / 1e9:.2f} B" if plan.num_params >= 1e8 else f"{plan.num_params:,}"
    if plan.on_gpu:
        return (f"device peak {format_bytes(plan.device_peak)}, host peak {format_bytes(plan.host_peak)}: "
                f"{plan.host_bytes_per_param:.1f} host bytes per parameter ({count} parameters)")
    return (f"process peak {format_bytes(plan.process_bytes)} (device and host are one memory): "
            f"{plan.host_bytes_per_param:.1f} bytes per parameter ({count} parameters)")


def peak_plan_json(plan: PeakPlan) -> dict[str, Any]:
    """The plan for scripts: peaks and rows in bytes."""
    return {"on_gpu": plan.on_gpu, "device_peak_bytes": int(plan.device_peak), "host_peak_bytes": int(plan.host_peak),
            "live_tensor_bytes": int(plan.live_bytes), "num_params": plan.num_params,
            "host_bytes_per_param": plan.host_bytes_per_param,
            "rows": [{"what": r.what, "device_bytes": int(r.device_bytes), "host_bytes": int(r.cpu_bytes)}
                     for r in plan.rows],
            "assumptions": list(plan.assumptions)}
