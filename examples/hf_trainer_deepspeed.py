"""RecAdam in a Hugging Face Trainer under DeepSpeed ZeRO-2 with the optimizer offloaded to the
CPU: our C++ kernel steps the CPU partitions, and each rank keeps only its partitions' slice of
theta*, in the optimizer state, in DeepSpeed's own checkpoints.

    torchrun --nproc_per_node 2 examples/hf_trainer_deepspeed.py --output-dir /tmp/hf_ds --max-steps 6
    deepspeed --num_gpus 2 examples/hf_trainer_deepspeed.py --output-dir /tmp/hf_ds     # on GPUs

Offline: the quickstart model and data. Without a GPU DeepSpeed runs on its CPU accelerator (gloo).
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("DS_ACCELERATOR", "cpu")  # read when deepspeed is first imported

sys.path.insert(0, str(Path(__file__).resolve().parent))
from hf_trainer import build_trainer  # noqa: E402


def zero_config(stage: int = 2, offload_optimizer: bool = True) -> dict:
    """DeepSpeed config: ZeRO `stage`, the optimizer state and step on the CPU; batch size, accumulation
    and clipping come from the TrainingArguments ("auto")."""
    zero: dict = {"stage": stage}
    if offload_optimizer:
        zero["offload_optimizer"] = {"device": "cpu", "pin_memory": torch.cuda.is_available()}
    return {"zero_optimization": zero, "train_micro_batch_size_per_gpu": "auto", "train_batch_size": "auto",
            "gradient_accumulation_steps": "auto", "gradient_clipping": "auto"}


def build_deepspeed_trainer(output_dir: str, max_steps: int, save_steps: int = 0, stage: int = 2,
                            offload_optimizer: bool = True, extra_args: dict | None = None, **kwargs):
    """examples/hf_trainer.py's Trainer (kwargs: its build_trainer's) with this DeepSpeed config."""
    return build_trainer(output_dir, max_steps, save_steps,
                         extra_args={"deepspeed": zero_config(stage, offload_optimizer), **(extra_args or {})}, **kwargs)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--output-dir", required=True)
    p.add_argument("--max-steps", type=int, default=20)
    p.add_argument("--save-steps", type=int, default=0)
    p.add_argument("--zero-stage", type=int, default=2)
    p.add_argument("--resume", default=None, help="a checkpoint-N directory of an earlier run")
    a = p.parse_args(argv)
    trainer = build_deepspeed_trainer(a.output_dir, a.max_steps, a.save_steps, a.zero_stage)
    trainer.train(resume_from_checkpoint=a.resume)
    factory = trainer.optimizer_cls_and_kwargs[0]
    if trainer.is_world_process_zero():
        print(f"optimizer {type(factory.optimizer).__name__} (impl {factory.optimizer.impl}), "
              f"theta*: {factory.theta_star_source}; last log: {trainer.state.log_history[-2]}")
    return trainer


if __name__ == "__main__":
    main()
