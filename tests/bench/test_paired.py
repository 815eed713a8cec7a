"""bench/paired.py: the paired-window estimate of one save's cost that make bench-checkpoint prints."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))

from paired import paired_overhead, saving_window  # noqa: E402


def test_a_save_adding_a_fixed_time_is_found_despite_a_drifting_machine():
    # 10-step windows of 0.1 s steps on a machine slowing down by 1 % a window; each saving
    # window (odd k) holds one save costing 0.05 s. A save every 50 steps: 0.05 / 5 s = 1 %.
    seconds = []
    for k in range(2 + 2 * 20):
        base = 1.0 * (1 + 0.01 * k)
        seconds.append(base + (0.05 if saving_window(k) else 0.0))
    st = paired_overhead(seconds, first=2, window=10, save_every=50)
    # Each pair also carries one window of drift (0.01 s): the reason the benchmark's windows are
    # short (a second), so that the drift between two of them is small.
    assert st["step_s"] == pytest.approx(sum(seconds[2::2]) / 20 / 10)
    assert st["overhead_pct"] == pytest.approx((0.05 + 0.01) / (50 * st["step_s"]) * 100)
    assert 0.9 < st["overhead_pct"] < 1.1
    assert st["overhead_pct_median"] == pytest.approx(st["overhead_pct"])
    assert st["overhead_pct_ci95"] == pytest.approx(0.0, abs=1e-9)  # every pair differs by the same
    assert st["blocked_pct"] is None and len(st["extra_s"]) == 20


def test_noise_without_saves_averages_to_zero_and_blocking_is_per_save():
    seconds = [1.0, 1.0] + [1.0, 1.02, 1.02, 1.0] * 10  # pairs: +0.02, -0.02
    blocking = [0.0, 0.3] + [0.0, 0.01] * 20
    st = paired_overhead(seconds, first=2, window=10, save_every=50, blocking=blocking)
    assert st["overhead_pct"] == pytest.approx(0.0, abs=1e-9)
    assert st["overhead_pct_ci95"] > 0
    assert st["blocking_s"] == [0.01] * 20  # the warm-up's 0.3 s first save is left out
    assert st["blocked_pct"] == pytest.approx(0.01 / (50 * st["step_s"]) * 100)


@pytest.mark.parametrize("seconds, first, match", [
    ([1.0] * 8, 1, "first must be even"),
    ([1.0] * 5, 2, "at least two whole pairs"),
    ([1.0] * 9, 2, "at least two whole pairs"),
])
def test_bad_input_names_the_value(seconds, first, match):
    with pytest.raises(ValueError, match=match):
        paired_overhead(seconds, first=first, window=10, save_every=50)
