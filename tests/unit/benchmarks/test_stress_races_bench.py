"""benchmarks/stress_races.py counts each test's failures over its runs and says which failed."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[3]


def test_the_table_counts_each_tests_failures_over_the_runs(tmp_path):
    tests = tmp_path / "test_sample.py"
    tests.write_text("def test_passes():\n    pass\n\n\ndef test_always_fails():\n    assert False, 'planted failure'\n")
    log = tmp_path / "stress.log"
    proc = subprocess.run([sys.executable, str(REPO / "benchmarks" / "stress_races.py"), "--runs", "2", "--busy", "1",
                           "--log", str(log), str(tests)], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 1, proc.stdout + proc.stderr  # a test failed
    rows = {line.split(" | ")[0].strip("| "): line.split(" | ")[1:4] for line in proc.stdout.splitlines()
            if line.startswith("| ") and "::" in line}
    [passes] = [v for k, v in rows.items() if k.endswith("::test_passes")]
    [always] = [v for k, v in rows.items() if k.endswith("::test_always_fails")]
    assert passes == ["2", "0", "0%"] and always == ["2", "2", "100%"], proc.stdout
    assert log.read_text().count("planted failure") == 2
    assert "1 busy loops beside the tests, 2 runs" in proc.stdout
