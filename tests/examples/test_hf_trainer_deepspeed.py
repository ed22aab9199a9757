"""examples/hf_trainer_deepspeed.py: our optimizer in a Hugging Face Trainer under DeepSpeed ZeRO-2
with the optimizer offloaded, on 2 CPU ranks (gloo; forked from one process that imported everything
once: hf_deepspeed_worker.py): the offloaded step runs our kernel, each rank's anchors are exactly
its slice of theta*, DeepSpeed's own checkpoint carries them across a resume, and the run equals the
single-process Trainer's on the same global batches."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch
from transformers import TrainingArguments

from ft_framework.errors import UserError
from ft_framework.integrations.transformers import ft_optimizer

pytest.importorskip("deepspeed")
pytestmark = pytest.mark.slow
WORKER = Path(__file__).resolve().parent / "hf_deepspeed_worker.py"
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "distributed"))
from rank_launcher import launch, step  # noqa: E402


@pytest.fixture(scope="module")
def ran(tmp_path_factory):
    out = tmp_path_factory.mktemp("hf_ds")
    log = launch(WORKER, [step("train_and_resume", 2, out=out)], out, timeout=600,
                 env={"TOKENIZERS_PARALLELISM": "false"})
    found = json.loads((out / "worker.json").read_text())
    return found, out, log


def test_offloaded_step_runs_our_kernel_with_theta_star_partitioned(ran):
    found, _, log = ran
    first = found["first"]
    assert first["zero_optimizer"] == "DeepSpeedZeroOptimizer" and first["cpu_offload"]
    # DeepSpeed kept our optimizer (zero_force_ds_cpu_optimizer=false), not DeepSpeedCPUAdam.
    assert first["base_optimizer_is_ours"] and first["optimizer"] == "RecAdam"
    assert first["impl"] == ("cpu" if first["kernel_available"] else "torch")
    assert "set zero_force_ds_cpu_optimizer=false" in log
    # Every anchored parameter's gathered anchor is its pretrained tensor, bit for bit; the head is
    # in groups not anchored, whose partitions hold no anchor.
    assert first["theta_star_source"] == "placed into the partitions" and first["pending_theta_star_dropped"]
    assert first["anchor_mismatches"] == []
    assert not any(n.startswith("classifier.") for n in first["anchored_names"])
    assert len(first["anchored_names"]) > 90
    assert {k for k, v in first["anchored_groups"].items() if v} == {"anchored/decay", "anchored/no_decay"}
    assert first["unanchored_partitions_with_anchor"] == 0
    # Training moved the weights; the optimizer's distance (partitions summed over ranks) equals the
    # one from the gathered masters.
    assert first["moved"] > len(first["anchored_names"]) // 2
    assert first["forgetting_distance"] == pytest.approx(first["reference_distance"], rel=1e-6)
    logs = first["logs"]
    assert [h["step"] for h in logs] == [2, 4]
    assert all(h["forgetting_distance"] > 0 for h in logs)
    assert all(0 < h["lambda/anchored/decay"] < 1 for h in logs) and not any("lambda/new" in k for k in logs[-1])


def test_resume_from_the_deepspeed_checkpoint_keeps_theta_star_bit_exact(ran):
    found, out, _ = ran
    resumed = found["resumed"]
    assert resumed["global_step"] == 4
    # The anchors came back from DeepSpeed's checkpoint (not re-captured), equal to theta*.
    assert resumed["theta_star_source"] == "checkpoint" and resumed["anchor_mismatches"] == []
    # The resumed run continued the first: same masters after step 4.
    first = torch.load(out / "masters_first.pt", weights_only=True)
    second = torch.load(out / "masters_resumed.pt", weights_only=True)
    assert first.keys() == second.keys()
    for name in first:
        torch.testing.assert_close(second[name], first[name], rtol=1e-5, atol=1e-6, msg=name)


def test_zero3_a_deepspeed_optimizer_section_and_zero0_in_bf16_are_refused_in_one_line(tmp_path):
    for config, match in (
            ({"zero_optimization": {"stage": 3}}, r"stage=3; valid with the Trainer: 0, 1, 2"),
            ({"zero_optimization": {"stage": 2}, "optimizer": {"type": "AdamW"}}, r"'optimizer' section"),
            ({"zero_optimization": {"stage": 2}, "zero_force_ds_cpu_optimizer": True}, r"zero_force_ds_cpu_optimizer=true"),
            ({"zero_optimization": {"stage": 0}, "bf16": True},
             r"stage=0 with bf16, which runs DeepSpeed's FP16_UnfusedOptimizer.*valid with the Trainer: stage 1 or 2")):
        bf16 = config.pop("bf16", False)
        args = TrainingArguments(output_dir=str(tmp_path), use_cpu=True, report_to=[], bf16=bf16,
                                 deepspeed={**config, "train_micro_batch_size_per_gpu": "auto"})
        with pytest.raises(UserError, match=rf"^ft_optimizer: .*{match}"):
            ft_optimizer("recadam", args, new_parameters=[])
