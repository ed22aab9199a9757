"""torchrun worker of test_r3f_distributed.py: one R3F run (argv[1]: its config) on these ranks."""

from __future__ import annotations

import logging
import sys

from ft_framework.config import load_config
from ft_framework.trainer import Trainer
from worker_exit import finish


def main(config: str) -> None:
    logging.basicConfig(level=logging.INFO)
    Trainer(load_config(config)).fit()
    finish()


if __name__ == "__main__":
    main(sys.argv[1])
