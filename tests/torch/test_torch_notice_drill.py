"""The phase drill's short form (bench/bench_notice.py, ``make bench-notice`` in full): a notice at
startup (a resume) and one during steps with two DataLoader workers, sent as the agent sends it."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

pytestmark = [pytest.mark.torch, pytest.mark.slow]

BENCH = Path(__file__).resolve().parents[2] / "bench" / "bench_notice.py"


def test_notice_drill_short_form_loses_nothing_and_exits_0() -> None:
    spec = importlib.util.spec_from_file_location("bench_notice", BENCH)
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    table = bench.run(trials=1, workers=[2], seed=1, phases=["startup", "step"])
    assert set(table) == {"startup", "step/w2"}
    for phase, row in table.items():
        assert row["committed"] == row["trials"], (phase, row)
        assert row["steps_lost_max"] == 0, (phase, row)
        assert row["exits"] == [0], (phase, row)
        assert row["worker_killed"] == 0, (phase, row)
