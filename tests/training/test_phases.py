"""A stop notice (SIGTERM) that arrives outside a training step, during a long evaluation pass, is
saved at once as the state after the last completed step, and the trainer exits 0 (real
TensorFlow in a subprocess, a real signal). The evaluation pass takes about 40 s; the checkpoint
must be committed long before it could have ended."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

import keras_jobs  # noqa: F401 - puts tests/ on sys.path for job_helpers
from job_helpers import notice_during_phase

JOB = Path(__file__).with_name("phase_job.py")
SPE = 20
EVAL_PASS_S = 40  # phase_job.py: 200 batches x 0.2 s
pytestmark = [pytest.mark.tensorflow, pytest.mark.slow]


@pytest.mark.parametrize("mode", ["keras", "tf"])
def test_sigterm_during_evaluation_saves_the_last_step_at_once_and_exits_0(tmp_path, mode):
    ckpt = tmp_path / "ckpt"
    rc, took, stderr = notice_during_phase([sys.executable, str(JOB), mode, str(ckpt)], phase="evaluation",
                                           wait_s=EVAL_PASS_S, TF_CPP_MIN_LOG_LEVEL="2")
    assert rc == 0, stderr[-3000:]
    assert took < EVAL_PASS_S / 2, f"{took:.1f} s from the notice to the exit: the evaluation pass was not abandoned"
    assert json.loads((ckpt / "LATEST").read_text())["step"] == SPE, "steps lost: " + stderr[-2000:]
    assert not (ckpt / "COMPLETED").exists()
    assert "outside a step: checkpoint at step 20 written, exiting 0" in stderr
