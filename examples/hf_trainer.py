"""RecAdam (or any optimizer of ft_framework's registry) in a Hugging Face Trainer.

    python examples/hf_trainer.py --output-dir /tmp/hf_recadam --max-steps 20

Offline: the quickstart model and data. theta* is captured when the Trainer builds the optimizer,
is saved in the Trainer's checkpoints, and survives --resume.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch
from transformers import Trainer, TrainingArguments

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _quickstart import Encoded, load_model, read_split  # noqa: E402

from ft_framework.integrations.transformers import ft_optimizer, install_callbacks, new_parameter_names  # noqa: E402


def build_trainer(output_dir: str, max_steps: int, save_steps: int = 0, optimizer: str = "recadam",
                  impl: str = "auto", train_examples: int = 64, seed: int = 0, extra_args: dict | None = None):
    model, tokenizer, info = load_model()
    settings = dict(
        output_dir=output_dir, max_steps=max_steps, per_device_train_batch_size=8, learning_rate=1e-4,
        logging_steps=2, save_strategy="steps" if save_steps else "no", save_steps=save_steps or 500,
        report_to=[], seed=seed, use_cpu=not torch.cuda.is_available(), disable_tqdm=True)
    args = TrainingArguments(**{**settings, **(extra_args or {})})
    hparams = dict(anneal_fun="sigmoid", anneal_k=0.5, anneal_t0=10, pretrain_cof=5000) if optimizer == "recadam" else {}
    trainer = Trainer(
        model=model, args=args, train_dataset=Encoded(read_split("train", train_examples), tokenizer),
        optimizer_cls_and_kwargs=ft_optimizer(optimizer, args, new_parameters=new_parameter_names(model, info),
                                              impl=impl, **hparams))
    install_callbacks(trainer)
    return trainer


def main(argv=None) -> Trainer:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--output-dir", required=True)
    p.add_argument("--max-steps", type=int, default=20)
    p.add_argument("--save-steps", type=int, default=0)
    p.add_argument("--optimizer", default="recadam")
    p.add_argument("--resume", default=None, help="a checkpoint-N directory of an earlier run")
    a = p.parse_args(argv)
    trainer = build_trainer(a.output_dir, a.max_steps, a.save_steps, a.optimizer)
    trainer.train(resume_from_checkpoint=a.resume)
    print({k: v for k, v in trainer.state.log_history[-2].items()})
    return trainer


if __name__ == "__main__":
    main()
