"""torchrun worker of test_child_tuning_distributed.py: in one launch (one process group), a fresh
Child-Tuning run (argv[1]: its config), then a resume of the one-process run's mid-run checkpoint
on these 2 ranks (argv[2]: the checkpoint, argv[3]: the output directory), 1 -> 2 ranks."""

from __future__ import annotations

import logging
import sys

from ft_framework.config import load_config
from ft_framework.trainer import Trainer
from worker_exit import finish


def main(config: str, checkpoint: str, resumed_dir: str) -> None:
    logging.basicConfig(level=logging.INFO)
    Trainer(load_config(config)).fit()
    Trainer(load_config(config, [f"logging.output_dir={resumed_dir}", f"checkpoint.resume_from={checkpoint}"])).fit()
    finish()


if __name__ == "__main__":
    main(*sys.argv[1:4])
