"""Runs several supervised fine-tuning runs of tiny decoders in one 2-rank launch (torchrun), one
after another in the same process group: `python -m torch.distributed.run --nproc_per_node 2
llm_strategies_worker.py CONFIG [CONFIG ...]`. The DeepSpeed runs go first: their strategy's set-up
makes the process group the way DeepSpeed wants it, and the other strategies join it as it is."""

import os
import sys

os.environ.setdefault("DS_ACCELERATOR", "cpu")

import torch  # noqa: E402

from ft_framework.config import load_config  # noqa: E402
from ft_framework.trainer import Trainer  # noqa: E402

torch.set_num_threads(1)

if __name__ == "__main__":
    trainers = []
    for config in sys.argv[1:]:
        trainer = Trainer(load_config(config))
        trainer.fit()
        trainers.append(trainer)
    for trainer in trainers:  # DeepSpeed's all-reduce segments go; the last close ends the group
        trainer.strategy.close()
