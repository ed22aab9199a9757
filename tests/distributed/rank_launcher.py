"""The one launcher of the tests' multi-process workers: a plan of steps, each step's ranks forked
from one process that imported everything once.

The test's side writes a plan and calls `launch(worker, plan, cwd)`, which runs
`python WORKER PLAN.json` and checks that every rank ended well. A plan is a list of steps, one
after another; a step (`step`) is a name, a number of ranks and keyword arguments: each of its ranks
calls the worker's function of that name with them. Trainer runs are steps too (`fit_step`: a
Trainer on a config, in the rank; `train_main_step`: ft-train's train_main, as launch/train.py runs
it). The worker's side is `run_plan({name: function, ...})`; this file, run as the worker itself
(FIT_WORKER), does a plan of trainer runs and nothing else.

Why not a torchrun launch per step, or one for all: a 2-rank torchrun costs its agent (~1.7 s of
CPU: torch and torch.distributed.elastic) and each rank's own imports (torch, the trainer,
transformers, DeepSpeed: 3-7 s of CPU each) before any work, and some workers need several world
sizes in turn (2 ranks, then 1 loading their checkpoint, then 2 again). Here one process imports
once and forks the ranks of each step; they share its imports (copy-on-write) and join a process
group of their own per step from the environment a launcher sets (RANK, WORLD_SIZE, LOCAL_RANK,
LOCAL_WORLD_SIZE, MASTER_ADDR, MASTER_PORT: rank 0 hosts the rendezvous, as under the deepspeed
launcher or srun), so each rank runs what it runs under a launcher, from a fresh process group and
a fresh copy of the parent: no step sees what an earlier one left in its process (DeepSpeed's hooks,
a closed process group, loggers), and the order of the steps matters only for their files.

The parent only imports and forks: a fork copies neither threads nor a process group safely, so it
refuses to fork once it has a second thread. Before a trainer run's ranks are forked it imports what
they would each import for themselves (the trainer, the model's transformers module, DeepSpeed when
the run uses it). Before it forks, it freezes what it allocated (gc.freeze, as the Python docs
advise before a fork): the ranks' garbage collections skip those objects (DeepSpeed calls
gc.collect itself, 0.35 s of CPU each over all that torch, transformers and DeepSpeed leave alive)
and leave their pages shared. A rank that fails fails the launch at once (its peers are killed, the
parent exits 1 naming the step and rank); a rank whose parent dies is killed too (PR_SET_PDEATHSIG),
so a test's timeout leaves nothing running.
"""

from __future__ import annotations

import ctypes
import faulthandler
import functools
import gc
import importlib
import importlib.util
import json
import logging
import os
import signal
import subprocess
import sys
import threading
import traceback
from pathlib import Path
from typing import Callable, Mapping, NoReturn

from ft_framework.distributed.ports import free_port
from worker_exit import finish

FIT_WORKER = Path(__file__)  # `python rank_launcher.py PLAN`: a plan of trainer runs (fit_step, train_main_step) only
_LAUNCHER_VARIABLES = ("TORCHELASTIC_USE_AGENT_STORE", "TORCHELASTIC_RESTART_COUNT", "GROUP_RANK", "ROLE_RANK")
# A step's ranks take seconds to a minute (DeepSpeed's first op build included); a rank past this has
# hung (one CI run saw a decoder plan's launch wait out its test's 900 s): it says where, and fails.
STEP_WATCHDOG_S = float(os.environ.get("FT_TEST_STEP_WATCHDOG_S", "600"))


# ---- the test's side --------------------------------------------------------------------------
def step(name: str, ranks: int = 2, **args) -> dict:
    """A plan's step: `ranks` ranks, each calling the worker's function `name` with `args` (paths
    are passed as strings)."""
    return {"name": name, "ranks": ranks, "args": json.loads(json.dumps(args, default=str))}


def fit_step(config: Path, overrides=(), log: Path | None = None, ranks: int = 2) -> dict:
    """A trainer run on `ranks` ranks: Trainer(load_config(config, overrides)).fit() in each. With
    `log`, every rank keeps the run's log records in LOG.rank<R> (`run_log` reads them back), so a
    test reads what one run said, not the whole launch."""
    return step("fit", ranks, config=config, overrides=list(overrides), log=log)


def train_main_step(args: list, ranks: int = 2) -> dict:
    """ft-train on `ranks` ranks: each runs ft_framework.cli.train_main(args), as a torchrun launch
    of launch/train.py runs it; the step fails when it does not return 0."""
    return step("train_main", ranks, args=[str(a) for a in args])


def launch(worker: Path, plan: list[dict], cwd: Path, timeout: int = 900, env: Mapping[str, str] = ()) -> str:
    """`worker` doing `plan` (written to cwd/plan.json), with `env` over this process's environment;
    returns its output (stdout and stderr) after checking that every rank ended well."""
    plan_file = Path(cwd) / "plan.json"
    plan_file.write_text(json.dumps(plan, indent=1))
    env = {**os.environ, "OMP_NUM_THREADS": "1", "DS_ACCELERATOR": "cpu", **dict(env)}
    out = subprocess.run([sys.executable, str(worker), str(plan_file)], capture_output=True, text=True, cwd=cwd,
                         env=env, timeout=timeout)
    assert out.returncode == 0, (out.stdout + out.stderr)[-12000:]
    return out.stdout + out.stderr


def run_log(log: Path, ranks: int = 2) -> str:
    """What every rank logged during one trainer run (fit_step's `log`), rank 0 first."""
    return "".join(log.with_name(f"{log.name}.rank{rank}").read_text() for rank in range(ranks))


# ---- the worker's side ------------------------------------------------------------------------
def run_plan(functions: Mapping[str, Callable[..., None]] | None = None, plan_file: str | None = None) -> NoReturn:
    """Does the plan (sys.argv[1]) step after step, each step's ranks forked from this process and
    calling `functions[name](**args)` ("fit" and "train_main" are always known); exits 0 when every
    rank of every step ended well, 1 naming the step and rank at the first that did not."""
    plan = json.loads(Path(plan_file or sys.argv[1]).read_text())
    known = {"fit": fit, "train_main": train_main, **(functions or {})}
    unknown = sorted({s["name"] for s in plan} - set(known))
    if unknown:
        raise SystemExit(f"rank_launcher: the plan names steps this worker does not know: {unknown}")
    _preimport_trainer_runs(plan)
    parent = os.getpid()
    for index, entry in enumerate(plan, start=1):
        _run_step(parent, f"step {index} ({entry['name']!r})", entry["ranks"],
                  functools.partial(known[entry["name"]], **entry["args"]))
    finish()


def close(strategies) -> None:
    """Every rank done, every strategy closed (DeepSpeed's all-reduce segments go; the first close
    ends the process group): the end of a step that set strategies up."""
    from ft_framework.distributed import collectives

    if collectives.is_distributed():
        collectives.barrier()
    for strategy in strategies:
        strategy.close()


# Every trainer a rank ran, kept until worker_exit.finish ends the rank with os._exit: freeing one when
# fit() returns runs ~Reducer -> ~ProcessGroupGloo in the main thread with the GIL held, which can wait
# forever for gloo's worker thread while that thread frees the last all-reduce's tensors and waits
# for the GIL (seen with py-spy: a DDP rank hung after its run ended, until the watchdog).
_KEPT_TRAINERS: list = []


def fit(config: str, overrides: list[str], log: str | None) -> None:
    """fit_step's run in this rank; its log records from INFO up go to stderr (the launch's output)."""
    from ft_framework.config import load_config
    from ft_framework.trainer import Trainer

    logging.basicConfig(level=logging.INFO)
    handler = None
    if log:
        handler = logging.FileHandler(f"{log}.rank{os.environ['RANK']}")
        logging.getLogger().addHandler(handler)
    try:
        trainer = Trainer(load_config(config, overrides))
        _KEPT_TRAINERS.append(trainer)
        trainer.fit()
    finally:
        if handler is not None:
            logging.getLogger().removeHandler(handler)
            handler.close()
    close([trainer.strategy])


def train_main(args: list[str]) -> None:
    """train_main_step's ft-train in this rank."""
    from ft_framework.cli import train_main as ft_train

    code = ft_train(args)
    if code != 0:
        raise SystemExit(f"ft-train exited with {code}")


def preimport_deepspeed_initialize() -> None:
    """The first deepspeed.initialize in a process imports DeepSpeed's Muon optimizer module, and
    torch.compile's inductor with it (deepspeed/runtime/zero/utils.py, is_zero_supported_optimizer:
    ~1 s of CPU): a DeepSpeed worker imports it once, before its ranks are forked."""
    if importlib.util.find_spec("deepspeed.runtime.zero.muon.muon_optimizer") is not None:
        importlib.import_module("deepspeed.runtime.zero.muon.muon_optimizer")


def preimport_model_module(path: str) -> None:
    """Imports the transformers modeling module of the model at `path`, as each rank's
    from_pretrained would (~1 s of CPU for BERT's): once, before the ranks are forked. Without
    loading the model: a progress bar would start tqdm's monitor thread, and its lock would be one
    that every forked rank shares."""
    import transformers  # here: a plan without trainer runs (test_rank_launcher.py) does without it

    model_type = transformers.AutoConfig.from_pretrained(path).model_type.replace("-", "_")
    module = f"transformers.models.{model_type}.modeling_{model_type}"
    if importlib.util.find_spec(module) is not None:
        importlib.import_module(module)


def _preimport_trainer_runs(plan: list[dict]) -> None:
    """What the ranks of the plan's trainer runs would each import: the trainer, every run's model
    module, DeepSpeed where a run uses it (with mlflow hidden: deepspeed_adapter)."""
    configs = []
    for entry in plan:
        if entry["name"] == "fit":
            configs.append((entry["args"]["config"], entry["args"]["overrides"]))
        elif entry["name"] == "train_main":
            import argparse

            from ft_framework.cli import add_run_config_arguments

            parser = argparse.ArgumentParser()
            add_run_config_arguments(parser)
            parsed = parser.parse_args(entry["args"]["args"])
            configs.append((parsed.config, parsed.overrides))
    if not configs:
        return
    from ft_framework import cli  # noqa: F401  (train_main's own imports)
    from ft_framework.config import load_config
    from ft_framework.trainer import Trainer  # noqa: F401

    models, deepspeed = set(), False
    for config, overrides in configs:
        cfg = load_config(config, overrides)
        models.add(cfg.model.name_or_path)
        deepspeed |= cfg.strategy.name == "deepspeed"
    if deepspeed:
        from ft_framework.strategies import deepspeed_adapter  # noqa: F401

        preimport_deepspeed_initialize()
    for model in sorted(models):
        preimport_model_module(model)


def _die_with_parent(parent: int) -> None:
    if sys.platform.startswith("linux"):
        pr_set_pdeathsig = 1
        ctypes.CDLL(None, use_errno=True).prctl(pr_set_pdeathsig, signal.SIGKILL)
    if os.getppid() != parent:  # the parent died before the line above
        os._exit(1)


def _rank(parent: int, rank: int, world: int, port: int, work: Callable[[], None]) -> NoReturn:
    """In the forked child: the launcher's environment for (rank, world), the work, then
    worker_exit.finish (every rank done, process group closed, exit 0). Never returns. A rank still
    running after STEP_WATCHDOG_S prints every thread's stack and exits 1 (faulthandler), so a hung
    step fails naming its step, rank and where it waits, before the test's own timeout kills the
    launch without a word."""
    try:
        _die_with_parent(parent)
        faulthandler.dump_traceback_later(STEP_WATCHDOG_S, exit=True)
        for name in _LAUNCHER_VARIABLES:
            os.environ.pop(name, None)
        os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank),
                          LOCAL_WORLD_SIZE=str(world), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
        work()
        finish()
    except BaseException:  # noqa: BLE001 - reported, then this rank fails the launch
        traceback.print_exc()
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(1)  # reached only when work() or finish() raised


def _run_step(parent: int, label: str, world: int, work: Callable[[], None]) -> None:
    """The step's ranks, forked from this process; SystemExit(1) naming the step and rank when a
    rank fails (after killing the step's other ranks)."""
    if threading.active_count() > 1:
        raise RuntimeError(f"rank_launcher: the launching process runs {threading.active_count()} threads; "
                           "fork it before anything starts one")
    port = free_port()
    gc.freeze()
    sys.stdout.flush()
    sys.stderr.flush()
    ranks = {}
    for rank in range(world):
        pid = os.fork()
        if pid == 0:
            _rank(parent, rank, world, port, work)
        ranks[pid] = rank
    while ranks:
        pid, status = os.waitpid(-1, 0)
        rank = ranks.pop(pid, None)
        if rank is None:
            continue
        code = os.waitstatus_to_exitcode(status)
        if code != 0:
            for other in ranks:
                os.kill(other, signal.SIGKILL)
            for other in ranks:
                os.waitpid(other, 0)
            raise SystemExit(f"rank_launcher: {label}, rank {rank} of {world} exited with {code}")


if __name__ == "__main__":
    run_plan()
