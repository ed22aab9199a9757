"""Console scripts. The only place (with launch/) that reads argv."""

from __future__ import annotations

import argparse
import logging
import sys


def train_main(argv: list[str] | None = None) -> int:
    """ft-train --config FILE [key.sub=value ...]: one fine-tuning run."""
    parser = argparse.ArgumentParser(
        prog="ft-train", description="Fine-tune a pretrained model on a GLUE task.",
        epilog="Example: ft-train --config configs/quickstart.yaml training.num_epochs=2")
    parser.add_argument("--config", required=True, help="YAML run config (see configs/)")
    parser.add_argument("overrides", nargs="*", metavar="key.sub=value",
                        help="override config values; the value is parsed as YAML")
    # DeepSpeed's launcher appends --local_rank=N; the rank also arrives in the environment.
    parser.add_argument("--local_rank", "--local-rank", type=int, default=None, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")

    from .config import ConfigError, load_config
    from .trainer import Trainer, format_results_table

    try:
        cfg = load_config(args.config, args.overrides)
    except (ConfigError, FileNotFoundError) as exc:
        print(f"ft-train: {exc}", file=sys.stderr)
        return 2
    trainer = Trainer(cfg)
    try:
        results = trainer.fit()
    finally:
        trainer.strategy.close()
    if trainer.strategy.is_main_process:
        print()
        print(format_results_table(results))
        print(f"\nlogs: {cfg.logging.output_dir}/metrics.jsonl, results: {cfg.logging.output_dir}/results.json")
    return 0


if __name__ == "__main__":
    raise SystemExit(train_main())
