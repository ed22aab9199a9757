"""Runs tests again and again beside busy loops, and counts how often each fails: the failure rate of a
multi-process test on a loaded machine, where races between processes show (docs/benchmarks.md,
"Multi-process tests under load").

    python benchmarks/stress_races.py --runs 20 --busy 2 tests/multinode/test_multinode_failures.py::test_ranks...

Each run is one pytest process over the given tests (no xdist: the busy loops are the load); the
loops are plain Python processes spinning on a core each, started before the first run and killed at
the end. Prints one row per test: runs, failures, the failure rate, and the slowest and median time;
the first lines of each failure's message go to --log (default stress_races.log).
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time
import xml.etree.ElementTree as ET
from pathlib import Path

from harness import cpu_flags, cpu_model, isa_of

REPO = Path(__file__).resolve().parents[1]
BUSY_LOOP = "while True:\n    pass\n"


def one_run(tests: list[str], junit: Path, timeout: float) -> dict[str, tuple[bool, float, str]]:
    """{test id: (passed, seconds, message)} of one pytest process over `tests`."""
    cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-p", "no:xdist", f"--junitxml={junit}",
           *tests]
    try:
        subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        return {test: (False, timeout, f"the pytest run passed its {timeout:g} s timeout") for test in tests}
    if not junit.is_file():
        return {test: (False, 0.0, "pytest wrote no report") for test in tests}
    out = {}
    for case in ET.parse(junit).getroot().iter("testcase"):
        name = f"{case.get('classname', '').replace('.', '/')}.py::{case.get('name')}"
        failure = case.find("failure")
        if failure is None:
            failure = case.find("error")
        skipped = case.find("skipped") is not None
        message = "" if failure is None else (failure.get("message") or failure.text or "")[:500]
        out[name] = (failure is None and not skipped, float(case.get("time", 0.0)),
                     "skipped" if skipped else message)
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("tests", nargs="+", help="pytest node ids or files")
    parser.add_argument("--runs", type=int, default=20)
    parser.add_argument("--busy", type=int, default=2, help="busy loops beside the tests (one core each)")
    parser.add_argument("--timeout", type=float, default=900.0, help="seconds one pytest run may take")
    parser.add_argument("--log", type=Path, default=Path("stress_races.log"))
    args = parser.parse_args(argv)
    if args.runs < 1 or args.busy < 0:
        parser.error("--runs must be at least 1 and --busy at least 0")
    loops = [subprocess.Popen([sys.executable, "-c", BUSY_LOOP]) for _ in range(args.busy)]
    results: dict[str, list[tuple[bool, float, str]]] = {}
    started = time.monotonic()
    try:
        with tempfile.TemporaryDirectory() as tmp, open(args.log, "w") as log:
            for run in range(1, args.runs + 1):
                for test, outcome in one_run(args.tests, Path(tmp) / f"run{run}.xml", args.timeout).items():
                    results.setdefault(test, []).append(outcome)
                    if not outcome[0] and outcome[2] != "skipped":
                        log.write(f"run {run}: {test}: {outcome[2]}\n\n")
                        log.flush()
                failed = sum(not o[0] for outcomes in results.values() for o in outcomes)
                print(f"run {run}/{args.runs}: {time.monotonic() - started:.0f} s, failures so far: {failed}",
                      file=sys.stderr, flush=True)
    finally:
        for loop in loops:
            loop.kill()
            loop.wait()
    print(f"{cpu_model()} ({', '.join(isa_of(cpu_flags())) or 'no AVX2'}), {os.cpu_count()} cores, {args.busy} busy loops beside the tests, "
          f"{args.runs} runs, {time.monotonic() - started:.0f} s in all")
    print("| test | runs | failed | rate | median s | slowest s |")
    print("|---|---|---|---|---|---|")
    for test, outcomes in sorted(results.items()):
        ran = [o for o in outcomes if o[2] != "skipped"]
        failed = sum(not o[0] for o in ran)
        times = [o[1] for o in ran] or [0.0]
        print(f"| {test} | {len(ran)} | {failed} | {failed / max(1, len(ran)):.0%} | {statistics.median(times):.1f} | "
              f"{max(times):.1f} |")
    return 0 if all(o[0] or o[2] == "skipped" for outcomes in results.values() for o in outcomes) else 1


if __name__ == "__main__":
    raise SystemExit(main())
