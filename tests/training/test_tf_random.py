"""tf.random draws inside a custom loop's step resume exactly: TensorFlow's global
generator is in every TFCheckpointer checkpoint, and a script's own tf.random.Generator is when
passed as a trackable. Real TensorFlow in subprocesses, a real SIGTERM, bitwise comparisons."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from keras_jobs import REPO

JOB = Path(__file__).with_name("tf_random_job.py")
pytestmark = [pytest.mark.tensorflow, pytest.mark.slow]


def run(ckpt: Path, out: Path, *extra: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(REPO), "TF_CPP_MIN_LOG_LEVEL": "2"}
    env = {k: v for k, v in env.items() if not k.startswith("SPOT_TRAINING_")}
    return subprocess.run([sys.executable, str(JOB), str(ckpt), str(out), "--steps", "30", *extra],
                          env=env, cwd=REPO, capture_output=True, text=True, timeout=300)


def test_global_and_own_generators_resume_bitwise_after_sigterm(tmp_path):
    ref = run(tmp_path / "ref", tmp_path / "ref.npz")
    assert ref.returncode == 0, ref.stderr
    stopped = run(tmp_path / "job", tmp_path / "stopped.npz", "--stop-after", "13")
    assert stopped.returncode == 0, stopped.stderr
    assert not (tmp_path / "stopped.npz").exists(), "code after the loop must not run after a stop"
    resumed = run(tmp_path / "job", tmp_path / "resumed.npz")
    assert resumed.returncode == 0, resumed.stderr
    with np.load(tmp_path / "ref.npz") as a, np.load(tmp_path / "resumed.npz") as b:
        assert sorted(a.files) == sorted(b.files)
        differing = [k for k in a.files if a[k].tobytes() != b[k].tobytes()]
    assert not differing, f"differ from the uninterrupted run: {differing}"
