"""Typed schema of a run's YAML config, and the loader that turns a file plus overrides into it.

A run config has one section per concern (model, data, optimizer, schedule, training, evaluation,
strategy, logging, checkpoint) and an optional ``task_overrides`` map with per-GLUE-task values.
Every section rejects unknown keys; :func:`load_config` reports them (and bad values) as a
:class:`ConfigError` that names the offending key path and lists what is valid there.

    cfg = load_config("configs/quickstart.yaml", ["training.max_steps=10"])

The package's modules:
    schema.py     the pydantic sections and RunConfig (add new fields here)
    overrides.py  YAML reading, `key=value` overrides, set_path, the task_overrides engine
    yaml_loader.py  the YAML loader: duplicate keys refused, aliases bounded (ALIAS_NODE_LIMIT)
    loading.py    validate_config / load_config: the above put together, and path checks
    errors.py     ConfigError and the formatting of validation errors
"""

from ft_framework.data.tasks import GLUE_TASK_NAMES

from ft_framework.config.errors import ConfigError
from ft_framework.config.loading import load_config, validate_config
from ft_framework.dotted import flatten_dotted
from ft_framework.config.overrides import apply_overrides, parse_override, read_yaml, resolve_task_overrides, set_path
from ft_framework.config.schema import (
    BUILTIN_DATA_SOURCES,
    CheckpointConfig,
    DataConfig,
    DeepSpeedConfig,
    EvaluationConfig,
    FSDPConfig,
    GlueTask,
    LoggingConfig,
    ModelConfig,
    OptimizerConfig,
    RunConfig,
    ScheduleConfig,
    StrategyConfig,
    TrainingConfig,
)

__all__ = [
    "GLUE_TASK_NAMES",
    "GlueTask",
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
    "set_path",
    "flatten_dotted",
    "read_yaml",
    "resolve_task_overrides",
]
