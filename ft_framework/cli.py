"""Console scripts. The only place (with launch/) that reads argv.

Each command answers ``--help`` and a usage error before it imports anything else of ours, and a
config error before it imports the modules that do its work: those import torch (seconds); the
config layer does not (pydantic and the schema: a few tenths of a second, which --help need not
pay). So this module imports at its top only what the parsers and the ends of a run need, and each
command imports the rest inside its function, after its arguments (and its config) are good. It is
the one module of ours allowed to do that (docs/design.md, "Layers"): nothing imports it, so no
cycle can hide there, and import-linter still checks those imports against the layers.
"""

from __future__ import annotations

import argparse
import json
import logging
import re
import sys
from pathlib import Path

from ft_framework.errors import UserError
from ft_framework.run.allocator import apply_run_policy
from ft_framework.run.failures import EXIT_DIVERGED, diverged_line, print_user_error, release_sigterm, report_failure
from ft_framework.run.files import LOG_FILE, REPORT_PLOTS_DIR, TRACKERS_FILE, RunPaths
from ft_framework.run.results import format_results_table


# --section.key=value or --section.key value: a config override in the form torchtitan, TRL and
# HfArgumentParser users type. A dot in the name tells it from our options, none of which has one.
_DOTTED_OPTION = re.compile(r"--([A-Za-z_][\w-]*(?:\.[\w-]+)+)(?:=(.*))?", re.DOTALL)


def dotted_options_as_overrides(argv: list[str], parser: argparse.ArgumentParser) -> list[str]:
    """`argv` with each --section.key=value and --section.key value turned into key.sub=value, in its
    place. Done before argparse sees them, so that none can be taken for an abbreviation of a real
    option; after "--" nothing is touched."""
    out: list[str] = []
    tokens = iter(argv)
    for token in tokens:
        if token == "--":
            out += [token, *tokens]
            break
        match = _DOTTED_OPTION.fullmatch(token)
        if match is None:
            out.append(token)
            continue
        key, value = match.groups()
        if value is None:
            value = next(tokens, None)
            if value is None or value.startswith("--"):
                parser.error(f"{token} needs a value: {token}=VALUE or {token} VALUE")
        out.append(f"{key}={value}")
    return out


def parse_run_arguments(parser: argparse.ArgumentParser, argv: list[str] | None) -> argparse.Namespace:
    """The arguments of a command that takes config overrides, in any of their forms and in any
    order among the options (`a.b=1 --debug --c.d 2`)."""
    argv = sys.argv[1:] if argv is None else list(argv)
    return parser.parse_intermixed_args(dotted_options_as_overrides(argv, parser))


def add_run_config_arguments(parser: argparse.ArgumentParser) -> None:
    """--config FILE and the key.sub=value overrides, as ft-train and ft-plan read them."""
    parser.add_argument("--config", required=True, help="YAML run config (see configs/)")
    parser.add_argument("overrides", nargs="*", metavar="key.sub=value",
                        help="override config values (also --key.sub=value or --key.sub value); the value is "
                        "parsed as YAML")


class _PrintSchema(argparse.Action):
    """--print-schema: the run config's JSON schema, for editors (YAML language servers), then exit."""

    def __init__(self, option_strings, dest, **kwargs):
        super().__init__(option_strings, dest, nargs=0, default=argparse.SUPPRESS, **kwargs)

    def __call__(self, parser, namespace, values, option_string=None):
        from ft_framework.config import RunConfig  # pydantic and the schema; no torch (module docstring)

        print(json.dumps(RunConfig.model_json_schema(), indent=2, allow_nan=False))
        parser.exit()


def train_main(argv: list[str] | None = None, prog: str = "ft-train") -> int:
    """ft-train --config FILE [key.sub=value ...]: one fine-tuning run. Exit codes (failures.py):
    0 finished, 1 crashed, 2 user error (one line), 3 diverged, 128 + N stopped by signal N after a
    checkpoint (143 SIGTERM, 130 SIGINT, 138 SIGUSR1)."""
    parser = argparse.ArgumentParser(
        prog=prog, description="Fine-tune a pretrained model on a GLUE task. Exit codes: 0 finished, "
        "1 crashed, 2 a config or data error (one line; --debug adds the traceback), 3 diverged (results.json "
        "says where), 128+N stopped by signal N after saving a checkpoint (143 SIGTERM, 130 SIGINT, 138 SIGUSR1).",
        epilog=f"Example: {prog} --config configs/quickstart.yaml --training.num_epochs=2")
    add_run_config_arguments(parser)
    # DeepSpeed's launcher appends --local_rank=N; the rank also arrives in the environment.
    parser.add_argument("--local_rank", "--local-rank", type=int, default=None, help=argparse.SUPPRESS)
    parser.add_argument("--debug", action="store_true", help="print the traceback of a config or data error too")
    parser.add_argument("--print-schema", action=_PrintSchema,
                        help="print the run config's JSON schema (for an editor's YAML completion) and exit")
    args = parse_run_arguments(parser, argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    from ft_framework.config import load_config  # after --help (module docstring)

    try:
        cfg = load_config(args.config, args.overrides)
    except Exception as exc:  # every rank reads the same file: rank 0 alone reports it
        return report_failure(exc, prog=prog, debug=args.debug, same_on_every_rank=True)
    # Before anything large is allocated (reading the config allocates little): with the default
    # policy the host memory then follows the live tensors (run/allocator.py).
    logging.getLogger("ft_framework.run.allocator").info(
        "%s", apply_run_policy(cfg.training.host_allocator, cfg.training.memory_budget_gib))
    from ft_framework.trainer import Trainer  # the config is good: now torch (module docstring)

    trainer = None
    try:
        trainer = Trainer(cfg)
        results = trainer.fit()
    except KeyboardInterrupt:  # Ctrl-C before the loop's handlers are installed (or after they are gone)
        print(f"{prog}: interrupted (SIGINT) before training started or after it ended; nothing to save",
              file=sys.stderr)
        return 130
    except Exception as exc:  # reported before the process group closes (finally): the peers read who failed
        return report_failure(exc, prog=prog, debug=args.debug)
    finally:
        if trainer is not None:
            trainer.strategy.close()
        release_sigterm()  # a hold the loop began and no report ended (run/failures.py)
    if results.get("status") == "interrupted":  # a signal: checkpoint saved, the line printed (run/signals.py)
        return int(results["exit_code"])
    if results.get("diverged"):
        if trainer.strategy.is_main_process:
            print(diverged_line(prog, results), file=sys.stderr)
        return EXIT_DIVERGED
    if trainer.strategy.is_main_process:
        print()
        print(format_results_table(results))
        paths = RunPaths(cfg.logging.output_dir)
        print(f"\nlogs: {paths.metrics}, results: {paths.results}")
        if cfg.evaluation.interpolation is not None:
            _interpolate_finished_run(cfg, str(trainer.strategy.device))
    return 0


def _interpolate_finished_run(cfg, device: str) -> None:
    """evaluation.interpolation: θ_α of the finished run, in this process, on its device (the main
    rank's; the other ranks are done). A failure is one line and leaves the run finished: the run's
    results stand, and ft-interpolate RUN_DIR (or a sweep's post-step) can try again."""
    from ft_framework.interpolate import format_table, run_interpolation

    spec, run_dir = cfg.evaluation.interpolation, cfg.logging.output_dir
    try:
        out = run_interpolation(run_dir, spec.alphas, device=device, theta_star=spec.theta_star)
    except Exception as exc:  # noqa: BLE001 - training is done and saved; only the interpolation is missing
        print(f"ft-train: the run finished, but its interpolation toward theta* failed ({type(exc).__name__}: "
              f"{exc}); ft-interpolate {run_dir} tries again", file=sys.stderr)
        return
    print()
    print(format_table(out))
    print(f"\nwrote {out['run_dir']}/interpolation.json and interpolation.png")


def sweep_main(argv: list[str] | None = None, prog: str = "ft-sweep") -> int:
    """ft-sweep --config FILE [--dry-run] [--runner local|ray] [key.sub=value ...]: a grid of runs."""
    parser = argparse.ArgumentParser(
        prog=prog, description="Run a grid of fine-tuning runs (configs/sweeps/*.yaml) locally or on Ray. "
        "Re-running the same command skips finished runs and runs failed or interrupted ones again.",
        epilog=f"Example: {prog} --config configs/sweeps/quickstart_grid.yaml --max-parallel 2")
    parser.add_argument("--config", required=True, help="YAML sweep file (see configs/sweeps/)")
    parser.add_argument("--dry-run", action="store_true", help="list the runs and their state; run nothing")
    parser.add_argument("--runner", choices=("local", "ray", "slurm"), help="overrides runner.name of the sweep file")
    parser.add_argument("--max-parallel", type=int, help="local runner: runs at a time")
    parser.add_argument("--address", help="ray runner: cluster address (default: the file's, else a local instance)")
    parser.add_argument("--num-cpus-per-run", type=float, help="CPUs (threads) each run gets")
    parser.add_argument("--num-gpus-per-run", type=int, help="GPUs each run gets")
    parser.add_argument("--output-dir", help="results store (default: output_dir of the sweep file)")
    parser.add_argument("--no-progress", action="store_true", help="no progress bar")
    parser.add_argument("overrides", nargs="*", metavar="key.sub=value",
                        help="set a config value in every run (parsed as YAML; also --key.sub=value or "
                        "--key.sub value); changes the run ids")
    args = parse_run_arguments(parser, argv)
    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    from ft_framework.config import ConfigError  # after --help (module docstring)
    from ft_framework.sweep import (SweepInterrupted, SweepLockedError, format_plan, load_sweep, make_runner,
                                    plan_sweep, run_sweep)

    try:
        spec = load_sweep(args.config)
        updates = {"name": args.runner, "max_parallel": args.max_parallel, "address": args.address,
                   "num_cpus_per_run": args.num_cpus_per_run, "num_gpus_per_run": args.num_gpus_per_run}
        updates = {k: v for k, v in updates.items() if v is not None}
        if args.address and not args.runner:
            updates["name"] = "ray"  # an address only means something to the Ray runner
        if updates:
            spec.runner = type(spec.runner).model_validate({**spec.runner.model_dump(), **updates})
        planned = plan_sweep(spec, args.overrides, args.output_dir)
    except (ConfigError, ValueError) as exc:
        return print_user_error(prog, exc)
    store, runs = planned
    if args.dry_run:
        try:
            print(format_plan(store, runs), flush=True)
        except BrokenPipeError:  # ft-sweep --dry-run | head
            sys.stdout = None
        except UserError as exc:  # a run's status.json in the store that cannot be read
            return print_user_error(prog, exc)
        return 0
    try:
        result = run_sweep(spec, args.overrides, output_dir=store.root, runner=make_runner(spec.runner),
                           progress=not args.no_progress, planned=planned)
    except (SweepLockedError, UserError) as exc:  # UserError: the slurm runner's (sbatch missing, failing)
        return print_user_error(prog, exc)
    except KeyboardInterrupt as exc:
        print(f"\n{prog}: interrupted; finished runs are kept in {store.root}. Run the same command again "
              "to run the rest.", file=sys.stderr)
        return 143 if isinstance(exc, SweepInterrupted) else 130
    counts = result.counts
    print(f"{len(result.runs)} runs in {store.root}: " + ", ".join(f"{v} {k}" for k, v in counts.items() if v))
    failed = [r for r in result.runs if not store.is_finished(r.run_id)]
    for run in failed[:20]:
        status = store.read_status(run.run_id)
        print(f"  {run.run_id} {status.get('state')}: {status.get('error')} (log: {store.run_dir(run.run_id) / LOG_FILE})")
    print(f"tables and plots: ft-report {store.root}")
    return 0 if result.complete else 1


def report_main(argv: list[str] | None = None, prog: str = "ft-report") -> int:
    """ft-report DIR [--out DIR]: Table 1, best settings, Levene's test, expected best of n, plots."""
    parser = argparse.ArgumentParser(
        prog=prog, description="Tables (Markdown and CSV) and plots of a sweep directory or of one run.",
        epilog=f"Example: {prog} runs/sweeps/quickstart_grid")
    parser.add_argument("directory", help="a sweep's output directory (or one run's output directory)")
    parser.add_argument("--out", help="where to write report.md, *.csv and plots/ (default: DIRECTORY)")
    parser.add_argument("--no-plots", action="store_true", help="tables only")
    parser.add_argument("--bootstrap-samples", type=int, default=10_000,
                        help="bootstrap draws for the expected best score of n trials")
    parser.add_argument("--forgetting-measure", default="auto",
                        help="the frontier's forgetting axis: auto (every output measure every point has: "
                             "mlm_forgetting, a decoder's kl_from_pretrained and lm_loss_gained; else cka_drift_last; and "
                             "benchmark_forgetting where runs scored evaluation.benchmarks), or one of mlm_forgetting, "
                             "cka_drift_last, cka_drift_mean, lm_loss_gained, kl_from_pretrained, benchmark_forgetting")
    parser.add_argument("--reference-method", default=None,
                        help="the full fine-tuning method whose best score sets the matched-accuracy target "
                             "(default: vanilla, where the sweep has it)")
    parser.add_argument("--matched-fraction", type=float, default=0.99,
                        help="the matched-accuracy target as a fraction of the reference's best score")
    args = parser.parse_args(argv)
    from ft_framework.run.tracking import log_artifacts_to_run  # after --help (module docstring)
    from ft_framework.sweep import build_report
    from ft_framework.sweep.plots import write_plots

    try:
        report = build_report(args.directory, bootstrap_samples=args.bootstrap_samples,
                              forgetting_measure=args.forgetting_measure, reference_method=args.reference_method,
                              matched_fraction=args.matched_fraction)
    except (FileNotFoundError, UserError) as exc:
        return print_user_error(prog, exc)
    print(report.markdown())
    out_dir = Path(args.out or args.directory)
    written = report.write(out_dir) + ([] if args.no_plots else write_plots(report, out_dir / REPORT_PLOTS_DIR))
    print(f"\nwrote {len(written)} files to {args.out or args.directory}: "
          + ", ".join(sorted({p.name if p.parent.name != REPORT_PLOTS_DIR else f"{REPORT_PLOTS_DIR}/"
                              for p in written})))
    if (Path(args.directory) / TRACKERS_FILE).is_file():  # one run's report: its plots go to its tracker runs
        try:
            log_artifacts_to_run(args.directory, [p for p in written if p.suffix == ".png"])
        except Exception as exc:  # noqa: BLE001 - the report is written; a tracker being down is not fatal
            print(f"{prog}: could not attach the plots to the run's trackers: {exc}", file=sys.stderr)
    return 0


def interpolate_main(argv: list[str] | None = None, prog: str = "ft-interpolate") -> int:
    """ft-interpolate RUN_DIR [--alphas 0,0.1,...,1]: WiSE-FT interpolation toward θ*."""
    parser = argparse.ArgumentParser(
        prog=prog, description="Evaluate theta_a = theta* + a (theta - theta*) of a finished run on its "
        "eval splits; writes interpolation.json and interpolation.png into the run directory.",
        epilog=f"Example: {prog} runs/quickstart --alphas 0,0.25,0.5,0.75,1")
    parser.add_argument("run_dir", help="a finished run's output directory (holding results.json), or its "
                        "checkpoints/ directory, checkpoints/latest pointer or a checkpoint directory")
    parser.add_argument("--alphas", default=None, help="comma-separated values in [0, 1] (default: 0,0.1,...,1)")
    parser.add_argument("--theta-star", choices=("auto", "anchors", "pretrained"), default="auto",
                        help="where theta* comes from: the checkpoint's anchors, the pretrained model the config "
                        "names, or auto (anchors when theta comes from a checkpoint that has them)")
    parser.add_argument("--device", default="cpu", help="evaluation device (cpu, cuda, cuda:1, ...)")
    parser.add_argument("--no-plot", action="store_true", help="no PNG")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    from ft_framework.interpolate import format_table, run_interpolation  # after --help (module docstring)

    try:
        out = run_interpolation(args.run_dir, args.alphas, device=args.device, theta_star=args.theta_star,
                                plot=not args.no_plot)
    except (ValueError, FileNotFoundError) as exc:
        return print_user_error(prog, exc)
    print(format_table(out))
    print(f"\nwrote {out['run_dir']}/interpolation.json" + ("" if args.no_plot else " and interpolation.png"))
    return 0


def export_main(argv: list[str] | None = None, prog: str = "ft-export") -> int:
    """ft-export CHECKPOINT OUT_DIR [--verify]: a Hugging Face model (with its tokenizer) from a checkpoint
    saved under any strategy and number of ranks; one process, offline."""
    parser = argparse.ArgumentParser(
        prog=prog, description="Write a Hugging Face model (save_pretrained, with the tokenizer) from an "
        "ft_framework checkpoint saved under any strategy and number of ranks; one process, no GPU, offline.",
        epilog=f"Example: {prog} runs/rte exported/rte   (a run directory: its latest checkpoint)")
    parser.add_argument("checkpoint", type=Path, help="a run's output directory, its checkpoints/ directory, the "
                        "checkpoints/latest pointer file, or a checkpoint directory (checkpoints/step_N; checkpoints/best: "
                        "the best evaluation's, with evaluation.select_best)")
    parser.add_argument("out", type=Path, nargs="?", help="where to write the model (optional with --verify)")
    parser.add_argument("--verify", action="store_true", help="check every file of the checkpoint against the size "
                        "and checksum its manifest records (before exporting, or alone without OUT)")
    parser.add_argument("--overwrite", action="store_true", help="replace an existing export at OUT (without it, an "
                        "OUT that holds files is refused); either way OUT is never half-written: the export is written "
                        "beside it and renamed into place")
    parser.add_argument("--config-dir", type=Path, help="model config.json directory, for a checkpoint without model "
                        "files (converted from an old format)")
    parser.add_argument("--model-class", help="module:Class of the model for such a checkpoint "
                        "(e.g. transformers:AutoModelForSequenceClassification)")
    args = parser.parse_args(argv)
    if args.out is None and not args.verify:
        parser.error("OUT is required (or pass --verify alone to check the checkpoint)")
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    from ft_framework.checkpointing.export import export_pretrained, verify_checkpoint  # after --help
    from ft_framework.checkpointing.manager import resolve_latest  # (module docstring)

    try:
        checkpoint = resolve_latest(args.checkpoint)
        if args.verify:
            checked = verify_checkpoint(checkpoint)
            print(f"{checkpoint}: {checked} files match the sizes and checksums of its manifest"
                  + ("" if checked else " (it records none: saved before checksums, or converted)"))
        if args.out is not None:
            export_pretrained(checkpoint, args.out, config_dir=args.config_dir, model_class=args.model_class,
                              replace="always" if args.overwrite else "never")
            print(f"exported {checkpoint} to {args.out}")
    except UserError as exc:
        return print_user_error(prog, exc)
    return 0


def planned_device(device: str) -> str:
    """What ft-plan planned for, said in its header: a GPU unless training.device is cpu. With auto
    on a machine without a GPU, ft-train here would run (and check its budget) on the CPU."""
    if device == "cpu":
        return "CPU (training.device: cpu)"
    if device == "cuda":
        return "GPU (training.device: cuda)"
    import torch

    if torch.cuda.is_available():
        return "GPU (training.device: auto; this machine has one)"
    return ("GPU (training.device: auto; this machine has none: ft-train here would run on the CPU and check "
            "its budget against the CPU plan, which training.device=cpu shows)")


def plan_main(argv: list[str] | None = None, prog: str = "ft-plan") -> int:
    """ft-plan --config FILE [key.sub=value ...] [--gpu-memory SIZE] [--fit] [--json]: each rank's
    planned memory peak, from the model's config.json alone (no weights)."""
    parser = argparse.ArgumentParser(
        prog=prog, description="Plan each rank's memory peak of a run (model states, activations traced on "
        "fake tensors, buckets, CUDA context) without loading weights; with a budget and --fit, find the largest "
        "micro-batch, then checkpointing, bf16, the compact optimizer state, then offload that fit, keeping the "
        "global batch (docs/memory.md).",
        epilog=f"Example: {prog} --config configs/albert_xxl_recadam.yaml --gpu-memory 16GiB --fit")
    add_run_config_arguments(parser)
    parser.add_argument("--ranks", type=int, default=1, help="number of ranks (processes) of the run (default 1)")
    parser.add_argument("--gpu-memory", help="the budget per device, e.g. 16GiB or 40GB (default: "
                        "training.memory_budget_gib)")
    parser.add_argument("--fit", action="store_true", help="search overrides that fit the budget")
    parser.add_argument("--json", action="store_true", help="print the plan as JSON (bytes)")
    parser.add_argument("--debug", action="store_true", help="print the traceback of an error too")
    args = parse_run_arguments(parser, argv)
    if args.ranks < 1:
        parser.error(f"--ranks must be at least 1, got {args.ranks}")
    from ft_framework.config import load_config  # after --help (module docstring)

    try:
        cfg = load_config(args.config, args.overrides, check_paths=False)
    except Exception as exc:
        return report_failure(exc, prog=prog, debug=args.debug, same_on_every_rank=True)
    import json

    from ft_framework.strategies.memory_fit import NOTHING_FITS, fit_to_budget, load_architecture, parse_size, plan_run
    from ft_framework.strategies.memory_plan import GIB, format_peak_plan, format_peaks, peak_plan_json
    from ft_framework.task_kinds import build_task_kind

    try:
        budget = (parse_size(args.gpu_memory) if args.gpu_memory else
                  cfg.training.memory_budget_gib * GIB if cfg.training.memory_budget_gib else None)
        if args.fit and budget is None:
            raise UserError("--fit needs a budget: --gpu-memory SIZE or training.memory_budget_gib")
        on_gpu = cfg.training.device != "cpu"
        arch = load_architecture(cfg.model)
        kind = build_task_kind(cfg)  # the plan traces the kind's own micro-batch and rows
        plan = plan_run(cfg, task=kind, world_size=args.ranks, on_gpu=on_gpu, arch=arch)
        fit = (fit_to_budget(cfg, task=kind, budget_bytes=budget, world_size=args.ranks, on_gpu=on_gpu, arch=arch)
               if args.fit and plan.device_peak > budget else None)
    except Exception as exc:
        return report_failure(exc, prog=prog, debug=args.debug, same_on_every_rank=True)
    fits = budget is None or plan.device_peak <= budget
    if args.json:
        answer = {"ranks": args.ranks, "planned_for": "gpu" if on_gpu else "cpu", "model_source": arch.source,
                  "budget_bytes": budget, "fits": fits,
                  "per_rank": [peak_plan_json(plan)] * args.ranks}
        if args.fit:
            answer["fit"] = None if fits else ({"overrides": fit.overrides, "plan": peak_plan_json(fit.plan)}
                                               if fit else None)
        print(json.dumps(answer, indent=2))
        return 0
    where = planned_device(cfg.training.device)
    print(f"model: {arch.source}")
    print(f"planned for: {where}")
    print(format_peak_plan(plan, title=f"memory plan per rank ({cfg.strategy.name}, {args.ranks} rank(s), "
                                       f"batch {cfg.training.per_device_batch_size} x {cfg.data.max_seq_length} "
                                       f"tokens, {cfg.training.precision}, {where}; every rank the same)"))
    if budget is not None:
        print(f"budget {budget / GIB:.1f} GiB: {'fits' if fits else 'does NOT fit'}")
    if args.fit and fits:
        print("fits as configured: no overrides needed")
    if args.fit and not fits:
        print(f"fits with: {' '.join(fit.overrides)}\n  {format_peaks(fit.plan)}" if fit else
              f"nothing fits: {NOTHING_FITS}")
    return 0


# ft COMMAND: each command is the ft-COMMAND console script (kept as an alias), named "ft COMMAND".
COMMANDS = {
    "train": (train_main, "one fine-tuning run (--config FILE [--key.sub=value ...])"),
    "sweep": (sweep_main, "a grid of runs, locally, on Ray or on SLURM"),
    "report": (report_main, "tables and plots of a sweep or a run"),
    "plan": (plan_main, "each rank's memory peak of a run, and overrides that fit a budget"),
    "export": (export_main, "a Hugging Face model from a checkpoint"),
    "interpolate": (interpolate_main, "WiSE-FT interpolation of a finished run toward theta*"),
}


def ft_main(argv: list[str] | None = None) -> int:
    """ft COMMAND [ARGS ...]: one command with the subcommands train, sweep, report, plan, export and
    interpolate, each the same as its ft-COMMAND script."""
    argv = sys.argv[1:] if argv is None else list(argv)
    width = max(map(len, COMMANDS))
    parser = argparse.ArgumentParser(
        prog="ft", usage="ft COMMAND [ARGS ...]", formatter_class=argparse.RawDescriptionHelpFormatter,
        description="Fine-tune pretrained models with less forgetting. Commands:\n"
        + "\n".join(f"  {name:<{width}}  {text}" for name, (_, text) in COMMANDS.items()),
        epilog="ft COMMAND --help shows a command's arguments. Example: ft train --config configs/quickstart.yaml "
        "--training.max_steps=10")
    parser.add_argument("command", choices=COMMANDS, metavar="COMMAND", help="one of " + ", ".join(COMMANDS))
    command = parser.parse_args(argv[:1]).command  # what follows is the command's own
    main = COMMANDS[command][0]
    return main(argv[1:], prog=f"ft {command}")


if __name__ == "__main__":
    raise SystemExit(train_main())
