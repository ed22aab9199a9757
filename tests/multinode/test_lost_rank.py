"""A rank killed without a word (SIGKILL: what the out-of-memory killer sends; a lost node looks the
same to the others) under DDP on 2 ranks. The survivor finds that rank's liveness witness gone
(distributed/liveness.py) and ends with one line naming it, no traceback; the job ends non-zero
within 60 s; the same command with checkpoint.resume_from=auto then completes."""

from __future__ import annotations

import os
import signal
import sys
import time
from pathlib import Path

import pytest

from multinode_helpers import TRAIN, fsdp_config, read_jsonl, worker_pid

pytestmark = pytest.mark.slow

STEPS = 16
LOST = 1
ENDS_WITHIN_S = 60  # the bound, from the kill to the launcher's exit


def ddp_config(tmp_path: Path, model_dir: Path) -> tuple[Path, Path]:
    out = tmp_path / "out"
    cfg = fsdp_config(tmp_path / "run.yaml", model_dir, out, strategy={"name": "ddp"},
                      training={"max_steps": STEPS}, evaluation={"num_evals": 1},
                      checkpoint={"every_steps": 2, "resume_from": "auto"})
    return cfg, out


def kill_rank_after_a_checkpoint(launches, launcher, out: Path, timeout: float = 240) -> float:
    """SIGKILLs rank LOST's worker once a checkpoint is complete; returns when that happened."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline and launcher.poll() is None:
        if (out / "checkpoints" / "latest").is_file():
            pid = worker_pid(launcher.pid, LOST)
            assert pid is not None, launches.tail(launcher)
            launches.remember_tree()
            os.kill(pid, signal.SIGKILL)
            return time.monotonic()
        time.sleep(0.02)
    raise AssertionError(f"no checkpoint before the run ended or {timeout:g} s passed:\n{launches.tail(launcher)}")


def lines_naming_the_lost_rank(text: str) -> list[str]:
    return [line for line in text.splitlines() if f"rank {LOST}" in line]


def assert_the_survivors_line(stderr: str) -> None:
    assert "Traceback" not in stderr, stderr[-4000:]
    [line] = lines_naming_the_lost_rank(stderr)
    assert line.startswith(f"ft-train (rank 0): stopped: rank {LOST} died without reporting an error (its process "
                           "is gone: killed by a signal such as SIGKILL"), line
    assert "resume from the last checkpoint with checkpoint.resume_from=auto" in line


def test_a_sigkilled_rank_under_plain_torchrun_ends_the_job_in_one_line_and_the_run_resumes(tiny_bert_dir, launches,
                                                                                            tmp_path):
    cfg, out = ddp_config(tmp_path, tiny_bert_dir)
    logs = tmp_path / "worker_logs"
    # --redirects 3: each worker's stdout and stderr in its own file, apart from torchrun's own output.
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2"]
    first = launches.start("first", [*torchrun, "--redirects", "3", "--log-dir", logs, TRAIN, "--config", cfg])
    killed_at = kill_rank_after_a_checkpoint(launches, first, out)
    [code] = launches.wait([first], timeout=ENDS_WITHIN_S + 60)
    ended_after = time.monotonic() - killed_at
    assert code != 0 and ended_after < ENDS_WITHIN_S, (code, ended_after, launches.tail(first))
    [survivor] = logs.glob("*/attempt_0/0/stderr.log")
    assert_the_survivors_line(survivor.read_text(errors="replace"))
    # Plain torchrun adds its own ChildFailedError block (docs/multinode.md), naming the signal.
    assert "Signal 9 (SIGKILL) received" in launches.log(first)

    again = launches.start("again", [*torchrun, TRAIN, "--config", cfg])  # resume_from: auto
    [code] = launches.wait([again], timeout=240)
    assert code == 0, launches.tail(again)
    assert "checkpoint.resume_from=auto: resuming from" in launches.log(again)
    assert max(r["step"] for r in read_jsonl(out / "metrics.jsonl") if r["type"] == "train") == STEPS
