"""Weight-space interpolation toward θ* (WiSE-FT, Wortsman et al. 2022): evaluate

    θ_α = θ* + α (θ − θ*),   α ∈ [0, 1]

for a finished run on its eval splits, in one process, whatever strategy trained it and whatever its
task's kind: the kind (task_kinds/) loads the data and scores θ_α as the run's evaluations scored θ,
and its forgetting probe measures θ_α against θ* (a classifier's accuracy and CKA drift; a decoder's
exact match and completion loss, its LM loss gained and KL from θ*, WiSE-FT for LLMs), and where
the run scored lm-eval benchmarks (evaluation.benchmarks) each θ_α's scores and their mean drop from
θ*'s, θ*'s read from the run's benchmark_reference.json, else scored on θ_0 (ft-report's frontier
draws these as the α curve on its benchmark axis).

    ft-interpolate runs/quickstart --alphas 0,0.25,0.5,0.75,1

- θ is the run's reported weights (results.json's "reported": the final ones, or the best with
  evaluation.select_best), read by checkpointing/run_weights.py: its export, else its best
  checkpoint, else its last checkpoint when that is of the final step. A LoRA run's is merged first.
- θ* is read from the anchors the checkpoint saved when θ comes from a checkpoint with fp32 anchors,
  else from the pretrained model the run's config names (model.name_or_path). The two are the same
  tensors: the anchors are fp32 copies of that model's weights, taken before anything changed them.
  Under RI (model.init: random) θ* is still the pretrained checkpoint — RI re-initialized the
  model the run started from, not the point RecAdam pulls toward — so α = 0 is the pretrained
  model, not the random one.
- Parameters without θ* (the new classification head) keep θ for every α: α = 0 is the pretrained
  encoder under the fine-tuned head, the only classifier there is. A decoder has θ* for every
  weight: α = 0 is the pretrained model, scored as the run's baseline was. A tensor with two names
  (tied input and output embeddings) is interpolated once.

Writes <run>/interpolation.json and <run>/interpolation.png, and prints a table of α, the metrics
of each eval split, ‖θ_α − θ*‖₂ (over the parameters that have a θ*; = α ‖θ − θ*‖₂) and the
probe's forgetting measures (and the benchmark drop).
"""

from __future__ import annotations

import json
import logging
import math
from pathlib import Path
from typing import Any, Sequence

import numpy as np
import torch
from torch import nn

from ft_framework.checkpointing.run_weights import RunWeightsError, finetuned_state
from ft_framework.config import validate_config
from ft_framework.config.schema import DEFAULT_INTERPOLATION_ALPHAS
from ft_framework.metrics import LOWER_IS_BETTER
from ft_framework.models.lm_benchmarks import BENCHMARK_FORGETTING, benchmark_forgetting
from ft_framework.models.loading import load_model, load_tokenizer
from ft_framework.run.files import CHECKPOINTS_DIR, INTERPOLATION_FILE, INTERPOLATION_PLOT, LATEST_FILE, RunPaths
from ft_framework.run.tracking import log_artifacts_to_run
from ft_framework.task_kinds import EvalContext, RunContext, build_task_kind
from ft_framework.user_files import read_json

logger = logging.getLogger(__name__)

__all__ = ["DEFAULT_ALPHAS", "InterpolationError", "parse_alphas", "load_run", "interpolate_state",
           "run_interpolation", "format_table", "plot_interpolation"]

DEFAULT_ALPHAS = DEFAULT_INTERPOLATION_ALPHAS



class InterpolationError(RunWeightsError):
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


def tied_aliases(model: nn.Module) -> dict[str, str]:
    """State-dict names that are another parameter's tensor (a decoder's output embedding tied to its
    input embedding: one parameter, two names) -> that parameter's name, so that every name of a
    tensor gets the same θ_α."""
    owner = {param.data_ptr(): name for name, param in model.named_parameters()}
    return {name: owner[tensor.data_ptr()] for name, tensor in model.state_dict(keep_vars=True).items()
            if tensor.data_ptr() in owner and owner[tensor.data_ptr()] != name}


def _with_aliases(state: dict[str, torch.Tensor], aliases: dict[str, str]) -> dict[str, torch.Tensor]:
    """`state` with every alias holding its parameter's tensor (a checkpoint saves a tied tensor
    under one name: the other is filled in; an export saves both: both get the same θ_α)."""
    out = dict(state)
    for alias, owner in aliases.items():
        if owner in out:
            out[alias] = out[owner]
    return out


# --------------------------------------------------------------------------------------------------
# Evaluation: the run's task kind scores θ_α as the run scored θ
# --------------------------------------------------------------------------------------------------


def run_interpolation(run_dir: str | Path, alphas: Sequence[float] | None = None, *, device: str = "cpu",
                      theta_star: str = "auto", write: bool = True, plot: bool = True) -> dict[str, Any]:
    """Evaluates θ_α for each α; returns (and writes) the content of interpolation.json.

    `theta_star`: "auto" (the checkpoint's fp32 anchors when θ comes from a checkpoint that has
    them, else the pretrained model), "anchors" (require them) or "pretrained"."""
    run_dir = run_dir_of(run_dir)
    alphas = parse_alphas(alphas)
    cfg, results = load_run(run_dir)
    task = cfg.data.task_spec()
    kind = build_task_kind(cfg)  # its model class, data, evaluation and forgetting probe: the run's own
    # The pretrained model as the config names it: θ* (and the architecture to evaluate with).
    plain_cfg = cfg.model.model_copy(update={"init": "pretrained", "reinit_top_layers": 0, "mixout": 0.0,
                                             "dtype": "float32", **({"lora": None} if "lora" in type(cfg.model).model_fields else {})})
    loaded = load_model(plain_cfg, model_class=kind.model_class, seed=cfg.training.seed)
    model = loaded.model
    theta, anchors, source = finetuned_state(run_dir, results, model, model_class=kind.model_class,
                                             lora=getattr(cfg.model, "lora", None),
                                             new_names=loaded.new_parameter_names)
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
    aliases = tied_aliases(model)

    tokenizer = load_tokenizer(cfg.model.tokenizer or cfg.model.name_or_path)
    dev = torch.device(device)
    run = RunContext(device=dev)
    data = kind.load_data(tokenizer, run)
    model.to(dev)
    model.eval()
    ctx = EvalContext(forward=lambda batch: model(**batch), device=dev, rank=0, world_size=1,
                      gather=lambda obj: [obj], batch_size=cfg.evaluation.batch_size,
                      collate=kind.collator(tokenizer, model.config))
    def take_reference(measurer: Any, kept: Path) -> None:
        """θ*'s side of `measurer` as the run kept it in `kept`, else measured on θ_0 itself."""
        if measurer.keeps_reference(kept):
            measurer.reference_from_run(kept, None, is_main=True, barrier=lambda: None)
        else:
            model.load_state_dict(_with_aliases(interpolate_state(theta, star, 0.0), aliases), strict=True)
            measurer.reference_from_model(ctx.forward, None, is_main=True, barrier=lambda: None)

    # The run's own probe: θ_α's forgetting reads like the run's evaluations, against θ*'s side as
    # the run kept it (a decoder's), else as the probe takes it from θ* itself.
    probe = kind.build_probe(tokenizer, run)
    if probe is not None:
        take_reference(probe, RunPaths(run_dir).forgetting_reference)
    # The run's lm-eval benchmarks (evaluation.benchmarks), against θ*'s scores as the run kept them
    # (benchmark_reference.json), else as θ_0 scores them: each θ_α's drop, as the run's evaluations.
    benchmarks = kind.build_benchmarks(tokenizer, model, run)
    if benchmarks is not None:
        take_reference(benchmarks, RunPaths(run_dir).benchmark_reference)
    full = distance(theta, star)
    rows = []
    for alpha in alphas:
        model.load_state_dict(_with_aliases(interpolate_state(theta, star, alpha), aliases), strict=True)
        model.eval()
        metrics = kind.evaluate(data, ctx)
        rows.append({"alpha": alpha, "metrics": metrics, "distance": alpha * full})
        if probe is not None:
            rows[-1]["forgetting"] = probe.measure(ctx.forward)
        if benchmarks is not None:
            rows[-1]["benchmarks"] = benchmarks.measure(ctx.forward)
            rows[-1][BENCHMARK_FORGETTING] = benchmark_forgetting(rows[-1]["benchmarks"])
        logger.info("alpha=%g %s", alpha, metrics)
    selection = results.get("selection_split", task.eval_splits[0])
    main = results.get("main_metric", task.main_metric)
    best = max(rows, key=lambda r: (_score(main, r["metrics"][selection][main]), -abs(r["alpha"] - 1.0)))
    out = {
        "run_dir": str(run_dir), "task": task.name, "main_metric": main, "selection_split": selection,
        "theta_source": source, "theta_star_source": star_source, "distance_full": full,
        "reported_metrics": results[results.get("reported", "final")]["metrics"],
        "baseline": results.get("baseline"),
        "method": _method_label(cfg), "alphas": alphas, "rows": rows, "best_alpha": best["alpha"],
        **({"forgetting_probe": probe.describe(), "forgetting_measures": list(probe.measures)}
           if probe is not None else {}),
        **({"benchmarks_run": benchmarks.describe()} if benchmarks is not None else {}),
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


def _score(metric: str, value: float) -> float:
    """`value` of `metric` as larger-is-better, for picking the best α (a loss counts negated)."""
    return -value if metric in LOWER_IS_BETTER else value


def _method_label(cfg: Any) -> str:
    if getattr(cfg.model, "lora", None) is not None:
        return f"lora+{cfg.optimizer.name}"
    return cfg.optimizer.name


def format_table(out: dict[str, Any]) -> str:
    """α, the metrics of every eval split, ‖θ_α − θ*‖₂ and the functional forgetting: one row per α
    (the best on dev marked)."""
    columns = [(split, name) for split, metrics in out["rows"][0]["metrics"].items() for name in metrics]
    forgetting = [name for name in out.get("forgetting_measures", ())
                  if name in out["rows"][0].get("forgetting", {})]
    benchmarks = [BENCHMARK_FORGETTING] if BENCHMARK_FORGETTING in out["rows"][0] else []
    header = ["alpha", *[f"{s}/{n}" for s, n in columns], "||theta_a - theta*||", *forgetting, *benchmarks]
    rows = []
    for r in out["rows"]:
        mark = " *" if r["alpha"] == out["best_alpha"] else ""
        rows.append([f"{r['alpha']:g}{mark}", *[f"{r['metrics'][s][n]:.4f}" for s, n in columns],
                     f"{r['distance']:.4f}", *[f"{r['forgetting'][n]:.4g}" for n in forgetting],
                     *[f"{r[n]:+.4g}" for n in benchmarks]])
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
