"""DeepSpeed without ZeRO in bf16/fp16 cannot run our optimizer (config/deepspeed_stage.py): the fact
the refusal rests on, checked against the DeepSpeed installed (in a process of its own: deepspeed
reads the accelerator and the rank from the environment at import); and a stage in the user's own
DeepSpeed JSON, which the run config's checks cannot see, must equal strategy.deepspeed.zero_stage."""

import os
import subprocess
import sys

import pytest

from ft_framework.config import DeepSpeedConfig, TrainingConfig
from ft_framework.distributed.rendezvous import free_port
from ft_framework.errors import UserError
from ft_framework.strategies.deepspeed import build_deepspeed_config

# A plain torch optimizer that counts its steps, handed to deepspeed.initialize as ours is.
WRAPPED = """
import deepspeed, torch

class Counting(torch.optim.AdamW):
    steps = 0

    def step(self, closure=None):
        Counting.steps += 1
        return super().step(closure)

for stage in (0, 1):
    model = torch.nn.Linear(4, 3)
    config = {{"train_micro_batch_size_per_gpu": 2, "bf16": {{"enabled": True}}, "zero_optimization": {{"stage": stage}},
              "zero_allow_untested_optimizer": True, "zero_force_ds_cpu_optimizer": False}}
    Counting.steps = 0
    engine, optimizer, _, _ = deepspeed.initialize(model=model, optimizer=Counting(model.parameters(), lr=0.1),
                                                   config=config)
    print(stage, type(optimizer).__name__, Counting.steps, flush=True)
"""


@pytest.mark.slow
def test_deepspeed_without_zero_in_bf16_steps_the_optimizer_before_the_first_batch():
    """Why zero_stage 0 is refused in bf16: the optimizer is stepped while deepspeed.initialize runs
    (before theta* could be placed in it), at stage 0 and only there."""
    pytest.importorskip("deepspeed")
    env = {**os.environ, "OMP_NUM_THREADS": "1", "DS_ACCELERATOR": "cpu", "RANK": "0", "LOCAL_RANK": "0",
           "WORLD_SIZE": "1", "LOCAL_WORLD_SIZE": "1", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port())}
    run = subprocess.run([sys.executable, "-c", WRAPPED.format()], env=env, capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, (run.stdout + run.stderr)[-4000:]
    lines = [line.split() for line in run.stdout.splitlines() if line[:2] in ("0 ", "1 ")]
    assert lines[0][:2] == ["0", "FP16_UnfusedOptimizer"] and int(lines[0][2]) >= 1, run.stdout
    assert lines[1][0] == "1" and lines[1][1] != "FP16_UnfusedOptimizer" and int(lines[1][2]) == 0, run.stdout


@pytest.mark.parametrize("json_stage", [0, 3])
def test_a_stage_in_the_users_deepspeed_json_must_equal_zero_stage(json_stage):
    """The run config's stage rules (stage 0 in bf16, LoRA or the compact state under ZeRO-3) read
    strategy.deepspeed.zero_stage: a JSON that set another stage would run unchecked."""
    training = TrainingConfig(max_steps=1, device="cpu", precision="bf16")
    given = {"zero_optimization": {"stage": json_stage, "contiguous_gradients": True}}
    for ds in (DeepSpeedConfig(config={"zero_optimization": {"stage": json_stage}}),  # zero_stage keeps its default, 2
               DeepSpeedConfig(zero_stage=1, config=given)):
        with pytest.raises(UserError) as info:
            build_deepspeed_config(ds, training)
        message = str(info.value)
        assert "\n" not in message and message == (
            f"the DeepSpeed config sets zero_optimization.stage={json_stage} but strategy.deepspeed.zero_stage is "
            f"{ds.zero_stage}; set strategy.deepspeed.zero_stage: {json_stage} (the run config's checks read it) and "
            "remove the stage from the DeepSpeed config")
    # the same stage in both, or none in the JSON: built, the JSON's other keys kept
    same = DeepSpeedConfig(zero_stage=3, config={"zero_optimization": {"stage": 3, "contiguous_gradients": True}})
    assert build_deepspeed_config(same, training)["zero_optimization"] == {"stage": 3, "contiguous_gradients": True}
    unset = DeepSpeedConfig(zero_stage=1, config={"zero_optimization": {"contiguous_gradients": True}})
    assert build_deepspeed_config(unset, training)["zero_optimization"] == {"stage": 1, "contiguous_gradients": True}
