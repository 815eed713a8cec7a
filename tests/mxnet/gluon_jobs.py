"""Helpers for the MXNet Gluon tests: one training job of ``spot_training/training/examples/gluon_resnet.py`` in a
subprocess, its CSV step log, and parameter comparisons. No MXNet import here (the subprocesses have it).
"""

from __future__ import annotations

import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/: job_helpers

from job_helpers import REPO, TrainingJob, load_npz  # noqa: E402
from job_helpers import assert_bitwise_equal as _assert_bitwise_equal  # noqa: E402

EXAMPLE = REPO / "spot_training" / "training" / "examples" / "gluon_resnet.py"
TOTAL_STEPS = 90
SAVE_EVERY = 20
SEED = 7


@dataclass
class Job(TrainingJob, run_timeout=120.0, rows_timeout=60.0, extra_env={"OMP_NUM_THREADS": "1"}):
    """One Gluon training job: the example with the tests' steps, batch, cadence and seed."""

    @property
    def final_params(self) -> Path:
        """Where the example writes its final parameters (``--save-final-params``)."""
        return self.final_weights

    def command(self, *more: str) -> list[str]:
        return [sys.executable, str(EXAMPLE), "--steps", str(TOTAL_STEPS), "--batch-size", "32",
                "--save-every-steps", str(SAVE_EVERY), "--seed", str(SEED),
                "--save-final-params", str(self.final_params), *self.extra_args, *more]

    def wait_for_file(self, proc: subprocess.Popen, path: Path, timeout: float = 60) -> None:
        deadline = time.monotonic() + timeout
        while not path.exists():
            if proc.poll() is not None:
                raise AssertionError(f"trainer exited {proc.returncode} before {path} appeared:\n{self.stderr_text()}")
            if time.monotonic() > deadline:
                raise AssertionError(f"{path} did not appear in {timeout} s")
            time.sleep(0.005)


load_params = load_npz


def assert_bitwise_equal(actual: dict[str, np.ndarray], expected: dict[str, np.ndarray]) -> None:
    _assert_bitwise_equal(actual, expected, "parameters")
