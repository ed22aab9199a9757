"""A training process started by SLURM's ``srun`` (one task per process, no torchrun): its rank,
world size and local rank from SLURM's environment, and where rank 0 hosts the rendezvous.

    srun -N2 --ntasks-per-node=1 ft-train --config run.yaml strategy.name=ddp

``SLURM_PROCID``, ``SLURM_NTASKS`` and ``SLURM_LOCALID`` give RANK, WORLD_SIZE and LOCAL_RANK; the
rendezvous is the first host of the step's node list (``SLURM_STEP_NODELIST``, else
``SLURM_JOB_NODELIST``), expanded as ``scontrol show hostnames`` does, on a port derived from the
job id (``MASTER_PORT`` set by the user wins, as does ``MASTER_ADDR``). Only a process of an
``srun`` step is a SLURM task: the batch script itself has SLURM_PROCID=0 but no SLURM_STEP_ID, and
a process a launcher already described (RANK set: torchrun, deepspeed) is left as it is.
"""

from __future__ import annotations

import os
import re
from typing import Mapping

from ft_framework.errors import UserError

__all__ = ["expand_hostlist", "slurm_launch_env", "slurm_job_record", "adopt_slurm_launch", "port_for_job", "PORT_BASE", "PORT_SPAN",
           "check_step_tasks"]

# The rendezvous port of job J: PORT_BASE + J mod PORT_SPAN, below Linux's ephemeral range (32768+),
# so two jobs sharing a node differ unless their ids are PORT_SPAN apart.
PORT_BASE = 12000
PORT_SPAN = 20000

_RANGE = re.compile(r"^(\d+)(?:-(\d+))?$")


def _split_top_level(text: str) -> list[str]:
    """`text` split at the commas outside brackets."""
    items, depth, start = [], 0, 0
    for i, ch in enumerate(text):
        if ch == "[":
            depth += 1
            if depth > 1:
                raise ValueError(f"nested '[' in host list {text!r}")
        elif ch == "]":
            depth -= 1
            if depth < 0:
                raise ValueError(f"unmatched ']' in host list {text!r}")
        elif ch == "," and depth == 0:
            items.append(text[start:i])
            start = i + 1
    if depth:
        raise ValueError(f"unmatched '[' in host list {text!r}")
    items.append(text[start:])
    return [item.strip() for item in items if item.strip()]


def _expand_ranges(body: str, whole: str) -> list[str]:
    """The numbers a bracket's body names (`1-3,05`), zero-padded to each range's first bound."""
    out: list[str] = []
    for part in body.split(","):
        m = _RANGE.match(part.strip())
        if not m:
            raise ValueError(f"bad range {part!r} in host list {whole!r}; valid: N or N-M")
        lo, hi = m.group(1), m.group(2) if m.group(2) is not None else m.group(1)
        if int(hi) < int(lo):
            raise ValueError(f"range {part!r} in host list {whole!r} runs backwards")
        width = len(lo)
        out.extend(f"{n:0{width}d}" for n in range(int(lo), int(hi) + 1))
    return out


def expand_hostlist(text: str) -> list[str]:
    """SLURM's compressed host list (``n[1-3,5],gpu-a[01-02]``) as the host names, in order, as
    ``scontrol show hostnames`` prints them (several bracket groups in one name multiply out,
    the rightmost varying fastest)."""
    hosts: list[str] = []
    for item in _split_top_level(text):
        names = [""]
        for literal, body in re.findall(r"([^\[]*)(?:\[([^\]]*)\])?", item):
            pieces = [literal + n for n in _expand_ranges(body, text)] if body else [literal]
            names = [prefix + piece for prefix in names for piece in pieces]
        hosts.extend(names)
    return hosts


def port_for_job(job_id: str | int) -> int:
    """The rendezvous port of a SLURM job (see PORT_BASE)."""
    try:
        number = int(str(job_id).split("_")[0])
    except ValueError:
        raise UserError(f"SLURM_JOB_ID={job_id!r} is not a job number; set MASTER_PORT to the rendezvous port") from None
    return PORT_BASE + number % PORT_SPAN


def slurm_launch_env(env: Mapping[str, str]) -> dict[str, str] | None:
    """The launcher variables (RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR, MASTER_PORT) of an srun task,
    or None when `env` is not one (no srun step, or a launcher already set RANK)."""
    if "RANK" in env or "SLURM_STEP_ID" not in env or "SLURM_PROCID" not in env:
        return None
    missing = [k for k in ("SLURM_NTASKS", "SLURM_LOCALID", "SLURM_JOB_ID") if not env.get(k)]
    if missing:
        raise UserError(f"srun started this process but {missing[0]} is not set: SLURM's task environment is "
                        "incomplete; set RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR and MASTER_PORT yourself")
    addr = env.get("MASTER_ADDR")
    if not addr:
        nodelist = env.get("SLURM_STEP_NODELIST") or env.get("SLURM_JOB_NODELIST")
        if not nodelist:
            raise UserError("srun started this process but neither SLURM_STEP_NODELIST nor SLURM_JOB_NODELIST is set; "
                            "set MASTER_ADDR to the host of rank 0")
        try:
            hosts = expand_hostlist(nodelist)
        except ValueError as e:
            raise UserError(f"cannot read SLURM's node list: {e}; set MASTER_ADDR to the host of rank 0") from None
        if not hosts:
            raise UserError(f"SLURM's node list {nodelist!r} names no host; set MASTER_ADDR to the host of rank 0")
        addr = hosts[0]
    port = env.get("MASTER_PORT") or str(port_for_job(env["SLURM_JOB_ID"]))
    return {"RANK": env["SLURM_PROCID"], "WORLD_SIZE": env["SLURM_NTASKS"], "LOCAL_RANK": env["SLURM_LOCALID"],
            "MASTER_ADDR": addr, "MASTER_PORT": port}


def check_step_tasks(env: Mapping[str, str], *, distributed: bool) -> None:
    """Refuses (one line) a task of an srun step of several tasks (no launcher) whose run is not
    distributed: each task would train the same run alone, a second writer of one output directory.
    Under a distributed strategy the step's tasks are its ranks (slurm_launch_env); with one task,
    or a launcher's RANK set, there is nothing to refuse."""
    if distributed or "RANK" in env or "SLURM_STEP_ID" not in env or "SLURM_PROCID" not in env:
        return
    name = "SLURM_STEP_NUM_TASKS" if env.get("SLURM_STEP_NUM_TASKS") else "SLURM_NTASKS"
    try:
        tasks = int(env.get(name) or 1)
    except ValueError:
        raise UserError(f"srun started this process but {name}={env.get(name)!r} is not a number of tasks") from None
    if tasks > 1:
        raise UserError(f"this process is task {env['SLURM_PROCID']} of an srun step of {tasks} tasks ({name}), but "
                        "strategy.name is single: every task would train the same run, each one more writer of its "
                        "output; use a distributed strategy (strategy.name: ddp, fsdp or deepspeed: the step's tasks "
                        "are its ranks), or start one task (srun -n1)")


def adopt_slurm_launch() -> bool:
    """Under srun without a launcher: sets RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR and MASTER_PORT in
    this process's environment from SLURM's (everything downstream then reads them as torchrun's).
    Returns True when it did."""
    launch = slurm_launch_env(os.environ)
    if launch is None:
        return False
    os.environ.update(launch)
    return True


def slurm_job_record(env: Mapping[str, str]) -> dict[str, object] | None:
    """What results.json records of the SLURM job that ran the run (None outside SLURM): its id, and
    SLURM_RESTART_COUNT, how often SLURM started the job again (a requeue) before this attempt."""
    job_id = env.get("SLURM_JOB_ID")
    if not job_id:
        return None
    try:
        restarts = int(env.get("SLURM_RESTART_COUNT") or 0)
    except ValueError:
        restarts = 0
    return {"job_id": job_id, "restart_count": restarts}
