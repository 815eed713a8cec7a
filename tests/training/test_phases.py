"""A stop notice (SIGTERM) that arrives outside a training step, during a long evaluation pass, is
saved at once as the state after the last completed step, and the trainer exits 0 (real
TensorFlow in a subprocess, a real signal). The evaluation pass takes about 40 s; the checkpoint
must be committed long before it could have ended."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from keras_jobs import REPO

JOB = Path(__file__).with_name("phase_job.py")
SPE = 20
EVAL_PASS_S = 40  # phase_job.py: 200 batches x 0.2 s
pytestmark = [pytest.mark.tensorflow, pytest.mark.slow]


def start(mode: str, ckpt: Path) -> subprocess.Popen:
    env = {k: v for k, v in os.environ.items() if not k.startswith("SPOT_TRAINING_")}
    env.update(PYTHONPATH=str(REPO), TF_CPP_MIN_LOG_LEVEL="2")
    return subprocess.Popen([sys.executable, str(JOB), mode, str(ckpt)], env=env, cwd=REPO,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


@pytest.mark.parametrize("mode", ["keras", "tf"])
def test_sigterm_during_evaluation_saves_the_last_step_at_once_and_exits_0(tmp_path, mode):
    ckpt = tmp_path / "ckpt"
    proc = start(mode, ckpt)
    try:
        for line in proc.stdout:
            if line.startswith("PHASE evaluation"):
                break
        else:
            pytest.fail(f"no evaluation phase: {proc.wait()} {proc.stderr.read()[-3000:]}")
        time.sleep(1.0)  # well inside the evaluation pass
        sent = time.monotonic()
        proc.send_signal(signal.SIGTERM)
        try:
            rc = proc.wait(timeout=EVAL_PASS_S)
        except subprocess.TimeoutExpired:
            pytest.fail("the notice waited for the evaluation pass to end")
        took = time.monotonic() - sent
        stderr = proc.stderr.read()
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert rc == 0, stderr[-3000:]
    assert took < EVAL_PASS_S / 2, f"{took:.1f} s from the notice to the exit: the evaluation pass was not abandoned"
    assert json.loads((ckpt / "LATEST").read_text())["step"] == SPE, "steps lost: " + stderr[-2000:]
    assert not (ckpt / "COMPLETED").exists()
    assert "outside a step: checkpoint at step 20 written, exiting 0" in stderr
