"""Entry point: `python launch/export.py CHECKPOINT_DIR OUT_DIR`. Same as the `ft-export` console script."""

from ft_framework.cli import export_main

if __name__ == "__main__":
    raise SystemExit(export_main())
