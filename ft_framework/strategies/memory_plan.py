"""Per-rank memory plan of a run: bytes of parameters, gradients, optimizer state and anchors,
on the device and on the CPU, for the chosen strategy. Activations, communication buckets and
the allocator's slack are not included (they depend on batch and sequence length)."""

from __future__ import annotations

from dataclasses import dataclass

GIB = 1024**3


@dataclass(frozen=True)
class PlanRow:
    what: str
    device_bytes: float
    cpu_bytes: float


def plan_memory(run_cfg, *, world_size: int, num_params: int, num_anchored: int) -> list[PlanRow]:
    """Rows for the run's strategy (single, ddp, deepspeed, fsdp)."""
    precision = run_cfg.training.precision
    mixed = precision in ("bf16", "fp16")
    anchor_bytes = 2 if run_cfg.optimizer.anchor_dtype == "bfloat16" else 4
    P, A, W = num_params, num_anchored, world_size
    strategy = run_cfg.strategy
    if strategy.name == "deepspeed":
        ds = strategy.deepspeed
        stage, off_opt, off_par = ds.zero_stage, ds.offload_optimizer, ds.offload_param
        weight_bytes = 2 if mixed else 4
        shard = W if stage >= 1 else 1
        rows = [
            PlanRow("parameters (model copy)", *_place(P * weight_bytes / (W if stage == 3 else 1), off_par)),
            PlanRow("gradients", P * weight_bytes / (W if stage >= 2 else 1), 0.0),
        ]
        if off_opt:
            rows.append(PlanRow("gradients (fp32 partition for the CPU step)", 0.0, P * 4 / shard))
        if stage >= 1 or mixed:
            rows.append(PlanRow("fp32 master weights", *_place(P * 4 / shard, off_opt)))
        rows += [PlanRow("Adam moments (exp_avg, exp_avg_sq)", *_place(2 * P * 4 / shard, off_opt)),
                 PlanRow("anchors theta*", *_place(A * anchor_bytes / shard, off_opt))]
        return rows
    if strategy.name == "fsdp":
        off = strategy.fsdp.cpu_offload
        return [PlanRow("parameters (fp32 shards)", *_place(P * 4 / W, off)),
                PlanRow("gradients (fp32 shards)", *_place(P * 4 / W, off)),
                PlanRow("Adam moments (exp_avg, exp_avg_sq)", *_place(2 * P * 4 / W, off)),
                PlanRow("anchors theta*", *_place(A * anchor_bytes / W, off))]
    # single / ddp: everything replicated on the device (autocast does not change storage)
    return [PlanRow("parameters", P * 4, 0.0), PlanRow("gradients", P * 4, 0.0),
            PlanRow("Adam moments (exp_avg, exp_avg_sq)", 2 * P * 4, 0.0),
            PlanRow("anchors theta*", A * anchor_bytes, 0.0)]


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
