"""The checkpoint's manifest (MANIFEST_FILE): each parameter's shape and dtype, the saving world,
and the model's class and config (plus the tokenizer, under MODEL_SUBDIR) so that a checkpoint
exports to a Hugging Face model with no training world."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import torch

from ft_framework.errors import UserError
from ft_framework.checkpointing.fragments import ParamInfo

FORMAT = "ft_framework.sharded_checkpoint/1"
MANIFEST_FILE = "ft_checkpoint.json"
MODEL_SUBDIR = "model"           # config.json (+ tokenizer files) of the model, for export

__all__ = ["FORMAT", "MANIFEST_FILE", "MODEL_SUBDIR", "CheckpointFormatError", "describe_model", "read_manifest",
           "write_manifest"]


class CheckpointFormatError(UserError):
    """The directory is not a checkpoint of this layout, or does not fit this model/optimizer."""


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def write_manifest(directory: Path, params: list[ParamInfo], saved_by: dict[str, Any],
                   model: torch.nn.Module | None, tokenizer: Any = None) -> None:
    """Rank 0: the manifest, and the model's config (+ tokenizer) for export."""
    model_entry: dict[str, Any] | None = None
    if model is not None:
        model_entry = describe_model(model)
        config = getattr(model, "config", None)
        if config is not None and hasattr(config, "save_pretrained"):
            (directory / MODEL_SUBDIR).mkdir(exist_ok=True)
            config.save_pretrained(directory / MODEL_SUBDIR)
            model_entry["config"] = f"{MODEL_SUBDIR}/config.json"
    if tokenizer is not None:
        (directory / MODEL_SUBDIR).mkdir(exist_ok=True)
        tokenizer.save_pretrained(directory / MODEL_SUBDIR)
    manifest = {
        "format": FORMAT,
        "saved_by": saved_by,
        "params": {p.name: {"shape": list(p.shape), "dtype": _dtype_name(p.dtype)} for p in params},
        "model": model_entry,
        "tokenizer": f"{MODEL_SUBDIR}/" if tokenizer is not None else None,
    }
    tmp = directory / (MANIFEST_FILE + ".tmp")
    tmp.write_text(json.dumps(manifest, indent=1))
    os.replace(tmp, directory / MANIFEST_FILE)


def describe_model(model: torch.nn.Module) -> dict[str, Any]:
    """How export rebuilds the module: its class, and (a LoRA model) the peft adapter config."""
    entry: dict[str, Any] = {}
    base = model
    peft_config = getattr(model, "peft_config", None)
    if peft_config and hasattr(model, "get_base_model"):
        base = model.get_base_model()
        adapter = getattr(model, "active_adapter", "default")
        entry["peft"] = {"adapter": adapter, "config": _jsonable(peft_config[adapter].to_dict())}
    entry["class"] = _importable_class(type(base))
    return entry


def _importable_class(cls: type) -> str:
    """module:qualname of the model's own class. FSDP2 swaps a module's class for a generated
    subclass (FSDP<Name>) that cannot be imported: the first importable class of the MRO is it."""
    import importlib

    for candidate in cls.__mro__:
        if not issubclass(candidate, torch.nn.Module) or candidate.__module__.startswith("torch.distributed"):
            continue
        try:
            obj = importlib.import_module(candidate.__module__)
            for part in candidate.__qualname__.split("."):
                obj = getattr(obj, part)
        except (ImportError, AttributeError):
            continue
        if obj is candidate:
            return f"{candidate.__module__}:{candidate.__qualname__}"
    raise TypeError(f"no importable class in the MRO of {cls}")


def _jsonable(obj: Any) -> Any:
    if isinstance(obj, dict):
        return {str(k): _jsonable(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple, set)):
        return [_jsonable(v) for v in obj]
    if obj is None or isinstance(obj, (str, int, float, bool)):
        return obj
    return str(obj)


def read_manifest(directory: Path) -> dict[str, Any]:
    """The manifest, or a CheckpointFormatError saying what the directory is instead."""
    from ft_framework.checkpointing.legacy import legacy_format_error

    directory = Path(directory)
    path = directory / MANIFEST_FILE
    if not path.is_file():
        legacy = legacy_format_error(directory)
        if legacy:
            raise CheckpointFormatError(legacy)
        raise CheckpointFormatError(f"{directory} is not an ft_framework checkpoint (no {MANIFEST_FILE})")
    try:
        manifest = json.loads(path.read_text())
    except (OSError, ValueError) as exc:
        raise CheckpointFormatError(f"checkpoint {directory}: {MANIFEST_FILE} cannot be read ({exc}); "
                                    "resume from an earlier checkpoint") from exc
    if manifest.get("format") != FORMAT:
        raise CheckpointFormatError(f"checkpoint {directory} has format {manifest.get('format')!r}; this "
                                    f"version of ft_framework reads {FORMAT!r}")
    return manifest
