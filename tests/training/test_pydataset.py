"""ResumableFit.fit trains on a keras.utils.PyDataset with worker processes (workers=2,
use_multiprocessing=True) as model.fit does, survives a SIGTERM sent to the whole process group
(the workers ignore it; the trainer saves and exits 0) and resumes mid-epoch bitwise equal to an
uninterrupted run. Real TensorFlow and real worker processes in subprocesses."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from keras_jobs import REPO

JOB = Path(__file__).with_name("pydataset_job.py")
STOP_AT = 27  # mid-epoch 1 (20 steps per epoch), between two saves
pytestmark = [pytest.mark.tensorflow, pytest.mark.slow]


def run(ckpt: Path, out: Path, *extra: str) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if not k.startswith("SPOT_TRAINING_")}
    env.update(PYTHONPATH=str(REPO), TF_CPP_MIN_LOG_LEVEL="2")
    return subprocess.run([sys.executable, str(JOB), str(ckpt), str(out), *extra], env=env, cwd=REPO,
                          capture_output=True, text=True, timeout=120, start_new_session=True)


def test_pydataset_with_workers_survives_a_group_sigterm_and_resumes_bitwise(tmp_path):
    ref = run(tmp_path / "ref", tmp_path / "ref.npz")
    assert ref.returncode == 0, ref.stderr[-3000:]
    stopped = run(tmp_path / "job", tmp_path / "stopped.npz", "--stop-at", str(STOP_AT))
    assert stopped.returncode == 0, stopped.stderr[-3000:]
    assert "WORKERS ALIVE 2/2" in stopped.stdout, stopped.stdout + stopped.stderr[-3000:]
    assert not (tmp_path / "stopped.npz").exists(), "code after fit() ran after a stop"
    assert json.loads((tmp_path / "job" / "LATEST").read_text())["step"] == STOP_AT
    resumed = run(tmp_path / "job", tmp_path / "resumed.npz")
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    with np.load(tmp_path / "ref.npz") as a, np.load(tmp_path / "resumed.npz") as b:
        differing = [k for k in a.files if a[k].tobytes() != b[k].tobytes()]
    assert not differing, f"differ from the uninterrupted run: {differing}"
