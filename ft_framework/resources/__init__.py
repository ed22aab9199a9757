"""Data files shipped inside the package (included in the wheel with the package directory)."""

from pathlib import Path


def quickstart_glue_dir() -> Path:
    """Root of the synthetic quickstart task in GLUE layout (``<root>/SST-2/{train,dev}.tsv``).

    Pass it as ``load_glue("sst2", source=str(quickstart_glue_dir()), ...)``.
    """
    return Path(__file__).resolve().parent / "quickstart_glue"
