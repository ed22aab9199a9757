"""examples/hf_trainer.py: our optimizer in a Hugging Face Trainer, theta* kept across a resume."""

from __future__ import annotations


import pytest
import torch
from transformers import Trainer, TrainingArguments

from ft_framework.errors import UserError
from ft_framework.integrations.transformers import ft_optimizer, install_callbacks
from ft_framework.optim import RecAdam

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def hf(load_example):
    return load_example("hf_trainer")


def _anchors(opt) -> dict[int, torch.Tensor]:
    return {i: opt.state[p]["anchor"].clone() for i, p in enumerate(p for g in opt.param_groups for p in g["params"])
            if "anchor" in opt.state.get(p, {})}


def test_trainer_resume_keeps_theta_star_bit_exact(hf, tmp_path):
    model, _, info = hf.load_model()
    new = set(hf.new_parameter_names(model, info))
    assert new == {"classifier.weight", "classifier.bias"}
    pretrained = {n: p.detach().clone() for n, p in model.named_parameters() if n not in new}

    first = hf.build_trainer(str(tmp_path / "run"), max_steps=4, save_steps=2)
    first.train()
    factory = first.optimizer_cls_and_kwargs[0]
    opt = factory.optimizer
    assert isinstance(opt, RecAdam)
    # theta* = the pretrained weights, the head and only the head left out (named in the groups).
    names = [n for g in opt.param_groups for n in g["param_names"]]
    params = dict(first.model.named_parameters())
    anchored = {names[i]: a for i, a in _anchors(opt).items()}
    assert set(anchored) == set(pretrained) and set(factory.anchored_names) == set(pretrained)
    for n, a in anchored.items():
        assert torch.equal(a, pretrained[n]), n
    # The model moved away from theta* (so a theta* re-captured at the first step of a resume,
    # as a lazy copy does, would be the trained weights, not theta*).
    ckpt = tmp_path / "run" / "checkpoint-2"
    assert ckpt.is_dir()
    moved = [n for n in pretrained if not torch.equal(params[n].detach(), pretrained[n])]
    assert len(moved) > len(pretrained) // 2

    resumed = hf.build_trainer(str(tmp_path / "run"), max_steps=4, save_steps=2)
    resumed.train(resume_from_checkpoint=str(ckpt))
    assert resumed.state.global_step == 4
    ropt = resumed.optimizer_cls_and_kwargs[0].optimizer
    rnames = [n for g in ropt.param_groups for n in g["param_names"]]
    ranchored = {rnames[i]: a for i, a in _anchors(ropt).items()}
    assert set(ranchored) == set(pretrained)
    for n, a in ranchored.items():
        assert torch.equal(a, pretrained[n]), f"theta* of {n} changed across the resume"
    # The resumed run continued the first one: same weights after step 4.
    for n, p in resumed.model.named_parameters():
        torch.testing.assert_close(p.detach(), params[n].detach(), rtol=1e-5, atol=1e-6)
    # lambda(t) and the forgetting distance reach the Trainer's logs.
    logged = [h for h in resumed.state.log_history if "loss" in h]
    assert logged and all(h["forgetting_distance"] > 0 for h in logged)
    assert any(k.startswith("lambda/anchored") for k in logged[-1])
    assert not any(k.startswith("lambda/new") for k in logged[-1])


def test_unknown_optimizer_names_the_valid_ones():
    with pytest.raises(ValueError, match="available: .*recadam"):
        ft_optimizer("recadamm", None, new_parameters=[], lr=1e-4)
    with pytest.raises(TypeError, match="unknown hyper-parameter.*anneal_kk"):
        ft_optimizer("recadam", None, new_parameters=[], lr=1e-4, anneal_kk=1.0)


def test_fsdp_trainer_args_are_refused_in_one_line(tmp_path):
    args = TrainingArguments(output_dir=str(tmp_path), use_cpu=True, report_to=[], fsdp=True)
    with pytest.raises(UserError, match=r"^ft_optimizer: TrainingArguments\(fsdp=\.\.\.\) is not supported"):
        ft_optimizer("recadam", args, new_parameters=[])


def test_the_compact_state_under_trainer_deepspeed_is_refused_in_one_line(tmp_path, monkeypatch):
    pytest.importorskip("deepspeed")
    from transformers.integrations.deepspeed import unset_hf_deepspeed_config

    monkeypatch.setenv("ACCELERATE_USE_DEEPSPEED", "false")  # TrainingArguments sets it; restored after
    args = TrainingArguments(output_dir=str(tmp_path), use_cpu=True, report_to=[],
                             deepspeed={"zero_optimization": {"stage": 2}, "train_micro_batch_size_per_gpu": "auto"})
    try:
        with pytest.raises(UserError, match=r"^ft_optimizer: state_dtype='bfloat16' under "
                                            r"TrainingArguments\(deepspeed=\.\.\.\) is not supported; use"):
            ft_optimizer("recadam", args, new_parameters=[], state_dtype="bfloat16", anchor_dtype="bfloat16")
    finally:
        unset_hf_deepspeed_config()


def test_install_callbacks_needs_a_trainer_built_with_ft_optimizer(hf, tmp_path):
    model, _, _ = hf.load_model()
    args = TrainingArguments(output_dir=str(tmp_path), use_cpu=True, report_to=[])
    with pytest.raises(UserError, match=r"^install_callbacks\(trainer\): the Trainer was not built with"):
        install_callbacks(Trainer(model=model, args=args))



def _tiny_bert_trainer(output_dir: str, gradient_checkpointing: bool) -> Trainer:
    from transformers import BertConfig, BertForSequenceClassification

    torch.manual_seed(0)  # the model, its new head included, the same in every call
    model = BertForSequenceClassification(BertConfig(vocab_size=50, hidden_size=16, num_hidden_layers=2,
                                                     num_attention_heads=2, intermediate_size=20))
    gen = torch.Generator().manual_seed(1)
    data = [{"input_ids": torch.randint(0, 50, (8,), generator=gen), "labels": int(i % 2)} for i in range(16)]
    args = TrainingArguments(output_dir=output_dir, max_steps=3, per_device_train_batch_size=4, learning_rate=1e-3,
                             logging_steps=1, save_strategy="no", report_to=[], seed=0, use_cpu=True,
                             disable_tqdm=True, gradient_checkpointing=gradient_checkpointing)
    trainer = Trainer(model=model, args=args, train_dataset=data, optimizer_cls_and_kwargs=ft_optimizer(
        "recadam", args, new_parameters=["classifier.weight", "classifier.bias"], anneal_k=0.5, anneal_t0=2,
        pretrain_cof=50.0))
    install_callbacks(trainer)
    return trainer


def test_trainer_gradient_checkpointing_trains_the_same_weights(tmp_path):
    """TrainingArguments(gradient_checkpointing=True): transformers checkpoints each layer itself
    (non-reentrant by default); our optimizer and callbacks see the same gradients, dropout on."""
    runs = {}
    for checkpointing in (False, True):
        trainer = _tiny_bert_trainer(str(tmp_path / f"run_{checkpointing}"), checkpointing)
        trainer.train()
        assert trainer.model.config.hidden_dropout_prob > 0
        assert all(layer.gradient_checkpointing is checkpointing for layer in trainer.model.bert.encoder.layer)
        logged = [h for h in trainer.state.log_history if "loss" in h]
        assert len(logged) == 3 and all(h["forgetting_distance"] > 0 for h in logged)
        runs[checkpointing] = ({n: p.detach().clone() for n, p in trainer.model.named_parameters()},
                               [(h["loss"], h["forgetting_distance"]) for h in logged])
    (plain, plain_log), (checkpointed, checkpointed_log) = runs[False], runs[True]
    assert checkpointed_log == plain_log
    for name, value in plain.items():
        assert torch.equal(checkpointed[name], value), name
