"""DeepSpeed ZeRO-2 with optimizer offload, bf16, our optimizer, one rank on the CPU: the run
tests/unit/strategies/test_offload_lean.py compares the device-lean offload with.

    RANK=0 WORLD_SIZE=1 MASTER_ADDR=127.0.0.1 MASTER_PORT=... DS_ACCELERATOR=cpu \\
        python lean_offload_ds_worker.py OUT.pt
"""

import os
import sys
from pathlib import Path

os.environ.setdefault("DS_ACCELERATOR", "cpu")

import torch  # noqa: E402

sys.path.insert(0, str(Path(__file__).parent))
from lean_offload_common import BATCH, STEPS, make_model_and_anchors, make_optimizer, train  # noqa: E402

from ft_framework.config import DeepSpeedConfig, TrainingConfig  # noqa: E402
from ft_framework.strategies.deepspeed import DeepSpeedStrategy  # noqa: E402


def main(out: Path) -> None:
    training = TrainingConfig(max_steps=STEPS, per_device_batch_size=BATCH, precision="bf16", device="cpu",
                              max_grad_norm=None)
    strategy = DeepSpeedStrategy(DeepSpeedConfig(zero_stage=2, offload_optimizer=True), training)
    model, anchors = make_model_and_anchors()
    strategy.setup(model, lambda m: make_optimizer(m, anchors), anchors=anchors)
    norms = train(strategy)
    result = {
        "norms": norms,
        "weights": {n: p.detach().clone() for n, p in strategy.unwrapped_model().named_parameters()},
        "masters": strategy.gather_full_state("fp32"),
        "exp_avg": strategy.gather_full_state("exp_avg"),
        "exp_avg_sq": strategy.gather_full_state("exp_avg_sq"),
        "partition_devices": sorted({flat.device.type for _, flat in strategy.state_map.partitions()}),
        "impl": strategy.optimizer.impl,
    }
    torch.save(result, out)
    strategy.close()
    sys.stdout.flush()
    os._exit(0)  # see tests/distributed/worker_exit.py: the interpreter's teardown is not under test


if __name__ == "__main__":
    main(Path(sys.argv[1]))
