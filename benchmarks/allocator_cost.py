"""The host allocator policy's cost: the quickstart (`ft-train --config configs/quickstart.yaml`)
under two settings of `training.host_allocator`, each run a fresh process, in pairs whose order
alternates (A B, B A, ...), so that a drift of the shared machine's load hits both alike.

    python benchmarks/allocator_cost.py --pairs 4                       # predictable against glibc
    python benchmarks/allocator_cost.py --pairs 4 --concurrent          # each pair's two runs at once
    python benchmarks/allocator_cost.py --pairs 4 --candidates predictable glibc
    python benchmarks/allocator_cost.py --pairs 2 --candidates predictable@131072 predictable@4194304

A candidate is a `training.host_allocator` value; `predictable@BYTES` runs the predictable policy
with another mmap threshold (run/allocator.MMAP_THRESHOLD_BYTES set in the child before ft-train
starts: for choosing the threshold, not for a run). Each run: `cli.train_main` (what ft-train runs)
in a child process, its own output directory; measured from outside: wall seconds, the child's user
and system CPU seconds and its peak resident set (wait4's rusage), and how many cores the other
processes of the machine kept busy meanwhile. The ratio is the median over the pairs of the first
candidate's wall time over the second's (benchmarks/harness.paired_ratio).

--concurrent: each pair's two runs start together and run side by side. On a machine whose other
users come and go (a shared one: the load average of 2 cores at 8 to 12), one run after the other
meets another load each time, and a pair's wall times differed by 1.6x at equal CPU time; side by
side, both meet the same load at every moment, and the scheduler shares the cores between them.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "benchmarks"))

from harness import loadavg, machine_busy_s, machine_line, markdown_table, paired_ratio  # noqa: E402

CONFIG = "configs/quickstart.yaml"


def child(candidate: str, output_dir: str) -> int:
    """ft-train's work in this process: the quickstart with `candidate`'s allocator policy."""
    policy, _, threshold = candidate.partition("@")
    if threshold:
        from ft_framework.run import allocator

        allocator.MMAP_THRESHOLD_BYTES = int(threshold)
    from ft_framework import cli

    return cli.train_main(["--config", CONFIG, f"training.host_allocator={policy}",
                           f"logging.output_dir={output_dir}", "logging.progress_bar=false"])


def run_together(candidates: list[str], tmp: Path, index: int) -> list[dict]:
    """The quickstart of each candidate in a fresh process, all started at once: per run its wall,
    user and sys seconds, peak RSS, and the cores the machine's other processes kept busy."""
    busy0, start = machine_busy_s(), time.perf_counter()
    processes = [subprocess.Popen([sys.executable, __file__, "--child", candidate, str(tmp / f"run{index + i}")],
                                  cwd=REPO, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
                 for i, candidate in enumerate(candidates)]
    ended = {}
    while len(ended) < len(processes):
        pid, status, usage = os.wait4(-1, 0)
        ended[pid] = (time.perf_counter() - start, status, usage)
    busy1 = machine_busy_s()
    wall_all = max(wall for wall, _, _ in ended.values())
    ours = sum(u.ru_utime + u.ru_stime for _, _, u in ended.values())
    background = None if busy0 is None or busy1 is None else max(0.0, (busy1 - busy0 - ours) / wall_all)
    runs = []
    for candidate, process in zip(candidates, processes):
        wall, status, usage = ended[process.pid]
        if os.waitstatus_to_exitcode(status) != 0:
            raise SystemExit(f"the quickstart with {candidate} exited {os.waitstatus_to_exitcode(status)}")
        runs.append({"candidate": candidate, "wall": wall, "user": usage.ru_utime, "sys": usage.ru_stime,
                     "peak_rss": usage.ru_maxrss * 1024, "background": background})
    return runs


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--pairs", type=int, default=4, help="pairs of runs (default 4)")
    parser.add_argument("--candidates", nargs=2, default=["predictable", "glibc"], metavar=("A", "B"),
                        help="two training.host_allocator values (or predictable@BYTES); the ratio is A / B")
    parser.add_argument("--concurrent", action="store_true", help="each pair's two runs side by side")
    parser.add_argument("--child", nargs=2, metavar=("CANDIDATE", "OUTPUT_DIR"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        raise SystemExit(child(*args.child))
    print(machine_line())
    print(f"load average before: {loadavg()}; pairs: {'side by side' if args.concurrent else 'one run after the other'}")
    a, b = args.candidates
    runs: list[dict] = []
    with tempfile.TemporaryDirectory() as tmp:
        for pair in range(args.pairs):
            order = [a, b] if pair % 2 == 0 else [b, a]
            batches = [order] if args.concurrent else [[c] for c in order]
            for batch in batches:
                for run in run_together(batch, Path(tmp), len(runs)):
                    run["pair"] = pair + 1
                    runs.append(run)
                    print(f"pair {run['pair']} {run['candidate']}: {run['wall']:.1f} s wall, {run['user']:.1f} "
                          f"user, {run['sys']:.1f} sys, peak RSS {run['peak_rss'] / 2**20:.0f} MiB, background "
                          f"{run['background']:.2f} cores", file=sys.stderr, flush=True)
    print(f"load average after: {loadavg()}")
    print()
    rows = [[r["pair"], r["candidate"], f"{r['wall']:.1f}", f"{r['user']:.1f}", f"{r['sys']:.1f}",
             f"{r['peak_rss'] / 2**20:.0f}", "n/a" if r["background"] is None else f"{r['background']:.2f}"]
            for r in runs]
    print(markdown_table(["pair", "host_allocator", "wall s", "user s", "sys s", "peak RSS MiB",
                          "other processes (cores)"], rows))
    of = {c: [r for r in runs if r["candidate"] == c] for c in (a, b)}
    print()
    summary = []
    for c in (a, b):
        summary.append([c] + [f"{statistics.median(r[k] for r in of[c]):.1f}" for k in ("wall", "user", "sys")]
                       + [f"{statistics.median(r['peak_rss'] for r in of[c]) / 2**20:.0f}"])
    print(markdown_table(["host_allocator", "median wall s", "median user s", "median sys s", "median peak RSS MiB"],
                         summary))
    ratio = paired_ratio([r["wall"] for r in of[a]], [r["wall"] for r in of[b]])
    cpu_ratio = paired_ratio([r["user"] + r["sys"] for r in of[a]], [r["user"] + r["sys"] for r in of[b]])
    print(f"\n{a} / {b}: wall {ratio:.3f} (median of {args.pairs} paired ratios; target <= 1.03), "
          f"CPU time {cpu_ratio:.3f}")


if __name__ == "__main__":
    main()
