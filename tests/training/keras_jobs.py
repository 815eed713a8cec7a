"""Helpers for the TensorFlow/Keras tests: one run of ``spot_training/training/examples/keras_resnet.py`` (or of
``tf_loop_job.py``) in a subprocess, its per-step CSV log, weight comparisons. No TensorFlow import
here: TensorFlow runs only in the subprocesses (and MXNet never in this pytest process)."""

from __future__ import annotations

import os
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/: job_helpers

from job_helpers import REPO, TrainingJob, load_npz  # noqa: E402
from job_helpers import assert_bitwise_equal as _assert_bitwise_equal  # noqa: E402

KERAS_EXAMPLE = REPO / "spot_training" / "training" / "examples" / "keras_resnet.py"
TF_LOOP_JOB = Path(__file__).with_name("tf_loop_job.py")
EPOCHS = 2          # 2 epochs x 44 steps (1,437 training digits, batch 32): resumes cross an epoch edge
SAVE_EVERY = 20
SEED = 7
STEP_DELAY = "0.03"  # seconds after each step, so that a signal lands at a step we can choose


def prepare_digits(out: Path) -> Path:
    """Write the digits dataset with the colleague's prepare_data (a subprocess: no sklearn import here)."""
    subprocess.run([sys.executable, "-m", "spot_training.training.examples.prepare_data", "--out", str(out)],
                   cwd=REPO, check=True, capture_output=True, env={**os.environ, "PYTHONPATH": str(REPO)})
    return out


@dataclass
class Job(TrainingJob, run_timeout=180.0, rows_timeout=90.0, extra_env={"TF_CPP_MIN_LOG_LEVEL": "2"}):
    """One Keras (or custom-loop) training job: ``script`` with the tests' epochs, batch, cadence and seed."""

    script: Path = KERAS_EXAMPLE

    def command(self, *more: str) -> list[str]:
        return [sys.executable, str(self.script), "--epochs", str(EPOCHS), "--batch-size", "32",
                "--save-every-steps", str(SAVE_EVERY), "--seed", str(SEED),
                "--save-final-weights", str(self.final_weights), *self.extra_args, *more]

    def tree(self) -> dict[str, bytes]:
        """Every file under the checkpoint directory with its content (to prove nothing changed)."""
        return {str(p.relative_to(self.checkpoint_dir)): p.read_bytes()
                for p in sorted(self.checkpoint_dir.rglob("*")) if p.is_file()}


load_weights = load_npz


def assert_bitwise_equal(actual: dict[str, np.ndarray], expected: dict[str, np.ndarray]) -> None:
    _assert_bitwise_equal(actual, expected, "variables")
