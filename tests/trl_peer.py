"""TRL's SFTTrainer as ft-train's peer: the same rows in the same batches, with the same learning
rates, so that the two runs can be compared step by step (tests/recipes/test_trl_parity.py) and timed
side by side (benchmarks/trl_compare.py).

    order = ft_train_order(len(rows), batch_size=8, accumulation=1, data_seed=2, steps=16)
    trainer = trl_peer(model, tokenizer, [rows[i] for i in order], output_dir=..., steps=16, ...)
    trainer.train(); trl_train_logs(trainer)  # one dict per step: loss, grad_norm, learning_rate

What is made equal, and why each needs saying:

- **Order.** ft-train's epoch order is a permutation fixed by the data seed (data/sharding.py,
  epoch_batches); TRL's Trainer draws its own. TRL gets a data set already in ft-train's order, one
  epoch after another, read sequentially (``train_sampling_strategy="sequential"``, transformers'
  own switch). ft-train cuts each epoch into micro-batches and ends it with a short one when the
  rows do not divide; TRL's sequential batches would straddle the epochs there, so the rows must
  divide into micro-batches (checked).
- **Schedule.** ft-train's optimizer step k (0-based) runs at the schedule's value for k + 1 (optim/schedules.py): its warm-up
  starts above zero and its linear decay reaches zero at the last step. transformers' schedules give
  step k their value at k: the warm-up starts at zero and the decay ends one step above it. The same
  function of the step, one step apart: TRL's scheduler (transformers' own, built by the Trainer) is
  advanced one step before the first.
- **Everything else is a setting**: fp32 (``bf16=False``), no gradient checkpointing (TRL's default
  is on; ft-train's activation checkpointing is off by default), no checkpoints, logging every step.
"""

from __future__ import annotations

import warnings
from typing import Any, Sequence

from ft_framework.data.sharding import batches_per_epoch, epoch_batches

__all__ = ["ft_train_order", "trl_peer", "trl_train_logs"]


def ft_train_order(num_rows: int, *, batch_size: int, accumulation: int, data_seed: int, steps: int) -> list[int]:
    """The rows ft-train trains on, in its order, for `steps` optimizer steps in one process: its
    epochs' orders one after another, as many epochs as the steps reach into."""
    if num_rows % batch_size:
        raise ValueError(f"{num_rows} rows do not divide into micro-batches of {batch_size}: ft-train's epochs would "
                         "end with a short one, which a sequential sampler over the epochs cannot reproduce")
    per_epoch = batches_per_epoch(num_rows, batch_size, world_size=1)
    epochs = -(-steps * accumulation // per_epoch)
    return [i for epoch in range(epochs)
            for batch in epoch_batches(num_rows, batch_size=batch_size, data_seed=data_seed, epoch=epoch, rank=0,
                                       world_size=1)
            for i in batch]


def trl_peer(model: Any, tokenizer: Any, rows: Sequence[dict[str, Any]], *, output_dir: str, steps: int,
             batch_size: int, accumulation: int, lr: float, weight_decay: float, warmup_steps: int,
             max_grad_norm: float, max_length: int, seed: int, logging_steps: int = 1, optim: str = "adamw_torch",
             **config: Any):
    """TRL's SFTTrainer over `rows` in the order given (ft_train_order's), with ft-train's linear
    schedule (see the module's docstring). `config`: more SFTConfig fields."""
    from datasets import Dataset
    from trl import SFTConfig, SFTTrainer

    class SFTTrainerOnFtTrainSchedule(SFTTrainer):
        def create_scheduler(self, num_training_steps, optimizer=None):
            fresh = self.lr_scheduler is None
            scheduler = super().create_scheduler(num_training_steps, optimizer)
            if fresh:  # step k runs at the schedule's value at k + 1, as ft-train's does
                with warnings.catch_warnings():  # "lr_scheduler.step() before optimizer.step()": meant
                    warnings.simplefilter("ignore", UserWarning)
                    scheduler.step()
            return scheduler

    args = SFTConfig(output_dir=output_dir, max_steps=steps, per_device_train_batch_size=batch_size,
                     gradient_accumulation_steps=accumulation, learning_rate=lr, weight_decay=weight_decay,
                     optim=optim, lr_scheduler_type="linear", warmup_steps=warmup_steps, max_grad_norm=max_grad_norm,
                     logging_steps=logging_steps, save_strategy="no", report_to=[], use_cpu=True, bf16=False,
                     fp16=False, activation_checkpointing=False, max_length=max_length,
                     train_sampling_strategy="sequential", dataloader_num_workers=0, disable_tqdm=True, seed=seed,
                     **config)
    return SFTTrainerOnFtTrainSchedule(model=model, args=args, train_dataset=Dataset.from_list(list(rows)),
                                       processing_class=tokenizer)


def trl_train_logs(trainer: Any) -> list[dict[str, Any]]:
    """The Trainer's training log lines (those with a loss), in step order."""
    return [entry for entry in trainer.state.log_history if "loss" in entry]
