"""Fixtures of the GPU suite: the tiny model, the fp32 CPU reference run, and one launch per
launcher (python / deepspeed / torchrun, world size 1) whose per-case results every test reads."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))

from gpu_common import (CASES, HERE, REPO, free_port, reference_case, run_config,  # noqa: E402
                        run_device, skip_reason, write_config)

LAUNCH_TIMEOUT_S = int(os.environ.get("FT_GPU_TESTS_TIMEOUT", "480"))
# Where each launch's output is written as it comes (launch_<launcher>.log), so that a launch killed
# from outside (benchmarks/gpu_run_next.sh's time limit) leaves its log: FT_GPU_TESTS_LOG_DIR, else
# the launch's own directory under pytest's tmp_path.
LOG_DIR_ENV = "FT_GPU_TESTS_LOG_DIR"
# The case names of the tests this session selected (pytest -k, node ids): a launch runs only those.
SELECTED_CASES = pytest.StashKey[set]()


@pytest.hookimpl(trylast=True)  # after -k / -m deselected (pytest's own hook): only the selected cases
def pytest_collection_modifyitems(config, items):
    config.stash[SELECTED_CASES] = {item.callspec.params["case_name"] for item in items
                                    if hasattr(item, "callspec") and "case_name" in item.callspec.params}


def launch_plan(selected: set[str]) -> dict[str, list[str]]:
    """Per launcher, the cases its one launch runs (selected and not skipped here), in CASES' order."""
    plan: dict[str, list[str]] = {}
    for name, case in CASES.items():
        if name in selected and skip_reason(name) is None:
            plan.setdefault(case.launcher, []).append(name)
    return plan


def pytest_report_collectionfinish(config, start_path, items):
    if not config.stash.get(SELECTED_CASES, set()):
        return None  # no GPU case in this session
    plan = launch_plan(config.stash[SELECTED_CASES])
    return "gpu launches: " + ("; ".join(f"{launcher}: {' '.join(names)}" for launcher, names in plan.items())
                               or "none")


def launcher_command(launcher: str, script: Path) -> list[str]:
    port = str(free_port())
    if launcher == "python":
        return [sys.executable, str(script)]
    if launcher == "torchrun":
        return [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "1",
                "--master_port", port, str(script)]
    if launcher == "deepspeed":
        exe = Path(sys.executable).parent / "deepspeed"
        prefix = [str(exe)] if exe.is_file() else ([shutil.which("deepspeed")] if shutil.which("deepspeed")
                                                    else [sys.executable, "-m", "deepspeed.launcher.runner"])
        return [*prefix, "--num_gpus", "1", "--master_port", port, str(script)]
    raise ValueError(launcher)


def kill_tree(pid: int) -> None:
    """SIGKILL to `pid` and every process below it (a launcher's workers), children first found."""
    children: dict[int, list[int]] = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        children.setdefault(int(fields[1]), []).append(int(stat.parent.name))
    todo, tree = [pid], []
    while todo:
        p = todo.pop()
        tree.append(p)
        todo += children.get(p, [])
    for p in tree:
        try:
            os.kill(p, signal.SIGKILL)
        except ProcessLookupError:
            pass


def worker_env() -> dict[str, str]:
    env = {**os.environ, "CUBLAS_WORKSPACE_CONFIG": ":4096:8", "PYTHONUNBUFFERED": "1",
           "FT_GPU_TESTS_DEVICE": run_device()}
    env.setdefault("OMP_NUM_THREADS", "1" if run_device() == "cpu" else "4")
    if run_device() == "cpu":
        env["DS_ACCELERATOR"] = "cpu"
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(REPO), env.get("PYTHONPATH", "")) if p)
    return env


class Launches:
    """Launches each launcher's selected cases once (the first test that needs one of them), then
    serves every case's results to every test."""

    def __init__(self, root: Path, model_dir: Path, selected: set[str]):
        self.root, self.model_dir, self.selected = root, model_dir, selected
        self.logs: dict[str, str] = {}

    def _launch(self, launcher: str) -> None:
        names = launch_plan(self.selected).get(launcher, [])
        out = self.root / launcher
        out.mkdir(parents=True, exist_ok=True)
        log_dir = Path(os.environ.get(LOG_DIR_ENV) or out)
        log_dir.mkdir(parents=True, exist_ok=True)
        log_path = log_dir / f"launch_{launcher}.log"
        cmd = launcher_command(launcher, HERE / "gpu_worker.py") + [str(out), str(self.model_dir), *names]
        # The output goes to the file as it comes (unbuffered workers, no pipe held in memory): a
        # kill from outside leaves what the launch printed. The launcher stays in pytest's process
        # group, so a `timeout` around pytest ends it too.
        with open(log_path, "w", buffering=1) as log:
            log.write(f"$ {' '.join(cmd)}\n")
            proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, text=True, cwd=self.root,
                                    env=worker_env())
            try:
                rc = proc.wait(timeout=LAUNCH_TIMEOUT_S)
                log.write(f"\nrc={rc}\n")
            except subprocess.TimeoutExpired:
                kill_tree(proc.pid)
                proc.wait()
                log.write(f"\nTIMEOUT after {LAUNCH_TIMEOUT_S}s (FT_GPU_TESTS_TIMEOUT)\n")
        self.logs[launcher] = log_path.read_text(errors="replace")

    def result(self, case_name: str) -> dict:
        launcher = CASES[case_name].launcher
        if launcher not in self.logs:
            self._launch(launcher)
        path = self.root / launcher / f"{case_name}.json"
        if not path.is_file():
            pytest.fail(f"the {launcher} launch wrote no result for {case_name}; its log ends:\n"
                        f"{self.logs[launcher][-5000:]}")
        record = json.loads(path.read_text())
        if record.get("error"):
            pytest.fail(f"{case_name} failed in the worker:\n{record['error']}")
        return record


@pytest.fixture(scope="session")
def gpu_model_dir(tmp_path_factory):
    from gpu_common import build_tiny_bert_dir

    return build_tiny_bert_dir(tmp_path_factory.mktemp("gpu_tiny_bert"))


@pytest.fixture(scope="session")
def launches(request, tmp_path_factory, gpu_model_dir):
    return Launches(tmp_path_factory.mktemp("gpu_runs"), gpu_model_dir,
                    request.config.stash.get(SELECTED_CASES, set(CASES)))


@pytest.fixture(scope="session")
def cpu_reference(tmp_path_factory, gpu_model_dir):
    """The same run in fp32 on the CPU, one process (in-process: tiny and fast)."""
    from ft_framework.config import load_config
    from ft_framework.trainer import Trainer

    root = tmp_path_factory.mktemp("cpu_reference")
    cfg = run_config(gpu_model_dir, root / "out", reference_case(), "cpu")
    cfg["checkpoint"] = {"every_steps": None}
    results = Trainer(load_config(write_config(root / "run.yaml", cfg), [])).fit()
    return {"out_dir": root / "out", "results": results}
