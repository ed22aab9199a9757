"""A run's assembly: everything one run needs before its first step, built in order, handed to the
loop (trainer.py) as one :class:`AssembledRun`.

    run = assemble_run(cfg, strategy, RunPaths(cfg.logging.output_dir))
    run.model, run.optimizer, run.data, run.total_steps, run.state, ...   # what the loop reads

In order (:func:`assemble_run`; each step says why it stands there):

1. before anything loads: the ranks agree on the config, rank 0 takes the run lock, a resume
   matches its checkpoint (run/start.py), the export directory and the memory budget are checked;
2. the model and tokenizer (models/loading.py: θ* captured, the transforms applied while loading),
   then the model transforms that stand before the strategy's wrap (models/transforms.py holds
   their order and its reasons, and applies them);
3. the data, its collation, the forgetting probe and the lm-eval benchmarks (the task kind's), the
   data seed set;
4. the optimizer factory, handed to Strategy.setup with θ*, which wraps the model and places θ* in
   the optimizer; the memory plan's rows logged;
5. the schedule's totals and evaluation steps, the checkpoint manager, the metrics logger;
6. where the loop starts: loss.kl_to_pretrained's stored targets of θ* (reused from the token cache or
   made by a pass while the model is still θ*); a resume restores the checkpoint and reads θ*'s probe
   side and benchmark scores back; a fresh run captures them from the model and chooses Child-Tuning's
   child; then the baseline.

The few ways of using the parts that both the assembly (the Fisher pass, the baseline) and the loop
need are :class:`AssembledRun`'s methods: this rank's batches of an epoch, the strategy's forward of
a batch, the step's loss units, an evaluation.
"""

from __future__ import annotations

import logging
import math
import random
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import numpy as np
import torch
from torch import nn

from ft_framework.checkpointing.dcp_io import CheckpointReadError
from ft_framework.checkpointing.export import ExportExistsError, check_run_export_dir
from ft_framework.checkpointing.manager import CheckpointManager
from ft_framework.config import RunConfig
from ft_framework.data.replay import ReplayMix
from ft_framework.data.sharding import batches_per_epoch, epoch_batches
from ft_framework.data.tasks import TaskSpec
from ft_framework.distributed.config_agreement import check_config_agreement
from ft_framework.errors import UserError
from ft_framework.models.kl_anchor import KLAnchor
from ft_framework.models.lm_benchmarks import BenchmarkSuite
from ft_framework.models.loading import LoadedModel, load_model_and_tokenizer
from ft_framework.models.probes import ForgettingProbe
from ft_framework.models.transforms import apply_before_the_wrap
from ft_framework.optim import build_optimizer
from ft_framework.optim.child_tuning import prepare_masks, run_fisher_pass, select_child
from ft_framework.optim.importance import capture_fisher, holds_importance, place_importance, prepare_importance
from ft_framework.optim.groups import GROUP_HPARAMS, build_param_groups
from ft_framework.optim.schedules import lr_schedule
from ft_framework.run.failures import same_on_every_rank
from ft_framework.run.files import RunPaths
from ft_framework.run.lock import RunLock, hold_run_lock
from ft_framework.run.logs import MetricsLogger
from ft_framework.run.preflight import check_data_not_empty, check_max_seq_length
from ft_framework.run.start import ResumePoint, check_resume_data, check_start, restore_rng
from ft_framework.run.tracking import open_trackers
from ft_framework.strategies import Strategy
from ft_framework.strategies.memory_fit import check_memory_budget
from ft_framework.strategies.memory_plan import format_memory_plan, plan_memory
from ft_framework.task_kinds import (Baseline, EvalContext, LossNormalizer, RunContext, TaskKind, build_task_kind,
                                    to_device)

# A run's log lines come from one logger, its set-up's and its loop's alike: the name users' logging
# configurations (and the tests) filter on stayed trainer.py's when the set-up moved here.
logger = logging.getLogger("ft_framework.trainer")

__all__ = ["AssembledRun", "TrainState", "assemble_run", "eval_steps", "seed_everything"]


@dataclass
class TrainState:
    """Everything besides model and optimizer that a resumed run needs to continue exactly."""

    step: int = 0                  # optimizer steps done
    epoch: int = 0
    batch_in_epoch: int = 0        # micro-batches of `epoch` already consumed
    examples_per_round: int = 0    # examples one micro-batch index covers on all ranks together
    evals: list[dict[str, Any]] = field(default_factory=list)
    best: dict[str, Any] | None = None
    window_loss: float = 0.0       # running sums for the next log line: this rank's summed loss,
    window_micro_batches: int = 0  # its micro-batches
    window_units: float = 0.0      # and the units the loss sums over (examples, a decoder's label tokens)
    window_replay_loss: float = 0.0   # the same of data.replay's rows (not in window_loss): their summed loss,
    window_replay_units: float = 0.0  # label tokens
    window_replay_rows: int = 0       # and rows (padding rows not counted)
    window_terms: dict[str, float] = field(default_factory=dict)  # the objective's added terms' sums (MicroBatchLoss)
    train_seconds: float = 0.0
    # Config changes accepted on resume (fingerprint.py): {"step", "key", "old", "new", "allowed_by"}.
    config_changes: list[dict[str, Any]] = field(default_factory=list)
    # Child-Tuning's Fisher pass and child network (ChildTuningResult.to_record), None when off.
    child_tuning: dict[str, Any] | None = None
    # optimizer.importance's Fisher pass (ImportanceResult.to_record), None when off.
    importance: dict[str, Any] | None = None
    # What the run is judged against (Baseline.to_record): the majority class, or a causal LM's own
    # scores before its first step (which a resumed run cannot measure again).
    baseline: dict[str, Any] | None = None


def seed_everything(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)


def eval_steps(total_steps: int, num_evals: int | None, every_steps: int | None) -> list[int]:
    """Optimizer steps after which to evaluate; the last step is always one of them."""
    if every_steps:
        steps = set(range(every_steps, total_steps + 1, every_steps))
    elif num_evals:
        steps = {max(1, round(total_steps * i / num_evals)) for i in range(1, num_evals + 1)}
    else:
        steps = set()
    return sorted(steps | {total_steps})


@dataclass
class AssembledRun:
    """Everything one run needs before its first step, as :func:`assemble_run` built it."""

    cfg: RunConfig
    strategy: Strategy
    paths: RunPaths
    task: TaskSpec
    kind: TaskKind                     # owns the model class, data, collation, loss, metrics, probe
    run_lock: RunLock | None           # rank 0's; the loop releases it when the run ends
    resume_point: ResumePoint | None   # the checkpoint a resume continues, None for a fresh run
    loaded: LoadedModel                # the model as loaded, its tokenizer; θ* dropped once placed
    transforms: dict[str, Any]         # what each transform applied before the wrap returned (None: off)
    data: Any
    collate: Callable[[list[dict[str, Any]]], dict[str, Any]]
    forgetting: ForgettingProbe | None
    benchmarks: BenchmarkSuite | None  # evaluation.benchmarks' lm-eval tasks (the kind's), θ*'s scores once started
    base_lr: float
    model: nn.Module                   # the strategy's wrapped model
    optimizer: Any
    peak_lrs: list[float]              # each group's own peak lr (LLRD scales it); the schedule multiplies it
    micro_batches_per_epoch: int
    total_steps: int
    warmup_steps: int
    lr_schedule: Callable[[int], float]  # the peak lr's multiplier at scheduler step s (optim/schedules.py)
    eval_at: set[int]
    selection_split: str
    checkpoints: CheckpointManager
    log: MetricsLogger
    state: TrainState = field(default_factory=TrainState)  # where the loop starts (a resume's: the checkpoint's)
    baseline: Baseline | None = None
    kl_anchor: KLAnchor | None = None  # loss.kl_to_pretrained's stored targets (the kind's), None: off
    replay: ReplayMix | None = None    # data.replay's rows and their draw (the kind's), None: off
    # {config key: content id} of every data file the run read (the kind's data_content), checked on a
    # resume (run/start.py: check_resume_data); the checkpoints' config record and results.json hold it.
    data_content: dict[str, str] = field(default_factory=dict)

    @property
    def data_seed(self) -> int:
        return self.cfg.training.data_seed  # the config fills it with training.seed when unset

    @property
    def fused_activations(self) -> dict[str, int] | None:
        """What model.fused_activations replaced ({activation name: modules}); None: the switch was off."""
        return self.transforms["model.fused_activations"]

    @property
    def r3f(self) -> Any:
        """The R3F objective (models/r3f.py: its KL for the logs), None without training.r3f."""
        return self.transforms["training.r3f"]

    def epoch_batches(self, epoch: int) -> list[list[int]]:
        """This rank's micro-batches of `epoch`: a permutation fixed by (data seed, epoch)."""
        return epoch_batches(len(self.data.train), batch_size=self.cfg.training.per_device_batch_size,
                             data_seed=self.data_seed, epoch=epoch, rank=self.strategy.rank,
                             world_size=self.strategy.world_size)

    def replay_batches(self, step: int) -> list[tuple[dict[str, Any], int]]:
        """This rank's collated replay micro-batches of optimizer step `step` (0-based) with their real
        rows (data/replay.py; a micro-batch of none holds a padding row without label tokens); [] when off."""
        if self.replay is None:
            return []
        cuts = self.replay.micro_batches(step, rank=self.strategy.rank, world_size=self.strategy.world_size,
                                         batch_size=self.cfg.training.per_device_batch_size)
        return [(self.collate(self.replay.items(rows)), len(rows)) for rows in cuts]

    def forward(self, batch: dict[str, Any], last_micro_batch: bool = True) -> Any:
        """The strategy's forward of a collated batch's model inputs (the kind says which they are)."""
        inputs = to_device(self.kind.model_inputs(batch), self.strategy.device)
        return self.strategy.forward(inputs, last_micro_batch=last_micro_batch)

    def step_units(self, batches: list[dict[str, torch.Tensor]]) -> float | None:
        """The loss units (a causal LM's label tokens) of one optimizer step on every rank together,
        or None when the kind averages each micro-batch itself. Collective when it counts."""
        units = self.kind.step_units(batches)
        return None if units is None else float(sum(self.strategy.gather_objects(units)))

    def eval_context(self) -> EvalContext:
        return EvalContext(forward=self.strategy.forward, device=self.strategy.device, rank=self.strategy.rank,
                           world_size=self.strategy.world_size, gather=self.strategy.gather_objects,
                           batch_size=self.cfg.evaluation.batch_size, collate=self.collate)

    @torch.no_grad()
    def evaluate(self) -> dict[str, dict[str, float]]:
        """Metrics of every eval split (the task kind's); each rank scores a slice, every rank's view
        is complete. Collective."""
        self.model.eval()
        return self.kind.evaluate(self.data, self.eval_context())


# ---- the assembly, in order ---------------------------------------------------------------------
def assemble_run(cfg: RunConfig, strategy: Strategy, paths: RunPaths) -> AssembledRun:
    """Builds everything the run of `cfg` needs before its first step (collective: every rank calls
    it). A failure after rank 0 took the run lock releases the lock before it propagates."""
    task = cfg.data.task_spec()
    # The task's kind owns its model class, data, collation, loss and metrics (task_kinds/).
    kind = build_task_kind(cfg)
    # The first collective: every rank (every node) must train the same resolved config.
    check_config_agreement(cfg.to_dict())
    # One writer per output directory: rank 0 holds its lock until the run ends (run/lock.py).
    run_lock = hold_run_lock(strategy, paths)
    try:
        run = _assemble(cfg, strategy, paths, task, kind, run_lock)
        _start(run)
        return run
    except BaseException:
        if run_lock is not None:
            run_lock.release()
        raise


def _assemble(cfg: RunConfig, strategy: Strategy, paths: RunPaths, task: TaskSpec, kind: TaskKind,
              run_lock: RunLock | None) -> AssembledRun:
    # Before anything is loaded: a resume must match its checkpoint, a fresh run must not mix with an old one.
    resume_point = check_start(cfg, strategy, paths)
    if cfg.checkpoint.export_dir:  # its end would refuse another run's export: refuse it now
        try:
            check_run_export_dir(Path(cfg.checkpoint.export_dir), paths.root)
        except ExportExistsError as exc:  # every rank sees the same directory
            raise same_on_every_rank(exc) from None
    # Before any weight loads: a run planned over training.memory_budget_gib stops here, in one line.
    check_memory_budget(cfg, task=kind, world_size=strategy.world_size, on_gpu=strategy.device.type == "cuda")

    # The init seed drives everything random in the model (head, RI, re-init); the data seed
    # drives data order and dropout, so the two can be varied separately (Dodge et al.).
    # load_model captures θ* and applies the transforms that stand while loading.
    loaded = load_model_and_tokenizer(cfg.model, model_class=kind.model_class, seed=cfg.training.seed)
    check_max_seq_length(cfg.data.max_seq_length, loaded.model, cfg.model.name_or_path)
    # The transforms between loading and the strategy's wrap, in models/transforms.py's order.
    transforms = apply_before_the_wrap(loaded.model, cfg, log=lambda line: logger.info("%s", line))

    run_context = _run_context(cfg, strategy)
    data = kind.load_data(loaded.tokenizer, run_context)
    check_data_not_empty(data, task=task.name, source=cfg.data.source)
    collate = kind.collator(loaded.tokenizer, loaded.model.config)
    # The forgetting probe (models/probes.py): it owns θ*'s side, which it reads from the model
    # once the strategy holds it (_start), or from the run's directory on a resume.
    forgetting = kind.build_probe(loaded.tokenizer, run_context)
    # The data read (and the probe's file) must be what a resumed checkpoint trained on.
    data_content = check_resume_data(cfg, resume_point, kind.data_content(data))
    # The lm-eval tasks (the kind's; checked now, before the wrap): θ* is scored once the strategy holds it.
    benchmarks = kind.build_benchmarks(loaded.tokenizer, loaded.model, run_context)
    # loss.kl_to_pretrained's stored targets, keyed on the weights as loaded (whole, before the wrap);
    # made or reused once the strategy holds the model (_start).
    kl_anchor = kind.build_kl_anchor(loaded.model, data)
    seed_everything(cfg.training.data_seed)

    opt_cfg = cfg.optimizer
    base_lr = float(opt_cfg.resolved_hparams()["lr"])

    def make_optimizer(model):
        groups = build_param_groups(
            model, loaded.pretrained_state, lr=base_lr, weight_decay=opt_cfg.weight_decay,
            no_decay_bias_and_norm=opt_cfg.no_decay_bias_and_norm,
            layerwise_lr_decay=opt_cfg.layerwise_lr_decay, attach_anchors=False,
            child_tuning=opt_cfg.child_tuning is not None)
        # lr and weight_decay reach the optimizer once: in the groups (LLRD and no-decay applied).
        kwargs = {k: v for k, v in opt_cfg.optimizer_kwargs().items() if k not in GROUP_HPARAMS}
        if opt_cfg.state_dtype != "float32":  # the compact state's stochastic rounding is keyed on the run's seed
            kwargs["rounding_seed"] = cfg.training.seed
        return build_optimizer(opt_cfg.name, groups, impl=opt_cfg.impl, **kwargs)

    num_params = sum(p.numel() for p in loaded.model.parameters())
    num_anchored = sum(t.numel() for t in loaded.pretrained_state.values())
    # The strategy places theta* once, after wrapping (sharded under ZeRO/FSDP, each rank its part).
    model, optimizer = strategy.setup(loaded.model, make_optimizer, anchors=loaded.pretrained_state)
    # The optimizer holds theta* now; a full copy per rank would undo the sharding.
    loaded.pretrained_state = None
    if strategy.is_main_process:
        plan = plan_memory(cfg, world_size=strategy.world_size, num_params=num_params, num_anchored=num_anchored)
        logger.info("%s", format_memory_plan(plan, strategy=cfg.strategy.name, world_size=strategy.world_size))

    tcfg = cfg.training
    micro_batches_per_epoch = batches_per_epoch(len(data.train), tcfg.per_device_batch_size, strategy.world_size)
    steps_per_epoch = max(1, micro_batches_per_epoch // tcfg.gradient_accumulation_steps)
    total_steps = tcfg.max_steps or max(1, math.ceil(steps_per_epoch * tcfg.num_epochs))
    warmup_steps = cfg.schedule.warmup_for(total_steps)

    checkpoints = CheckpointManager(paths.checkpoints, keep_last=cfg.checkpoint.keep_last,
                                    is_main_process=strategy.is_main_process, barrier=strategy.barrier,
                                    tokenizer=loaded.tokenizer)
    log = MetricsLogger(paths.root, enabled=strategy.is_main_process, tensorboard=cfg.logging.tensorboard,
                        trackers=open_trackers(cfg, enabled=strategy.is_main_process,
                                               resuming=resume_point is not None))
    return AssembledRun(
        cfg=cfg, strategy=strategy, paths=paths, task=task, kind=kind, run_lock=run_lock, resume_point=resume_point,
        loaded=loaded, transforms=transforms, data=data, collate=collate, forgetting=forgetting, base_lr=base_lr,
        benchmarks=benchmarks, kl_anchor=kl_anchor, data_content=data_content, model=model, optimizer=optimizer, peak_lrs=[g["lr"] for g in optimizer.param_groups],
        micro_batches_per_epoch=micro_batches_per_epoch, total_steps=total_steps,
        warmup_steps=warmup_steps,
        lr_schedule=lr_schedule(cfg.schedule.name, warmup_steps=warmup_steps, total_steps=total_steps, base_lr=base_lr,
                                kwargs=cfg.schedule.kwargs),
        eval_at=set(eval_steps(total_steps, cfg.evaluation.num_evals, cfg.evaluation.every_steps)),
        selection_split=task.eval_splits[0], checkpoints=checkpoints, log=log, replay=kind.replay(data))


def _run_context(cfg: RunConfig, strategy: Strategy) -> RunContext:
    return RunContext(rank=strategy.rank, world_size=strategy.world_size, is_main=strategy.is_main_process,
                      barrier=strategy.barrier, gather=strategy.gather_objects, device=strategy.device,
                      progress=cfg.logging.progress_bar and strategy.is_main_process)


def _start(run: AssembledRun) -> None:
    """Where the loop starts (run.state): a resume's checkpoint, or a fresh run's θ* reference and
    child network; then the baseline the run is judged against."""
    strategy, point = run.strategy, run.resume_point
    if run.kl_anchor is not None:
        # θ*'s distributions at the trained tokens, from the cache or a pass now: the model is θ* until
        # its first step, and until a resume loads its checkpoint (collective).
        run.model.eval()
        run.kl_anchor.prepare(run.data, forward=strategy.forward, collate=run.collate, device=strategy.device,
                              batch_size=run.cfg.evaluation.batch_size, rank=strategy.rank,
                              world_size=strategy.world_size, is_main=strategy.is_main_process,
                              barrier=strategy.barrier, gather=strategy.gather_objects)
    if point is not None:
        if run.cfg.optimizer.child_tuning is not None:
            prepare_masks(run.optimizer)  # targets of the checkpoint's masks: no second Fisher pass
        if run.cfg.optimizer.importance is not None:
            prepare_importance(run.optimizer)  # targets of the checkpoint's F~: never captured again
        run.state = _resume(run, point)
        importance = run.cfg.optimizer.importance is not None
        if importance and not any(strategy.gather_objects(holds_importance(run.optimizer))):
            raise same_on_every_rank(UserError(
                f"checkpoint {point.directory} holds no importance F~ (its run had no optimizer.importance), and "
                "capturing it now would weigh the pull by a model that has moved; resume without "
                "optimizer.importance, or start a fresh run"))
        if run.forgetting is not None:
            # θ*'s side as the run that wrote the checkpoint kept it (its output directory:
            # <run>/checkpoints/<checkpoint>), kept in this run's directory too for its own resumes.
            saved_by = RunPaths(point.directory.parent.parent).forgetting_reference
            run.forgetting.reference_from_run(saved_by, run.paths.forgetting_reference,
                                              is_main=strategy.is_main_process, barrier=strategy.barrier)
        if run.benchmarks is not None:  # θ*'s scores as the run that wrote the checkpoint kept them
            run.benchmarks.reference_from_run(RunPaths(point.directory.parent.parent).benchmark_reference,
                                              run.paths.benchmark_reference, is_main=strategy.is_main_process,
                                              barrier=strategy.barrier)
    else:
        if run.forgetting is not None:
            # θ* is the model as it is now, before its first step (collective).
            run.model.eval()
            run.forgetting.reference_from_model(strategy.forward, run.paths.forgetting_reference,
                                                is_main=strategy.is_main_process, barrier=strategy.barrier)
        if run.benchmarks is not None:  # θ*'s benchmark scores, on the live model before its first step
            run.model.eval()
            run.benchmarks.reference_from_model(strategy.forward, run.paths.benchmark_reference,
                                                is_main=strategy.is_main_process, barrier=strategy.barrier)
        if run.cfg.optimizer.importance is not None:  # the Fisher of θ*, before anything moves
            run.state.importance = _capture_importance(run)
            run.data_content = {**run.data_content, **run.kind.data_content(run.data)}  # its text, now read
        if run.cfg.optimizer.child_tuning is not None:
            run.state.child_tuning = _choose_child(run)
    if run.state.baseline is None:  # a fresh run (or a checkpoint written before baselines were kept)
        run.state.baseline = run.kind.baseline(run.data, run.evaluate).to_record()
    run.baseline = Baseline.from_record(run.state.baseline)


def _resume(run: AssembledRun, point: ResumePoint) -> TrainState:
    """Loads the checkpoint into the strategy and returns the loop's state as it saved it."""
    strategy, cfg = run.strategy, run.cfg
    directory, saved = point.directory, point.saved
    try:
        strategy.load_checkpoint(directory)
    except CheckpointReadError as exc:  # its message names the checkpoint already
        raise UserError(str(exc)) from exc
    except UserError:  # the checkpoint does not fit this model (the message names it)
        raise
    except Exception as exc:
        if strategy.world_size > 1:  # a collective failed (a rank went away): a crash, not the file
            raise
        said = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise UserError(f"checkpoint {directory} cannot be read ({said}); resume from an earlier checkpoint "
                        "(checkpoint.resume_from=<its directory>) or start fresh") from exc
    state = TrainState(**saved["train_state"])
    changes = point.config_changes
    for change in changes:
        logger.warning("resuming with %s changed from %r to %r at step %d (%s)", change["key"], change["old"],
                       change["new"], change["step"], change["allowed_by"])
    state.config_changes = state.config_changes + changes
    here = cfg.training.per_device_batch_size * strategy.world_size
    if state.examples_per_round and state.examples_per_round != here:
        # Resumed on another number of ranks: keep the position in examples, not in batches.
        state.batch_in_epoch = state.batch_in_epoch * state.examples_per_round // here
        logger.warning("resuming with %d examples per micro-batch round instead of %d: data order "
                       "continues from the same example, batches differ", here, state.examples_per_round)
    restore_rng(saved["rng"], strategy)
    # Logs past the checkpoint belong to the interrupted attempt: drop them so they are not doubled.
    run.log.truncate_after(state.step)
    logger.info("resumed from %s at step %d", directory, state.step)
    return state


def _choose_child(run: AssembledRun) -> dict[str, Any]:
    """Child-Tuning-D (optim/child_tuning.py): the Fisher pass over the first fisher_batches
    micro-batches of epoch 0 (default: all of them), each through the strategy's forward,
    backward and unclipped step, then the child's mask in the optimizer state. Returns its record."""
    strategy, ct = run.strategy, run.cfg.optimizer.child_tuning
    batches = run.epoch_batches(0)[:ct.fisher_batches]
    progress = None
    if run.cfg.logging.progress_bar and strategy.is_main_process:
        from tqdm.auto import tqdm

        progress = tqdm(total=len(batches), desc="Fisher (child-tuning)", unit="batch", dynamic_ncols=True)

    def micro_step(indices: list[int]) -> None:
        _unclipped_micro_step(run, run.collate([run.data.train[i] for i in indices]))
        if progress is not None:
            progress.update(1)

    run.model.train()
    started = time.perf_counter()
    try:
        fisher = run_fisher_pass(run.optimizer, batches, micro_step)
    finally:
        if progress is not None:
            progress.close()
    numel_of = {p.name: p.numel for p in strategy.checkpointable().params()}
    result = select_child(fisher, ct.reserve_p, numel_of, partitioned=strategy.optimizer_state_is_partitioned,
                          seconds=time.perf_counter() - started)
    logger.info("child-tuning: Fisher over %d micro-batch(es) in %.1f s; the child keeps %d of %d candidate "
                "elements (%.4f, reserve_p %g)", result.fisher_batches, result.fisher_seconds,
                result.kept_elements, result.candidate_elements, result.kept_fraction, ct.reserve_p)
    return result.to_record()


def _unclipped_micro_step(run: AssembledRun, batch: dict[str, Any]) -> float | None:
    """One micro-batch of a Fisher pass: the strategy's forward, the kind's loss (the mean over the
    global micro-batch), backward and the unclipped step, in which the pass reads the reduced
    gradients. Returns the loss units of the global micro-batch (None: the kind counts none)."""
    strategy = run.strategy
    units = run.step_units([batch])
    out = run.forward(batch)
    loss = run.kind.loss(out, batch, LossNormalizer(micro_batches=1, world_size=strategy.world_size, step_units=units))
    strategy.backward(loss.backward)
    strategy.step_unclipped()
    return units


def _capture_importance(run: AssembledRun) -> dict[str, Any]:
    """optimizer.importance (optim/importance.py): the Fisher pass over the general text's global
    batches of batch_size texts (each rank its contiguous share), then F~ in the optimizer state.
    Returns its record."""
    strategy, imp = run.strategy, run.cfg.optimizer.importance
    world = strategy.world_size
    if imp.batch_size % world:
        raise same_on_every_rank(UserError(
            f"optimizer.importance.batch_size {imp.batch_size} does not split over {world} ranks; give a multiple "
            f"of {world}"))
    rows = run.kind.general_text(run.loaded.tokenizer, _run_context(run.cfg, strategy))
    whole = len(rows) // imp.batch_size
    count = whole if imp.batches is None else imp.batches
    if whole == 0 or count > whole:
        raise same_on_every_rank(UserError(
            f"optimizer.importance: its text ({imp.source}) holds {len(rows)} text(s), {whole} whole batch(es) of "
            f"batch_size {imp.batch_size}, and {count or 1} are asked for; give more text, or fewer or smaller "
            "batches (optimizer.importance.batches, batch_size)"))
    share = imp.batch_size // world
    batches = [[b * imp.batch_size + strategy.rank * share + j for j in range(share)] for b in range(count)]
    tokens = 0.0

    def micro_step(indices: list[int]) -> None:
        nonlocal tokens
        tokens += _unclipped_micro_step(run, run.collate([rows[i] for i in indices])) or 0.0

    run.model.train()
    started = time.perf_counter()
    fisher = capture_fisher(run.optimizer, batches, micro_step)
    numel_of = {p.name: p.numel for p in strategy.checkpointable().params()}
    result = place_importance(fisher, numel_of, partitioned=strategy.optimizer_state_is_partitioned,
                              tokens=int(tokens), seconds=time.perf_counter() - started)
    logger.info("importance: the Fisher of theta* over %d batch(es) of general text (%d tokens) in %.1f s; mean F %.4g "
                "over %d anchored elements, max F~ %.4g", result.batches, result.tokens, result.seconds,
                result.mean_fisher, result.anchored_elements, result.max_importance)
    return result.to_record()
