"""The torchrun notice phase drill's short form (bench/notice/torchrun.py; the full form: the notice
drill harness, docs/training-pytorch.md): a two-node TorchElastic cluster, the notice relayed to
rank 0's node while it trains and writes a checkpoint after every step, as the cluster agent relays it
(one phase: a cluster per trial takes 30-60 s here)."""

from __future__ import annotations

import random
import sys
from pathlib import Path

import pytest

pytestmark = [pytest.mark.torch, pytest.mark.slow]

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repository root: ``bench`` is there

from bench.notice import torchrun as drill  # noqa: E402


def test_torchrun_notice_drill_short_form_loses_nothing_and_the_other_node_resumes_there(tmp_path) -> None:
    ctx = drill.prepare(tmp_path)
    ctx["budget_s"] = 30.0
    row = drill.trial(tmp_path / "step", ctx, phase="write", rng=random.Random(1))
    assert row["exit"] == 0 and not row["worker_killed"], row
    assert row["committed"] and row["lost"] == 0 and row["ran"] > 0, row
    assert row["resumed_at"] == row["saved"], row
