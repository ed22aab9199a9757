"""benchmarks/offload_overlap.py runs end to end on a tiny model (the numbers in
docs/benchmarks.md come from it) and refuses a malformed --shape."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[3]
SCRIPT = REPO / "benchmarks" / "offload_overlap.py"


def _run(*args):
    env = dict(os.environ, OMP_NUM_THREADS="1")
    return subprocess.run([sys.executable, str(SCRIPT), *args], capture_output=True, text=True, env=env,
                          timeout=300)


@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="the benchmark pins the training thread and "
                    "the worker to two cores; this machine gives the process one")
@pytest.mark.slow
def test_tiny_run_prints_one_row_per_shape():
    out = _run("--shape", "2x32:4", "--shape", "3x16:2", "--steps", "2", "--warmup", "1", "--quiet-wait", "0",
               "--max-grad-norm", "1e-6")
    assert out.returncode == 0, out.stderr[-2000:]
    rows = [line for line in out.stdout.splitlines() if line.startswith("| 2 x 32²") or line.startswith("| 3 x 16²")]
    assert len(rows) == 2, out.stdout
    cells = [c.strip() for c in rows[0].strip("|").split("|")]
    assert cells[1] == "4" and float(cells[7].strip("*")) > 0
    # Clipping fires on every step: the first speculates and rolls back, the rest do not speculate.
    assert cells[8] == "1 / 5"  # iterations: 1 warm-up + 2 cycles x (1 lead-in + 1 timed)
    assert "lead-in 1" in out.stdout


def test_malformed_shape_is_refused():
    out = _run("--shape", "16by1024")
    assert out.returncode == 2 and "expected LAYERSxWIDTH:BATCH" in out.stderr
