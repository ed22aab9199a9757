"""2-node training on loopback, one process per node, started as users start it on two machines:

- FSDP2: two torchrun launchers meeting at a c10d rendezvous (``--nnodes 2 --node-rank {0,1}
  --rdzv-backend c10d --rdzv-endpoint 127.0.0.1:PORT``);
- DeepSpeed ZeRO-2 + optimizer offload: two ``deepspeed --hostfile HF --no_ssh --node_rank {0,1}
  --master_addr 127.0.0.1`` launchers (the launcher's ssh-free multi-node mode).

Each equals the 2-process single-node run of the same config: the same ranks, the same gloo
collectives, so metrics.jsonl and results.json are identical (not just close).
"""

from __future__ import annotations

import uuid

import pytest

from multinode_helpers import (TRAIN, ZERO2_OFFLOAD, comparable_results, deepspeed_node, free_port, fsdp_config,
                               read_jsonl, torchrun_node, write_hostfile)

pytestmark = pytest.mark.slow


def test_fsdp2_on_two_torchrun_nodes_equals_two_processes_on_one(tiny_bert_dir, fsdp_reference, launches, tmp_path):
    cfg = fsdp_config(tmp_path / "run.yaml", tiny_bert_dir, tmp_path / "out")
    endpoint, run_id = f"127.0.0.1:{free_port()}", uuid.uuid4().hex[:8]
    nodes = [launches.start(f"node{r}", torchrun_node(r, 2, endpoint, run_id, [TRAIN, "--config", cfg]))
             for r in (0, 1)]
    codes = launches.wait(nodes, timeout=240)
    assert codes == [0, 0], "\n".join(launches.tail(p) for p in nodes)
    # Both nodes ran one worker of a 2-rank job; rank 0 (whichever node it landed on) wrote the logs.
    assert "memory plan per rank (fsdp, 2 rank(s)" in launches.log(nodes[0]) + launches.log(nodes[1])
    assert read_jsonl(tmp_path / "out" / "metrics.jsonl") == read_jsonl(fsdp_reference / "metrics.jsonl")
    assert comparable_results(tmp_path / "out") == comparable_results(fsdp_reference)


def test_zero2_offload_on_two_deepspeed_nodes_without_ssh_equals_two_processes_on_one(tiny_bert_dir,
                                                                                       zero2_offload_reference,
                                                                                       launches, tmp_path):
    cfg = fsdp_config(tmp_path / "run.yaml", tiny_bert_dir, tmp_path / "out", strategy=ZERO2_OFFLOAD)
    hostfile = write_hostfile(tmp_path / "hostfile")
    port = free_port()
    nodes = [launches.start(f"node{r}", deepspeed_node(r, hostfile, port, [TRAIN, "--config", cfg]))
             for r in (0, 1)]
    codes = launches.wait(nodes, timeout=300)
    assert codes == [0, 0], "\n".join(launches.tail(p) for p in nodes)
    node0, node1 = launches.log(nodes[0]), launches.log(nodes[1])
    # Each launcher started one rank of the 2-node job: node 0 rank 0, node 1 rank 1.
    assert "node_rank=0" in node0 and "node_rank=1" in node1
    assert "memory plan per rank (deepspeed, 2 rank(s)" in node0
    assert read_jsonl(tmp_path / "out" / "metrics.jsonl") == read_jsonl(zero2_offload_reference / "metrics.jsonl")
    assert comparable_results(tmp_path / "out") == comparable_results(zero2_offload_reference)
