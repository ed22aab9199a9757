"""A real two-node SLURM cluster on this host for the tests of this folder: scripts/slurm_cluster.sh
brings it up once per test session (under the session's temporary directory, on free ports) and
down at the end. Where the daemons cannot start (SLURM not installed, not root, a daemon failing),
every test that needs the cluster skips with the reason."""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
SCRIPT = REPO / "scripts" / "slurm_cluster.sh"


def _why_no_cluster() -> str | None:
    missing = [b for b in ("munged", "slurmctld", "slurmd", "sbatch", "srun", "squeue", "scancel")
               if shutil.which(b) is None and not Path("/usr/sbin", b).exists()]
    if missing:
        return (f"SLURM is not installed ({', '.join(missing)} missing): bash scripts/install.sh --test as root "
                "installs slurm-wlm and munge")
    if os.geteuid() != 0:
        return "the SLURM daemons need root (slurmd starts the jobs' processes)"
    return None


@pytest.fixture(scope="session")
def slurm_cluster(tmp_path_factory):
    """SLURM_CONF of the running cluster (also set in os.environ for the session's subprocesses)."""
    reason = _why_no_cluster()
    if reason:
        pytest.skip(reason)
    directory = tmp_path_factory.mktemp("slurm_cluster")
    env = {**os.environ, "FT_SLURM_DIR": str(directory)}
    up = subprocess.run(["bash", str(SCRIPT), "up"], env=env, capture_output=True, text=True, timeout=120)
    if up.returncode != 0:
        subprocess.run(["bash", str(SCRIPT), "down"], env=env, capture_output=True, timeout=120)
        lines = (up.stderr or up.stdout).strip().splitlines()
        pytest.skip(f"the SLURM daemons did not start: {' | '.join(lines[-3:])}")
    conf = str(directory / "slurm.conf")
    previous = os.environ.get("SLURM_CONF")
    os.environ["SLURM_CONF"] = conf
    try:
        yield conf
    finally:
        if previous is None:
            os.environ.pop("SLURM_CONF", None)
        else:
            os.environ["SLURM_CONF"] = previous
        subprocess.run(["bash", str(SCRIPT), "down"], env=env, capture_output=True, timeout=120)
