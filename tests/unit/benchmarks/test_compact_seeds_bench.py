"""The verdict of benchmarks/compact_seeds.py (the three-seed table in docs/optimizers.md): the
compact runs' mean against the fp32 runs' seed-to-seed standard deviation."""

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[3] / "benchmarks"))
import compact_seeds  # noqa: E402


def test_a_gap_below_the_fp32_std_is_within():
    # fp32 0.5, 0.6, 0.7: mean 0.6, sample std 0.1; compact mean 0.65, same-seed gaps 0.1, 0.0, 0.05.
    c = compact_seeds.compare([0.5, 0.6, 0.7], [0.6, 0.6, 0.75])
    assert c["fp32_mean"] == pytest.approx(0.6) and c["fp32_std"] == pytest.approx(0.1)
    assert c["compact_mean"] == pytest.approx(0.65) and c["mean_gap"] == pytest.approx(0.05)
    assert c["paired_gap"] == pytest.approx(0.05)
    assert c["within"]


def test_a_gap_above_the_fp32_std_is_outside():
    # fp32 std 0.1, compact mean 0.8: a gap of 0.2.
    c = compact_seeds.compare([0.5, 0.6, 0.7], [0.8, 0.8, 0.8])
    assert c["mean_gap"] == pytest.approx(0.2) and not c["within"]


def test_unpaired_or_single_seed_values_are_refused():
    with pytest.raises(ValueError, match="same number"):
        compact_seeds.compare([0.5, 0.6], [0.5])
    with pytest.raises(ValueError, match="at least 2"):
        compact_seeds.compare([0.5], [0.5])
