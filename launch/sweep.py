"""Entry point: `python launch/sweep.py --config configs/sweeps/quickstart_grid.yaml [--dry-run]`.
Same as the `ft-sweep` console script."""

from ft_framework.cli import sweep_main

if __name__ == "__main__":
    raise SystemExit(sweep_main())
