"""The fine-tuning loop. Backend-agnostic: everything device- or sharding-specific goes through the
Strategy, so this file reads the same for one CPU, DDP, DeepSpeed or FSDP. What the loop trains is
built before its first step by the run's assembly (assembly.py: model, transforms, data, strategy,
optimizer, files, resume); this file holds the loop, evaluation, logging, checkpoints and results.

    results = Trainer(load_config("configs/quickstart.yaml")).fit()
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import signal
import sys
import time
from pathlib import Path
from typing import Any

from ft_framework.assembly import AssembledRun, TrainState, assemble_run, eval_steps
from ft_framework.checkpointing.export import export_pretrained
from ft_framework.config import RunConfig
from ft_framework.distributed.slurm_env import slurm_job_record
from ft_framework.metrics import is_better, is_failed
from ft_framework.models.lm_benchmarks import BENCHMARK_FORGETTING, benchmark_forgetting
from ft_framework.models.lora import merged_forgetting_distance
from ft_framework.models.r3f import tag_batch
from ft_framework.run.divergence import DivergenceGuard
from ft_framework.run.files import RESULTS_FILE, RunPaths
from ft_framework.run.fingerprint import config_record
from ft_framework.run.signals import StopSignals, interrupted_line
from ft_framework.run.start import capture_rng
from ft_framework.strategies import Strategy, build_strategy
from ft_framework.task_kinds import LossNormalizer

logger = logging.getLogger(__name__)

# eval_steps and TrainState live in assembly.py (the set-up decides when to evaluate); named here too.
__all__ = ["TrainState", "Trainer", "eval_steps"]


def _assembled(name: str) -> property:
    """A part of the assembled run, read through the trainer (trainer.model, trainer.kind, ...)."""
    return property(lambda self: getattr(self.run, name), doc=f"The assembled run's {name} (assembly.py).")


class Trainer:
    """One run: its assembly (set-up), then the loop, evaluation, logs, checkpoints, results.json."""

    run: AssembledRun  # what setup() assembled

    def __init__(self, cfg: RunConfig, strategy: Strategy | None = None):
        self.cfg = cfg
        self.strategy = strategy or build_strategy(cfg.strategy, cfg.training)
        self.output_dir = Path(cfg.logging.output_dir)
        self.paths = RunPaths(self.output_dir)
        self.data_seed = cfg.training.data_seed  # the config fills it with training.seed when unset
        self.state = TrainState()

    # The assembled run's parts, read as the trainer's own.
    task = _assembled("task")
    kind = _assembled("kind")
    loaded = _assembled("loaded")
    data = _assembled("data")
    collate = _assembled("collate")
    forgetting = _assembled("forgetting")
    benchmarks = _assembled("benchmarks")
    fused_activations = _assembled("fused_activations")
    r3f = _assembled("r3f")
    base_lr = _assembled("base_lr")
    model = _assembled("model")
    optimizer = _assembled("optimizer")
    peak_lrs = _assembled("peak_lrs")
    micro_batches_per_epoch = _assembled("micro_batches_per_epoch")
    total_steps = _assembled("total_steps")
    warmup_steps = _assembled("warmup_steps")
    lr_schedule = _assembled("lr_schedule")
    eval_at = _assembled("eval_at")
    selection_split = _assembled("selection_split")
    checkpoints = _assembled("checkpoints")
    log = _assembled("log")
    baseline = _assembled("baseline")

    # ---- set-up ---------------------------------------------------------------------------
    def setup(self) -> None:
        """Builds everything the run needs before its first step, and the state the loop starts from
        (assembly.py: a resume's checkpoint, or a fresh run's θ* reference and child network)."""
        self.run = assemble_run(self.cfg, self.strategy, self.paths)
        self._run_lock = self.run.run_lock  # released when fit() ends, however it ends
        self.state = self.run.state

    # ---- data ---------------------------------------------------------------------------------
    def _micro_batches(self):
        """Yields collated micro-batches from the saved position on, across epochs, forever."""
        while True:
            batches = self.run.epoch_batches(self.state.epoch)
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
                # The task's micro-batches, then data.replay's (none when off): one step, one loss over both.
                replay = self.run.replay_batches(st.step)
                step_batches = [next(batches) for _ in range(accum)] + [batch for batch, _ in replay]
                # The trainer alone counts accumulation and ranks: the kind scales each micro-batch's
                # loss by them (and by the step's loss units), and the strategy hears of the end.
                normalizer = LossNormalizer(micro_batches=len(step_batches), world_size=self.strategy.world_size,
                                            step_units=self.run.step_units(step_batches))
                for micro, batch in enumerate(step_batches):
                    last = micro == len(step_batches) - 1
                    out = self.run.forward(batch, last_micro_batch=last)
                    loss = self.kind.loss(out, batch, normalizer)
                    self.strategy.backward(loss.backward, last_micro_batch=last)
                    if micro < accum:
                        st.window_loss += loss.total
                        st.window_units += loss.units
                        for name, value in loss.terms.items():
                            st.window_terms[name] = st.window_terms.get(name, 0.0) + value
                    else:
                        st.window_replay_loss += loss.total
                        st.window_replay_units += loss.units
                        st.window_replay_rows += replay[micro - accum][1]
                    st.window_micro_batches += 1
                grad_norm = self.strategy.clip_and_step(cfg.training.max_grad_norm)
                st.step += 1
                # every rank agrees
                diverged = divergence.check(st.step, st.window_loss + st.window_replay_loss, grad_norm)
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
        # Step k (0-based) runs at the schedule's value for k + 1 (docs/training.md, "Schedules"):
        # a warm-up's first step moves the weights, and recorded runs and checkpoints keep their curve.
        mult = self.lr_schedule(step + 1)
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
        # The mean over every rank's units since the last line (collective: every rank logs here);
        # data.replay's rows apart (their own mean, rows and label tokens), the task's in `loss`.
        sums = [*zip(*self.strategy.gather_objects((st.window_loss, st.window_units, st.window_replay_loss,
                                                     st.window_replay_units, st.window_replay_rows,
                                                     st.window_terms)))]
        loss = sum(sums[0]) / max(sum(sums[1]), 1.0)
        # The objective's added terms (loss.kl_to_pretrained's KL), each its mean over the same units.
        terms = {name: sum(t.get(name, 0.0) for t in sums[5]) / max(sum(sums[1]), 1.0)
                 for name in sorted(set().union(*sums[5]))}
        st.window_terms = {}
        st.window_loss, st.window_units, st.window_micro_batches = 0.0, 0.0, 0
        st.window_replay_loss, st.window_replay_units, st.window_replay_rows = 0.0, 0.0, 0
        record = {"type": "train", "step": st.step, "epoch": st.epoch, "loss": loss,
                  "lr": self.optimizer.param_groups[0]["lr"], "grad_norm": grad_norm, **terms}
        if self.run.replay is not None:
            record.update(replay_loss=sum(sums[2]) / max(sum(sums[3]), 1.0), replay_rows=int(sum(sums[4])),
                          replay_tokens=int(sum(sums[3])))
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
    def evaluate(self) -> dict[str, dict[str, float]]:
        """Metrics of every eval split (the task kind's); each rank scores a slice, every rank's view
        is complete. Collective."""
        return self.run.evaluate()

    def _evaluate_and_select(self) -> None:
        st = self.state
        metrics = self.evaluate()
        record = {"step": st.step, "metrics": metrics}
        samples = self.kind.samples(self.data, self.run.eval_context())  # collective: every rank generates them
        if samples is not None:
            record["samples"] = samples
            if self.strategy.is_main_process:
                for sample in samples:
                    logger.info("step %d sample: %r -> %r (reference %r)", st.step, sample["prompt"][-80:],
                                sample["generated"], sample["reference"])
        if self.forgetting is not None:  # collective: every rank runs its share of the probe
            self.model.eval()
            record["forgetting"] = self.forgetting.measure(lambda batch: self.strategy.forward(batch))
        if self.benchmarks is not None and (self.cfg.evaluation.benchmarks.every_eval or st.step >= self.total_steps):
            self.model.eval()  # collective: every rank scores its share of each task's requests
            record["benchmarks"] = self.benchmarks.measure(self.strategy.forward)
            record[BENCHMARK_FORGETTING] = benchmark_forgetting(record["benchmarks"])
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
                "config_record": config_record(self.cfg.to_dict(), self.strategy.world_size,
                                               data_content=self.run.data_content)}

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
                   "evals": st.evals, "data_content": self.run.data_content, "config": self.cfg.to_dict()}
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
            # data.replay: its file (path, sha256), fraction, rows per step and rows used.
            **({"replay": self.run.replay.record(st.step)} if self.run.replay is not None else {}),
            # loss.kl_to_pretrained: β, k, its stored targets (tokens, cache bytes) and the pass's seconds.
            **({"kl_to_pretrained": self.run.kl_anchor.record} if self.run.kl_anchor is not None else {}),
            # What model.fused_activations replaced ({activation name: modules}); null: the switch was off.
            "fused_activations": self.fused_activations,
            **({"forgetting_probe": self.forgetting.describe()} if self.forgetting is not None else {}),
            **self._benchmark_results(reported, final),
            **({"child_tuning": st.child_tuning} if st.child_tuning is not None else {}),
            # optimizer.importance's Fisher pass: batches, tokens, seconds, mean F, max F~.
            **({"importance": st.importance} if st.importance is not None else {}),
            "config_changes": st.config_changes,
            # {config key: content id} of every data file it read (run/fingerprint.py: check_data_content).
            "data_content": self.run.data_content,
            "config": self.cfg.to_dict(),
        }
        if self.cfg.checkpoint.export_dir and diverged is None:
            results["exported_to"] = self.export(Path(self.cfg.checkpoint.export_dir))
        if self.strategy.is_main_process:
            self._write_results(results)
            self.log.log_artifact(self.output_dir / RESULTS_FILE)
        self.log.close()
        return results

    def _benchmark_results(self, reported: dict[str, Any] | None, final: dict[str, Any] | None) -> dict[str, Any]:
        """results.json's benchmark scores: the reported evaluation's when it scored them (every_eval),
        else the final one's; with θ*'s and the drop from them, their mean, and what was scored."""
        if self.benchmarks is None:
            return {}
        scored = next((r for r in (reported, final) if r is not None and "benchmarks" in r), None)
        out: dict[str, Any] = {"benchmarks_run": {**self.benchmarks.describe(),
                                                  "step": None if scored is None else scored["step"]}}
        if scored is not None:
            out.update({"benchmarks": scored["benchmarks"], BENCHMARK_FORGETTING: scored[BENCHMARK_FORGETTING]})
        return out

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
