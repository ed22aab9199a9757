"""A fourth task kind, defined here and nowhere in ft_framework: token tagging (a token classifier
on a tiny BERT that tags the colour words of a sentence). Registered with
task_kinds.register_task_kind, it trains in one process and under 2-rank FSDP2 (the same numbers),
ft-plan traces its own micro-batch, and ft-interpolate scores its θ_α, with no change to the
trainer, the strategies, the memory plan or the interpolation: the seam docs/design.md describes
("How to add a task kind") holds for a kind it has never seen.

Run as a script (`python test_fourth_kind.py PLAN`), it is the 2-rank worker of the FSDP2 test.
"""

from __future__ import annotations

import json
import random
import sys
from pathlib import Path
from typing import Any, Callable, Sequence

import pytest
import torch
import torch.nn.functional as F
import yaml

from ft_framework.cli import interpolate_main, plan_main
from ft_framework.config import validate_config
from ft_framework.data.readers import read_table
from ft_framework.data.sharding import eval_shard
from ft_framework.models.forgetting import EncoderForgettingProbe
from ft_framework.models.loading import ModelClass
from ft_framework.models.probes import build_probe
from ft_framework.errors import UserError
from ft_framework.task_kinds import (TASK_KIND_CLASSES, Baseline, EvalContext, LossNormalizer, MicroBatchLoss,
                                     RunContext, TaskKind, TraceBatch, build_task_kind, register_task_kind,
                                     to_device, unregister_task_kind)
from ft_framework.trainer import Trainer

# tests/ (tiny_run) and the rank launcher's folder: on the path under pytest and as the worker script
TESTS = Path(__file__).resolve().parents[2]
sys.path[:0] = [str(p) for p in (TESTS, TESTS / "distributed") if str(p) not in sys.path]

from rank_launcher import fit_step, launch, run_plan  # noqa: E402
from tiny_run import assert_same_forgetting  # noqa: E402

IGNORE = -100
COLOURS = ("red", "green", "blue", "yellow", "purple", "orange")
OTHER_WORDS = ("the", "cat", "sat", "on", "a", "mat", "dog", "ran", "to", "house", "big", "small", "car", "tree")


class TokenTaggingKind(TaskKind):
    """One tag per word (data.labels: the tag set, data.text_columns: the words, data.label_column:
    their tags, both space-separated); each word's first sub-token carries its tag. The loss is the
    mean over every tagged token of the optimizer step on every rank (step_units), so that ranks
    holding different numbers of tokens train as one process would."""

    name = "token_tagging"
    metrics = ("token_accuracy",)

    @property
    def model_class(self) -> ModelClass:
        return ModelClass("AutoModelForTokenClassification", (("num_labels", len(self.spec.label_list)),))

    # ---- data ----------------------------------------------------------------------------------
    def _rows(self, tokenizer: Any, split: str) -> list[dict[str, list[int]]]:
        tags = {tag: i for i, tag in enumerate(self.spec.label_list)}
        words_key, tags_key = self.spec.text_keys[0], self.spec.label_key
        rows = []
        for _, record in read_table(Path(self.cfg.data.files[split]), split).records:
            ids, labels = [], []
            for word, tag in zip(record[words_key].split(), record[tags_key].split(), strict=True):
                pieces = tokenizer(word, add_special_tokens=False)["input_ids"]
                ids += pieces
                labels += [tags[tag]] + [IGNORE] * (len(pieces) - 1)
            ids = [tokenizer.cls_token_id, *ids, tokenizer.sep_token_id][:self.cfg.data.max_seq_length]
            labels = ([IGNORE] + labels + [IGNORE])[:len(ids)]
            rows.append({"input_ids": ids, "labels": labels})
        return rows

    def load_data(self, tokenizer: Any, run: RunContext) -> Any:
        class Data:
            pass

        data = Data()
        data.train = self._rows(tokenizer, "train")
        data.eval = {split: self._rows(tokenizer, split) for split in self.spec.eval_splits}
        return data

    def collator(self, tokenizer: Any, model_config: Any) -> Callable:
        pad = tokenizer.pad_token_id

        def collate(items: list[dict[str, list[int]]]) -> dict[str, torch.Tensor]:
            width = max(len(item["input_ids"]) for item in items)
            ids = torch.full((len(items), width), pad, dtype=torch.long)
            labels = torch.full((len(items), width), IGNORE, dtype=torch.long)
            for i, item in enumerate(items):
                ids[i, :len(item["input_ids"])] = torch.tensor(item["input_ids"])
                labels[i, :len(item["labels"])] = torch.tensor(item["labels"])
            return {"input_ids": ids, "attention_mask": (ids != pad).long(), "labels": labels}

        return collate

    # ---- loss ------------------------------------------------------------------------------------
    def model_inputs(self, batch: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        return {k: v for k, v in batch.items() if k != "labels"}

    def step_units(self, batches: Sequence[dict[str, torch.Tensor]]) -> float | None:
        return float(sum(int((b["labels"] != IGNORE).sum()) for b in batches))

    def loss(self, outputs: Any, batch: dict[str, torch.Tensor], normalizer: LossNormalizer) -> MicroBatchLoss:
        labels = batch["labels"].to(outputs.logits.device)
        total = F.cross_entropy(outputs.logits.float().flatten(0, 1), labels.flatten(), ignore_index=IGNORE,
                                reduction="sum")
        return MicroBatchLoss(total * (normalizer.world_size / normalizer.step_units), float(total.detach()),
                              float((labels != IGNORE).sum()))

    # ---- metrics ---------------------------------------------------------------------------------
    @torch.no_grad()
    def evaluate(self, data: Any, ctx: EvalContext) -> dict[str, dict[str, Any]]:
        out = {}
        for split, rows in data.eval.items():
            shard = eval_shard(len(rows), ctx.rank, ctx.world_size)
            padded = [rows[i] for i in shard.padded]
            right = total = 0
            for start in range(0, len(padded), ctx.batch_size):
                chunk = padded[start:start + ctx.batch_size]
                real = max(0, min(shard.num_real - start, len(chunk)))
                batch = ctx.collate(chunk)
                logits = ctx.forward(to_device(self.model_inputs(batch), ctx.device)).logits[:real].cpu()
                labels = batch["labels"][:real]
                tagged = labels != IGNORE
                right += int((logits.argmax(-1)[tagged] == labels[tagged]).sum())
                total += int(tagged.sum())
            sums = ctx.gather((right, total))
            out[split] = {"token_accuracy": sum(s[0] for s in sums) / sum(s[1] for s in sums)}
        return out

    def baseline(self, data: Any, evaluate: Callable[[], dict[str, dict[str, Any]]]) -> Baseline:
        counts = torch.bincount(torch.tensor([t for row in data.train for t in row["labels"] if t != IGNORE]))
        majority = int(counts.argmax())
        return Baseline("majority tag", {split: {"token_accuracy": sum(t == majority for r in rows for t in r["labels"])
                                                 / sum(t != IGNORE for r in rows for t in r["labels"])}
                                         for split, rows in data.eval.items()})

    def build_probe(self, tokenizer: Any, run: RunContext) -> Any:
        forgetting = self.cfg.evaluation.forgetting
        return build_probe(EncoderForgettingProbe, forgetting, tokenizer=tokenizer,
                           batch_size=self.cfg.evaluation.batch_size, rank=run.rank, world_size=run.world_size,
                           device=run.device, gather=run.gather, model_name_or_path=self.cfg.model.name_or_path,
                           mask_seed=forgetting.mask_seed)

    # ---- the memory plan -------------------------------------------------------------------------
    traced = 0   # how often the memory plan asked for a trace batch (the test below reads it)

    def trace_batch(self, arch: Any, *, batch_size: int, seq_len: int, device: str) -> TraceBatch:
        type(self).traced += 1
        shape = (batch_size, seq_len)
        labels = torch.randint(0, len(self.spec.label_list), shape, device=device)
        inputs = {"input_ids": torch.randint(0, arch.vocab_size, shape, device=device),
                  "attention_mask": torch.ones(shape, dtype=torch.long, device=device)}
        return TraceBatch(inputs, lambda out: F.cross_entropy(out.logits.float().flatten(0, 1), labels.flatten(),
                                                              reduction="sum"))


def write_tagging_files(directory: Path, *, train_rows: int = 48, eval_rows: int = 16) -> dict[str, str]:
    """Sentences of 4-8 words, each word tagged C (a colour) or O, as JSON lines."""
    rng = random.Random(7)
    directory.mkdir(parents=True, exist_ok=True)
    files = {}
    for split, rows in (("train", train_rows), ("validation", eval_rows)):
        lines = []
        for _ in range(rows):
            words = [rng.choice(COLOURS if rng.random() < 0.3 else OTHER_WORDS) for _ in range(rng.randint(4, 8))]
            tags = ["C" if w in COLOURS else "O" for w in words]
            lines.append(json.dumps({"words": " ".join(words), "tags": " ".join(tags)}))
        (directory / f"{split}.jsonl").write_text("\n".join(lines) + "\n")
        files[split] = str(directory / f"{split}.jsonl")
    return files


def tagging_config(model_dir: Path, files: dict[str, str], output_dir: Path, **sections: dict) -> dict:
    cfg = {
        "model": {"name_or_path": str(model_dir)},
        "data": {"source": "files", "files": files, "problem": TokenTaggingKind.name, "name": "colours",
                 "text_columns": ["words"], "label_column": "tags", "labels": ["O", "C"], "max_seq_length": 24},
        "optimizer": {"name": "recadam", "hparams": {"lr": 3e-3, "anneal_k": 0.5, "anneal_t0": 5,
                                                      "pretrain_cof": 100.0}},
        "schedule": {"name": "linear", "warmup_steps": 1},
        "training": {"max_steps": 6, "per_device_batch_size": 4, "seed": 1, "data_seed": 2, "device": "cpu"},
        "evaluation": {"num_evals": 2, "batch_size": 8, "forgetting": {"num_sentences": 8, "max_length": 16}},
        "logging": {"output_dir": str(output_dir), "log_every_steps": 1, "progress_bar": False},
        "checkpoint": {"export_dir": str(output_dir / "export")},
    }
    for section, values in sections.items():
        cfg.setdefault(section, {}).update(values)
    return cfg


@pytest.fixture
def tagging_kind():
    register_task_kind(TokenTaggingKind)
    yield TokenTaggingKind
    unregister_task_kind(TokenTaggingKind.name)


@pytest.fixture(scope="module")
def tagging_run(tiny_bert_dir, tmp_path_factory):
    """One finished single-process run of the fourth kind (its config, results and directory)."""
    register_task_kind(TokenTaggingKind)
    try:
        tmp = tmp_path_factory.mktemp("tagging")
        files = write_tagging_files(tmp / "data")
        cfg = validate_config(tagging_config(tiny_bert_dir, files, tmp / "run"))
        trainer = Trainer(cfg)
        results = trainer.fit()
        trainer.strategy.close()
        yield cfg, results, tmp / "run"
    finally:
        unregister_task_kind(TokenTaggingKind.name)


def test_a_registered_kind_is_a_valid_problem_and_only_then(tagging_kind, tiny_bert_dir, tmp_path):
    files = write_tagging_files(tmp_path / "data", train_rows=4, eval_rows=2)
    cfg = validate_config(tagging_config(tiny_bert_dir, files, tmp_path / "run"))
    spec = cfg.data.task_spec()
    assert spec.kind == "token_tagging" and spec.metrics == ("token_accuracy",) and spec.label_list == ("O", "C")
    assert isinstance(build_task_kind(cfg), TokenTaggingKind)
    unregister_task_kind(TokenTaggingKind.name)
    with pytest.raises(UserError, match="unknown data.problem 'token_tagging'.*valid: classification, regression, "
                                        "causal_lm"):
        validate_config(tagging_config(tiny_bert_dir, files, tmp_path / "run"))
    register_task_kind(TokenTaggingKind)
    with pytest.raises(ValueError, match="built in"):
        register_task_kind(type("Shadow", (TokenTaggingKind,), {"name": "causal_lm"}))
    assert TASK_KIND_CLASSES["causal_lm"].__name__ == "CausalLMKind"


def test_the_fourth_kind_trains_in_one_process(tagging_run):
    cfg, results, run_dir = tagging_run
    assert results["main_metric"] == "token_accuracy" and results["baseline"]["name"] == "majority tag"
    assert set(results["final"]["metrics"]["validation"]) == {"token_accuracy"}
    assert results["final"]["forgetting"]["cka_drift_last"] > 0   # the encoder's probe, through the kind
    losses = [json.loads(line)["loss"] for line in (run_dir / "metrics.jsonl").read_text().splitlines()
              if json.loads(line)["type"] == "train"]
    assert len(losses) == 6 and losses[-1] < losses[0]


@pytest.mark.slow
def test_the_fourth_kind_under_2_rank_fsdp2_equals_one_process(tagging_run, tiny_bert_dir, tmp_path):
    cfg, single, single_dir = tagging_run
    # The same global batch of 4 on 2 ranks; this file, run as the worker, registers the kind in
    # the process whose forked ranks train (as a plug-in would, before the config is read).
    run = cfg.to_dict()
    run["training"]["per_device_batch_size"] = 2
    run["strategy"] = {"name": "fsdp"}
    run["logging"]["output_dir"] = str(tmp_path / "fsdp")
    run["checkpoint"]["export_dir"] = str(tmp_path / "fsdp" / "export")
    config = tmp_path / "fsdp.yaml"
    config.write_text(yaml.safe_dump({k: v for k, v in run.items() if k != "task_overrides"}))
    launch(Path(__file__), [fit_step(config)], tmp_path, timeout=600)
    fsdp = json.loads((tmp_path / "fsdp" / "results.json").read_text())
    assert fsdp["config"]["strategy"]["name"] == "fsdp" and fsdp["steps"] == single["steps"] == 6
    # Tagged tokens per rank differ; the loss normalized over the step's tokens on every rank makes
    # the two ranks' step the one process's.
    for key in ("loss", "grad_norm", "forgetting_distance"):
        want = [json.loads(line)[key] for line in (single_dir / "metrics.jsonl").read_text().splitlines()
                if json.loads(line)["type"] == "train"]
        got = [json.loads(line)[key] for line in (tmp_path / "fsdp" / "metrics.jsonl").read_text().splitlines()
               if json.loads(line)["type"] == "train"]
        assert got == pytest.approx(want, rel=1e-5), key
    assert fsdp["final"]["metrics"] == single["final"]["metrics"]
    assert fsdp["baseline"] == single["baseline"]
    assert_same_forgetting(fsdp["final"]["forgetting"], single["final"]["forgetting"])


def test_ft_plan_traces_the_kinds_own_micro_batch(tagging_kind, tiny_bert_dir, tmp_path, capsys):
    files = write_tagging_files(tmp_path / "data", train_rows=4, eval_rows=2)
    config = tmp_path / "tagging.yaml"
    config.write_text(yaml.safe_dump(tagging_config(tiny_bert_dir, files, tmp_path / "run")))
    traced = TokenTaggingKind.traced
    assert plan_main(["--config", str(config), "training.per_device_batch_size=64", "--json"]) == 0
    plan = json.loads(capsys.readouterr().out)["per_rank"][0]
    assert TokenTaggingKind.traced == traced + 1
    activations = next(r for r in plan["rows"] if r["what"].startswith("activations"))
    # Its (B, T, tags) logits and the token classifier's activations at batch 64: more than at batch 1.
    assert plan_main(["--config", str(config), "training.per_device_batch_size=1", "--json"]) == 0
    small = next(r for r in json.loads(capsys.readouterr().out)["per_rank"][0]["rows"]
                 if r["what"].startswith("activations"))
    assert activations["device_bytes"] > 8 * small["device_bytes"] > 0
    assert not any(r["what"].startswith("MLM head") for r in plan["rows"])   # the kind keeps nothing besides


def test_ft_interpolate_scores_the_fourth_kind(tagging_run, capsys):
    cfg, results, run_dir = tagging_run
    register_task_kind(TokenTaggingKind)
    try:
        assert interpolate_main([str(run_dir), "--alphas", "0,0.5,1"]) == 0
    finally:
        unregister_task_kind(TokenTaggingKind.name)
    printed = capsys.readouterr().out
    assert "validation/token_accuracy" in printed and "cka_drift_last" in printed
    out = json.loads((run_dir / "interpolation.json").read_text())
    rows = {r["alpha"]: r for r in out["rows"]}
    assert rows[1.0]["metrics"] == results["final"]["metrics"]
    assert rows[1.0]["forgetting"] == pytest.approx(results["final"]["forgetting"], rel=1e-6)
    assert rows[0.0]["forgetting"]["cka_drift_last"] == pytest.approx(0.0, abs=1e-9)
    assert rows[0.0]["distance"] == 0.0 and rows[0.5]["distance"] == pytest.approx(rows[1.0]["distance"] / 2)


if __name__ == "__main__":  # the FSDP2 test's worker: python test_fourth_kind.py PLAN
    register_task_kind(TokenTaggingKind)
    run_plan()
