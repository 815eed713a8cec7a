"""A SIGTERM during ``import tensorflow``: with ``import spot_training.training.early_notice`` as the
script's first line the process exits 0 without training; without it, -15. Real TensorFlow in a
subprocess, a real signal sent while the import runs."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from keras_jobs import REPO

pytestmark = [pytest.mark.tensorflow, pytest.mark.slow]

SCRIPT = r'''
import sys, pathlib
pathlib.Path(sys.argv[1]).write_text("importing")
import tensorflow as tf
import keras
import numpy as np
from spot_training.training.keras_adapter import ResumableFit, make_deterministic
make_deterministic(0)
model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(2)])
model.compile(optimizer="sgd", loss="mse")
x = np.zeros((64, 4), np.float32)
ResumableFit(model, sys.argv[2], every_steps=5).fit(x, np.zeros((64, 2), np.float32), batch_size=8, epochs=2, verbose=0)
pathlib.Path(sys.argv[3]).write_text("trained")
'''


def run_with_sigterm_during_import(tmp_path: Path, first_line: str) -> tuple[int, Path, str]:
    script = tmp_path / "train.py"
    script.write_text(first_line + SCRIPT)
    marker, ckpt, done = tmp_path / "marker", tmp_path / "ckpt", tmp_path / "done"
    env = {k: v for k, v in os.environ.items() if not k.startswith("SPOT_TRAINING_")}
    env.update(PYTHONPATH=str(REPO), TF_CPP_MIN_LOG_LEVEL="2")
    proc = subprocess.Popen([sys.executable, str(script), str(marker), str(ckpt), str(done)], env=env,
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    deadline = time.monotonic() + 60
    while not marker.exists():
        assert proc.poll() is None and time.monotonic() < deadline, proc.stderr.read().decode()[-3000:]
        time.sleep(0.001)
    time.sleep(0.2)  # inside `import tensorflow` (it takes seconds)
    proc.send_signal(signal.SIGTERM)
    rc = proc.wait(timeout=120)
    stderr = proc.stderr.read().decode()
    assert not done.exists(), f"training ran after the stop:\n{stderr[-3000:]}"
    return rc, ckpt, stderr


def test_sigterm_during_tensorflow_import_exits_0_with_early_notice(tmp_path):
    rc, ckpt, stderr = run_with_sigterm_during_import(tmp_path, "import spot_training.training.early_notice\n")
    assert rc == 0, stderr[-3000:]
    assert not (ckpt / "LATEST").exists() and not (ckpt / "COMPLETED").exists()


def test_without_early_notice_the_same_signal_kills_the_import(tmp_path):
    # The test above cannot pass by accident: the signal does land during the import.
    rc, _ckpt, _stderr = run_with_sigterm_during_import(tmp_path, "")
    assert rc == -signal.SIGTERM
