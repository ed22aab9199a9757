"""The trainer gives lr and weight_decay to the optimizer once, through the param groups (LLRD and
no-decay already applied there), never again as build_optimizer keywords."""

import math

import pytest

from tiny_run import write_run_config
from ft_framework.config import load_config
from ft_framework.optim.registry import optimizer_hparams
from ft_framework.trainer import Trainer


def test_lr_and_weight_decay_reach_the_optimizer_only_through_the_groups(tiny_bert_dir, tmp_path):
    cfg = write_run_config(tmp_path / "run.yaml", tiny_bert_dir, tmp_path / "out", training={"max_steps": 1},
                           optimizer={"name": "adamw", "hparams": {"lr": 3e-3}, "weight_decay": 0.05,
                                      "layerwise_lr_decay": 0.5})
    trainer = Trainer(load_config(cfg))
    trainer.setup()
    opt = trainer.optimizer
    constructor = optimizer_hparams("adamw")
    # The optimizer's own defaults are its constructor's: the configured values were not passed again.
    assert opt.defaults["lr"] == constructor["lr"] != 3e-3
    assert opt.defaults["weight_decay"] == constructor["weight_decay"] != 0.05
    # Every group carries its value from the config.
    top = max(g["lr"] for g in opt.param_groups)
    assert top == pytest.approx(3e-3, rel=1e-12)
    for g in opt.param_groups:
        ratio = top / g["lr"]
        assert ratio == pytest.approx(2 ** round(math.log2(ratio)), rel=1e-9), g["group_name"]
        assert g["weight_decay"] == (0.05 if "/decay" in g["group_name"] else 0.0), g["group_name"]
    assert trainer.peak_lrs == [g["lr"] for g in opt.param_groups]
