"""Helpers for the PyTorch tests: one job of ``training/examples/torch_resnet.py`` in a subprocess
(or under ``torchrun``), its CSV step log and final-state comparisons. No torch import here."""

from __future__ import annotations

import csv
import os
import re
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parents[2]
EXAMPLE = REPO / "training" / "examples" / "torch_resnet.py"
TORCHRUN = Path(sys.executable).with_name("torchrun")
TOTAL_STEPS = 60
SAVE_EVERY = 10
SEED = 3
#: BatchNorm + Dropout + OneCycleLR + AdamW + shifts and flips drawn from torch's generator.
TRAIN_ARGS = ("--steps", str(TOTAL_STEPS), "--batch-size", "32", "--save-every-steps", str(SAVE_EVERY),
              "--seed", str(SEED), "--flip-prob", "0.5", "--dropout", "0.2", "--device", "cpu")
_RESTORED = re.compile(r"restored \S+ckpt-0*(\d+): step (\d+)")


@dataclass
class Job:
    """One training job's directories and the command that (re)starts it."""

    root: Path
    data_dir: Path
    extra_args: tuple[str, ...] = ()
    nproc: int = 1  # > 1: torchrun --standalone with gloo
    started: list = field(default_factory=list)

    @property
    def checkpoint_dir(self) -> Path:
        return self.root / "checkpoints"

    @property
    def log_path(self) -> Path:
        return self.root / "logs" / "training_log.csv"

    @property
    def final_weights(self) -> Path:
        return self.root / "final.npz"

    def env(self) -> dict[str, str]:
        env = {k: v for k, v in os.environ.items() if not k.startswith("SPOT_TRAINING_")}
        env.update(SPOT_TRAINING_DATA_DIR=str(self.data_dir), SPOT_TRAINING_CHECKPOINT_DIR=str(self.checkpoint_dir),
                   SPOT_TRAINING_LOG_DIR=str(self.root / "logs"),
                   SPOT_TRAINING_CHECKPOINT_REQUEST_FILE=str(self.root / "checkpoint-request"),
                   OMP_NUM_THREADS="1", PYTHONPATH=str(REPO))
        return env

    def command(self, *more: str) -> list[str]:
        args = [*TRAIN_ARGS, "--save-final-weights", str(self.final_weights), *self.extra_args, *more]
        if self.nproc > 1:
            return [str(TORCHRUN), "--standalone", f"--nproc-per-node={self.nproc}", str(EXAMPLE), *args]
        return [sys.executable, str(EXAMPLE), *args]

    def start(self, *more: str) -> subprocess.Popen:
        cmd = self.command(*more)
        with open(self.root / f"stderr-{time.monotonic_ns()}.log", "wb") as stderr:
            proc = subprocess.Popen(cmd, env=self.env(), cwd=REPO, stdout=subprocess.DEVNULL, stderr=stderr,
                                    start_new_session=True)
        proc.stderr_path = Path(stderr.name)
        self.started.append(proc)
        return proc

    def kill_leftovers(self) -> None:
        """SIGKILL every trainer this job started that still runs (teardown), by its process group."""
        for proc in self.started:
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()

    def run(self, *more: str, timeout: float = 180) -> int:
        proc = self.start(*more)
        try:
            return proc.wait(timeout=timeout)
        finally:
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()

    def stderr_text(self, proc: subprocess.Popen | None = None) -> str:
        if proc is not None:
            return proc.stderr_path.read_text(errors="replace")
        return "\n".join(p.read_text(errors="replace") for p in sorted(self.root.glob("stderr-*.log")))

    def restored_step(self, proc: subprocess.Popen) -> int | None:
        found = _RESTORED.findall(self.stderr_text(proc))
        return int(found[-1][1]) if found else None

    def logged_steps(self) -> list[int]:
        if not self.log_path.exists():
            return []
        with open(self.log_path, newline="") as handle:
            return [int(row["step"]) for row in csv.DictReader(handle)]

    def wait_for_rows(self, proc: subprocess.Popen, rows: int, timeout: float = 120) -> None:
        deadline = time.monotonic() + timeout
        while len(self.logged_steps()) < rows:
            if proc.poll() is not None:
                raise AssertionError(f"trainer exited {proc.returncode} before {rows} rows:\n{self.stderr_text(proc)}")
            if time.monotonic() > deadline:
                raise AssertionError(f"trainer did not reach {rows} rows in {timeout} s")
            time.sleep(0.005)


def load_state(path: Path) -> dict[str, np.ndarray]:
    with np.load(path) as data:
        return {name: data[name] for name in data.files}


def assert_bitwise_equal(actual: dict[str, np.ndarray], expected: dict[str, np.ndarray]) -> None:
    assert sorted(actual) == sorted(expected)
    differing = [k for k in expected if actual[k].dtype != expected[k].dtype or not np.array_equal(actual[k], expected[k])]
    assert not differing, f"state differs from the uninterrupted run: {differing}"
