"""ResumableFit with what a newcomer's Keras script uses: tf.data, validation_split,
class_weight, sample_weight, EarlyStopping, ReduceLROnPlateau, CSVLogger; a real SIGTERM in the
middle of an epoch. Real TensorFlow in subprocesses; bitwise comparisons with an uninterrupted run."""

from __future__ import annotations

import csv
import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from keras_jobs import REPO

JOB = Path(__file__).with_name("keras_newcomer_job.py")
SPE = 35             # 1,437 digits, 80 % for training, batch 32
STOP_AT = 2 * SPE + 5  # in epoch 2, between two saves: after ReduceLROnPlateau fired once
pytestmark = [pytest.mark.tensorflow, pytest.mark.slow]


def run(digits_dir: Path, root: Path, data: str, *extra: str) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if not k.startswith("SPOT_TRAINING_")}
    env.update(PYTHONPATH=str(REPO), TF_CPP_MIN_LOG_LEVEL="2")
    return subprocess.run([sys.executable, str(JOB), str(digits_dir), str(root / "ckpt"), str(root / "out"),
                           "--data", data, *extra], env=env, cwd=REPO, capture_output=True, text=True, timeout=400)


@pytest.mark.parametrize("data", ["numpy", "tfdata"])
def test_sigterm_mid_epoch_resumes_bitwise_with_stateful_callbacks(tmp_path, digits_dir, data):
    ref = run(digits_dir, tmp_path / "ref", data)
    assert ref.returncode == 0, ref.stderr[-4000:]
    ref_state = json.loads((tmp_path / "ref" / "out" / "callbacks.json").read_text())
    # EarlyStopping ended training after epoch 2 and ReduceLROnPlateau fired twice: their counters matter.
    assert ref_state["early"][2] == 2 and ref_state["step"] == 3 * SPE, ref_state
    assert ref_state["lr"] == pytest.approx(1e-2 / 4), ref_state

    stopped = run(digits_dir, tmp_path / "job", data, "--stop-at", str(STOP_AT))
    assert stopped.returncode == 0, stopped.stderr[-4000:]
    out = tmp_path / "job" / "out"
    assert not (out / "final.npz").exists(), "code after fit() ran after a stop"
    events = (out / "events.txt").read_text().split()
    # Epochs 0 and 1 ended (with validation each); the partial epoch 2 got neither.
    assert events == ["validation", "epoch_end", "0", "validation", "epoch_end", "1"], events
    assert json.loads((tmp_path / "job" / "ckpt" / "LATEST").read_text())["step"] == STOP_AT

    resumed = run(digits_dir, tmp_path / "job", data)
    assert resumed.returncode == 0, resumed.stderr[-4000:]
    assert json.loads((out / "callbacks.json").read_text()) == ref_state
    with np.load(tmp_path / "ref" / "out" / "final.npz") as a, np.load(out / "final.npz") as b:
        differing = [k for k in a.files if a[k].tobytes() != b[k].tobytes()]
    assert not differing, f"differ from the uninterrupted run: {differing}"
    with open(out / "epochs.csv", newline="") as handle:
        epochs = [int(row["epoch"]) for row in csv.DictReader(handle)]
    assert epochs == [0, 1, 2], f"CSVLogger rows (one per epoch, none repeated): {epochs}"
