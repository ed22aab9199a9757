import sys
from pathlib import Path

import pytest
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).parent))

from multinode_helpers import TRAIN, ZERO2_OFFLOAD, Launches, base_env, free_port, fsdp_config  # noqa: E402

if not dist.is_available():
    pytest.skip("torch.distributed is not available", allow_module_level=True)


@pytest.fixture
def launches(tmp_path):
    """Starts launcher processes for a test; whatever is left of them (and their workers) is killed."""
    tracker = Launches(tmp_path)
    yield tracker
    tracker.kill_all()


@pytest.fixture(scope="session")
def fsdp_reference(tiny_bert_dir, tmp_path_factory):
    """The uninterrupted 2-process single-node FSDP run (torchrun --standalone); its output dir."""
    root = tmp_path_factory.mktemp("fsdp_reference")
    cfg = fsdp_config(root / "run.yaml", tiny_bert_dir, root / "out")
    tracker = Launches(root)
    try:
        proc = tracker.start("reference", [sys.executable, "-m", "torch.distributed.run", "--standalone",
                                           "--nproc-per-node", "2", str(TRAIN), "--config", str(cfg)])
        [rc] = tracker.wait([proc], timeout=240)
        assert rc == 0, tracker.tail(proc)
    finally:
        tracker.kill_all()
    return root / "out"



@pytest.fixture(scope="session")
def zero2_offload_reference(tiny_bert_dir, tmp_path_factory):
    """The uninterrupted 2-process single-node DeepSpeed ZeRO-2 + optimizer offload run (the
    deepspeed launcher), the same run as fsdp_reference otherwise; its output dir. Shared by the
    two-node and the SIGTERM tests, which must each equal it."""
    pytest.importorskip("deepspeed")
    root = tmp_path_factory.mktemp("zero2_offload_reference")
    cfg = fsdp_config(root / "run.yaml", tiny_bert_dir, root / "out", strategy=ZERO2_OFFLOAD)
    tracker = Launches(root)
    try:
        proc = tracker.start("reference", ["deepspeed", "--num_gpus", "2", "--master_port", free_port(), TRAIN,
                                           "--config", cfg], env=base_env())
        [rc] = tracker.wait([proc], timeout=300)
        assert rc == 0, tracker.tail(proc)
    finally:
        tracker.kill_all()
    return root / "out"
