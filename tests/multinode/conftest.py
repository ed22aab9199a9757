import importlib.util
import sys
from pathlib import Path

import pytest
import torch.distributed as dist

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(HERE.parent / "distributed"))  # rank_launcher: the reference runs' launch

from multinode_helpers import ZERO2_OFFLOAD, Launches, base_env, fsdp_config  # noqa: E402
from rank_launcher import FIT_WORKER, fit_step, launch  # noqa: E402

if not dist.is_available():
    pytest.skip("torch.distributed is not available", allow_module_level=True)


@pytest.fixture
def launches(tmp_path):
    """Starts launcher processes for a test; whatever is left of them (and their workers) is killed."""
    tracker = Launches(tmp_path)
    yield tracker
    tracker.kill_all()


@pytest.fixture(scope="session")
def reference_runs(request, tiny_bert_dir, tmp_path_factory) -> dict[str, Path]:
    """The uninterrupted 2-process single-node runs the multi-node cases are compared with, by
    strategy: "fsdp" (FSDP2) and "zero2_offload" (DeepSpeed ZeRO-2 with the optimizer offloaded;
    RUN otherwise), the latter where DeepSpeed is installed and a collected test asks for it. One
    launch makes both, one after another, each on 2 ranks forked from one process that imported
    everything once (rank_launcher.py): a launch per run would cost the imports again, and the
    metrics are the same as each run's own launch makes (torchrun's, the DeepSpeed launcher's). The
    tests must equal them exactly, so a run this launch got wrong fails them."""
    root = tmp_path_factory.mktemp("reference_runs")
    runs = {"fsdp": {}}
    if importlib.util.find_spec("deepspeed") is not None and any(
            "zero2_offload_reference" in item.fixturenames for item in request.session.items):
        runs = {"zero2_offload": {"strategy": ZERO2_OFFLOAD}, **runs}
    plan = [fit_step(fsdp_config(root / f"{name}.yaml", tiny_bert_dir, root / name, **sections))
            for name, sections in runs.items()]
    launch(FIT_WORKER, plan, root, timeout=300, env=base_env())
    return {name: root / name for name in runs}


@pytest.fixture(scope="session")
def fsdp_reference(reference_runs):
    """The uninterrupted 2-process single-node FSDP2 run (reference_runs); its output dir."""
    return reference_runs["fsdp"]


@pytest.fixture(scope="session")
def zero2_offload_reference(reference_runs):
    """The uninterrupted 2-process single-node DeepSpeed ZeRO-2 + optimizer offload run
    (reference_runs), the same run as fsdp_reference otherwise; its output dir. Shared by the
    two-node and the SIGTERM tests, which must each equal it."""
    pytest.importorskip("deepspeed")
    return reference_runs["zero2_offload"]
