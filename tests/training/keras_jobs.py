"""Helpers for the TensorFlow/Keras tests: one run of ``training/examples/keras_resnet.py`` (or of
``tf_loop_job.py``) in a subprocess, its per-step CSV log, weight comparisons. No TensorFlow import
here: TensorFlow runs only in the subprocesses (and MXNet never in this pytest process)."""

from __future__ import annotations

import csv
import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parents[2]
KERAS_EXAMPLE = REPO / "training" / "examples" / "keras_resnet.py"
TF_LOOP_JOB = Path(__file__).with_name("tf_loop_job.py")
EPOCHS = 2          # 2 epochs x 44 steps (1,437 training digits, batch 32): resumes cross an epoch edge
SAVE_EVERY = 20
SEED = 7
STEP_DELAY = "0.03"  # seconds after each step, so that a signal lands at a step we can choose


def prepare_digits(out: Path) -> Path:
    """Write the digits dataset with the colleague's prepare_data (a subprocess: no sklearn import here)."""
    subprocess.run([sys.executable, "-m", "training.examples.prepare_data", "--out", str(out)],
                   cwd=REPO, check=True, capture_output=True, env={**os.environ, "PYTHONPATH": str(REPO)})
    return out


@dataclass
class Job:
    """One training job's directories and the command that (re)starts it."""

    root: Path
    data_dir: Path
    extra_args: tuple[str, ...] = ()
    script: Path = KERAS_EXAMPLE

    @property
    def checkpoint_dir(self) -> Path:
        return self.root / "checkpoints"

    @property
    def log_path(self) -> Path:
        return self.root / "logs" / "training_log.csv"

    @property
    def final_weights(self) -> Path:
        return self.root / "final.npz"

    @property
    def request_file(self) -> Path:
        return self.root / "checkpoint-request"

    def env(self) -> dict[str, str]:
        env = {k: v for k, v in os.environ.items() if not k.startswith("SPOT_TRAINING_")}
        env.update(
            SPOT_TRAINING_DATA_DIR=str(self.data_dir),
            SPOT_TRAINING_CHECKPOINT_DIR=str(self.checkpoint_dir),
            SPOT_TRAINING_LOG_DIR=str(self.root / "logs"),
            SPOT_TRAINING_CHECKPOINT_REQUEST_FILE=str(self.request_file),
            TF_CPP_MIN_LOG_LEVEL="2",
            PYTHONPATH=str(REPO),
        )
        return env

    def command(self) -> list[str]:
        return [sys.executable, str(self.script), "--epochs", str(EPOCHS), "--batch-size", "32",
                "--save-every-steps", str(SAVE_EVERY), "--seed", str(SEED),
                "--save-final-weights", str(self.final_weights), *self.extra_args]

    def start(self, *extra: str) -> subprocess.Popen:
        self.root.mkdir(parents=True, exist_ok=True)
        stderr = open(self.root / f"stderr-{time.monotonic_ns()}.log", "wb")
        return subprocess.Popen([*self.command(), *extra], env=self.env(), cwd=REPO, stdout=subprocess.DEVNULL,
                                stderr=stderr, start_new_session=True)

    def run(self, *extra: str, timeout: float = 180) -> int:
        proc = self.start(*extra)
        try:
            return proc.wait(timeout=timeout)
        finally:
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()

    def stderr_text(self) -> str:
        return "\n".join(p.read_text(errors="replace") for p in sorted(self.root.glob("stderr-*.log")))

    def logged_steps(self) -> list[int]:
        """The ``step`` column of every row of training_log.csv, in file order."""
        if not self.log_path.exists():
            return []
        with open(self.log_path, newline="") as handle:
            return [int(row["step"]) for row in csv.DictReader(handle)]

    def wait_for_rows(self, proc: subprocess.Popen, rows: int, timeout: float = 90) -> None:
        deadline = time.monotonic() + timeout
        while len(self.logged_steps()) < rows:
            if proc.poll() is not None:
                raise AssertionError(f"trainer exited {proc.returncode} before {rows} steps:\n{self.stderr_text()}")
            if time.monotonic() > deadline:
                raise AssertionError(f"trainer did not reach {rows} steps in {timeout} s")
            time.sleep(0.005)

    def tree(self) -> dict[str, bytes]:
        """Every file under the checkpoint directory with its content (to prove nothing changed)."""
        return {str(p.relative_to(self.checkpoint_dir)): p.read_bytes()
                for p in sorted(self.checkpoint_dir.rglob("*")) if p.is_file()}


def load_weights(path: Path) -> dict[str, np.ndarray]:
    with np.load(path) as data:
        return {name: data[name] for name in data.files}


def assert_bitwise_equal(actual: dict[str, np.ndarray], expected: dict[str, np.ndarray]) -> None:
    assert sorted(actual) == sorted(expected)
    differing = [name for name in expected
                 if actual[name].dtype != expected[name].dtype or actual[name].tobytes() != expected[name].tobytes()]
    assert not differing, f"variables differ from the uninterrupted run: {differing}"
