"""Helpers for the PyTorch tests: one job of ``spot_training/training/examples/torch_resnet.py`` in a subprocess
(or under ``torchrun``), its CSV step log and final-state comparisons. No torch import here."""

from __future__ import annotations

import re
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/: job_helpers

from job_helpers import REPO, TrainingJob, load_npz  # noqa: E402
from job_helpers import assert_bitwise_equal as _assert_bitwise_equal  # noqa: E402

EXAMPLE = REPO / "spot_training" / "training" / "examples" / "torch_resnet.py"
TORCHRUN = Path(sys.executable).with_name("torchrun")
TOTAL_STEPS = 60
SAVE_EVERY = 10
SEED = 3
#: BatchNorm + Dropout + OneCycleLR + AdamW + shifts and flips drawn from torch's generator.
TRAIN_ARGS = ("--steps", str(TOTAL_STEPS), "--batch-size", "32", "--save-every-steps", str(SAVE_EVERY),
              "--seed", str(SEED), "--flip-prob", "0.5", "--dropout", "0.2", "--device", "cpu")
_RESTORED = re.compile(r"restored \S+ckpt-0*(\d+): step (\d+)")


@dataclass
class Job(TrainingJob, run_timeout=180.0, rows_timeout=120.0, extra_env={"OMP_NUM_THREADS": "1"}):
    """One PyTorch training job: the example with ``TRAIN_ARGS``, under torchrun for ``nproc`` > 1."""

    nproc: int = 1  # > 1: torchrun --standalone with gloo

    def command(self, *more: str) -> list[str]:
        args = [*TRAIN_ARGS, "--save-final-weights", str(self.final_weights), *self.extra_args, *more]
        if self.nproc > 1:
            return [str(TORCHRUN), "--standalone", f"--nproc-per-node={self.nproc}", str(EXAMPLE), *args]
        return [sys.executable, str(EXAMPLE), *args]

    def restored_step(self, proc: subprocess.Popen) -> int | None:
        found = _RESTORED.findall(self.stderr_text(proc))
        return int(found[-1][1]) if found else None


load_state = load_npz


def assert_bitwise_equal(actual: dict[str, np.ndarray], expected: dict[str, np.ndarray]) -> None:
    _assert_bitwise_equal(actual, expected, "state")
