"""A preemption signal on 2 ranks: SIGTERM to the launcher (what Kubernetes sends to a pod's first
process; torchrun and DeepSpeed's launcher pass it on to their workers). Every rank finishes its
step, the ranks agree on the step, save a checkpoint, results.json says interrupted, and the same
command again resumes to the uninterrupted run's metrics.jsonl. (One process, SIGINT and
SIGUSR1: tests/recipes/test_run_robustness.py.)"""

from __future__ import annotations

import json
import os
import signal
import sys
import time
from pathlib import Path

import pytest

from multinode_helpers import (STEPS, TRAIN, ZERO2_OFFLOAD, base_env, cmdline, comparable_results, descendants,
                               free_port, fsdp_config, read_jsonl)

pytestmark = pytest.mark.slow


def signal_after(launches, proc, metrics: Path, step: int, timeout: float = 240, target=None) -> None:
    """Sends SIGTERM to the launcher (`target(proc)`: the pid to signal) once metrics.jsonl shows
    train step `step`."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline and proc.poll() is None:
        records = read_jsonl(metrics) if metrics.is_file() else []
        if any(r.get("type") == "train" and r["step"] >= step for r in records):
            launches.remember_tree()
            os.kill(target(proc) if target else proc.pid, signal.SIGTERM)
            return
        time.sleep(0.02)
    raise AssertionError(f"the run never reached step {step}:\n{launches.tail(proc)}")


def check_interrupted(out: Path, log: str) -> int:
    results = json.loads((out / "results.json").read_text())
    assert results["status"] == "interrupted" and results["signal"] == "SIGTERM", log[-3000:]
    step = results["steps"]
    assert 1 <= step < STEPS and Path(results["checkpoint"]).name == f"step_{step:08d}"
    # Rank 0 alone prints the line; no rank prints a traceback.
    assert log.count(f"stopped by SIGTERM at step {step}") == 1 and "Traceback" not in log, log[-3000:]
    return step


def test_sigterm_to_torchrun_saves_on_both_ranks_and_resumes_to_the_same_metrics(tiny_bert_dir, fsdp_reference,
                                                                                  launches, tmp_path):
    out = tmp_path / "out"
    cfg = fsdp_config(tmp_path / "run.yaml", tiny_bert_dir, out, checkpoint={"resume_from": "auto"})
    cmd = [sys.executable, "-m", "ft_framework.distributed.torchrun", "--standalone", "--nproc-per-node", "2",
           str(TRAIN), "--config", str(cfg)]
    first = launches.start("first", cmd)
    signal_after(launches, first, out / "metrics.jsonl", 1)
    assert launches.wait([first], timeout=120) == [143]
    check_interrupted(out, launches.log(first))
    assert "ft_framework.distributed.torchrun: stopped by SIGTERM" in launches.log(first)
    again = launches.start("again", cmd)
    [rc] = launches.wait([again], timeout=240)
    assert rc == 0, launches.tail(again)
    assert read_jsonl(out / "metrics.jsonl") == read_jsonl(fsdp_reference / "metrics.jsonl")
    assert comparable_results(out) == comparable_results(fsdp_reference)


def test_sigterm_to_the_deepspeed_launcher_saves_and_resumes_to_the_same_metrics(tiny_bert_dir,
                                                                                  zero2_offload_reference,
                                                                                  launches, tmp_path):
    out = tmp_path / "out"
    cfg = fsdp_config(tmp_path / "run.yaml", tiny_bert_dir, out, strategy=ZERO2_OFFLOAD,
                      checkpoint={"resume_from": "auto"})

    def command():
        return ["deepspeed", "--num_gpus", "2", "--master_port", str(free_port()), str(TRAIN), "--config", str(cfg)]

    first = launches.start("first", command(), env=base_env())
    # `deepspeed` runs the node's launcher (deepspeed.launcher.launch), which passes SIGTERM on to
    # the workers; `deepspeed` itself passes on nothing on one node, so the node's launcher is told.
    def node_launcher(runner):
        [pid] = [p for p in descendants(runner.pid) if "deepspeed.launcher.launch" in cmdline(p)]
        return pid

    signal_after(launches, first, out / "metrics.jsonl", 1, target=node_launcher)
    launches.wait([first], timeout=120)
    check_interrupted(out, launches.log(first))
    again = launches.start("again", command(), env=base_env())
    assert launches.wait([again], timeout=300) == [0], launches.tail(again)
    assert read_jsonl(out / "metrics.jsonl") == read_jsonl(zero2_offload_reference / "metrics.jsonl")
    assert comparable_results(out) == comparable_results(zero2_offload_reference)
