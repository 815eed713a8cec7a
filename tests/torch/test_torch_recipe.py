"""The recipe of docs/training-pytorch.md as a new user writes it (tests/torch/recipe_trainer.py, no exit-code
mapping of its own), stopped the way the node agent stops it: SIGTERM to the trainer's whole process
group (spot_training/agent/supervisor.py ``terminate``), DataLoader workers included."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from spot_training.training.store import CheckpointStore

pytestmark = pytest.mark.torch

RECIPE = Path(__file__).with_name("recipe_trainer.py")
ENV = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}


def start(ckpt_dir: Path, data_dir: Path, *args: str) -> subprocess.Popen:
    """The trainer in a process group of its own, as the agent's supervisor starts it."""
    return subprocess.Popen([sys.executable, str(RECIPE), str(ckpt_dir), str(data_dir), *args], env=ENV,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True)


def wait_for_step(proc: subprocess.Popen, step: int, timeout: float = 60.0) -> list[str]:
    """Read the trainer's ``step N`` lines until step ``step`` ran; return them."""
    deadline, lines = time.monotonic() + timeout, []
    while time.monotonic() < deadline:
        line = proc.stdout.readline()
        if not line:
            break
        lines.append(line.strip())
        if line.strip() == f"step {step}":
            return lines
    proc.kill()
    pytest.fail(f"step {step} never ran: {lines[-3:]} {proc.stderr.read()[-2000:]}")


def latest_step(ckpt_dir: Path) -> int | None:
    latest = CheckpointStore(ckpt_dir, framework="pytorch").latest()
    return None if latest is None else latest.step


@pytest.mark.parametrize("loader_args", [("--workers", "2", "--persistent", "--pin"), ("--workers", "2")],
                         ids=["persistent-pinned", "plain"])
def test_group_sigterm_with_loader_workers_saves_and_exits_0(tmp_path, digits_dir, loader_args):
    ckpt_dir = tmp_path / "ckpt"
    proc = start(ckpt_dir, digits_dir, "--steps", "400", "--step-delay", "0.05", "--every-steps", "1000", *loader_args)
    try:
        wait_for_step(proc, 5)
        os.killpg(proc.pid, signal.SIGTERM)  # the whole group: the trainer and its loader workers
        rest, err = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    ran = [int(line.split()[1]) for line in rest.splitlines() if line.startswith("step ")]
    last = max([5, *ran])
    assert "killed by signal" not in err, err[-2000:]
    assert proc.returncode == 0, err[-2000:]
    assert latest_step(ckpt_dir) == last + 1, err[-2000:]  # the notice checkpoint: 0 steps lost
