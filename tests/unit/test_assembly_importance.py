"""optimizer.importance in a run (assembly.py, the causal-LM kind's general text): the Fisher pass
over a file's texts (.txt lines, .jsonl text fields) or the probe's before the first step, its record
in results.json, F~ in the checkpoint, and the one-line refusals: too little text, and a resume whose
checkpoint holds no F~ (capturing it then would read a model that has moved)."""

from __future__ import annotations

import json

import pytest
import torch
from tiny_llm import build_tiny_llm_dir, write_sft_rows, write_sft_run_config

from ft_framework.checkpointing.layout import read_fields
from ft_framework.errors import UserError

TEXTS = [f"General text number {i}: the river runs past the stone and the bird sings over the tree." for i in range(9)]


def fit(config, overrides=()):
    from ft_framework.config import load_config
    from ft_framework.trainer import Trainer

    trainer = Trainer(load_config(config, list(overrides)))
    try:
        return trainer.fit()
    finally:
        trainer.strategy.close()


@pytest.fixture(scope="module")
def setting(tmp_path_factory):
    root = tmp_path_factory.mktemp("importance_run")
    files = write_sft_rows(root / "data", train_rows=16, eval_rows=4)
    (root / "general.txt").write_text("\n".join(TEXTS[:5]) + "\n\n" + "\n".join(TEXTS[5:]) + "\n")
    (root / "general.jsonl").write_text("".join(json.dumps({"text": t, "source": "x"}) + "\n" for t in TEXTS))
    return root, build_tiny_llm_dir(root / "llama"), files


def config(setting, name, optimizer, **sections):
    root, model, files = setting
    return write_sft_run_config(root / f"{name}.yaml", model, root / name, files, optimizer=optimizer,
                                training={"max_steps": 2}, checkpoint={"every_steps": 1, "keep_last": 2},
                                evaluation={"num_evals": 1, "forgetting": {"num_sentences": 7}}, **sections)


@pytest.mark.parametrize("suffix", ["txt", "jsonl"])
def test_a_file_of_general_text_gives_the_importance(setting, suffix):
    root = setting[0]
    cfg = config(setting, f"file_{suffix}", {"name": "ewc", "hparams": {"lr": 1e-3, "ewc_lambda": 50.0},
                                             "importance": {"source": str(root / f"general.{suffix}"),
                                                            "batch_size": 4, "max_tokens": 24}})
    results = fit(cfg)
    record = results["importance"]
    assert record["batches"] == 2  # 9 texts: two whole batches of 4
    assert record["tokens"] == 8 * 23  # each text cut to 24 tokens, every token but the first a label
    assert record["mean_fisher"] > 0 and record["max_importance"] >= 1.0 and record["seconds"] >= 0
    fields = read_fields(root / f"file_{suffix}" / "checkpoints" / "step_00000002", fields=["importance"])
    values = torch.cat([f["importance"].double().reshape(-1) for f in fields.values()])
    assert len(fields) > 5 and values.numel() == record["anchored_elements"]
    assert float(values.mean()) == pytest.approx(1.0, abs=2e-3) and float(values.max()) == record["max_importance"]


def test_both_suffixes_read_the_same_texts(setting):
    root = setting[0]
    a, b = (read_fields(root / f"file_{s}" / "checkpoints" / "step_00000001", fields=["importance"])
            for s in ("txt", "jsonl"))
    assert all(torch.equal(a[n]["importance"], b[n]["importance"]) for n in a)


def test_too_little_text_is_one_line(setting):
    cfg = config(setting, "short", {"name": "recadam", "hparams": {"lr": 1e-3, "pretrain_cof": 10.0},
                                    "importance": {"source": "probe", "batch_size": 4, "batches": 3}})
    with pytest.raises(UserError) as info:
        fit(cfg)
    message = str(info.value)
    assert "\n" not in message
    assert "holds 7 text(s), 1 whole batch(es) of batch_size 4, and 3 are asked for" in message


def test_a_resume_of_a_checkpoint_without_importance_is_refused(setting):
    root = setting[0]
    plain = {"name": "prior_wd", "hparams": {"lr": 1e-3}}
    cfg = config(setting, "plain", plain)
    fit(cfg)
    with pytest.raises(UserError) as info:
        fit(cfg, [f"logging.output_dir={root / 'plain_resumed'}", "optimizer.importance={source: probe, batch_size: 2}",
                  f"checkpoint.resume_from={root / 'plain' / 'checkpoints' / 'step_00000001'}",
                  "checkpoint.allow_config_change=[optimizer.importance]"])
    assert "holds no importance F~ (its run had no optimizer.importance)" in str(info.value)
    assert "\n" not in str(info.value)


def test_a_kind_without_a_language_model_loss_has_no_general_text():
    from ft_framework.config import validate_config
    from ft_framework.task_kinds import RunContext, build_task_kind

    cfg = validate_config({"model": {"name_or_path": "some/model"}, "data": {"task": "rte"},
                           "schedule": {"warmup_ratio": 0.1}, "training": {"max_steps": 10}})
    with pytest.raises(UserError) as info:
        build_task_kind(cfg).general_text(None, RunContext())
    assert "the classification task kind has none" in str(info.value)
