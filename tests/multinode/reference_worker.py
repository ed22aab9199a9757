"""torchrun worker of the shared reference runs (conftest.py's reference_runs): the trainer runs of
a plan (argv[1]: tests/distributed/runs_in_one_launch.py's plan, DeepSpeed's first) one after
another on these 2 ranks, in one process group."""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "distributed"))

from runs_in_one_launch import close_and_finish, fit, read_plan  # noqa: E402

if __name__ == "__main__":
    close_and_finish([fit(step) for step in read_plan(sys.argv[1])])
