"""Weight-space interpolation toward θ* (WiSE-FT, Wortsman et al. 2022): evaluate

    θ_α = θ* + α (θ − θ*),   α ∈ [0, 1]

for a finished run on its eval splits, in one process, whatever strategy trained it.

    ft-interpolate runs/quickstart --alphas 0,0.25,0.5,0.75,1

- θ is the run's reported weights (results.json's "reported": the final ones, or the best with
  evaluation.select_best): its export (checkpoint.export_dir, a save_pretrained directory; a LoRA
  run exports its merged weights), else the best checkpoint (checkpoints/best), else the last
  checkpoint when it is the final step (single/DDP model.pt, DeepSpeed's consolidated file, FSDP's torch.distributed.checkpoint).
  A LoRA run's checkpoint is merged first.
- θ* is read from the anchors the checkpoint saved when θ comes from a checkpoint with fp32 anchors,
  else from the pretrained model the run's config names (model.name_or_path). The two are the same
  tensors: the anchors are fp32 copies of that model's weights, taken before anything changed them.
  Under RI (model.init: random) θ* is still the pretrained checkpoint — RI re-initialized the
  model the run started from, not the point RecAdam pulls toward — so α = 0 is the pretrained
  model, not the random one.
- Parameters without θ* (the new classification head) keep θ for every α: α = 0 is the pretrained
  encoder under the fine-tuned head, the only classifier there is.

Writes <run>/interpolation.json and <run>/interpolation.png, and prints a table of α, the metrics
of each eval split and ‖θ_α − θ*‖₂ (over the parameters that have a θ*; = α ‖θ − θ*‖₂).
"""

from __future__ import annotations

import copy
import json
import logging
import math
import pickle
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Sequence

import numpy as np
import torch
from torch import nn

from ft_framework.checkpointing import ANCHOR, MANIFEST_FILE, MASTER, read_fields
from ft_framework.checkpointing.dcp_read import DCP_METADATA, read_whole_checkpoint
from ft_framework.checkpointing.layout import read_buffers
from ft_framework.checkpointing.manager import CheckpointError, resolve_latest
from ft_framework.checkpointing.manifest import check_files
from ft_framework.checkpointing.old_formats import DEEPSPEED_CONSOLIDATED, SINGLE_MODEL, SINGLE_OPTIMIZER
from ft_framework.config import validate_config
from ft_framework.config.schema import DEFAULT_INTERPOLATION_ALPHAS
from ft_framework.data import TaskSpec, load_task_data, make_collator
from ft_framework.errors import UserError
from ft_framework.data.tasks import CAUSAL_LM
from ft_framework.metrics import compute_metrics
from ft_framework.models.forgetting import FORGETTING_MEASURES, build_probe
from ft_framework.models.loading import load_model, load_tokenizer
from ft_framework.models.lora import apply_lora, merged_copy
from ft_framework.user_files import NO_REMOTE_CODE, open_binary, read_json, refused_entries
from ft_framework.run.files import (CHECKPOINTS_DIR, COMPLETE_MARKER, INTERPOLATION_FILE, INTERPOLATION_PLOT,
                                    LATEST_FILE, RunPaths)
from ft_framework.run.tracking import log_artifacts_to_run
from ft_framework.task_kinds import model_class_of

logger = logging.getLogger(__name__)

__all__ = ["DEFAULT_ALPHAS", "InterpolationError", "parse_alphas",
           "load_run", "finetuned_state", "anchors_from_checkpoint", "interpolate_state",
           "run_interpolation", "format_table", "plot_interpolation"]

DEFAULT_ALPHAS = DEFAULT_INTERPOLATION_ALPHAS



class InterpolationError(UserError):
    """The run cannot be interpolated (no weights saved, unfinished run, ...); the message says why."""


def parse_alphas(text: str | Sequence[float] | None) -> list[float]:
    """ "0,0.5,1" -> [0.0, 0.5, 1.0]; sorted, each in [0, 1]; None: 0, 0.1, ..., 1."""
    if text is None:
        return list(DEFAULT_ALPHAS)
    values = [float(x) for x in text.split(",") if x.strip()] if isinstance(text, str) else [float(x) for x in text]
    if not values:
        raise InterpolationError("--alphas needs at least one value, e.g. 0,0.5,1")
    bad = [a for a in values if not 0.0 <= a <= 1.0 or math.isnan(a)]
    if bad:
        raise InterpolationError(f"alphas must lie in [0, 1] (θ* at 0, the run at 1), got {bad}")
    return sorted(set(values))


# --------------------------------------------------------------------------------------------------
# The run, θ and θ*
# --------------------------------------------------------------------------------------------------


def load_run(run_dir: str | Path) -> tuple[Any, dict[str, Any]]:
    """The run's validated config (as it ran) and its results.json."""
    run_dir = Path(run_dir)
    path = RunPaths(run_dir).results
    if not path.is_file():
        raise InterpolationError(f"{run_dir} has no results.json: not a finished run's output directory")
    results = read_json(path, root=run_dir, entry="results.json")  # a regular file, bounded, an object
    data = results.get("config")
    if not isinstance(data, dict):
        raise InterpolationError(f"{path} holds no config")
    data = json.loads(json.dumps(data))
    # Trackers are not needed (nor perhaps installed) to evaluate.
    logging_data = data.get("logging") or {}
    for key in ("report_to",):
        logging_data.pop(key, None)
    logging_data["tensorboard"] = False
    return validate_config(data, where=f"(config of {run_dir})"), results


def _load_tensors(path: Path) -> Any:
    """A torch file read as data (weights_only: tensors, containers, numbers, strings); a file that
    would need unpickling of anything else (code) is refused in one line."""
    try:
        with open_binary(path, root=path.parent) as f:  # a regular file inside its checkpoint
            return torch.load(f, map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as exc:
        raise InterpolationError(f"{path} holds objects other than tensors and plain data, which are never "
                                 "unpickled (they could run code): it is not a file ft_framework wrote") from exc


def run_dir_of(path: str | Path) -> Path:
    """The run's output directory from any path a user would pass: the run directory, its
    checkpoints/ directory, the checkpoints/latest pointer, or a checkpoint directory."""
    path = Path(path)
    if RunPaths(path).results.is_file():
        return path
    if path.name == LATEST_FILE and path.is_file():
        path = path.parent
    if path.name == CHECKPOINTS_DIR and path.is_dir():
        return path.parent
    if path.parent.name == CHECKPOINTS_DIR and path.is_dir():
        return path.parent.parent
    return path  # load_run says what is missing


def _is_lora_state(state: dict[str, torch.Tensor]) -> bool:
    return any(".lora_A." in k or k.startswith("base_model.model.") for k in state)


def _refuse_links_out(directory: Path) -> Path:
    """`directory` when no symlink in it leads out of it (path_containment.py) and nothing in it is a
    named pipe or a device (user_files.py): checked before anything in it is opened."""
    escaped = refused_entries(directory) if Path(directory).is_dir() else []
    if escaped:
        raise InterpolationError(f"{directory}: {escaped[0]}")
    return directory


def _checkpoint_model_state(directory: Path) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor] | None]:
    """(model state dict, fp32 anchors by parameter name or None) of one checkpoint, any strategy."""
    _refuse_links_out(directory)
    if (directory / MANIFEST_FILE).is_file():  # the sharded layout every strategy writes
        damaged = check_files(directory)
        if damaged:
            raise InterpolationError(f"checkpoint {directory} is damaged: {'; '.join(damaged)}")
        fields = read_fields(directory, fields=(MASTER, ANCHOR))
        anchors = {name: f[ANCHOR] for name, f in fields.items() if ANCHOR in f}  # saved dtype: auto
        # picks them only when fp32 (exact); bfloat16 anchors fall back to the pretrained model
        return {**read_buffers(directory), **{name: f[MASTER] for name, f in fields.items()}}, anchors or None
    if (directory / SINGLE_MODEL).is_file():  # single / DDP (before the sharded layout)
        model = _load_tensors(directory / SINGLE_MODEL)
        anchors = None
        opt_path = directory / SINGLE_OPTIMIZER
        if opt_path.is_file():
            opt = _load_tensors(opt_path).get("optimizer", {})
            anchors = _anchors_from_optimizer_state(opt)
        return model, anchors
    consolidated = directory / DEEPSPEED_CONSOLIDATED
    if consolidated.is_file():  # DeepSpeed
        saved = _load_tensors(consolidated)
        model = {name: entry["fp32"] for name, entry in saved["params"].items()}
        anchors = {name: entry["anchor"] for name, entry in saved["params"].items() if "anchor" in entry}
        return model, anchors or None
    if (directory / DCP_METADATA).is_file():  # FSDP: torch.distributed.checkpoint
        full = read_whole_checkpoint(directory)  # .metadata and non-tensor entries read as data
        model = full["model"]
        states = (full.get("optimizer") or {}).get("state") or {}
        anchors = {fqn: s["anchor"] for fqn, s in states.items() if isinstance(s, dict) and "anchor" in s}
        return model, anchors or None
    raise InterpolationError(f"{directory} holds no model weights this tool can read")


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
    return _checkpoint_model_state(Path(directory))[1]


def finetuned_state(run_dir: str | Path, cfg: Any, results: dict[str, Any], model: nn.Module
                    ) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor] | None, str]:
    """(θ as a state dict of the plain model, anchors saved with it or None, where θ came from).

    `model` is a plain model of the run's architecture (used to merge a LoRA state dict)."""
    run_dir = Path(run_dir)
    paths = RunPaths(run_dir)
    reported = results.get("reported", "final")
    exported = results.get("exported_to")
    if exported and Path(exported).is_dir():
        _refuse_links_out(Path(exported))
        from transformers import AutoModelForSequenceClassification

        loaded = AutoModelForSequenceClassification.from_pretrained(exported, dtype=torch.float32, **NO_REMOTE_CODE)
        return loaded.state_dict(), None, f"export {exported}"
    if reported == "best":
        best = _refuse_links_out(paths.best_checkpoint)
        if not (best / COMPLETE_MARKER).is_file():
            raise InterpolationError(f"{run_dir} reports its best evaluation but {best} is not a complete checkpoint")
        state, anchors = _checkpoint_model_state(best)
        return _plain_state(state, cfg, model), anchors, str(best)
    if paths.latest_checkpoint.is_file():
        try:
            directory = _refuse_links_out(resolve_latest(paths.latest_checkpoint))
        except CheckpointError as exc:
            raise InterpolationError(str(exc)) from exc
        try:  # a regular file inside the checkpoint (a named pipe there would block the read)
            marker = read_json(directory / COMPLETE_MARKER, root=directory, entry=f"the {COMPLETE_MARKER} marker")
        except UserError as exc:
            raise InterpolationError(f"checkpoint {directory}: {exc}") from exc
        step = marker.get("step", -1)
        if type(step) is not int:
            raise InterpolationError(f"checkpoint {directory}: its {COMPLETE_MARKER} marker records no step")
        if step == results.get("steps"):
            state, anchors = _checkpoint_model_state(directory)
            return _plain_state(state, cfg, model), anchors, str(directory)
        raise InterpolationError(f"the last checkpoint of {run_dir} is at step {step}, the run ended at step "
                                 f"{results.get('steps')}: its final weights were not saved")
    raise InterpolationError(
        f"{run_dir} saved no weights to interpolate: run it with checkpoint.export_dir set (or "
        "checkpoint.every_steps dividing the run's length, or evaluation.select_best)")


def _plain_state(state: dict[str, torch.Tensor], cfg: Any, model: nn.Module) -> dict[str, torch.Tensor]:
    """A state dict of the plain model: a LoRA state dict is loaded into a LoRA model and merged."""
    if not _is_lora_state(state):
        return state
    lora_model = apply_lora(copy.deepcopy(model), cfg.model.lora, _new_names(model, cfg))
    lora_model.load_state_dict(state)
    return merged_copy(lora_model).state_dict()


def _new_names(model: nn.Module, cfg: Any) -> list[str]:
    return getattr(model, "_ft_new_parameter_names", [])


def interpolate_state(theta: dict[str, torch.Tensor], theta_star: dict[str, torch.Tensor],
                      alpha: float) -> dict[str, torch.Tensor]:
    """θ* + α (θ − θ*) for every tensor with a θ*; the others (head, buffers) keep θ. fp32."""
    out = {}
    for name, value in theta.items():
        anchor = theta_star.get(name)
        if anchor is not None and value.is_floating_point():
            t, a = value.to(torch.float32), anchor.to(torch.float32)
            out[name] = a + alpha * (t - a) if alpha != 1.0 else t.clone()
        else:
            out[name] = value
    return out


def distance(theta: dict[str, torch.Tensor], theta_star: dict[str, torch.Tensor]) -> float:
    total = 0.0
    for name, anchor in theta_star.items():
        if name in theta:
            total += float((theta[name].double() - anchor.double()).square().sum())
    return math.sqrt(total)


# --------------------------------------------------------------------------------------------------
# Evaluation
# --------------------------------------------------------------------------------------------------


@dataclass
class _EvalSet:
    task: TaskSpec
    data: Any
    collate: Any
    batch_size: int


@torch.no_grad()
def _evaluate(model: nn.Module, ev: _EvalSet, device: torch.device) -> dict[str, dict[str, float]]:
    from torch.utils.data import DataLoader

    model.eval()
    out = {}
    for split, dataset in ev.data.eval.items():
        loader = DataLoader([dataset[i] for i in range(len(dataset))], batch_size=ev.batch_size,
                            collate_fn=ev.collate)
        logits = []
        for batch in loader:
            batch = {k: v.to(device) for k, v in batch.items() if k != "labels"}
            logits.append(model(**batch).logits.float().cpu())
        out[split] = compute_metrics(ev.task, torch.cat(logits).numpy(), ev.data.eval_labels[split])
    return out


def run_interpolation(run_dir: str | Path, alphas: Sequence[float] | None = None, *, device: str = "cpu",
                      theta_star: str = "auto", write: bool = True, plot: bool = True) -> dict[str, Any]:
    """Evaluates θ_α for each α; returns (and writes) the content of interpolation.json.

    `theta_star`: "auto" (the checkpoint's fp32 anchors when θ comes from a checkpoint that has
    them, else the pretrained model), "anchors" (require them) or "pretrained"."""
    run_dir = run_dir_of(run_dir)
    alphas = parse_alphas(alphas)
    cfg, results = load_run(run_dir)
    task = cfg.data.task_spec()
    # The pretrained model as the config names it: θ* (and the architecture to evaluate with).
    plain_cfg = cfg.model.model_copy(update={"init": "pretrained", "reinit_top_layers": 0, "mixout": 0.0,
                                             "dtype": "float32", **({"lora": None} if "lora" in type(cfg.model).model_fields else {})})
    if task.kind == CAUSAL_LM:
        raise InterpolationError(f"{run_dir} fine-tuned a causal LM (data.problem: {CAUSAL_LM}); ft-interpolate "
                                 "scores sequence classifiers only")
    loaded = load_model(plain_cfg, model_class=model_class_of(task, cfg), seed=cfg.training.seed)
    model = loaded.model
    model._ft_new_parameter_names = loaded.new_parameter_names
    theta, anchors, source = finetuned_state(run_dir, cfg, results, model)
    pretrained = loaded.pretrained_state
    fp32_anchors = anchors is not None and all(a.dtype == torch.float32 for a in anchors.values())
    if theta_star == "anchors" and not fp32_anchors:
        raise InterpolationError(f"θ came from {source}, which holds no fp32 anchors; use --theta-star pretrained")
    if theta_star == "pretrained" or (theta_star == "auto" and not fp32_anchors):
        star, star_source = pretrained, f"pretrained model {cfg.model.name_or_path}"
    else:
        star, star_source = {k: v.to(torch.float32) for k, v in anchors.items()}, f"anchors in {source}"
    missing = sorted(set(star) - set(theta))
    if missing:
        raise InterpolationError(f"θ ({source}) lacks parameters that have a θ*: {missing[:5]}")

    tokenizer = load_tokenizer(cfg.model.tokenizer or cfg.model.name_or_path)
    data = load_task_data(task, tokenizer=tokenizer, **cfg.data.loader_arguments())
    ev = _EvalSet(task, data, make_collator(tokenizer), cfg.evaluation.batch_size)
    dev = torch.device(device)
    model.to(dev)
    # The run's own probe settings: θ_α's forgetting reads like the run's evaluations.
    probe = build_probe(cfg.evaluation.forgetting, model_name_or_path=cfg.model.name_or_path, tokenizer=tokenizer,
                        batch_size=cfg.evaluation.batch_size, device=dev)
    full = distance(theta, star)
    rows = []
    for alpha in alphas:
        state = interpolate_state(theta, star, alpha)
        model.load_state_dict(state, strict=True)
        metrics = _evaluate(model, ev, dev)
        rows.append({"alpha": alpha, "metrics": metrics, "distance": alpha * full})
        if probe is not None:
            rows[-1]["forgetting"] = probe.measure(lambda batch: model(**batch))
        logger.info("alpha=%g %s", alpha, metrics)
    selection = results.get("selection_split", task.eval_splits[0])
    main = results.get("main_metric", task.main_metric)
    best = max(rows, key=lambda r: (r["metrics"][selection][main], -abs(r["alpha"] - 1.0)))
    out = {
        "run_dir": str(run_dir), "task": task.name, "main_metric": main, "selection_split": selection,
        "theta_source": source, "theta_star_source": star_source, "distance_full": full,
        "reported_metrics": results[results.get("reported", "final")]["metrics"],
        "method": _method_label(cfg), "alphas": alphas, "rows": rows, "best_alpha": best["alpha"],
        **({"forgetting_probe": probe.describe()} if probe is not None else {}),
    }
    if write:
        (run_dir / INTERPOLATION_FILE).write_text(json.dumps(out, indent=2, allow_nan=True))
        written = [run_dir / INTERPOLATION_FILE]
        if plot:
            written.append(plot_interpolation(out, run_dir / INTERPOLATION_PLOT))
        try:
            log_artifacts_to_run(run_dir, written)
        except Exception as exc:  # noqa: BLE001 - a tracker being down must not lose the result
            logger.warning("could not attach the interpolation files to the run's trackers: %s", exc)
    return out


def _method_label(cfg: Any) -> str:
    if getattr(cfg.model, "lora", None) is not None:
        return f"lora+{cfg.optimizer.name}"
    return cfg.optimizer.name


def format_table(out: dict[str, Any]) -> str:
    """α, the metrics of every eval split, ‖θ_α − θ*‖₂ and the functional forgetting: one row per α
    (the best on dev marked)."""
    columns = [(split, name) for split, metrics in out["rows"][0]["metrics"].items() for name in metrics]
    forgetting = [name for name in FORGETTING_MEASURES
                  if name in out["rows"][0].get("forgetting", {})]
    header = ["alpha", *[f"{s}/{n}" for s, n in columns], "||theta_a - theta*||", *forgetting]
    rows = []
    for r in out["rows"]:
        mark = " *" if r["alpha"] == out["best_alpha"] else ""
        rows.append([f"{r['alpha']:g}{mark}", *[f"{r['metrics'][s][n]:.4f}" for s, n in columns],
                     f"{r['distance']:.4f}", *[f"{r['forgetting'][n]:.4g}" for n in forgetting]])
    widths = [max(len(x) for x in col) for col in zip(header, *rows)]
    lines = ["  ".join(c.rjust(w) for c, w in zip(header, widths)), "  ".join("-" * w for w in widths)]
    lines += ["  ".join(c.rjust(w) for c, w in zip(row, widths)) for row in rows]
    lines.append("")
    lines.append(f"* best {out['main_metric']} on {out['selection_split']}: alpha = {out['best_alpha']:g}. "
                 f"θ from {out['theta_source']}; θ* from {out['theta_star_source']}.")
    return "\n".join(lines)


def plot_interpolation(out: dict[str, Any] | Sequence[dict[str, Any]], path: str | Path,
                       labels: Sequence[str] | None = None) -> Path:
    """Main metric against α (and against ‖θ_α − θ*‖₂) for one run or several (one line each)."""
    from matplotlib.figure import Figure

    runs = [out] if isinstance(out, dict) else list(out)
    fig = Figure(figsize=(9, 3.6))
    ax_a, ax_d = fig.subplots(1, 2)
    for i, run in enumerate(runs):
        label = labels[i] if labels else run.get("method", "run")
        alphas = [r["alpha"] for r in run["rows"]]
        scores = [r["metrics"][run["selection_split"]][run["main_metric"]] for r in run["rows"]]
        dists = [r["distance"] for r in run["rows"]]
        ax_a.plot(alphas, scores, marker="o", label=label)
        ax_d.plot(dists, scores, marker="o", label=label)
    metric = f"{runs[0]['selection_split']} {runs[0]['main_metric']}"
    ax_a.set_xlabel("α (0: θ*, 1: fine-tuned)")
    ax_a.set_ylabel(metric)
    ax_d.set_xlabel("‖θ_α − θ*‖₂")
    ax_a.set_title("WiSE-FT interpolation")
    ax_d.set_title("score vs distance from θ*")
    for ax in (ax_a, ax_d):
        ax.grid(alpha=0.3)
    ax_a.legend(fontsize="small")
    fig.tight_layout()
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    return path


def mean_curves(outs: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """The rows of several runs' interpolation.json averaged over runs (same alphas), for reports."""
    first = outs[0]
    rows = []
    for i, row in enumerate(first["rows"]):
        metrics = {split: {name: float(np.mean([o["rows"][i]["metrics"][split][name] for o in outs]))
                           for name in m} for split, m in row["metrics"].items()}
        rows.append({"alpha": row["alpha"], "metrics": metrics,
                     "distance": float(np.mean([o["rows"][i]["distance"] for o in outs]))})
    return {**first, "rows": rows, "n": len(outs)}
