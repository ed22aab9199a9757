"""The one-line multi-node failures, in process: the config-agreement message, the bounded
process-group rendezvous (rendezvous.py) and the torchrun wrapper's lines (torchrun.py). The real
multi-node runs of the same failures are tests/multinode/test_multinode_failures.py."""

from __future__ import annotations

import os
import time
from types import SimpleNamespace

import pytest

from ft_framework.distributed.config_agreement import check_config_agreement, config_hash, describe_disagreement
from ft_framework.errors import UserError
from ft_framework.distributed.rendezvous import RendezvousFailed, join_process_group, rendezvous_timeout_s
from ft_framework.distributed.torchrun import describe_failure
from ft_framework.distributed.rendezvous import free_port


CFG = {"training": {"max_steps": 8, "seed": 1}, "data": {"task": "sst2"}, "logging": {"output_dir": "out"}}


def with_(cfg: dict, section: str, key: str, value) -> dict:
    out = {k: dict(v) for k, v in cfg.items()}
    out[section][key] = value
    return out


def test_config_hash_ignores_key_order_and_sees_every_value():
    reordered = {"logging": {"output_dir": "out"}, "data": {"task": "sst2"}, "training": {"seed": 1, "max_steps": 8}}
    assert config_hash(reordered) == config_hash(CFG)
    assert config_hash(with_(CFG, "training", "seed", 2)) != config_hash(CFG)


def test_disagreement_names_the_ranks_and_the_keys_on_one_line():
    other = with_(with_(CFG, "training", "max_steps", 7), "data", "task", "rte")
    message = describe_disagreement([CFG, other, CFG, other])
    assert "\n" not in message
    assert f"ranks 0,2: {config_hash(CFG)}; ranks 1,3: {config_hash(other)}" in message
    assert 'data.task is "sst2" on rank 0 but "rte" on ranks 1,3' in message
    assert "training.max_steps is 8 on rank 0 but 7 on ranks 1,3" in message
    assert describe_disagreement([CFG, CFG]) is None


def test_disagreement_lists_at_most_five_keys_and_counts_the_rest():
    other = {"training": {"seed": 1, **{f"k{i}": i for i in range(8)}}}
    message = describe_disagreement([{"training": {"seed": 1}}, other])
    assert message.count(" on rank 0 but ") == 5 and "(and 3 more keys)" in message
    assert "training.k0 is unset on rank 0 but 0 on rank 1" in message


def test_agreement_check_is_a_no_op_without_a_process_group():
    assert check_config_agreement(CFG) == config_hash(CFG)


def test_a_rank_that_cannot_reach_the_rendezvous_fails_in_bounded_time(monkeypatch):
    port = free_port()  # nothing listens there
    monkeypatch.setenv("RANK", "1")
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.setenv("MASTER_PORT", str(port))
    monkeypatch.delenv("TORCHELASTIC_USE_AGENT_STORE", raising=False)
    started = time.monotonic()
    with pytest.raises(RendezvousFailed) as info:
        join_process_group("gloo", timeout_s=1.0)
    assert time.monotonic() - started < 10
    message = str(info.value)
    assert "\n" not in message
    assert f"rank 1 of 2 could not reach the rendezvous at 127.0.0.1:{port} within 1 s" in message
    assert "FT_RENDEZVOUS_TIMEOUT_S" in message


def test_rank_0_waiting_for_a_node_that_never_comes_fails_in_bounded_time(monkeypatch):
    port = free_port()
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.setenv("MASTER_PORT", str(port))
    monkeypatch.delenv("TORCHELASTIC_USE_AGENT_STORE", raising=False)
    monkeypatch.setenv("FT_RENDEZVOUS_TIMEOUT_S", "1")
    started = time.monotonic()
    with pytest.raises(RendezvousFailed, match=f"rank 0 of 2 hosted the rendezvous at 127.0.0.1:{port} but not "
                                               "all 2 ranks joined within 1 s"):
        join_process_group("gloo")
    assert time.monotonic() - started < 10


@pytest.mark.parametrize("raw", ["0", "-3", "soon"])
def test_a_bad_rendezvous_timeout_is_a_user_error(monkeypatch, raw):
    monkeypatch.setenv("FT_RENDEZVOUS_TIMEOUT_S", raw)
    with pytest.raises(UserError, match="FT_RENDEZVOUS_TIMEOUT_S"):
        rendezvous_timeout_s()


def test_torchrun_failures_are_told_in_one_line():
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError, ProcessFailure
    from torch.distributed.elastic.rendezvous.api import RendezvousConnectionError, RendezvousTimeoutError

    args = SimpleNamespace(rdzv_endpoint="10.0.0.1:29400", rdzv_id="job7", nnodes="2",
                           rdzv_conf="join_timeout=30", max_restarts=0)
    try:
        try:
            raise ConnectionError("The client socket has timed out after 60000ms\nframe #0: ...")
        except ConnectionError as inner:
            raise RendezvousConnectionError("The connection to the C10d store has failed.") from inner
    except RendezvousConnectionError as exc:
        line = describe_failure(exc, args)
    assert line.startswith("ft_framework.distributed.torchrun: this node cannot reach the rendezvous at 10.0.0.1:29400 "
                           "within read_timeout=60 s (ConnectionError: The client socket has timed out after 60000ms)")
    assert "frame #" not in line and "--rdzv-id job7" in line

    line = describe_failure(RendezvousTimeoutError(), args)
    assert "did not fill up within join_timeout=30 s (not all of --nnodes 2 joined)" in line

    failure = ProcessFailure(local_rank=1, pid=4242, exitcode=3, error_file="/nonexistent")
    line = describe_failure(ChildFailedError("train.py", {3: failure}), args)
    assert line == ("ft_framework.distributed.torchrun: workers failed on this node: rank 3 (local rank 1, pid 4242) "
                    "exit code 3; their own error lines are above")

    # Rank 3 was SIGKILLed (it printed nothing), then torchrun stopped rank 2 with SIGTERM.
    killed = ProcessFailure(local_rank=1, pid=4242, exitcode=-9, error_file="/nonexistent")
    stopped = ProcessFailure(local_rank=0, pid=4241, exitcode=-15, error_file="/nonexistent")
    stopped.timestamp = killed.timestamp + 1
    line = describe_failure(ChildFailedError("train.py", {3: killed, 2: stopped}), args)
    assert line == ("ft_framework.distributed.torchrun: workers failed on this node: rank 2 (local rank 0, pid 4241) "
                    "killed by SIGTERM; rank 3 (local rank 1, pid 4242) killed by SIGKILL first; rank 3 printed "
                    "nothing: SIGKILL ended it (kill -9, or the kernel's out-of-memory killer, which the node's "
                    "kernel log records: dmesg); the other ranks' lines are above")
    assert describe_failure(ValueError("not ours"), args) is None


WORKER = r"""
import json, os, sys
from ft_framework.distributed.config_agreement import ConfigDisagreement, check_config_agreement
from ft_framework.distributed.rendezvous import join_process_group
join_process_group("gloo", timeout_s=60)  # rank 0 hosts the store on MASTER_PORT, as under the deepspeed launcher
import torch.distributed as dist
cfg = {"training": {"max_steps": 8, "seed": 1}}
out = {"agree": check_config_agreement(cfg)}
if int(os.environ["RANK"]) == 1:
    cfg["training"]["max_steps"] = 7
try:
    check_config_agreement(cfg)
except ConfigDisagreement as exc:
    out["disagree"] = str(exc)
dist.destroy_process_group()
print(json.dumps(out))
"""


@pytest.mark.slow
def test_two_processes_join_through_the_bounded_rendezvous_and_compare_config_hashes():
    import json
    import os
    import subprocess
    import sys

    env = {**os.environ, "WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port()),
           "OMP_NUM_THREADS": "1"}
    env.pop("TORCHELASTIC_USE_AGENT_STORE", None)
    procs = [subprocess.Popen([sys.executable, "-c", WORKER], env={**env, "RANK": str(r)}, stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True) for r in (0, 1)]
    try:
        outs = [p.communicate(timeout=120) for p in procs]
    finally:
        for p in procs:
            p.kill()
    assert [p.returncode for p in procs] == [0, 0], [o[1][-2000:] for o in outs]
    results = [json.loads(o[0].strip().splitlines()[-1]) for o in outs]
    assert results[0]["agree"] == results[1]["agree"]
    # Both ranks raise, with the same line.
    assert results[0]["disagree"] == results[1]["disagree"]
    assert "training.max_steps is 8 on rank 0 but 7 on rank 1" in results[0]["disagree"]


def test_a_restart_on_torchrun_s_shared_store_is_refused_in_one_line(monkeypatch):
    # The failed attempt's addresses are still in the agent's store (pytorch/pytorch#135712).
    for key, value in dict(RANK="1", WORLD_SIZE="2", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()),
                           TORCHELASTIC_USE_AGENT_STORE="True", TORCHELASTIC_RESTART_COUNT="1").items():
        monkeypatch.setenv(key, value)
    with pytest.raises(RendezvousFailed, match="torchrun restarted this worker .restart 1. but shares its rendezvous "
                                               "store .* launch with python -m ft_framework.distributed.torchrun"):
        join_process_group("gloo", timeout_s=1.0)


def test_the_torchrun_wrapper_gives_each_round_of_workers_a_fresh_store(monkeypatch):
    import ft_framework.distributed.torchrun as wrapper
    from torch.distributed import run as torchrun

    seen = {}
    monkeypatch.delenv(wrapper.FRESH_STORE_ENV, raising=False)
    monkeypatch.setattr(torchrun, "run", lambda args: seen.setdefault("env", os.environ.get(wrapper.FRESH_STORE_ENV)))
    assert wrapper.main(["--standalone", "--nproc-per-node", "1", "script.py"]) == 0
    assert seen["env"] == "1"
