"""torchrun worker of test_child_tuning_distributed.py: the runs of a plan (argv[1]:
runs_in_one_launch's plan) one after another on these ranks, in one process group. Per backend
(DeepSpeed's first): a fresh Child-Tuning run, then a resume of the one-process run's mid-run
checkpoint on these 2 ranks (1 -> 2 ranks)."""

from __future__ import annotations

import sys

from runs_in_one_launch import close_and_finish, fit, read_plan

if __name__ == "__main__":
    close_and_finish([fit(step) for step in read_plan(sys.argv[1])])
