"""Loading a run config: a YAML file plus `key.sub=value` overrides, task overrides merged,
validated into a RunConfig, with errors as ConfigError messages that name the key path.

    cfg = load_config("configs/quickstart.yaml", ["training.max_steps=10"])
"""

from __future__ import annotations

import importlib.util
import os
import warnings
from copy import deepcopy
from pathlib import Path
from typing import Any, Mapping, Sequence

from pydantic import ValidationError

from ft_framework.distributed.slurm_env import check_step_tasks
from ft_framework.errors import UserError, quoted, shortened
from ft_framework.data.hub_tables import open_hub_split
from ft_framework.data.tasks import CAUSAL_LM
from ft_framework.models.hub import hub_is_offline, local_config_file, looks_like_path
from ft_framework.run.fingerprint import check_allow_list
from ft_framework.user_files import MissingFile, read_json

from ft_framework.config.errors import ConfigError, check_keys, format_validation_error
from ft_framework.config.overrides import (apply_overrides, normalized_task_overrides, parse_override, read_yaml,
                        resolve_task_overrides, set_path)
from ft_framework.config.schema import (EITHER_OR_KEYS, FILES_SOURCE, IMPORTANCE_PROBE_SOURCE, RunConfig,
                                        general_text_path)

__all__ = ["validate_config", "load_config"]

# Triton's own switch that runs a kernel in its interpreter, on CPU tensors (the tests' way of running it).
TRITON_INTERPRETER = "TRITON_INTERPRET"


def validate_config(data: dict[str, Any], *, pinned: Sequence[str] = (), where: str = "") -> RunConfig:
    """Validates a raw config mapping into a RunConfig, raising ConfigError with readable messages.

    Every `task_overrides` entry is checked (merged over the base config), not only the active one,
    so a typo in the RTE values is caught while running MNLI.
    """
    if not isinstance(data, dict):
        raise ConfigError(f"a config must be a mapping of sections, got {type(data).__name__}")
    check_keys({k: v for k, v in data.items() if k != "task_overrides"}, RunConfig, "")
    overrides = normalized_task_overrides(data)
    for task, values in overrides.items():
        check_keys(values, RunConfig, f"task_overrides.{task}.")
    base = {k: v for k, v in data.items() if k != "task_overrides"}
    merged = resolve_task_overrides({**base, "task_overrides": overrides}, pinned)
    cfg = _validate_model(merged, where)
    if cfg.checkpoint.allow_config_change:  # names keys of the resolved config
        try:
            check_allow_list(cfg.checkpoint.allow_config_change, cfg.to_dict())
        except ValueError as exc:
            raise ConfigError(str(exc)) from None
    # Command-line overrides apply to every variant, except the one that picks the task.
    variant_pins = [p for p in pinned if parse_override(p)[0] != ["data", "task"]]
    for task in overrides:
        if task == cfg.data.task:
            continue
        variant = deepcopy(base)
        set_path(variant, "data.task", task)
        variant = resolve_task_overrides({**variant, "task_overrides": overrides}, variant_pins)
        with warnings.catch_warnings():  # warnings are for the run at hand, not its variants
            warnings.simplefilter("ignore")
            _validate_model(variant, f"{where} for data.task={task} (with task_overrides.{task})".strip())
    return cfg


def _validate_model(data: dict[str, Any], where: str) -> RunConfig:
    try:
        return RunConfig.model_validate(data)
    except ValidationError as e:
        raise ConfigError(format_validation_error(e, where)) from None


def _check_paths(cfg: RunConfig) -> None:
    """Checks that files the config points to exist (relative paths: from the current directory)."""
    source = cfg.data.source
    if source not in ("hub", FILES_SOURCE) and not source.startswith("builtin:") and not Path(source).is_dir():
        raise ConfigError(f"data.source: directory {quoted(source)} not found; use 'hub', "
                          f"'builtin:quickstart', {FILES_SOURCE!r} (your own data) or a directory in the GLUE layout")
    for split, path in (cfg.data.files or {}).items():
        if not Path(path).expanduser().exists():
            raise ConfigError(f"data.files.{shortened(str(split))}: {quoted(path)} not found (relative paths start at the current "
                              f"directory, {Path.cwd()})")
    replay = cfg.data.replay
    if replay is not None and not general_text_path(replay.file).is_file():
        raise ConfigError(f"data.replay.file: {quoted(replay.file)} is not a file (relative paths start at the current "
                          f"directory, {Path.cwd()}); give a .txt file of general text or rows with a text field")
    importance = cfg.optimizer.importance
    if importance is not None and importance.source != IMPORTANCE_PROBE_SOURCE \
            and not general_text_path(importance.source).is_file():
        raise ConfigError(f"optimizer.importance.source: {quoted(importance.source)} is not a file (relative paths "
                          f"start at the current directory, {Path.cwd()}); give a .txt or .jsonl file of general text, "
                          "or probe")
    ds = cfg.strategy.deepspeed
    if ds is not None and ds.config_file is not None and not Path(ds.config_file).is_file():
        raise ConfigError(f"strategy.deepspeed.config_file: {quoted(ds.config_file)} not found")
    # A local path, not a hub id: it must exist.
    for key, name in (("model.name_or_path", cfg.model.name_or_path), ("model.tokenizer", cfg.model.tokenizer)):
        if name and looks_like_path(name) and not Path(name).expanduser().is_dir():
            raise ConfigError(f"{key}: directory {quoted(name)} not found (a local model directory must hold "
                              "config.json and the weights; a hub id looks like org/name)")
        if name and looks_like_path(name):
            if key == "model.name_or_path":
                _require_config_file(key, Path(name).expanduser())
            _refuse_custom_code(key, Path(name).expanduser())
    if cfg.data.problem == CAUSAL_LM:
        _refuse_non_causal_lm("model.name_or_path", cfg.model.name_or_path)


def _require_config_file(key: str, directory: Path) -> None:
    """A local model directory holds its config.json (as save_pretrained writes it): one missing is
    named here, not in transformers' traceback ("Unrecognized model") after the imports."""
    if not os.path.lexists(directory / "config.json"):
        raise ConfigError(f"{key}: directory {quoted(str(directory))} holds no config.json; a local model directory "
                          "holds config.json and the weights, as save_pretrained writes them")


def _refuse_custom_code(key: str, directory: Path) -> None:
    """A local model directory whose config.json names its own code (auto_map) for a model type
    transformers does not ship: every from_pretrained of ours refuses to run it (NO_REMOTE_CODE), so
    the run is refused here, in one line, before anything loads. Its config.json is read as a file a
    user hands us (a named pipe there is refused, not waited on)."""
    config = directory / "config.json"
    try:
        data = read_json(config)
    except MissingFile:
        return  # transformers says what is missing
    except UserError as exc:
        raise ConfigError(f"{key}: {exc}") from None
    if "auto_map" not in data:
        return
    # Only a config naming its own code pays for this import (transformers imports torch: seconds).
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING_NAMES

    if data.get("model_type") in CONFIG_MAPPING_NAMES:
        return  # transformers ships the type: its own code loads it, the auto_map is not used
    raise ConfigError(f"{key}: {config} names a model's own code (auto_map) for model type "
                      f"{quoted(data.get('model_type'))}, which transformers does not ship; ft_framework never runs a "
                      "model's own code (trust_remote_code=False): use a model of a type transformers ships")


def _refuse_non_causal_lm(key: str, name: str) -> None:
    """data.problem causal_lm trains the model as AutoModelForCausalLM, which transformers builds for
    an encoder too (BERT's causal-LM head is its decoder mode) and then trains something else; a model
    that is no decoder is refused here, in one line, from its config.json alone, wherever that is on
    this machine (a hub id not in the Hugging Face cache stays unchecked: nothing is downloaded here).
    A decoder: a model type with a causal-LM head in transformers (MODEL_FOR_CAUSAL_LM_MAPPING_NAMES);
    a type that has a masked-LM head too (an encoder, or an encoder-decoder: bert, roberta, bart) only
    when its config says is_decoder: true."""
    config = local_config_file(name)
    if config is None:
        return
    try:
        data = read_json(config)
    except MissingFile:
        return  # a hub cache entry without it: transformers says what is missing
    except UserError as exc:
        raise ConfigError(f"{key}: {exc}") from None
    model_type = data.get("model_type")
    if not isinstance(model_type, str):
        return  # transformers says it cannot tell the model's type
    # Only a decoder run pays for this import (transformers imports torch: seconds; the run imports it next).
    from transformers.models.auto.modeling_auto import (MODEL_FOR_CAUSAL_LM_MAPPING_NAMES,
                                                        MODEL_FOR_MASKED_LM_MAPPING_NAMES)

    if model_type not in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES:
        found = "which has no causal-LM head in transformers"
    elif model_type in MODEL_FOR_MASKED_LM_MAPPING_NAMES and data.get("is_decoder") is not True:
        kind = "an encoder-decoder" if data.get("is_encoder_decoder") is True else "an encoder"
        found = f"{kind}, not a decoder (its config.json does not set is_decoder: true)"
    else:
        return
    raise ConfigError(f"{key}: {config} is a model of type {quoted(model_type)}, {found}; data.problem "
                      f"{CAUSAL_LM} needs a decoder (a model type with a causal-LM head: llama, qwen2, gpt2, ...)")


def _check_machine(cfg: RunConfig, env: Mapping[str, str]) -> None:
    """What the config asks of the machine the run starts on, checked before anything loads: one task
    of an srun step of several under strategy single (distributed/slurm_env.py), your own Hub data set
    offline (in the Hugging Face cache), and the Triton step where it cannot run (it needs the triton
    package and CUDA tensors, bar triton's interpreter)."""
    try:
        check_step_tasks(env, distributed=cfg.strategy.name != "single")
    except UserError as exc:
        raise ConfigError(str(exc)) from None
    _check_hub_data(cfg)
    if cfg.optimizer.impl != "triton":
        return
    if importlib.util.find_spec("triton") is None:
        raise ConfigError("optimizer.impl: 'triton' needs the triton package, which is not installed (pip install "
                          "triton); use 'torch' or 'auto'")
    if env.get(TRITON_INTERPRETER, "0") == "1":  # triton's interpreter runs the kernel on CPU tensors
        return
    if getattr(cfg.strategy, "offload_optimizer", None) is not None:
        where = "the offloaded optimizer steps on the CPU (strategy.offload_optimizer)"
    elif cfg.training.device == "cpu":
        where = "this run's device is the CPU (training.device: cpu)"
    elif cfg.training.device == "auto" and not _cuda_available():
        where = "this machine has no CUDA device (training.device: auto picks the CPU)"
    else:
        return
    raise ConfigError(f"optimizer.impl: 'triton' steps CUDA tensors, but {where}; use 'torch' or 'auto'")


def _check_hub_data(cfg: RunConfig) -> None:
    """Offline (HF_HUB_OFFLINE=1), your own Hub data set loads only from the Hugging Face cache: resolve
    it and its splits there now (a local read), not after the model has loaded."""
    source = cfg.data.hub_source()
    if source is None or not hub_is_offline():
        return
    for split in source.splits:
        try:
            open_hub_split(source, split)
        except UserError as exc:
            raise ConfigError(str(exc)) from None


def _cuda_available() -> bool:
    """Whether torch sees a CUDA device: asked only for impl triton on device auto (importing torch
    takes seconds; the run imports it next anyway)."""
    import torch

    return torch.cuda.is_available()


def replacing_either_or(overrides: list[str]) -> list[str]:
    """`overrides` where one sets a key of an either-or pair (training.max_steps or num_epochs, ...)
    and none sets the other: that other set to null first. The command line's value replaces the
    file's, as transformers' max_steps replaces num_train_epochs (a task override still says which)."""
    given = dict((".".join(path), value) for path, value in map(parse_override, overrides))
    cleared = [f"{other}=null" for pair in EITHER_OR_KEYS for key, other in (pair, pair[::-1])
               if given.get(key) is not None and other not in given]
    return cleared + overrides


def load_config(path: str | Path, overrides: Sequence[str] = (), *, check_paths: bool = True) -> RunConfig:
    """Reads a YAML config, applies `key.sub=value` overrides, merges task_overrides and validates.

    Overrides win over the task's values in task_overrides; each value is parsed as YAML
    (`training.max_steps=10`, `optimizer.hparams.betas=[0.9,0.98]`).
    """
    overrides = replacing_either_or(list(overrides))
    data = apply_overrides(read_yaml(path), overrides)
    cfg = validate_config(data, pinned=overrides, where=f"({path})")
    if check_paths:  # against the machine the run starts on (ft-plan plans for another: it passes False)
        _check_paths(cfg)
        _check_machine(cfg, os.environ)
    return cfg
