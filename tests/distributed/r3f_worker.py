"""torchrun worker of test_r3f_distributed.py: the R3F runs of a plan (argv[1]: runs_in_one_launch's
plan, one run per backend, DeepSpeed's first) one after another on these ranks, in one process group."""

from __future__ import annotations

import sys

from runs_in_one_launch import close_and_finish, fit, read_plan

if __name__ == "__main__":
    close_and_finish([fit(step) for step in read_plan(sys.argv[1])])
