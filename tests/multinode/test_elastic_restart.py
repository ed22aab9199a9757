"""Elastic restart: a 2-process FSDP job under ``torchrun --max-restarts 1`` with
``checkpoint.resume_from: auto``. One worker is killed with SIGKILL mid-training (after the step-4
checkpoint, while rank 0 has logged step 5); torchrun restarts the worker group, both ranks resume
from the step-4 checkpoint, and the job ends with the same metrics.jsonl and results.json as the
uninterrupted run (the logs of step 5 from the killed attempt are dropped, not doubled).
"""

from __future__ import annotations

import os
import signal
import sys
import time
from pathlib import Path

import pytest

from ft_framework.checkpointing.manager import CheckpointManager
from multinode_helpers import base_env, comparable_results, fsdp_config, read_jsonl

HERE = Path(__file__).resolve().parent
PAUSE_AT_STEP = 5

pytestmark = pytest.mark.slow


def test_kill_9_a_worker_and_torchrun_restarts_it_from_the_last_checkpoint(tiny_bert_dir, fsdp_reference,
                                                                           launches, tmp_path):
    out = tmp_path / "out"
    cfg = fsdp_config(tmp_path / "run.yaml", tiny_bert_dir, out, checkpoint={"every_steps": 2, "resume_from": "auto"})
    pid_file = tmp_path / "paused.pid"
    env = base_env(FT_TEST_PAUSE_AT_STEP=str(PAUSE_AT_STEP), FT_TEST_PAUSE_RANK="1", FT_TEST_PAUSE_FILE=str(pid_file))
    job = launches.start("job", [sys.executable, "-m", "ft_framework.distributed.torchrun", "--standalone", "--nproc-per-node", "2",
                                 "--max-restarts", "1", HERE / "elastic_train.py", "--config", cfg], env=env)
    deadline = time.monotonic() + 180
    while not pid_file.is_file():
        assert job.poll() is None, f"the job ended before the pause:\n{launches.tail(job)}"
        assert time.monotonic() < deadline, f"no pause within 180 s:\n{launches.tail(job)}"
        launches.remember_tree()
        time.sleep(0.2)
    # Rank 0 finishes step 5 with rank 1 (and logs it), then waits for rank 1 in step 6.
    while (logged := [r["step"] for r in read_jsonl(out / "metrics.jsonl") if r["type"] == "train"])[-1:] != [5]:
        assert time.monotonic() < deadline, f"rank 0 logged {logged}:\n{launches.tail(job)}"
        time.sleep(0.2)
    assert logged == list(range(1, PAUSE_AT_STEP + 1))
    latest = CheckpointManager(out / "checkpoints").latest_complete()
    assert latest is not None and latest.name.endswith("04"), latest

    os.kill(int(pid_file.read_text()), signal.SIGKILL)
    [rc] = launches.wait([job], timeout=240)
    log = launches.log(job)
    assert rc == 0, launches.tail(job, 8000)
    # The restarted attempt (both ranks) resumed from the step-4 checkpoint.
    assert log.count(f"checkpoint.resume_from=auto: resuming from {latest}") == 2, log[-6000:]
    assert read_jsonl(out / "metrics.jsonl") == read_jsonl(fsdp_reference / "metrics.jsonl")
    assert comparable_results(out) == comparable_results(fsdp_reference)
