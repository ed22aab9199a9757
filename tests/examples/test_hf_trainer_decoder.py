"""Our optimizer inside a Hugging Face Trainer fine-tuning a decoder: every parameter of a causal LM
is pretrained, so θ* covers them all (tied embeddings once), and a resume keeps it bit for bit."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM, Trainer, TrainingArguments

from tiny_llm import build_tiny_llm_dir
from ft_framework.integrations.transformers import ft_optimizer, install_callbacks
from ft_framework.optim import RecAdam


def _trainer(model_dir, output_dir: str) -> Trainer:
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    gen = torch.Generator().manual_seed(1)
    data = []
    for _ in range(16):
        ids = torch.randint(0, 256, (12,), generator=gen)
        labels = ids.clone()
        labels[:5] = -100  # a prompt: no loss there
        data.append({"input_ids": ids, "labels": labels})
    args = TrainingArguments(output_dir=output_dir, max_steps=4, save_steps=2, per_device_train_batch_size=4,
                             learning_rate=1e-3, logging_steps=1, report_to=[], seed=0, use_cpu=True,
                             disable_tqdm=True)
    trainer = Trainer(model=model, args=args, train_dataset=data, optimizer_cls_and_kwargs=ft_optimizer(
        "recadam", args, new_parameters=[], anneal_k=0.5, anneal_t0=2, pretrain_cof=50.0))
    install_callbacks(trainer)
    return trainer


def _anchors(opt) -> dict[str, torch.Tensor]:
    names = [n for g in opt.param_groups for n in g["param_names"]]
    params = [p for g in opt.param_groups for p in g["params"]]
    return {n: opt.state[p]["anchor"].clone() for n, p in zip(names, params) if "anchor" in opt.state.get(p, {})}


def test_a_decoders_theta_star_is_every_parameter_and_survives_a_resume(tmp_path):
    model_dir = build_tiny_llm_dir(tmp_path / "llama", "llama")
    pretrained = dict(AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).named_parameters())
    first = _trainer(model_dir, str(tmp_path / "run"))
    first.train()
    opt = first.optimizer_cls_and_kwargs[0].optimizer
    assert isinstance(opt, RecAdam)
    anchors = _anchors(opt)
    assert set(anchors) == set(pretrained)  # the tied output layer is the embedding: once
    for name, value in anchors.items():
        assert torch.equal(value, pretrained[name].detach()), name
    trained = {n: p.detach().clone() for n, p in first.model.named_parameters()}
    assert any(not torch.equal(trained[n], pretrained[n].detach()) for n in trained)

    resumed = _trainer(model_dir, str(tmp_path / "run"))
    resumed.train(resume_from_checkpoint=str(tmp_path / "run" / "checkpoint-2"))
    for name, value in _anchors(resumed.optimizer_cls_and_kwargs[0].optimizer).items():
        assert torch.equal(value, pretrained[name].detach()), f"theta* of {name} changed across the resume"
    for name, param in resumed.model.named_parameters():
        torch.testing.assert_close(param.detach(), trained[name], rtol=1e-5, atol=1e-6)
    logged = [h for h in resumed.state.log_history if "loss" in h]
    assert logged and all(h["forgetting_distance"] > 0 for h in logged)
