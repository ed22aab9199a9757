"""Machine-noise harness shared by the benchmark scripts.

The development machine is shared, so a timing is only worth what the machine was doing meanwhile.
This module holds what every benchmark needs for that, and nothing benchmark-specific:

- the machine: CPU name, ISA flags, memory, load average (`machine_lines` for a table header);
- background load: how many cores OTHER processes kept busy while we timed (`BackgroundLoad`,
  from /proc/stat), `wait_for_quiet` before a measurement, and `quiet_rounds` to drop noisy rounds;
- interleaving: `round_order` (candidates reversed every other round) and `paired_times` (all
  candidates alive together, steps interleaved one by one, each step timed on its own);
- statistics: `paired_ratio` (median of per-cycle ratios, or ratio of medians when unpaired);
- output: `fmt_size`, `fmt_bg`, `markdown_table`.

Pure functions (no clock, no /proc) are tested in tests/unit/benchmarks/test_bench_harness.py.
"""

from __future__ import annotations

import os
import platform
import statistics
import sys
import time
from pathlib import Path
from typing import Callable, Sequence

# Rows where other processes kept more than this many cores busy are flagged NOISY.
NOISY_CORES = 0.2
# ISA flags worth naming in a table header (as /proc/cpuinfo spells them).
ISA_FLAGS = ("avx2", "fma", "avx512f", "avx512bw", "avx512_bf16")


def log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


# --------------------------------------------------------------------------------------------------
# Machine
# --------------------------------------------------------------------------------------------------
def _proc_field(path: str, prefix: str) -> str | None:
    try:
        for line in Path(path).read_text().splitlines():
            if line.startswith(prefix):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return None


def cpu_model() -> str:
    return _proc_field("/proc/cpuinfo", "model name") or platform.processor() or "unknown CPU"


def cpu_flags() -> set[str]:
    return set((_proc_field("/proc/cpuinfo", "flags") or "").split())


def isa_of(flags: set[str]) -> list[str]:
    """The ISA_FLAGS present in `flags`, in ISA_FLAGS order."""
    return [f for f in ISA_FLAGS if f in flags]


def mem_total_gib() -> float | None:
    value = _proc_field("/proc/meminfo", "MemTotal")
    return int(value.split()[0]) / 2**20 if value else None


def loadavg() -> str:
    try:
        return " ".join(Path("/proc/loadavg").read_text().split()[:3])
    except OSError:
        return "n/a"


def machine_line() -> str:
    """'machine: <CPU>, N cores, M GiB RAM, ISA: ...' for a table header."""
    mem = mem_total_gib()
    isa = isa_of(cpu_flags())
    return (f"machine: {cpu_model()}, {os.cpu_count()} cores, "
            + (f"{mem:.0f} GiB RAM, " if mem else "") + f"ISA: {' '.join(isa) or 'n/a'}")


# --------------------------------------------------------------------------------------------------
# Background load
# --------------------------------------------------------------------------------------------------
_CLK_TCK = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100


def machine_busy_s() -> float | None:
    """CPU seconds all processes have run (all cores), from /proc/stat; None where unreadable."""
    try:
        f = [int(x) for x in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]]
    except (OSError, ValueError):
        return None
    idle = f[3] + (f[4] if len(f) > 4 else 0)  # idle + iowait
    return (sum(f[:8]) - idle) / _CLK_TCK


def background_cores(machine_busy_delta: float, own_cpu_delta: float, wall_s: float) -> float | None:
    """Cores other processes kept busy: (machine CPU time - our CPU time) / wall time, >= 0.
    None when the window is too short for /proc/stat's 10 ms ticks."""
    if wall_s < 0.25:
        return None
    return max(0.0, (machine_busy_delta - own_cpu_delta) / wall_s)


class BackgroundLoad:
    """Context manager; afterwards `.cores` is how many cores OTHER processes kept busy during the
    block (0 on a quiet machine; None where /proc/stat is unreadable or the block was too short)."""

    cores: float | None = None

    def __enter__(self):
        self.t0, self.busy0, self.own0 = time.perf_counter(), machine_busy_s(), time.process_time()
        return self

    def __exit__(self, *exc):
        wall = time.perf_counter() - self.t0
        busy1 = machine_busy_s()
        if self.busy0 is None or busy1 is None:
            self.cores = None
        else:
            self.cores = background_cores(busy1 - self.busy0, time.process_time() - self.own0, wall)
        return False


def wait_for_quiet(threshold: float, max_wait_s: float) -> float | None:
    """Sleeps until other processes use < `threshold` cores (sampled over 1 s), at most max_wait_s.
    Returns the last sample."""
    deadline = time.perf_counter() + max_wait_s
    announced = False
    while True:
        with BackgroundLoad() as bg:
            time.sleep(1.0)
        if bg.cores is None or bg.cores < threshold or time.perf_counter() >= deadline:
            if announced:
                log(f"    (background load now {'n/a' if bg.cores is None else f'{bg.cores:.2f}'} cores)")
            return bg.cores
        if not announced:
            log(f"    waiting for a quiet machine: other processes use {bg.cores:.2f} cores "
                f"(threshold {threshold:g}, up to {max_wait_s:.0f} s) ...")
            announced = True


def quiet_rounds(backgrounds: Sequence[float | None], threshold: float = NOISY_CORES) -> list[int]:
    """Indices of the rounds to keep: those at or below `threshold` background cores (an unknown
    load counts as quiet); every round when none is quiet."""
    quiet = [i for i, b in enumerate(backgrounds) if b is None or b <= threshold]
    return quiet or list(range(len(backgrounds)))


# --------------------------------------------------------------------------------------------------
# Threads
# --------------------------------------------------------------------------------------------------
def openmp_runtimes() -> list[tuple[str, int]] | None:
    """(library path, num_threads) of every OpenMP runtime loaded in this process, or None."""
    try:
        import threadpoolctl
    except ImportError:
        return None
    return [(d["filepath"], d["num_threads"]) for d in threadpoolctl.threadpool_info()
            if d.get("user_api") == "openmp"]


def set_threads(n: int) -> str:
    """torch.set_num_threads(n) (which also calls omp_set_num_threads) and a check that every loaded
    OpenMP runtime now reports n threads. Returns a one-line verdict."""
    import torch

    torch.set_num_threads(n)
    runtimes = openmp_runtimes()
    if runtimes is None:
        return f"torch threads {torch.get_num_threads()}; OpenMP not verifiable (threadpoolctl missing)"
    wrong = [(path, k) for path, k in runtimes if k != n]
    libs = ", ".join(f"{Path(p).name} ({Path(p).parent.parent.name}) = {k}" for p, k in runtimes)
    if wrong:
        return f"WARNING: OpenMP runtimes not at {n} threads: {libs}"
    return f"{len(runtimes)} OpenMP runtime(s) at {n} thread(s): {libs}"


# --------------------------------------------------------------------------------------------------
# Interleaving and timing
# --------------------------------------------------------------------------------------------------
def round_order(names: Sequence[str], round_index: int) -> list[str]:
    """Candidates in order on even rounds, reversed on odd ones, so slow drifts of the machine's
    bandwidth hit all candidates alike."""
    return list(names) if round_index % 2 == 0 else list(names)[::-1]


def cycle_order(n: int, cycle: int) -> list[int]:
    """Indices 0..n-1 rotated by `cycle` (A B C, B C A, C A B, ...): in a paired run no candidate
    always goes first."""
    if n == 0:
        return []
    k = cycle % n
    return list(range(k, n)) + list(range(k))


def paired_times(fns: Sequence[Callable[[], None]], steps: int, warmup: int, min_timed_s: float = 0.0,
                 sync: Callable[[], None] = lambda: None, lead_in: int = 0) -> tuple[list[list[float]], float | None]:
    """Runs every function `warmup` times, then interleaves them one call at a time for at least
    `steps` cycles (and `min_timed_s` seconds), timing each call on its own (`sync` before and after,
    e.g. torch.cuda.synchronize). Returns the per-function times (cycle i of every list measured in
    the same cycle) and the background load over the timed cycles.

    `lead_in`: untimed calls of the same function right before each timed call, so that each is
    timed after itself, as in a training run, and not after the previous candidate (whose writes
    the next call otherwise pays for: benchmarks/offload_overlap.py measured 1-1.3 ms of a
    40 ms iteration)."""
    times: list[list[float]] = [[] for _ in fns]
    for _ in range(max(1, warmup)):
        for f in fns:
            f()
    with BackgroundLoad() as bg:
        t_begin = time.perf_counter()
        cycle = 0
        while cycle < steps or time.perf_counter() - t_begin < min_timed_s:
            for i in cycle_order(len(fns), cycle):
                for _ in range(lead_in):
                    fns[i]()
                sync()
                t0 = time.perf_counter()
                fns[i]()
                sync()
                times[i].append(time.perf_counter() - t0)
            cycle += 1
    return times, bg.cores


# --------------------------------------------------------------------------------------------------
# Statistics and output
# --------------------------------------------------------------------------------------------------
def paired_ratio(a: Sequence[float], b: Sequence[float], paired: bool = True) -> float:
    """a's time / b's time. Paired (same number of samples, sample i of both taken in the same
    cycle): the median of the per-cycle ratios, so machine drift between cycles cancels.
    Otherwise: median(a) / median(b)."""
    if not a or not b:
        raise ValueError("paired_ratio needs samples on both sides")
    if paired and len(a) == len(b):
        return statistics.median(x / y for x, y in zip(a, b))
    return statistics.median(a) / statistics.median(b)


def fmt_bg(x: float | None, threshold: float = NOISY_CORES) -> str:
    if x is None:
        return "n/a"
    return f"{x:.2f}" + (" NOISY" if x > threshold else "")


def fmt_size(n: int) -> str:
    """1000000 -> '1M', 50000000 -> '50M', 1500 -> '1.5k'."""
    for unit, div in (("G", 10**9), ("M", 10**6), ("k", 10**3)):
        if n >= div:
            v = n / div
            return f"{v:g}{unit}" if v == int(v) else f"{v:.3g}{unit}"
    return str(n)


def markdown_table(header: Sequence[str], rows: Sequence[Sequence[object]]) -> str:
    """A GitHub markdown table (also readable as plain text). Every row must have len(header) cells."""
    for r in rows:
        if len(r) != len(header):
            raise ValueError(f"row has {len(r)} cells, header has {len(header)}: {list(r)}")
    lines = ["| " + " | ".join(str(h) for h in header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(str(c) for c in r) + " |" for r in rows]
    return "\n".join(lines)
