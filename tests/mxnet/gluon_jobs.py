"""Helpers for the MXNet Gluon tests: one training job of ``training/examples/gluon_resnet.py`` in a
subprocess, its CSV step log, and parameter comparisons. No MXNet import here (the subprocesses have it).
"""

from __future__ import annotations

import csv
import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parents[2]
EXAMPLE = REPO / "training" / "examples" / "gluon_resnet.py"
TOTAL_STEPS = 90
SAVE_EVERY = 20
SEED = 7


@dataclass
class Job:
    """One training job's directories and the command that (re)starts it."""

    root: Path
    data_dir: Path
    extra_args: tuple[str, ...] = ()
    started: list = field(default_factory=list)

    @property
    def checkpoint_dir(self) -> Path:
        return self.root / "checkpoints"

    @property
    def log_path(self) -> Path:
        return self.root / "logs" / "training_log.csv"

    @property
    def final_params(self) -> Path:
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
            OMP_NUM_THREADS="1",
            PYTHONPATH=str(REPO),
        )
        return env

    def command(self) -> list[str]:
        return [sys.executable, str(EXAMPLE), "--steps", str(TOTAL_STEPS), "--batch-size", "32",
                "--save-every-steps", str(SAVE_EVERY), "--seed", str(SEED),
                "--save-final-params", str(self.final_params), *self.extra_args]

    def start(self) -> subprocess.Popen:
        with open(self.root / f"stderr-{time.monotonic_ns()}.log", "wb") as stderr:
            proc = subprocess.Popen(self.command(), env=self.env(), cwd=REPO, stdout=subprocess.DEVNULL,
                                    stderr=stderr, start_new_session=True)
        self.started.append(proc)
        return proc

    def kill_leftovers(self) -> None:
        """SIGKILL every trainer this job started that is still running (test teardown), by its group id."""
        for proc in self.started:
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()

    def run(self, timeout: float = 120) -> int:
        proc = self.start()
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

    def wait_for_rows(self, proc: subprocess.Popen, rows: int, timeout: float = 60) -> None:
        deadline = time.monotonic() + timeout
        while len(self.logged_steps()) < rows:
            if proc.poll() is not None:
                raise AssertionError(f"trainer exited {proc.returncode} before {rows} steps:\n{self.stderr_text()}")
            if time.monotonic() > deadline:
                raise AssertionError(f"trainer did not reach {rows} steps in {timeout} s")
            time.sleep(0.005)

    def wait_for_file(self, proc: subprocess.Popen, path: Path, timeout: float = 60) -> None:
        deadline = time.monotonic() + timeout
        while not path.exists():
            if proc.poll() is not None:
                raise AssertionError(f"trainer exited {proc.returncode} before {path} appeared:\n{self.stderr_text()}")
            if time.monotonic() > deadline:
                raise AssertionError(f"{path} did not appear in {timeout} s")
            time.sleep(0.005)


def load_params(path: Path) -> dict[str, np.ndarray]:
    with np.load(path) as data:
        return {name: data[name] for name in data.files}


def assert_bitwise_equal(actual: dict[str, np.ndarray], expected: dict[str, np.ndarray]) -> None:
    assert sorted(actual) == sorted(expected)
    differing = [name for name in expected if not np.array_equal(actual[name], expected[name])]
    assert not differing, f"parameters differ from the uninterrupted run: {differing}"
