"""The phase drill's short form for PyTorch (bench/notice/pytorch.py; ``make bench-notice`` in full): a
notice at startup (a resume) and one during steps with two DataLoader workers, sent as the agent sends it."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

pytestmark = [pytest.mark.torch, pytest.mark.slow]

REPO = Path(__file__).resolve().parents[2]


def test_notice_drill_short_form_loses_nothing_and_exits_0() -> None:
    sys.path.insert(0, str(REPO))
    from bench.notice.common import summarise
    from bench.notice.run import run_trials

    table = summarise(run_trials("bench.notice.pytorch", trials=2, seed=1, phases=["startup", "step/w2"],
                                 resume=False))
    assert set(table) == {"startup", "step/w2"}
    for phase, row in table.items():
        assert row["committed"] == row["trials"], (phase, row)
        assert row["steps_lost_max"] == 0, (phase, row)
        assert row["exits"] == [0], (phase, row)
        assert row["worker_killed"] == 0, (phase, row)
