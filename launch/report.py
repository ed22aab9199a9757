"""Entry point: `python launch/report.py runs/sweeps/quickstart_grid [--out DIR]`.
Same as the `ft-report` console script."""

from ft_framework.cli import report_main

if __name__ == "__main__":
    raise SystemExit(report_main())
