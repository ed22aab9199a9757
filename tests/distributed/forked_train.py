"""`ft-train` (launch/train.py) on N ranks forked from this one process, for the tests' trainer runs
on 2 ranks:

    python forked_train.py N [--deepspeed] --config FILE [key=value ...]

Each rank runs what a torchrun launch of launch/train.py runs on it (ft_framework.cli.train_main,
same arguments) in a launcher's environment (forked_ranks.py), without torchrun's agent and without
every rank importing torch, the trainer, the model's transformers module and, with --deepspeed,
DeepSpeed for itself (~5-7 s of CPU per rank): they are imported here once, before the ranks are
forked. The launch fails (exit 1) when a rank's train_main does not return 0.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from forked_ranks import preimport_deepspeed_initialize, preimport_model_module, run_phases  # noqa: E402
from worker_exit import finish  # noqa: E402

from ft_framework.cli import add_run_config_arguments, train_main  # noqa: E402
from ft_framework.config import load_config  # noqa: E402
from ft_framework.trainer import Trainer  # noqa: E402,F401  (what train_main imports once the config is read)


def model_path(args: list[str]) -> str:
    """The run's model (model.name_or_path), from ft-train's arguments."""
    parser = argparse.ArgumentParser()
    add_run_config_arguments(parser)
    parsed = parser.parse_args(args)
    return load_config(parsed.config, parsed.overrides).model.name_or_path


def train(args: list[str]) -> None:
    code = train_main(args)
    if code != 0:
        raise SystemExit(f"ft-train exited with {code}")


if __name__ == "__main__":
    nproc, args = int(sys.argv[1]), sys.argv[2:]
    if args[:1] == ["--deepspeed"]:
        args = args[1:]
        from ft_framework.strategies import deepspeed_adapter  # noqa: F401  (DeepSpeed, mlflow hidden)

        preimport_deepspeed_initialize()
    preimport_model_module(model_path(args))
    run_phases([("ft-train", nproc, lambda: train(args))])
    finish()
