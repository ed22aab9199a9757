"""Entry point for launchers: `deepspeed launch/train.py --config ...`,
`torchrun --nproc_per_node N launch/train.py --config ...`, or plain `python launch/train.py ...`.
Same as the `ft-train` console script."""

from ft_framework.cli import train_main

if __name__ == "__main__":
    raise SystemExit(train_main())
