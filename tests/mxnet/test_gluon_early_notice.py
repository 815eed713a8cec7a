"""A SIGTERM while the Gluon example imports MXNet (seconds, before its checkpointer installs the notice
handlers): the example imports ``spot_training.training.early_notice`` first, so it exits 0 without
training instead of dying by the signal (-15). Real MXNet in a subprocess, a real signal."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import pytest

from gluon_jobs import EXAMPLE, REPO

pytestmark = [pytest.mark.slow]


def test_sigterm_while_the_gluon_example_imports_mxnet_exits_0_without_training(tmp_path, digits_dir):
    env = {k: v for k, v in os.environ.items() if not k.startswith("SPOT_TRAINING_")}
    env.update(PYTHONPATH=str(REPO), OMP_NUM_THREADS="1")
    ckpt, logs = tmp_path / "ckpt", tmp_path / "logs"
    proc = subprocess.Popen([sys.executable, str(EXAMPLE), "--steps", "5", "--data-dir", str(digits_dir),
                             "--checkpoint-dir", str(ckpt), "--log-dir", str(logs)],
                            env=env, cwd=REPO, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    time.sleep(0.5)  # Python is up; `import mxnet` takes seconds
    proc.send_signal(signal.SIGTERM)
    rc = proc.wait(timeout=120)
    stderr = proc.stderr.read()
    assert "restored" not in stderr and "training complete" not in stderr, stderr[-3000:]
    assert rc == 0, stderr[-3000:]
    assert not (ckpt / "LATEST").exists() and not (ckpt / "COMPLETED").exists()
