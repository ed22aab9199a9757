"""Several pieces of work on 2 ranks in ONE torchrun launch (one process group), one after another.

A torchrun launch of 2 ranks costs ~10 s of CPU before any work (each rank imports torch and the
trainer), so a test file launches once for all its cases: its module fixture writes a plan (a list
of steps, JSON) and calls `launch`; the worker reads the plan (`read_plan`), does its steps in order
and ends with `close_and_finish`. DeepSpeed's steps go first: its strategy's set-up makes the
process group the way DeepSpeed wants it (deepspeed.init_distributed), and the other strategies
join the group as it is. A trainer run's step is {"config": path, "overrides": [...], "log": path};
with "log", every rank keeps that run's log records in LOG.rank<R> (`run_log` reads them back), so
a test reads what one run said, not the whole launch. Run as the worker itself (FIT_WORKER), it
does a plan of trainer runs and nothing else; a worker with steps of its own kinds imports the
worker's side below."""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
from pathlib import Path

from ft_framework.distributed import collectives
from ft_framework.distributed.ports import free_port
from worker_exit import finish

FIT_WORKER = Path(__file__)  # `python runs_in_one_launch.py PLAN`: a plan of trainer runs (fit_step) only


# ---- the test's side --------------------------------------------------------------------------
def launch(worker: Path, plan: list[dict], cwd: Path, timeout: int = 900) -> str:
    """`worker` on 2 ranks with `plan` (written to cwd/plan.json); returns the launch's output
    (stdout and stderr) after checking that every rank ended well."""
    plan_file = cwd / "plan.json"
    plan_file.write_text(json.dumps(plan, indent=1))
    env = {**os.environ, "OMP_NUM_THREADS": "1", "DS_ACCELERATOR": "cpu"}
    out = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port",
                          str(free_port()), str(worker), str(plan_file)],
                         capture_output=True, text=True, cwd=cwd, env=env, timeout=timeout)
    assert out.returncode == 0, (out.stdout + out.stderr)[-6000:]
    return out.stdout + out.stderr


def fit_step(config: Path, overrides=(), log: Path | None = None) -> dict:
    """A plan's step: one trainer run."""
    return {"config": str(config), "overrides": list(overrides), "log": None if log is None else str(log)}


def run_log(log: Path) -> str:
    """What every rank logged during one run (the step's "log"), rank 0 first."""
    return "".join(log.with_name(f"{log.name}.rank{rank}").read_text() for rank in (0, 1))


# ---- the worker's side ------------------------------------------------------------------------
def read_plan(path: str) -> list[dict]:
    """The plan's steps; the worker's log records from INFO up go to stderr (the launch's output)."""
    logging.basicConfig(level=logging.INFO)
    return json.loads(Path(path).read_text())


def fit(step: dict):
    """Runs one trainer run of the plan on these ranks; returns its strategy (still open: the
    process group outlives it, for the steps after it)."""
    from ft_framework.config import load_config
    from ft_framework.trainer import Trainer

    handler = None
    if step.get("log"):
        handler = logging.FileHandler(f"{step['log']}.rank{os.environ['RANK']}")
        logging.getLogger().addHandler(handler)
    try:
        trainer = Trainer(load_config(step["config"], step.get("overrides", [])))
        trainer.fit()
    finally:
        if handler is not None:
            logging.getLogger().removeHandler(handler)
            handler.close()
    return trainer.strategy


def close_and_finish(strategies) -> None:
    """Every rank done, every strategy closed (DeepSpeed's all-reduce segments go; the first close
    ends the process group), then the worker's exit (worker_exit.finish)."""
    if collectives.is_distributed():
        collectives.barrier()
    for strategy in strategies:
        strategy.close()
    finish()


if __name__ == "__main__":
    close_and_finish([fit(step) for step in read_plan(sys.argv[1])])
