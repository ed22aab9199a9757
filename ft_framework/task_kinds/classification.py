"""Sequence classification and regression (GLUE, your own labelled texts): a pretrained encoder
with a new head (AutoModelForSequenceClassification; one output for a regression), batches padded
to their longest example, the model's own loss (cross-entropy, or MSE for a regression), the task
spec's metrics against the majority class (a regression: the train mean), and the encoder's
forgetting probe (models/forgetting.py). A regression is a classifier with one output: both kinds
are this module; metrics.py reads which one from the spec."""

from __future__ import annotations

from typing import Any, Callable

import torch
from torch.utils.data import DataLoader

from ft_framework.data import load_task_data, make_collator
from ft_framework.data.hub_tables import open_hub_split
from ft_framework.data.sharding import eval_shard, restore_order
from ft_framework.metrics import compute_metrics, majority_baseline
from ft_framework.models.forgetting import EncoderForgettingProbe, pretrained_mlm_head_parameters
from ft_framework.models.loading import ModelClass, sequence_classifier
from ft_framework.models.probes import build_probe
from ft_framework.task_kinds.base import (Baseline, EvalContext, LossNormalizer, MemoryRow, MicroBatchLoss, RunContext,
                                         TaskKind, TraceBatch, combined_content)

__all__ = ["SequenceClassificationKind"]


class SequenceClassificationKind(TaskKind):
    name = "classification"

    @property
    def model_class(self) -> ModelClass:
        return sequence_classifier(self.spec.num_labels, self.spec.is_regression)

    def load_data(self, tokenizer: Any, run: RunContext) -> Any:
        return load_task_data(self.spec, tokenizer=tokenizer, **self.cfg.data.loader_arguments())

    def collator(self, tokenizer: Any, model_config: Any) -> Callable:
        return make_collator(tokenizer)

    def data_content(self, data: Any) -> dict[str, str]:
        # Your own files by their bytes (the base's: one more read of each, their rows were parsed
        # without a cache), or your Hub data set's splits by their revision; GLUE's are not recorded.
        hub = self.cfg.data.hub_source()
        if hub is None:
            return super().data_content(data)
        splits = ("train",) + self.spec.eval_splits
        return {**self.probe_content(),
                "data.hub_id": combined_content({split: open_hub_split(hub, split).fingerprint for split in splits})}

    def loss(self, outputs: Any, batch: dict[str, torch.Tensor], normalizer: LossNormalizer) -> MicroBatchLoss:
        # The model's own loss is the micro-batch's mean; micro-batches and ranks hold as many
        # examples each, so the step's mean is the mean of the micro-batch means.
        examples = len(batch["labels"])
        return MicroBatchLoss(outputs.loss / normalizer.micro_batches, float(outputs.loss.detach()) * examples,
                              float(examples))

    @torch.no_grad()
    def evaluate(self, data: Any, ctx: EvalContext) -> dict[str, dict[str, Any]]:
        out = {}
        for split, dataset in data.eval.items():
            # Same number of batches on every rank (sharded forwards are collective); the padding's
            # logits are dropped below.
            shard = eval_shard(len(dataset), ctx.rank, ctx.world_size)
            loader = DataLoader([dataset[i] for i in shard.padded], batch_size=ctx.batch_size, collate_fn=ctx.collate)
            preds = []
            for batch in loader:
                batch = {k: v.to(ctx.device) for k, v in batch.items() if k != "labels"}
                preds.append(ctx.forward(batch).logits.float().cpu())
            local = (torch.cat(preds) if preds else torch.empty(0))[:shard.num_real]
            gathered = ctx.gather((shard.indices, local))
            logits = torch.cat([t for _, t in gathered])[torch.tensor(restore_order([idx for idx, _ in gathered]))]
            out[split] = compute_metrics(self.spec, logits.numpy(), data.eval_labels[split])
        return out

    def baseline(self, data: Any, evaluate: Callable[[], dict[str, dict[str, Any]]]) -> Baseline:
        name = "train mean" if self.spec.is_regression else "majority class"
        return Baseline(name, {split: majority_baseline(self.spec, data.train_labels, labels)
                               for split, labels in data.eval_labels.items()})

    def build_probe(self, tokenizer: Any, run: RunContext) -> EncoderForgettingProbe | None:
        forgetting = self.cfg.evaluation.forgetting
        return build_probe(EncoderForgettingProbe, forgetting, tokenizer=tokenizer,
                           batch_size=self.cfg.evaluation.batch_size, rank=run.rank, world_size=run.world_size,
                           device=run.device, gather=run.gather, model_name_or_path=self.cfg.model.name_or_path,
                           mask_seed=forgetting.mask_seed)

    def trace_batch(self, arch: Any, *, batch_size: int, seq_len: int, device: str) -> TraceBatch:
        # The model's own loss on (B,) labels: class ids, or a regression's targets.
        labels = (torch.zeros(batch_size, device=device) if self.spec.is_regression else
                  torch.randint(0, self.spec.num_labels, (batch_size,), device=device))
        inputs = {"input_ids": torch.randint(0, arch.vocab_size, (batch_size, seq_len), device=device),
                  "attention_mask": torch.ones((batch_size, seq_len), dtype=torch.long, device=device),
                  "labels": labels}
        return TraceBatch(inputs, lambda out: out.loss)

    def memory_rows(self, arch: Any, *, world_size: int) -> list[MemoryRow]:
        # The probe keeps the pretrained masked-LM head (fp32) on the device for the whole run.
        head = pretrained_mlm_head_parameters(arch) if self.cfg.evaluation.forgetting.enabled else 0
        return [MemoryRow("MLM head kept for the forgetting probe (fp32)", head * 4, 0.0)] if head else []
