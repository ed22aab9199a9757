"""DeepSpeed's internals are read in strategies/deepspeed_adapter.py only, and that module refuses
DeepSpeed versions outside the range it was written for."""

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

import ft_framework
from ft_framework.distributed.rendezvous import free_port

PACKAGE = Path(ft_framework.__file__).parent
ADAPTER = PACKAGE / "strategies" / "deepspeed_adapter.py"
# Private functions and internal attributes of DeepSpeed's ZeRO optimizers and parameters. (The
# ZeRO-3 parameter attributes ds_shape / ds_numel / ds_id, which DeepSpeed sets for user code to
# read a partitioned parameter's full size, are not on the list.)
INTERNAL_NAMES = [
    "_hp_mapping", "hp_fragment_address", "lp_fragment_address", "_dp_group",
    "_get_fp32_opt_state_partition", "_get_param_partition_rank",
    "_reassign_or_swap_out_partitioned_parameters", "_z3_optimizer", "_link_all_hp_params",
    "single_partition_of_fp32_groups", "fp32_partitioned_groups_flat", "fp32_groups_flat_partition",
    "bit16_groups", "bf16_groups", "fp16_groups", "grad_position", "get_param_id",
]


def test_deepspeed_internals_appear_in_the_adapter_only():
    offenders = []
    for path in sorted(PACKAGE.rglob("*.py")):
        if path == ADAPTER:
            continue
        text = path.read_text()
        for name in INTERNAL_NAMES:
            for m in re.finditer(rf"\b{re.escape(name)}\b", text):
                line = text.count("\n", 0, m.start()) + 1
                offenders.append(f"{path.relative_to(PACKAGE.parent)}:{line}: {name}")
    assert not offenders, "move these into strategies/deepspeed_adapter.py:\n" + "\n".join(offenders)


def test_the_adapter_does_use_them():  # the list above names what the adapter really reads
    text = ADAPTER.read_text()
    used = [n for n in INTERNAL_NAMES if re.search(rf"\b{re.escape(n)}\b", text)]
    assert len(used) >= 12, used


def test_versions_outside_the_supported_range_are_refused_in_one_line():
    pytest.importorskip("deepspeed")
    from ft_framework.strategies.deepspeed_adapter import check_deepspeed_version

    for ok in ("0.17.0", "0.19.8", "0.19.10+abc"):
        check_deepspeed_version(ok)
    for bad in ("0.16.9", "0.20.0", "1.0.0"):
        with pytest.raises(RuntimeError) as err:
            check_deepspeed_version(bad)
        msg = str(err.value)
        assert "\n" not in msg
        assert msg.startswith("ft_framework's DeepSpeed strategy supports deepspeed>=0.17,<0.20")
        assert f"found {bad}: pip install 'deepspeed>=0.17,<0.20'" in msg


IMPORT_PROBE = """
import sys{first}
from ft_framework.strategies import deepspeed_adapter
import deepspeed.autotuning.autotuner as autotuner
loaded_with_deepspeed = "mlflow" in sys.modules
import mlflow
print(loaded_with_deepspeed, autotuner.has_mlflow, mlflow.__name__)
"""


@pytest.mark.parametrize("mlflow_first", [False, True], ids=["deepspeed_first", "mlflow_first"])
def test_deepspeed_is_imported_without_mlflow_and_mlflow_imports_after(mlflow_first):
    """DeepSpeed's autotuner imports mlflow when it is installed; the adapter keeps it out of a
    rank (1.1 s, 117 MB), and a process that imported mlflow before (our tracking) keeps it."""
    pytest.importorskip("deepspeed")
    pytest.importorskip("mlflow")
    code = IMPORT_PROBE.format(first="\nimport mlflow" if mlflow_first else "")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300,
                         env={**os.environ, "DS_ACCELERATOR": "cpu"})
    assert out.returncode == 0, out.stderr[-3000:]
    want = "True True mlflow" if mlflow_first else "False False mlflow"
    assert out.stdout.strip().splitlines()[-1] == want, out.stdout


RELEASED_BEFORE_CLOSE = """
import os, sys
sys.path.insert(0, {here!r})
from lean_offload_common import make_model_and_anchors, make_optimizer
from ft_framework.config import DeepSpeedConfig, TrainingConfig
from ft_framework.strategies.deepspeed import DeepSpeedStrategy
from ft_framework.strategies.deepspeed_adapter import shm_allreduce_segment

strategy = DeepSpeedStrategy(DeepSpeedConfig(zero_stage=1), TrainingConfig(max_steps=1, device="cpu", max_grad_norm=None))
model, anchors = make_model_and_anchors()
strategy.setup(model, lambda m: make_optimizer(m, anchors), anchors=anchors)
# One rank makes no segment (DeepSpeed's shared-memory all-reduce needs two on one machine): the
# test plants the file that rank 0 of a two-rank run would have, under the name DeepSpeed gives it.
segment = shm_allreduce_segment(0)
segment.write_bytes(b"")
strategy.engine = None  # what benchmarks/gpu_suite.py's release() does before close()
strategy.close()
print("left behind" if segment.exists() else "removed", flush=True)
os._exit(0)
"""


@pytest.mark.slow
def test_the_all_reduce_segment_goes_even_when_the_engine_was_dropped_before_close(tmp_path):
    """The GPU suite drops a DeepSpeed engine before closing its strategy (to measure the next one):
    the /dev/shm segment of DeepSpeed's CPU all-reduce (66 MB a rank) must go all the same."""
    pytest.importorskip("deepspeed")
    here = str(Path(__file__).resolve().parent)
    env = {**os.environ, "OMP_NUM_THREADS": "1", "DS_ACCELERATOR": "cpu", "RANK": "0", "LOCAL_RANK": "0",
           "WORLD_SIZE": "1", "LOCAL_WORLD_SIZE": "1", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port())}
    run = subprocess.run([sys.executable, "-c", RELEASED_BEFORE_CLOSE.format(here=here)], env=env, cwd=tmp_path,
                         capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, (run.stdout + run.stderr)[-4000:]
    assert run.stdout.strip().splitlines()[-1] == "removed", run.stdout[-2000:]
