"""What functional forgetting (evaluation.forgetting) costs against training, at a config's settings.

    python benchmarks/forgetting_cost.py --config configs/quickstart.yaml --rounds 5

Sets the run up as ft-train does (which builds the probe: θ*'s features, timed by the probe itself),
then alternates `--steps-per-round` training steps with one measurement, `--rounds` times, so both
see the same machine load (on a shared machine, two separate runs' wall times compare nothing).
Prints the medians and the cost of the whole run's measurements (set-up + one per evaluation) as a
fraction of its training steps' time.
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time

from ft_framework.config import load_config
from ft_framework.task_kinds import LossNormalizer
from ft_framework.trainer import Trainer


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", default="configs/quickstart.yaml")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--steps-per-round", type=int, default=4)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as out:
        trainer = Trainer(load_config(args.config, [f"logging.output_dir={out}", "logging.progress_bar=false"]))
        trainer.setup()
        build_s = trainer.forgetting.seconds
        batches = trainer._micro_batches()
        accum = trainer.cfg.training.gradient_accumulation_steps
        step_s, measure_s = [], []
        for _ in range(args.rounds):
            trainer.model.train()
            started = time.perf_counter()
            for _ in range(args.steps_per_round):
                # the trainer's step: the kind's loss of each micro-batch, normalized over the step
                step_batches = [next(batches) for _ in range(accum)]
                normalizer = LossNormalizer(micro_batches=accum, world_size=trainer.strategy.world_size,
                                            step_units=trainer.run.step_units(step_batches))
                for micro, batch in enumerate(step_batches):
                    last = micro == accum - 1
                    loss = trainer.kind.loss(trainer.run.forward(batch, last_micro_batch=last), batch, normalizer)
                    trainer.strategy.backward(loss.backward, last_micro_batch=last)
                trainer.strategy.clip_and_step(trainer.cfg.training.max_grad_norm)
            step_s.append((time.perf_counter() - started) / args.steps_per_round)
            trainer.model.eval()
            started = time.perf_counter()
            trainer.forgetting.measure(lambda batch: trainer.strategy.forward(batch))
            measure_s.append(time.perf_counter() - started)
        step, measure = statistics.median(step_s), statistics.median(measure_s)
        evals, steps = len(trainer.eval_at), trainer.total_steps
        print(json.dumps({
            "config": args.config, "probe": trainer.forgetting.describe(), "train_step_s": round(step, 4),
            "measure_s": round(measure, 4), "probe_build_s": round(build_s, 3), "total_steps": steps,
            "evaluations": evals, "train_s": round(steps * step, 2),
            "forgetting_s": round(build_s + evals * measure, 2),
            "fraction_of_train": round((build_s + evals * measure) / (steps * step), 4),
        }, indent=1))


if __name__ == "__main__":
    main()
