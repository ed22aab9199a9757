"""The fine-tuning loop. Backend-agnostic: everything device- or sharding-specific goes through the
Strategy, so this file reads the same for one CPU, DDP, DeepSpeed or FSDP.

    results = Trainer(load_config("configs/quickstart.yaml")).fit()
"""

from __future__ import annotations

import json
import logging
import math
import os
import random
import shutil
import signal
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch

from ft_framework.checkpointing.dcp_io import CheckpointReadError
from ft_framework.checkpointing.export import ExportExistsError, check_run_export_dir, export_pretrained
from ft_framework.checkpointing.manager import CheckpointManager
from ft_framework.distributed.config_agreement import check_config_agreement
from ft_framework.distributed.slurm_env import slurm_job_record
from ft_framework.config import RunConfig
from ft_framework.data.sharding import batches_per_epoch, epoch_batches
from ft_framework.run.divergence import DivergenceGuard
from ft_framework.run.failures import same_on_every_rank
from ft_framework.errors import UserError
from ft_framework.run.fingerprint import config_record
from ft_framework.strategies.memory_fit import check_memory_budget
from ft_framework.strategies.memory_plan import format_memory_plan, plan_memory
from ft_framework.metrics import is_better, is_failed
from ft_framework.models.activation_checkpointing import apply_activation_checkpointing
from ft_framework.models.fused_activations import describe_fused, fuse_activations
from ft_framework.models.loading import load_model_and_tokenizer
from ft_framework.models.lora import merged_forgetting_distance
from ft_framework.models.r3f import R3FSettings, attach_r3f, tag_batch
from ft_framework.optim import build_optimizer
from ft_framework.optim.child_tuning import prepare_masks, run_fisher_pass, select_child
from ft_framework.optim.groups import GROUP_HPARAMS, build_param_groups
from ft_framework.run.preflight import check_data_not_empty, check_max_seq_length
from ft_framework.run.files import RESULTS_FILE, RunPaths
from ft_framework.run.start import ResumePoint, capture_rng, check_start, restore_rng
from ft_framework.run.lock import hold_run_lock
from ft_framework.run.logs import MetricsLogger
from ft_framework.run.tracking import open_trackers
from ft_framework.run.signals import StopSignals, interrupted_line
from ft_framework.strategies import Strategy, build_strategy
from ft_framework.task_kinds import Baseline, EvalContext, LossNormalizer, RunContext, build_task_kind, to_device

logger = logging.getLogger(__name__)


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
    train_seconds: float = 0.0
    # Config changes accepted on resume (fingerprint.py): {"step", "key", "old", "new", "allowed_by"}.
    config_changes: list[dict[str, Any]] = field(default_factory=list)
    # Child-Tuning's Fisher pass and child network (ChildTuningResult.to_record), None when off.
    child_tuning: dict[str, Any] | None = None
    # What the run is judged against (Baseline.to_record): the majority class, or a causal LM's own
    # scores before its first step (which a resumed run cannot measure again).
    baseline: dict[str, Any] | None = None


def seed_everything(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)


def lr_multiplier(step: int, total_steps: int, warmup_steps: int, schedule: str) -> float:
    """Linear warm-up to 1, then linear decay to 0 at total_steps (or constant after warm-up)."""
    if warmup_steps and step < warmup_steps:
        return step / warmup_steps
    if schedule == "constant":
        return 1.0
    return max(0.0, (total_steps - step) / max(1, total_steps - warmup_steps))


def eval_steps(total_steps: int, num_evals: int | None, every_steps: int | None) -> list[int]:
    """Optimizer steps after which to evaluate; the last step is always one of them."""
    if every_steps:
        steps = set(range(every_steps, total_steps + 1, every_steps))
    elif num_evals:
        steps = {max(1, round(total_steps * i / num_evals)) for i in range(1, num_evals + 1)}
    else:
        steps = set()
    return sorted(steps | {total_steps})


class Trainer:
    """One run: data, model, optimizer, loop, evaluation, logs, checkpoints, results.json."""

    def __init__(self, cfg: RunConfig, strategy: Strategy | None = None):
        self.cfg = cfg
        self.strategy = strategy or build_strategy(cfg.strategy, cfg.training)
        self.output_dir = Path(cfg.logging.output_dir)
        self.paths = RunPaths(self.output_dir)
        self.data_seed = cfg.training.data_seed  # the config fills it with training.seed when unset
        self.state = TrainState()

    # ---- set-up ---------------------------------------------------------------------------
    def setup(self) -> None:
        cfg = self.cfg
        self.task = cfg.data.task_spec()
        # The task's kind owns its model class, data, collation, loss and metrics (task_kinds/).
        self.kind = build_task_kind(cfg)
        # The first collective: every rank (every node) must train the same resolved config.
        check_config_agreement(cfg.to_dict())
        # One writer per output directory: rank 0 holds its lock until the run ends (run/lock.py).
        self._run_lock = hold_run_lock(self.strategy, self.paths)
        # Before anything is loaded: a resume must match its checkpoint, a fresh run must not mix with an old one.
        self._resume_point = check_start(cfg, self.strategy, self.paths)
        if cfg.checkpoint.export_dir:  # its end would refuse another run's export: refuse it now
            try:
                check_run_export_dir(Path(cfg.checkpoint.export_dir), self.paths.root)
            except ExportExistsError as exc:  # every rank sees the same directory
                raise same_on_every_rank(exc) from None
        # Before any weight loads: a run planned over training.memory_budget_gib stops here, in one line.
        check_memory_budget(cfg, world_size=self.strategy.world_size, on_gpu=self.strategy.device.type == "cuda")
        # The init seed drives everything random in the model (head, RI, re-init); the data seed
        # drives data order and dropout, so the two can be varied separately (Dodge et al.).
        loaded = load_model_and_tokenizer(cfg.model, model_class=self.kind.model_class, seed=cfg.training.seed)
        self.loaded = loaded
        check_max_seq_length(cfg.data.max_seq_length, loaded.model, cfg.model.name_or_path)
        # Before checkpointing and the strategy wrap the model (the memory plan traces the same transform).
        self.fused_activations = fuse_activations(loaded.model) if cfg.model.fused_activations else None
        logger.info("model.fused_activations: %s", "off (the model's own activation modules)"
                    if self.fused_activations is None else describe_fused(self.fused_activations))
        run = RunContext(rank=self.strategy.rank, world_size=self.strategy.world_size,
                         is_main=self.strategy.is_main_process, barrier=self.strategy.barrier,
                         gather=self.strategy.gather_objects, device=self.strategy.device,
                         progress=cfg.logging.progress_bar and self.strategy.is_main_process)
        self.data = self.kind.load_data(loaded.tokenizer, run)
        check_data_not_empty(self.data, task=self.task.name, source=cfg.data.source)
        self.collate = self.kind.collator(loaded.tokenizer, loaded.model.config)
        # The forgetting probe: θ*'s side from the checkpoint (an encoder's), or from the model
        # before its first step (a decoder's: captured below, once the strategy holds the model).
        self.forgetting = self.kind.build_probe(loaded.tokenizer, run)
        seed_everything(self.data_seed)

        opt_cfg = cfg.optimizer
        self.base_lr = float(opt_cfg.resolved_hparams()["lr"])

        def make_optimizer(model):
            groups = build_param_groups(
                model, loaded.pretrained_state, lr=self.base_lr, weight_decay=opt_cfg.weight_decay,
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
        if cfg.training.activation_checkpointing:
            # Before any strategy wraps the model: FSDP2 shards the blocks as they are then.
            num_blocks = apply_activation_checkpointing(loaded.model)
            logger.info("activation checkpointing: %d transformer block module(s) recompute their "
                        "activations in backward", num_blocks)
        # Before any strategy wraps the model: its wrapper then sees R3F's two passes as one forward.
        self.r3f = None if cfg.training.r3f is None else attach_r3f(loaded.model, R3FSettings(
            weight=cfg.training.r3f.weight, noise=cfg.training.r3f.noise, sigma=cfg.training.r3f.sigma,
            seed=self.data_seed, max_seq_length=cfg.data.max_seq_length))
        # The strategy places theta* once, after wrapping (sharded under ZeRO/FSDP, each rank its part).
        self.model, self.optimizer = self.strategy.setup(loaded.model, make_optimizer,
                                                         anchors=loaded.pretrained_state)
        # The optimizer holds theta* now; a full copy per rank would undo the sharding.
        loaded.pretrained_state = None
        if self.strategy.is_main_process:
            plan = plan_memory(cfg, world_size=self.strategy.world_size, num_params=num_params,
                               num_anchored=num_anchored)
            logger.info("%s", format_memory_plan(plan, strategy=cfg.strategy.name,
                                                 world_size=self.strategy.world_size))
        # Each group's own peak lr (LLRD scales it); the schedule multiplies it.
        self.peak_lrs = [g["lr"] for g in self.optimizer.param_groups]

        tcfg = cfg.training
        self.micro_batches_per_epoch = batches_per_epoch(len(self.data.train), tcfg.per_device_batch_size,
                                                         self.strategy.world_size)
        steps_per_epoch = max(1, self.micro_batches_per_epoch // tcfg.gradient_accumulation_steps)
        self.total_steps = tcfg.max_steps or max(1, math.ceil(steps_per_epoch * tcfg.num_epochs))
        self.warmup_steps = cfg.schedule.warmup_for(self.total_steps)
        self.eval_at = set(eval_steps(self.total_steps, cfg.evaluation.num_evals, cfg.evaluation.every_steps))
        self.selection_split = self.task.eval_splits[0]

        self.checkpoints = CheckpointManager(self.paths.checkpoints, keep_last=cfg.checkpoint.keep_last,
                                             is_main_process=self.strategy.is_main_process,
                                             barrier=self.strategy.barrier, tokenizer=self.loaded.tokenizer)
        self.log = MetricsLogger(self.output_dir, enabled=self.strategy.is_main_process,
                                 tensorboard=cfg.logging.tensorboard,
                                 trackers=open_trackers(cfg, enabled=self.strategy.is_main_process,
                                                        resuming=self._resume_point is not None))
        if self._resume_point is not None:
            if cfg.optimizer.child_tuning is not None:
                prepare_masks(self.optimizer)  # targets of the checkpoint's masks: no second Fisher pass
            self._resume(self._resume_point)
            if getattr(self.forgetting, "needs_reference", False):
                # θ*'s answers as the run that wrote the checkpoint saved them (its output directory:
                # <run>/checkpoints/<checkpoint>), kept in this run's directory too for its own resumes.
                saved_by = RunPaths(self._resume_point.directory.parent.parent).forgetting_reference
                self.forgetting.load_reference(saved_by)
                if saved_by.resolve() != self.paths.forgetting_reference.resolve():
                    self.forgetting.save_reference(self.paths.forgetting_reference,
                                                   is_main=self.strategy.is_main_process, barrier=self.strategy.barrier)
        else:
            if getattr(self.forgetting, "needs_reference", False):
                # θ* is the model as it is now, before its first step (collective).
                self.model.eval()
                self.forgetting.capture_reference(self.strategy.forward)
                self.forgetting.save_reference(self.paths.forgetting_reference,
                                               is_main=self.strategy.is_main_process, barrier=self.strategy.barrier)
            if cfg.optimizer.child_tuning is not None:
                self._choose_child()
        if self.state.baseline is None:  # a fresh run (or a checkpoint written before baselines were kept)
            self.state.baseline = self.kind.baseline(self.data, self.evaluate).to_record()
        self.baseline = Baseline.from_record(self.state.baseline)

    def _choose_child(self) -> None:
        """Child-Tuning-D (optim/child_tuning.py): the Fisher pass over the first fisher_batches
        micro-batches of epoch 0 (default: all of them), each through the strategy's forward,
        backward and unclipped step, then the child's mask in the optimizer state."""
        ct = self.cfg.optimizer.child_tuning
        batches = self._epoch_batches(0)[:ct.fisher_batches]
        progress = None
        if self.cfg.logging.progress_bar and self.strategy.is_main_process:
            from tqdm.auto import tqdm

            progress = tqdm(total=len(batches), desc="Fisher (child-tuning)", unit="batch", dynamic_ncols=True)

        def micro_step(indices: list[int]) -> None:
            batch = self.collate([self.data.train[i] for i in indices])
            out = self._forward(batch)
            loss = self.kind.loss(out, batch, LossNormalizer(micro_batches=1, world_size=self.strategy.world_size,
                                                             step_units=self._step_units([batch])))
            self.strategy.backward(loss.backward)
            self.strategy.step_unclipped()
            if progress is not None:
                progress.update(1)

        self.model.train()
        started = time.perf_counter()
        try:
            fisher = run_fisher_pass(self.optimizer, batches, micro_step)
        finally:
            if progress is not None:
                progress.close()
        numel_of = {p.name: p.numel for p in self.strategy.checkpointable().params()}
        result = select_child(fisher, ct.reserve_p, numel_of, partitioned=self.strategy.optimizer_state_is_partitioned,
                              seconds=time.perf_counter() - started)
        self.state.child_tuning = result.to_record()
        logger.info("child-tuning: Fisher over %d micro-batch(es) in %.1f s; the child keeps %d of %d candidate "
                    "elements (%.4f, reserve_p %g)", result.fisher_batches, result.fisher_seconds,
                    result.kept_elements, result.candidate_elements, result.kept_fraction, ct.reserve_p)

    def _resume(self, point: ResumePoint) -> None:
        directory, saved = point.directory, point.saved
        try:
            self.strategy.load_checkpoint(directory)
        except CheckpointReadError as exc:  # its message names the checkpoint already
            raise UserError(str(exc)) from exc
        except UserError:  # the checkpoint does not fit this model (the message names it)
            raise
        except Exception as exc:
            if self.strategy.world_size > 1:  # a collective failed (a rank went away): a crash, not the file
                raise
            said = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
            raise UserError(f"checkpoint {directory} cannot be read ({said}); resume from an earlier checkpoint "
                            "(checkpoint.resume_from=<its directory>) or start fresh") from exc
        self.state = TrainState(**saved["train_state"])
        changes = point.config_changes
        for change in changes:
            logger.warning("resuming with %s changed from %r to %r at step %d (%s)", change["key"], change["old"],
                           change["new"], change["step"], change["allowed_by"])
        self.state.config_changes = self.state.config_changes + changes
        here = self.cfg.training.per_device_batch_size * self.strategy.world_size
        if self.state.examples_per_round and self.state.examples_per_round != here:
            # Resumed on another number of ranks: keep the position in examples, not in batches.
            self.state.batch_in_epoch = self.state.batch_in_epoch * self.state.examples_per_round // here
            logger.warning("resuming with %d examples per micro-batch round instead of %d: data order "
                           "continues from the same example, batches differ", here, self.state.examples_per_round)
        restore_rng(saved["rng"], self.strategy)
        # Logs past the checkpoint belong to the interrupted attempt: drop them so they are not doubled.
        self.log.truncate_after(self.state.step)
        logger.info("resumed from %s at step %d", directory, self.state.step)

    # ---- data ---------------------------------------------------------------------------------
    def _epoch_batches(self, epoch: int) -> list[list[int]]:
        """This rank's micro-batches of `epoch`: a permutation fixed by (data seed, epoch)."""
        return epoch_batches(len(self.data.train), batch_size=self.cfg.training.per_device_batch_size,
                             data_seed=self.data_seed, epoch=epoch, rank=self.strategy.rank,
                             world_size=self.strategy.world_size)

    def _forward(self, batch: dict[str, Any], last_micro_batch: bool = True) -> Any:
        """The strategy's forward of a collated batch's model inputs (the kind says which they are)."""
        inputs = to_device(self.kind.model_inputs(batch), self.strategy.device)
        return self.strategy.forward(inputs, last_micro_batch=last_micro_batch)

    def _step_units(self, batches: list[dict[str, torch.Tensor]]) -> float | None:
        """The loss units (a causal LM's label tokens) of one optimizer step on every rank together,
        or None when the kind averages each micro-batch itself. Collective when it counts."""
        units = self.kind.step_units(batches)
        return None if units is None else float(sum(self.strategy.gather_objects(units)))

    def _micro_batches(self):
        """Yields collated micro-batches from the saved position on, across epochs, forever."""
        while True:
            batches = self._epoch_batches(self.state.epoch)
            while self.state.batch_in_epoch < len(batches):
                idx = batches[self.state.batch_in_epoch]
                self.state.batch_in_epoch += 1
                batch = self.collate([self.data.train[i] for i in idx])
                # R3F's noise is keyed on the examples and the step, not on where they landed.
                yield batch if self.r3f is None else tag_batch(batch, idx, self.state.step)
            self.state.epoch += 1
            self.state.batch_in_epoch = 0

    # ---- the loop -------------------------------------------------------------------------
    def fit(self, stop_after_step: int | None = None) -> dict[str, Any]:
        """Trains to the configured length (or stops after `stop_after_step`, as a preempted run
        would, after saving a checkpoint) and returns the results written to results.json."""
        # SIGTERM / SIGINT / SIGUSR1 set a flag; the ranks act on it together at a step boundary.
        with StopSignals(on_signal=self.cfg.checkpoint.on_signal, prog="ft-train") as signals:
            try:
                return self._fit(signals, stop_after_step)
            finally:
                if getattr(self, "_run_lock", None) is not None:
                    self._run_lock.release()

    def _fit(self, signals: StopSignals, stop_after_step: int | None) -> dict[str, Any]:
        self.setup()
        cfg, st = self.cfg, self.state
        accum = cfg.training.gradient_accumulation_steps
        progress = self._progress_bar()
        batches = self._micro_batches()
        divergence = DivergenceGuard(self.strategy)
        started = time.perf_counter() - st.train_seconds
        try:
            while st.step < self.total_steps:
                self.model.train()
                # Before backward: an overlapped offloaded step runs during it (strategies/offload.py).
                self._set_lr(st.step)
                step_batches = [next(batches) for _ in range(accum)]
                # The trainer alone counts accumulation and ranks: the kind scales each micro-batch's
                # loss by them (and by the step's loss units), and the strategy hears of the end.
                normalizer = LossNormalizer(micro_batches=accum, world_size=self.strategy.world_size,
                                            step_units=self._step_units(step_batches))
                for micro, batch in enumerate(step_batches):
                    last = micro == accum - 1
                    out = self._forward(batch, last_micro_batch=last)
                    loss = self.kind.loss(out, batch, normalizer)
                    self.strategy.backward(loss.backward, last_micro_batch=last)
                    st.window_loss += loss.total
                    st.window_units += loss.units
                    st.window_micro_batches += 1
                grad_norm = self.strategy.clip_and_step(cfg.training.max_grad_norm)
                st.step += 1
                diverged = divergence.check(st.step, st.window_loss, grad_norm)  # every rank agrees
                if diverged is not None:
                    self._log_train(grad_norm, progress)
                    if self.strategy.is_main_process:
                        logger.error("diverged at step %d: %s; stopping", diverged["step"], diverged["what"])
                    return self._finish(diverged=diverged)
                st.train_seconds = time.perf_counter() - started
                if progress is not None:
                    progress.update(1)
                if st.step % cfg.logging.log_every_steps == 0 or st.step == self.total_steps:
                    self._log_train(grad_norm, progress)
                if st.step in self.eval_at:
                    self._evaluate_and_select()
                stopping = stop_after_step is not None and st.step >= stop_after_step
                every = cfg.checkpoint.every_steps
                if (every and st.step % every == 0) or stopping:
                    self._save_checkpoint()
                if stopping and st.step < self.total_steps:
                    self.log.close(ok=False)  # trackers: this attempt ends here, a resume continues it
                    return {"stopped_at_step": st.step}
                signum = signals.agreed(self.strategy)  # every rank: one of them was asked to stop
                if signum and st.step < self.total_steps:
                    return self._interrupted(signum, saved=bool(every and st.step % every == 0))
        except BaseException:
            self.log.close(ok=False)
            raise
        finally:
            if progress is not None:
                progress.close()
        results = self._finish()
        return results

    def _set_lr(self, step: int) -> None:
        # The lr of optimizer step `step`+1 (0-based step index): warm-up starts above zero.
        mult = lr_multiplier(step + 1, self.total_steps, self.warmup_steps, self.cfg.schedule.name)
        for group, peak in zip(self.optimizer.param_groups, self.peak_lrs):
            group["lr"] = peak * mult

    def _progress_bar(self):
        if not (self.cfg.logging.progress_bar and self.strategy.is_main_process):
            return None
        from tqdm.auto import tqdm

        return tqdm(total=self.total_steps, initial=self.state.step, desc=self.task.name,
                    unit="step", dynamic_ncols=True)

    def _log_train(self, grad_norm: float, progress) -> None:
        st = self.state
        # The mean over every rank's units since the last line (collective: every rank logs here).
        sums = self.strategy.gather_objects((st.window_loss, st.window_units))
        loss = sum(total for total, _ in sums) / max(sum(units for _, units in sums), 1.0)
        st.window_loss, st.window_units, st.window_micro_batches = 0.0, 0.0, 0
        record = {"type": "train", "step": st.step, "epoch": st.epoch, "loss": loss,
                  "lr": self.optimizer.param_groups[0]["lr"], "grad_norm": grad_norm}
        lambdas = self.strategy.current_lambdas()
        if lambdas is not None:
            record["lambda"] = lambdas
        record.update(self.strategy.train_metrics())
        if self.r3f is not None:
            record.update(self.r3f.pop_metrics())
        record.update(self._forgetting_distance())
        self.log.write(record)
        if progress is not None:
            progress.set_postfix(loss=f"{loss:.4f}", lr=f"{record['lr']:.2e}")

    def _forgetting_distance(self) -> dict[str, float]:
        """{"forgetting_distance": ‖θ − θ*‖₂} where the run has θ* (collective under sharding)."""
        distance = self.strategy.forgetting_distance()
        if self.cfg.model.lora is not None:  # the optimizer anchors nothing: the merged weights' distance
            distance = merged_forgetting_distance(self.strategy.unwrapped_model())
        return {} if distance is None else {"forgetting_distance": distance}

    # ---- evaluation ---------------------------------------------------------------------------
    def _eval_context(self) -> EvalContext:
        return EvalContext(forward=self.strategy.forward, device=self.strategy.device, rank=self.strategy.rank,
                           world_size=self.strategy.world_size, gather=self.strategy.gather_objects,
                           batch_size=self.cfg.evaluation.batch_size, collate=self.collate)

    @torch.no_grad()
    def evaluate(self) -> dict[str, dict[str, float]]:
        """Metrics of every eval split (the task kind's); each rank scores a slice, every rank's view
        is complete. Collective."""
        self.model.eval()
        return self.kind.evaluate(self.data, self._eval_context())

    def _evaluate_and_select(self) -> None:
        st = self.state
        metrics = self.evaluate()
        record = {"step": st.step, "metrics": metrics}
        samples = self.kind.samples(self.data, self._eval_context())  # collective: every rank generates them
        if samples is not None:
            record["samples"] = samples
            if self.strategy.is_main_process:
                for sample in samples:
                    logger.info("step %d sample: %r -> %r (reference %r)", st.step, sample["prompt"][-80:],
                                sample["generated"], sample["reference"])
        if self.forgetting is not None:  # collective: every rank runs its share of the probe
            self.model.eval()
            record["forgetting"] = self.forgetting.measure(lambda batch: self.strategy.forward(batch))
        # Every evaluation point carries the distance too, so ft-report can set it against the
        # functional forgetting whatever logging.log_every_steps is.
        record.update(self._forgetting_distance())
        st.evals.append(record)
        self.log.write({"type": "eval", **record})
        main = self.task.main_metric
        score = metrics[self.selection_split][main]
        if st.best is None or is_better(main, score, st.best["metrics"][self.selection_split][main]):
            st.best = record
            if self.cfg.evaluation.select_best:
                self.checkpoints.save_best(st.step, self.strategy, self._checkpoint_state())

    # ---- checkpoints and results -------------------------------------------------------------
    def _checkpoint_state(self) -> dict[str, Any]:
        """The trainer's part of a checkpoint (collective: every rank's random state)."""
        rng = capture_rng(self.strategy)  # collective
        self.state.examples_per_round = self.cfg.training.per_device_batch_size * self.strategy.world_size
        return {"train_state": vars(self.state).copy(), "rng": rng,
                "config_record": config_record(self.cfg.to_dict(), self.strategy.world_size)}

    def _save_checkpoint(self) -> None:
        self.checkpoints.save(self.state.step, self.strategy, self._checkpoint_state())

    def _interrupted(self, signum: int, *, saved: bool) -> dict[str, Any]:
        """A signal stopped the run at this step boundary (run/signals.py): a checkpoint (unless this
        step's is saved already), results.json with status interrupted, one line; the CLI exits
        with 128 + the signal's number."""
        st = self.state
        if not saved:
            self._save_checkpoint()
        checkpoint = self.checkpoints.latest()
        name = signal.Signals(signum).name
        results = {"status": "interrupted", "signal": name, "exit_code": 128 + signum, "steps": st.step,
                   "total_steps": self.total_steps, "checkpoint": str(checkpoint), "task": self.task.name,
                   "evals": st.evals, "config": self.cfg.to_dict()}
        if self.strategy.is_main_process:
            self._write_results(results)
            print(interrupted_line("ft-train", signum, st.step, checkpoint), file=sys.stderr, flush=True)
        self.log.close(ok=False)  # trackers: this attempt ends here, a resume continues it
        return results

    def _write_results(self, results: dict[str, Any]) -> None:
        slurm = slurm_job_record(os.environ)
        if slurm is not None:  # which SLURM job ran it, and how often SLURM requeued that job
            results = {**results, "slurm": slurm}
        self.output_dir.mkdir(parents=True, exist_ok=True)
        tmp = self.output_dir / (RESULTS_FILE + ".tmp")
        tmp.write_text(json.dumps(results, indent=2, allow_nan=True))
        tmp.replace(self.output_dir / RESULTS_FILE)

    def _finish(self, diverged: dict[str, Any] | None = None) -> dict[str, Any]:
        """Writes results.json. A diverged run (divergence.py) is not evaluated again: it records
        where it diverged, its evaluations before that, and failed: true."""
        st = self.state
        if diverged is None and (not st.evals or st.evals[-1]["step"] != st.step):
            self._evaluate_and_select()
        final = st.evals[-1] if st.evals else None
        reported = st.best if self.cfg.evaluation.select_best else final
        main = self.task.main_metric
        results = {
            "task": self.task.name,
            "main_metric": main,
            "selection_split": self.selection_split,
            "steps": st.step,
            "train_seconds": round(st.train_seconds, 3),
            "final": final,
            "best": st.best,
            "reported": "best" if self.cfg.evaluation.select_best else "final",
            "baseline": self.baseline.to_record(),
            "failed": diverged is not None or bool(is_failed(
                self.task, reported["metrics"][self.selection_split], self.baseline.metrics[self.selection_split])),
            **({"diverged": diverged} if diverged is not None else {}),
            # The size this run trained on (ft-report groups tasks by it, not by the nominal GLUE size).
            "train_examples": len(self.data.train),
            **self.kind.describe_data(self.data),
            # What model.fused_activations replaced ({activation name: modules}); null: the switch was off.
            "fused_activations": self.fused_activations,
            **({"forgetting_probe": self.forgetting.describe()} if self.forgetting is not None else {}),
            **({"child_tuning": st.child_tuning} if st.child_tuning is not None else {}),
            "config_changes": st.config_changes,
            "config": self.cfg.to_dict(),
        }
        if self.cfg.checkpoint.export_dir and diverged is None:
            results["exported_to"] = self.export(Path(self.cfg.checkpoint.export_dir))
        if self.strategy.is_main_process:
            self._write_results(results)
            self.log.log_artifact(self.output_dir / RESULTS_FILE)
        self.log.close()
        return results

    def export(self, directory: Path) -> str:
        """Writes the model as a Hugging Face model (save_pretrained) with its tokenizer, the way
        ft-export does: rank 0 reads a sharded checkpoint in one process. With evaluation.select_best
        that is the best evaluation's (checkpoints/best); else the last checkpoint when it is of this
        step, else one saved for the purpose and removed after. A LoRA model is written merged, its
        adapter under adapter/."""
        latest = self.checkpoints.latest()
        source, temporary = latest, None
        if self.cfg.evaluation.select_best and self.state.best is not None:
            source = self.paths.best_checkpoint  # written at the best evaluation, by every rank
        elif latest is None or latest.name != self.checkpoints.name_for(self.state.step):
            source = temporary = self.paths.export_scratch
            if self.strategy.is_main_process:
                shutil.rmtree(temporary, ignore_errors=True)
                temporary.mkdir(parents=True)
            self.strategy.barrier()
            self.strategy.save_checkpoint(temporary, tokenizer=self.loaded.tokenizer)  # collective
            self.strategy.barrier()
        if self.strategy.is_main_process:
            export_pretrained(source, directory, tokenizer=self.loaded.tokenizer)
            if temporary is not None:
                shutil.rmtree(temporary, ignore_errors=True)
        self.strategy.barrier()
        return str(directory)
