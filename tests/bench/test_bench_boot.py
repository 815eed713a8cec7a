"""bench/bench_boot.py's phase split, on log text as a local node writes it (no node is started)."""

from __future__ import annotations

import datetime
import importlib.util
import json
import sys
from pathlib import Path

import pytest

pytest.importorskip("aws_cdk")
ROOT = Path(__file__).resolve().parents[2]


def _bench():
    spec = importlib.util.spec_from_file_location("bench_boot", ROOT / "bench" / "bench_boot.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules.setdefault("bench_boot", module)
    spec.loader.exec_module(module)
    return module


def _agent(t: float, message: str) -> str:
    when = datetime.datetime.fromtimestamp(t, datetime.timezone.utc).strftime("%Y-%m-%dT%H:%M:%S.%fZ")
    return json.dumps({"time": when, "message": message})


def _trainer(t: float, message: str) -> str:
    stamp = datetime.datetime.fromtimestamp(t)  # local time, as logging's asctime
    return f"{stamp:%Y-%m-%d %H:%M:%S},{stamp.microsecond // 1000:03d} INFO spot_training.training.core: {message}"


def test_every_phase_is_timed_and_the_trainer_import_and_restore_are_split() -> None:
    bench = _bench()
    t0 = 1_800_000_000.0
    text = "\n".join([
        "local-init: user data exited with status 0 after 4.0 s",
        _agent(t0 + 5, "agent starting"), _agent(t0 + 6, "data volume mounted"), _agent(t0 + 7, "dataset ready"),
        _agent(t0 + 8, "environment reused"), _agent(t0 + 9, "training started"),
        "2026-01-01 00:00:00,000 INFO some.other.logger: looking for a checkpoint under /elsewhere",
        _trainer(t0 + 20, "looking for a checkpoint under /data/checkpoints"),
        _trainer(t0 + 21.5, "restored /data/checkpoints/ckpt-40: step 40, epoch 0"),
    ])
    phases = bench._phases([json.loads(line) for line in text.splitlines() if line.startswith("{")], t0, 23.0,
                           bench._trainer_times(text))
    assert list(phases) == list(bench.PHASES)
    assert phases == {"agent_start": 5.0, "volume": 6.0, "dataset": 7.0, "environment": 8.0, "trainer_start": 9.0,
                      "trainer_import": 20.0, "restore": 21.5, "first_step": 23.0}
    assert bench._durations(phases) == {"agent_start": 5.0, "volume": 1.0, "dataset": 1.0, "environment": 1.0,
                                        "trainer_start": 1.0, "trainer_import": 11.0, "restore": 1.5, "first_step": 1.5}


def test_a_phase_not_seen_is_none_and_the_next_counts_from_the_last_seen() -> None:
    bench = _bench()
    phases = {"agent_start": 5.0, "volume": None, "dataset": 7.0, "environment": 8.0, "trainer_start": 9.0,
              "trainer_import": 20.0, "restore": None, "first_step": 23.0}
    durations = bench._durations(phases)
    assert durations["volume"] is None and durations["dataset"] == 2.0
    assert durations["restore"] is None and durations["first_step"] == 3.0
