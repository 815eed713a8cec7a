"""A stop notice during a Gluon evaluation loop (inside ``outside_step()``) is saved at once as the
state after the last completed step, and the trainer exits 0 (real MXNet in a subprocess, a real
SIGTERM). The evaluation takes about 40 s; the checkpoint must be committed long before."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

import gluon_jobs  # noqa: F401 - puts tests/ on sys.path for job_helpers
from job_helpers import notice_during_phase

JOB = Path(__file__).with_name("gluon_phase_job.py")
EVAL_PASS_S = 40
pytestmark = [pytest.mark.slow]


def test_sigterm_during_a_gluon_evaluation_saves_the_last_step_at_once_and_exits_0(tmp_path):
    ckpt = tmp_path / "ckpt"
    rc, took, stderr = notice_during_phase([sys.executable, str(JOB), str(ckpt)], phase="evaluation",
                                           wait_s=EVAL_PASS_S, OMP_NUM_THREADS="1")
    assert rc == 0, stderr[-3000:]
    assert took < EVAL_PASS_S / 2, f"{took:.1f} s from the notice to the exit"
    assert json.loads((ckpt / "LATEST").read_text())["step"] == 20, stderr[-2000:]
    assert "outside a step: checkpoint at step 20 written, exiting 0" in stderr
