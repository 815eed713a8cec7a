"""A stop notice during a Gluon evaluation loop (inside ``outside_step()``) is saved at once as the
state after the last completed step, and the trainer exits 0 (real MXNet in a subprocess, a real
SIGTERM). The evaluation takes about 40 s; the checkpoint must be committed long before."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from gluon_jobs import REPO

JOB = Path(__file__).with_name("gluon_phase_job.py")
EVAL_PASS_S = 40
pytestmark = [pytest.mark.slow]


def test_sigterm_during_a_gluon_evaluation_saves_the_last_step_at_once_and_exits_0(tmp_path):
    ckpt = tmp_path / "ckpt"
    env = {k: v for k, v in os.environ.items() if not k.startswith("SPOT_TRAINING_")}
    env.update(PYTHONPATH=str(REPO), OMP_NUM_THREADS="1")
    proc = subprocess.Popen([sys.executable, str(JOB), str(ckpt)], env=env, cwd=REPO,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        for line in proc.stdout:
            if line.startswith("PHASE evaluation"):
                break
        else:
            pytest.fail(f"no evaluation phase: {proc.wait()} {proc.stderr.read()[-3000:]}")
        time.sleep(1.0)
        sent = time.monotonic()
        proc.send_signal(signal.SIGTERM)
        try:
            rc = proc.wait(timeout=EVAL_PASS_S)
        except subprocess.TimeoutExpired:
            pytest.fail("the notice waited for the evaluation loop to end")
        took = time.monotonic() - sent
        stderr = proc.stderr.read()
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert rc == 0, stderr[-3000:]
    assert took < EVAL_PASS_S / 2, f"{took:.1f} s from the notice to the exit"
    assert json.loads((ckpt / "LATEST").read_text())["step"] == 20, stderr[-2000:]
    assert "outside a step: checkpoint at step 20 written, exiting 0" in stderr
