"""The pure parts of benchmarks/harness.py: paired-ratio statistics, noisy-round selection,
interleaving orders and table formatting."""

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[3] / "benchmarks"))
import harness  # noqa: E402


def test_paired_ratio_is_the_median_of_per_cycle_ratios():
    a, b = [1.0, 10.0, 3.0], [2.0, 5.0, 1.0]        # per cycle: 0.5, 2, 3
    assert harness.paired_ratio(a, b) == 2.0
    # Unpaired: ratio of the medians, 3 / 2.
    assert harness.paired_ratio(a, b, paired=False) == 1.5


def test_paired_ratio_cancels_drift_between_cycles():
    # The machine slows down 4x over the run; a is always 10 % slower than b in the same cycle.
    b = [1.0, 2.0, 4.0, 4.0, 4.0]
    a = [1.1 * x for x in b]
    assert harness.paired_ratio(a, b) == pytest.approx(1.1)
    # Sequential timing (a measured while the machine was slow, b while fast) cannot see it.
    assert harness.paired_ratio([4.4] * 5, [1.0] * 5, paired=False) == pytest.approx(4.4)


def test_paired_ratio_falls_back_to_medians_when_lengths_differ_and_refuses_empty():
    assert harness.paired_ratio([2.0, 4.0, 6.0], [1.0, 3.0]) == pytest.approx(4.0 / 2.0)
    with pytest.raises(ValueError):
        harness.paired_ratio([], [1.0])


def test_quiet_rounds_drops_noisy_rounds_unless_all_are_noisy():
    assert harness.quiet_rounds([0.5, 0.1, None, 0.2, 0.21]) == [1, 2, 3]
    assert harness.quiet_rounds([0.5, 0.9]) == [0, 1]
    assert harness.quiet_rounds([0.5, 0.3], threshold=0.4) == [1]


def test_background_cores():
    # 3 s of machine CPU time, 1 s of it ours, over 2 s of wall time: 1 other core busy.
    assert harness.background_cores(3.0, 1.0, 2.0) == pytest.approx(1.0)
    assert harness.background_cores(0.9, 1.0, 2.0) == 0.0   # tick rounding never goes negative
    assert harness.background_cores(3.0, 1.0, 0.1) is None  # too short for 10 ms ticks


def test_interleaving_orders():
    assert harness.round_order(["a", "b", "c"], 0) == ["a", "b", "c"]
    assert harness.round_order(["a", "b", "c"], 1) == ["c", "b", "a"]
    assert [harness.cycle_order(3, c) for c in range(4)] == [[0, 1, 2], [1, 2, 0], [2, 0, 1], [0, 1, 2]]
    assert harness.cycle_order(0, 5) == []


def test_paired_times_interleaves_and_aligns_cycles():
    calls = []
    fns = [lambda i=i: calls.append(i) for i in range(3)]
    times, _ = harness.paired_times(fns, steps=4, warmup=2)
    assert [len(t) for t in times] == [4, 4, 4]
    assert calls[:6] == [0, 1, 2, 0, 1, 2]                 # warm-up, in order
    assert calls[6:] == [0, 1, 2, 1, 2, 0, 2, 0, 1, 0, 1, 2]  # rotated every cycle
    assert all(t >= 0 for ts in times for t in ts)


def test_paired_times_lead_in_times_each_call_after_itself():
    calls = []

    def make(i):
        def f():
            calls.append(i)
        return f

    fns = [make(i) for i in range(2)]
    times, _ = harness.paired_times(fns, steps=2, warmup=1, lead_in=1)
    assert calls == [0, 1, 0, 0, 1, 1, 1, 1, 0, 0]  # warm-up; then each timed call after itself
    assert [len(t) for t in times] == [2, 2]


def test_size_and_load_formatting():
    assert [harness.fmt_size(n) for n in (999, 1500, 10**6, 5 * 10**7, 2 * 10**8, 1_230_000_000)] == \
        ["999", "1.5k", "1M", "50M", "200M", "1.23G"]
    assert harness.fmt_bg(None) == "n/a"
    assert harness.fmt_bg(0.2) == "0.20"
    assert harness.fmt_bg(0.25) == "0.25 NOISY"


def test_markdown_table():
    assert harness.markdown_table(["params", "ms"], [["1M", 0.5], ["50M", "27.1"]]) == (
        "| params | ms |\n"
        "|---|---|\n"
        "| 1M | 0.5 |\n"
        "| 50M | 27.1 |")
    with pytest.raises(ValueError, match="2 cells, header has 3"):
        harness.markdown_table(["a", "b", "c"], [["x", "y"]])


def test_isa_of_keeps_header_order():
    assert harness.isa_of({"avx512f", "sse2", "fma", "avx2"}) == ["avx2", "fma", "avx512f"]
    assert harness.isa_of(set()) == []
