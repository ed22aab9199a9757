"""A 2-node Ray cluster on loopback for sweep tests, and a fake run that checkpoints.

The cluster is ray.cluster_utils.Cluster: a head and a worker node, each its own raylet with its own
resources, all on 127.0.0.1 (Ray otherwise advertises the machine's interface address).

The fake run behaves like the trainer as far as the sweep can see: it writes a checkpoint
(checkpoints/latest) first, then results.json; started again with "resume" it only finishes, saying
so in results.json. Runs whose seed is listed in <store>/control.json "hold" wait after their
checkpoint until the file named there as "release" exists.
"""

from __future__ import annotations

import contextlib
import sys
from types import SimpleNamespace

NODE = dict(num_cpus=2, object_store_memory=80 * 2**20, node_ip_address="127.0.0.1")

FAKE_CHECKPOINTING_RUN = r"""
import json, os, sys, time, yaml
cfg = yaml.safe_load(open(sys.argv[1]))
resume = len(sys.argv) > 2
out, seed = cfg["logging"]["output_dir"], cfg["training"]["seed"]
control = json.load(open(os.path.join(out, "..", "..", "control.json")))
print("fake run seed", seed, "threads", os.environ.get("OMP_NUM_THREADS"), "resume" if resume else "fresh", flush=True)
if not resume:
    step = os.path.join(out, "checkpoints", "step_00000001")
    os.makedirs(step, exist_ok=True)
    open(os.path.join(step, "COMPLETE"), "w").write("{}")
    open(os.path.join(out, "checkpoints", "latest"), "w").write("step_00000001")
    if seed in control["hold"]:
        deadline = time.time() + 120
        while not os.path.exists(control["release"]) and time.time() < deadline:
            time.sleep(0.1)
final = {"step": 2, "metrics": {"validation": {"accuracy": 0.5 + 0.01 * seed}}}
results = {"task": cfg["data"]["task"], "main_metric": "accuracy", "selection_split": "validation", "steps": 2,
           "final": final, "best": final, "reported": "final", "failed": False,
           "baseline": {"name": "majority class", "metrics": {"validation": {"accuracy": 0.5}}}, "resumed": resume, "config": cfg}
json.dump(results, open(os.path.join(out, "results.json.tmp"), "w"))
os.replace(os.path.join(out, "results.json.tmp"), os.path.join(out, "results.json"))
"""


def fake_checkpointing_command(config_path, cfg, spec, resume):
    return [sys.executable, "-c", FAKE_CHECKPOINTING_RUN, str(config_path), *(["resume"] if resume else [])]


@contextlib.contextmanager
def loopback_cluster():
    """A head and a worker node (2 CPUs each) on 127.0.0.1, with this process connected to it."""
    import pytest

    ray = pytest.importorskip("ray")
    from ray._private import ray_constants
    from ray.cluster_utils import Cluster

    with pytest.MonkeyPatch.context() as mp:
        # Ray replaces 127.0.0.1 by the machine's address unless it believes clusters are off; the
        # flag only steers that choice (nodes are still separate raylets). Children inherit the env.
        mp.setenv(ray_constants.ENABLE_RAY_CLUSTERS_ENV_VAR, "0")
        mp.setattr(ray_constants, "ENABLE_RAY_CLUSTER", False)
        cluster = Cluster(initialize_head=True, head_node_args={**NODE, "include_dashboard": False})
        try:
            worker = cluster.add_node(**NODE)
            cluster.wait_for_nodes()
            ray.init(address=cluster.address, log_to_driver=False)
            # The fake command is pickled into the tasks by value (its module is not on the workers' path).
            ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])
            yield SimpleNamespace(cluster=cluster, worker=worker, head=cluster.head_node)
        finally:
            ray.shutdown()
            cluster.shutdown()


def node_ids_in_log(text: str) -> list[str]:
    """The Ray node of each attempt, from the run log's attempt headers."""
    return [line.split("(ray node ", 1)[1].split(")", 1)[0] for line in text.splitlines()
            if line.startswith("==== attempt") and "(ray node " in line]


__all__ = ["NODE", "fake_checkpointing_command", "loopback_cluster", "node_ids_in_log"]
