"""The phase drill's short form (bench/bench_notice.py; ``make bench-notice`` runs the full one): one
notice per framework and phase below, sent as the agent sends it, each front-end in its own environment.
Keras: a notice inside a validation pass longer than the budget; TF loop: a notice inside its
evaluation (``outside_step``), also longer than the budget; PyTorch: a step with DataLoader workers. The notice budget is 20 s (SIGKILL after it), the validation pass 27 s."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))

from bench import bench_notice  # noqa: E402


def test_every_front_end_commits_the_notice_checkpoint_in_budget_and_exits_0() -> None:
    tables = bench_notice.run(["keras", "tfloop", "pytorch"], trials=1, seed=3, budget_s=20.0, resume=False,
                              phases=["validation", "step/w2"])
    assert {name: set(table) for name, table in tables.items()} == {
        "keras": {"validation"}, "tfloop": {"validation"}, "pytorch": {"step/w2"}}
    for name, table in tables.items():
        for phase, row in table.items():
            assert row["committed"] == row["trials"], (name, phase, row)
            assert row["steps_lost_max"] == 0, (name, phase, row)
            assert row["exits"] == [0], (name, phase, row)
            assert row["worker_killed"] == 0, (name, phase, row)
