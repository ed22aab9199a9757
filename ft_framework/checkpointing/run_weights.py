"""A finished run's weights θ as it reported them (its export, its best checkpoint, or its last one
when that is of its final step), and the fp32 anchors θ* saved with them: read from every layout a
strategy writes (the sharded layout, the older single/DDP files, DeepSpeed's consolidated file,
torch.distributed.checkpoint) as data, never unpickled. ft-interpolate reads θ and θ* here.

    theta, anchors, source = finetuned_state(run_dir, results, model, model_class=kind.model_class,
                                             lora=cfg.model.lora, new_names=loaded.new_parameter_names)
"""

from __future__ import annotations

import copy
import pickle
from pathlib import Path
from typing import Any

import torch
from torch import nn

from ft_framework.checkpointing.dcp_read import DCP_METADATA, read_whole_checkpoint
from ft_framework.checkpointing.fragments import ANCHOR, MASTER
from ft_framework.checkpointing.layout import read_buffers, read_fields
from ft_framework.checkpointing.manager import CheckpointError, resolve_latest
from ft_framework.checkpointing.manifest import MANIFEST_FILE, check_files
from ft_framework.checkpointing.old_formats import DEEPSPEED_CONSOLIDATED, SINGLE_MODEL, SINGLE_OPTIMIZER
from ft_framework.errors import UserError
from ft_framework.models.loading import ModelClass
from ft_framework.models.lora import apply_lora, merged_copy
from ft_framework.run.files import COMPLETE_MARKER, RunPaths
from ft_framework.user_files import NO_REMOTE_CODE, open_binary, read_json, refused_entries

__all__ = ["RunWeightsError", "anchors_from_checkpoint", "checkpoint_model_state", "finetuned_state", "load_tensors"]


class RunWeightsError(UserError):
    """The run's weights cannot be read (none saved, an unfinished run, a damaged or foreign file);
    the message says why."""


def load_tensors(path: Path) -> Any:
    """A torch file read as data (weights_only: tensors, containers, numbers, strings); a file that
    would need unpickling of anything else (code) is refused in one line."""
    try:
        with open_binary(path, root=path.parent) as f:  # a regular file inside its checkpoint
            return torch.load(f, map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as exc:
        raise RunWeightsError(f"{path} holds objects other than tensors and plain data, which are never "
                                 "unpickled (they could run code): it is not a file ft_framework wrote") from exc


def _is_lora_state(state: dict[str, torch.Tensor]) -> bool:
    return any(".lora_A." in k or k.startswith("base_model.model.") for k in state)


def _refuse_links_out(directory: Path) -> Path:
    """`directory` when no symlink in it leads out of it (path_containment.py) and nothing in it is a
    named pipe or a device (user_files.py): checked before anything in it is opened."""
    escaped = refused_entries(directory) if Path(directory).is_dir() else []
    if escaped:
        raise RunWeightsError(f"{directory}: {escaped[0]}")
    return directory


def checkpoint_model_state(directory: Path) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor] | None]:
    """(model state dict, fp32 anchors by parameter name or None) of one checkpoint, any strategy."""
    _refuse_links_out(directory)
    if (directory / MANIFEST_FILE).is_file():  # the sharded layout every strategy writes
        damaged = check_files(directory)
        if damaged:
            raise RunWeightsError(f"checkpoint {directory} is damaged: {'; '.join(damaged)}")
        fields = read_fields(directory, fields=(MASTER, ANCHOR))
        anchors = {name: f[ANCHOR] for name, f in fields.items() if ANCHOR in f}  # saved dtype: auto
        # picks them only when fp32 (exact); bfloat16 anchors fall back to the pretrained model
        return {**read_buffers(directory), **{name: f[MASTER] for name, f in fields.items()}}, anchors or None
    if (directory / SINGLE_MODEL).is_file():  # single / DDP (before the sharded layout)
        model = load_tensors(directory / SINGLE_MODEL)
        anchors = None
        opt_path = directory / SINGLE_OPTIMIZER
        if opt_path.is_file():
            opt = load_tensors(opt_path).get("optimizer", {})
            anchors = _anchors_from_optimizer_state(opt)
        return model, anchors
    consolidated = directory / DEEPSPEED_CONSOLIDATED
    if consolidated.is_file():  # DeepSpeed
        saved = load_tensors(consolidated)
        model = {name: entry["fp32"] for name, entry in saved["params"].items()}
        anchors = {name: entry["anchor"] for name, entry in saved["params"].items() if "anchor" in entry}
        return model, anchors or None
    if (directory / DCP_METADATA).is_file():  # FSDP: torch.distributed.checkpoint
        full = read_whole_checkpoint(directory)  # .metadata and non-tensor entries read as data
        model = full["model"]
        states = (full.get("optimizer") or {}).get("state") or {}
        anchors = {fqn: s["anchor"] for fqn, s in states.items() if isinstance(s, dict) and "anchor" in s}
        return model, anchors or None
    raise RunWeightsError(f"{directory} holds no model weights this tool can read")


def _anchors_from_optimizer_state(opt: dict[str, Any]) -> dict[str, torch.Tensor] | None:
    """Anchors by parameter name from an AnchoredOptimizer state dict (groups keep param_names)."""
    out = {}
    for group in opt.get("param_groups", []):
        names = group.get("param_names")
        if not names:
            continue
        for idx, name in zip(group["params"], names):
            state = opt.get("state", {}).get(idx, {})
            if "anchor" in state:
                out[name] = state["anchor"]
    return out or None


def anchors_from_checkpoint(directory: str | Path) -> dict[str, torch.Tensor] | None:
    """θ* as the optimizer saved it in a checkpoint (by parameter name), or None when it has none."""
    return checkpoint_model_state(Path(directory))[1]


def finetuned_state(run_dir: str | Path, results: dict[str, Any], model: nn.Module, *, model_class: ModelClass,
                    lora: Any = None, new_names: list[str] | None = None
                    ) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor] | None, str]:
    """(θ as a state dict of the plain model, anchors saved with it or None, where θ came from).

    `model` is a plain model of the run's architecture, of `model_class` (the run's task kind's),
    used to merge a LoRA state dict (`lora`: the run's model.lora; `new_names`: the parameters
    without θ*, which LoRA trains whole)."""
    run_dir = Path(run_dir)
    paths = RunPaths(run_dir)
    reported = results.get("reported", "final")
    exported = results.get("exported_to")
    if exported and Path(exported).is_dir():
        _refuse_links_out(Path(exported))
        import transformers  # slow: imported where used

        auto_class = getattr(transformers, model_class.auto_class)
        loaded = auto_class.from_pretrained(exported, dtype=torch.float32, **dict(model_class.config_values),
                                            **NO_REMOTE_CODE)
        return loaded.state_dict(), None, f"export {exported}"
    if reported == "best":
        best = _refuse_links_out(paths.best_checkpoint)
        if not (best / COMPLETE_MARKER).is_file():
            raise RunWeightsError(f"{run_dir} reports its best evaluation but {best} is not a complete checkpoint")
        state, anchors = checkpoint_model_state(best)
        return _plain_state(state, model, lora, new_names or []), anchors, str(best)
    if paths.latest_checkpoint.is_file():
        try:
            directory = _refuse_links_out(resolve_latest(paths.latest_checkpoint))
        except CheckpointError as exc:
            raise RunWeightsError(str(exc)) from exc
        try:  # a regular file inside the checkpoint (a named pipe there would block the read)
            marker = read_json(directory / COMPLETE_MARKER, root=directory, entry=f"the {COMPLETE_MARKER} marker")
        except UserError as exc:
            raise RunWeightsError(f"checkpoint {directory}: {exc}") from exc
        step = marker.get("step", -1)
        if type(step) is not int:
            raise RunWeightsError(f"checkpoint {directory}: its {COMPLETE_MARKER} marker records no step")
        if step == results.get("steps"):
            state, anchors = checkpoint_model_state(directory)
            return _plain_state(state, model, lora, new_names or []), anchors, str(directory)
        raise RunWeightsError(f"the last checkpoint of {run_dir} is at step {step}, the run ended at step "
                                 f"{results.get('steps')}: its final weights were not saved")
    raise RunWeightsError(
        f"{run_dir} saved no weights to interpolate: run it with checkpoint.export_dir set (or "
        "checkpoint.every_steps dividing the run's length, or evaluation.select_best)")


def _plain_state(state: dict[str, torch.Tensor], model: nn.Module, lora: Any,
                 new_names: list[str]) -> dict[str, torch.Tensor]:
    """A state dict of the plain model: a LoRA state dict is loaded into a LoRA model and merged."""
    if not _is_lora_state(state):
        return state
    if lora is None:
        raise RunWeightsError("the run's weights are a LoRA model's, but its config sets no model.lora")
    lora_model = apply_lora(copy.deepcopy(model), lora, new_names)
    lora_model.load_state_dict(state)
    return merged_copy(lora_model).state_dict()


