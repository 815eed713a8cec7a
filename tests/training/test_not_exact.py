"""A resume that cannot be bitwise says so: one WARNING ``resume is not exact`` naming the cause
and the fix, for a tf.data pipeline that reshuffles on every iteration (ResumableFit) and for a
stateful tf.random op in a traced step (TFCheckpointer); none for the exact variants. Real
TensorFlow in a subprocess."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from keras_jobs import REPO

JOB = Path(__file__).with_name("not_exact_job.py")
pytestmark = [pytest.mark.tensorflow, pytest.mark.slow]


@pytest.mark.parametrize("mode, cause, fix", [
    ("keras", "reshuffle_each_iteration=True", "reshuffle_each_iteration=False"),
    ("tf", "stateful random op(s) RandomStandardNormal", "tf.random.get_global_generator()"),
])
def test_inexact_resume_is_warned_once_naming_cause_and_fix(tmp_path, mode, cause, fix):
    env = {k: v for k, v in os.environ.items() if not k.startswith("SPOT_TRAINING_")}
    env.update(PYTHONPATH=str(REPO), TF_CPP_MIN_LOG_LEVEL="2")
    proc = subprocess.run([sys.executable, str(JOB), mode, str(tmp_path)], env=env, cwd=REPO,
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    control, _, inexact = proc.stderr.partition("CONTROL DONE")
    assert "resume is not exact" not in control, control[-2000:]
    warnings = [line for line in inexact.splitlines() if "resume is not exact" in line]
    assert len(warnings) == 1, inexact[-3000:]
    assert warnings[0].startswith("WARNING") and cause in warnings[0] and fix in warnings[0], warnings[0]
