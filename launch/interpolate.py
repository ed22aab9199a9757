"""`python launch/interpolate.py RUN_DIR [--alphas ...]`: same as the `ft-interpolate` console script."""

from ft_framework.cli import interpolate_main

if __name__ == "__main__":
    raise SystemExit(interpolate_main())
