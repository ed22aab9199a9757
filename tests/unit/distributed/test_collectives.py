"""ft_framework.distributed.collectives owns every torch.distributed collective: the device choice per backend,
an AST walk that fails on a collective called anywhere else in the package, and the module's
collectives on a real (one-process gloo) group."""

import ast
import os
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

import ft_framework
from ft_framework.distributed import collectives
from ft_framework.distributed.collectives import communication_device
from ft_framework.distributed.rendezvous import free_port

PACKAGE = Path(ft_framework.__file__).parent  # the whole library, every subpackage
COLLECTIVES = {
    "all_reduce", "all_gather", "all_gather_object", "all_gather_into_tensor", "all_to_all",
    "all_to_all_single", "broadcast", "broadcast_object_list", "reduce", "reduce_scatter",
    "reduce_scatter_tensor", "gather", "gather_object", "scatter", "scatter_object_list", "barrier",
    "monitored_barrier", "send", "recv", "isend", "irecv", "batch_isend_irecv", "all_reduce_coalesced",
    "_all_gather_base", "_reduce_scatter_base",
}
DIST_MODULES = {"torch.distributed", "deepspeed.comm"}


def test_nccl_communicates_on_the_local_cuda_device():
    assert communication_device("nccl", 3) == torch.device("cuda", 3)
    assert communication_device("NCCL", 0) == torch.device("cuda", 0)


def test_nccl_without_a_local_device_says_to_set_it():
    with pytest.raises(ValueError, match=r"call torch.cuda.set_device\(LOCAL_RANK\) before the first collective"):
        communication_device("nccl", None)


@pytest.mark.parametrize("backend", ["gloo", "mpi"])
def test_cpu_backends_communicate_on_the_cpu_whatever_the_local_device(backend):
    assert communication_device(backend, None) == torch.device("cpu")
    assert communication_device(backend, 1) == torch.device("cpu")


def test_unknown_backend_is_a_clear_error():
    with pytest.raises(ValueError, match="unknown torch.distributed backend 'ucc'"):
        communication_device("ucc", 0)


def _dist_aliases(tree: ast.Module) -> tuple[set[str], set[str]]:
    """Names bound to a torch.distributed-like module, and collectives imported by name."""
    modules, functions = set(), set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for a in node.names:
                if a.name in DIST_MODULES:
                    modules.add(a.asname or a.name)
        elif isinstance(node, ast.ImportFrom) and node.module:
            for a in node.names:
                if f"{node.module}.{a.name}" in DIST_MODULES:
                    modules.add(a.asname or a.name)
                elif node.module in DIST_MODULES and a.name in COLLECTIVES:
                    functions.add(a.asname or a.name)
    return modules, functions


def _dotted(node: ast.AST) -> str | None:
    if isinstance(node, ast.Name):
        return node.id
    if isinstance(node, ast.Attribute):
        base = _dotted(node.value)
        return f"{base}.{node.attr}" if base else None
    return None


def collective_calls(source: str) -> list[tuple[int, str]]:
    tree = ast.parse(source)
    modules, functions = _dist_aliases(tree)
    found = []
    for node in ast.walk(tree):
        if not isinstance(node, ast.Call):
            continue
        name = _dotted(node.func)
        if name is None:
            continue
        head, _, last = name.rpartition(".")
        if (head in modules or head in DIST_MODULES) and last in COLLECTIVES:
            found.append((node.lineno, name))
        elif not head and last in functions:
            found.append((node.lineno, name))
    return found


def test_the_ast_walk_finds_every_spelling_of_a_collective():
    source = """
import torch
import torch.distributed as dist
import torch.distributed
from torch import distributed as d2
from torch.distributed import all_gather_object as gather_all
from deepspeed import comm
dist.all_reduce(t)
torch.distributed.barrier()
d2.broadcast(t, 0)
gather_all(out, obj)
comm.all_reduce(t)
collectives.all_reduce(t)
self.barrier()
"""
    assert [name for _, name in collective_calls(source)] == [
        "dist.all_reduce", "torch.distributed.barrier", "d2.broadcast", "gather_all", "comm.all_reduce"]


def test_no_collective_is_called_outside_the_collectives_module():
    offenders = []
    for path in sorted(PACKAGE.rglob("*.py")):
        if path == Path(collectives.__file__):
            continue
        for line, name in collective_calls(path.read_text()):
            offenders.append(f"{path.relative_to(PACKAGE.parent)}:{line}: {name}")
    assert not offenders, "call these through ft_framework.distributed.collectives:\n" + "\n".join(offenders)


@pytest.fixture
def one_process_group(monkeypatch):
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.setenv("MASTER_PORT", str(free_port()))
    dist.init_process_group("gloo", rank=0, world_size=1)
    yield
    dist.destroy_process_group()


def test_collectives_on_a_real_group_keep_the_device_and_the_input(one_process_group):
    assert collectives.is_distributed() and collectives.group_device() == torch.device("cpu")
    t = torch.tensor([1.5, -2.0], dtype=torch.float64)
    out = collectives.all_reduce(t, op="max")
    assert torch.equal(out, t) and out is not t and out.dtype == torch.float64
    assert collectives.all_reduce_(t) is t
    assert collectives.all_gather_object({"rank": 0}) == [{"rank": 0}]
    collectives.barrier()
    with pytest.raises(ValueError, match="unknown reduce op 'avg'; valid: sum, max, min"):
        collectives.all_reduce(t, op="avg")
