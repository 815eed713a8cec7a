"""Paired-window statistics shared by the checkpoint benchmarks (pure Python: imported by the
TensorFlow and the MXNet benchmark, each in its own process).

A run trains in windows of ``window`` steps that alternate without and with one save (window k
saves when k is odd). Each saving window is compared with the window just before it, so what one
save adds is measured about a second apart in the same process, and the load of other processes
and the slow drift of a shared machine cancel out (bench/bench_checkpoint.py, 1.).
"""

from __future__ import annotations

import statistics


def saving_window(k: int) -> bool:
    """True for the windows that hold a save (odd k)."""
    return k % 2 == 1


def paired_overhead(seconds: list[float], *, first: int, window: int, save_every: int,
                    blocking: list[float] | None = None) -> dict:
    """Overhead of one save every ``save_every`` steps, from per-window wall (or CPU) times.

    seconds: one figure per window, in order (window k saves when k is odd); the first ``first``
    windows (even, the warm-up) are left out. window: steps per window. save_every: steps between
    two saves in the run the figure is for (50 for a save every 50 steps, an epoch's steps for
    the article's). blocking: optional training-thread seconds of the save in each window.

    Returns ``step_s`` (mean seconds of a step in the windows without a save), ``extra_s`` (per
    pair: saving window - the window before it, seconds), ``overhead_pct`` (mean extra time of a
    save over ``save_every`` steps, %), ``overhead_pct_ci95`` (1.96 standard errors, %),
    ``overhead_pct_median`` and ``blocked_pct`` (mean blocking over ``save_every`` steps, %, or
    None). Raises ValueError for fewer than two pairs, an odd ``first`` or a ragged last pair.
    """
    if first % 2:
        raise ValueError(f"first must be even (whole pairs of windows). Received: first={first}")
    w = seconds[first:]
    if len(w) < 4 or len(w) % 2:
        raise ValueError(f"need at least two whole pairs of windows after the first {first}. "
                         f"Received: {len(seconds)} windows")
    extra = [w[i + 1] - w[i] for i in range(0, len(w), 2)]
    step_s = statistics.mean(w[0::2]) / window
    scale = 100 / (save_every * step_s)
    saves = [b for b in (blocking or [])[first:]][1::2]
    return {
        "step_s": step_s,
        "extra_s": extra,
        "overhead_pct": statistics.mean(extra) * scale,
        "overhead_pct_ci95": 1.96 * statistics.stdev(extra) / len(extra) ** 0.5 * scale,
        "overhead_pct_median": statistics.median(extra) * scale,
        "blocking_s": saves,
        "blocked_pct": statistics.mean(saves) * scale if saves else None,
    }
