"""The Gluon notice phase drill's short form (bench/notice/gluon.py; the full form: the notice drill
harness, docs/training-mxnet.md): one notice while DataLoader workers feed the steps and one inside a
validation pass, sent as the agent sends it, each run resumed to the end and compared bitwise."""

from __future__ import annotations

import random
import sys
from pathlib import Path

import pytest

pytestmark = [pytest.mark.slow]

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repository root: ``bench`` is there

from bench.notice import gluon as drill  # noqa: E402


def test_gluon_notice_drill_short_form_loses_nothing_exits_0_and_resumes_bitwise(tmp_path) -> None:
    ctx = drill.prepare(tmp_path)
    ctx["budget_s"] = 10.0  # the validation pass lasts 12 s: longer than the budget, as in the full form
    rng = random.Random(1)
    for phase in ("loader", "validation"):
        row = drill.trial(tmp_path / phase, ctx, phase=phase, rng=rng)
        assert row["exit"] == 0, row  # with the workers ignoring SIGTERM for good: SIGKILL at the budget
        assert row["committed"] and row["lost"] == 0, row
        assert row["group_exit_s"] < ctx["budget_s"], row
        assert not row["worker_killed"], row
        assert row["bitwise"] and row["steps_once"], row
