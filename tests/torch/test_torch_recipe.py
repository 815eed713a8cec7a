"""The recipe of docs/training-pytorch.md as a new user writes it (tests/torch/recipe_trainer.py, no exit-code
mapping of its own), stopped the way the node agent stops it: SIGTERM to the trainer's whole process
group (spot_training/agent/supervisor.py ``terminate``), DataLoader workers included."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from spot_training.training.store import CheckpointStore

pytestmark = [pytest.mark.torch, pytest.mark.slow]

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


@pytest.mark.parametrize("loader_args", [("--workers", "2", "--persistent", "--pin")], ids=["persistent-pinned"])
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


def run(ckpt_dir: Path, data_dir: Path, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(RECIPE), str(ckpt_dir), str(data_dir), *args], env=ENV,
                          capture_output=True, text=True, timeout=120)


def test_gradient_accumulation_resumes_bitwise_from_a_mid_accumulation_notice(tmp_path, digits_dir):
    import numpy as np

    args = ("--steps", "24", "--accumulate", "4", "--every-steps", "1000")
    ref = run(tmp_path / "ref", digits_dir, *args, "--final", str(tmp_path / "ref.npz"))
    assert ref.returncode == 0, ref.stderr[-2000:]
    proc = start(tmp_path / "ckpt", digits_dir, *args, "--step-delay", "0.2")
    wait_for_step(proc, 9)  # 10 micro-batches done: 2 of the third accumulation window
    os.kill(proc.pid, signal.SIGTERM)
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == 0, err[-2000:]
    stopped_at = latest_step(tmp_path / "ckpt")
    assert stopped_at % 4 != 0, f"the notice landed on an accumulation boundary ({stopped_at}); the test needs one inside"
    done = run(tmp_path / "ckpt", digits_dir, *args, "--final", str(tmp_path / "resumed.npz"))
    assert done.returncode == 0, done.stderr[-2000:]
    with np.load(tmp_path / "ref.npz") as a, np.load(tmp_path / "resumed.npz") as b:
        assert sorted(a.files) == sorted(b.files)
        differ = [k for k in a.files if not np.array_equal(a[k], b[k])]
    assert not differ, f"{len(differ)} state entries differ after a resume mid-accumulation: {differ[:5]}"


def test_early_stop_with_finish_commits_the_step_and_completed(tmp_path, digits_dir):
    ckpt_dir = tmp_path / "ckpt"
    logs = tmp_path / "logs"  # the docs' optional progress lines (TrainingLog)
    first = run(ckpt_dir, digits_dir, "--steps", "40", "--stop-at", "14", "--finish-on-stop", "--log-dir", str(logs))
    assert first.returncode == 0, first.stderr[-2000:]
    assert latest_step(ckpt_dir) == 15  # steps 0..14 ran: 15 completed
    assert (ckpt_dir / "COMPLETED").is_file()
    again = run(ckpt_dir, digits_dir, "--steps", "40", "--stop-at", "14", "--finish-on-stop", "--log-dir", str(logs))
    assert again.returncode == 0 and "step " not in again.stdout, again.stdout[-500:]
    rows = (logs / "training_log.csv").read_text().splitlines()
    assert rows[0] == "step,epoch,loss,accuracy,wall_time" and [r.split(",")[0] for r in rows[1:]] == [
        str(s) for s in range(1, 16)]
    assert json.loads((logs / "progress.json").read_text()) == {"steps_total": 40}


def test_early_stop_with_a_bare_break_is_refused_loudly(tmp_path, digits_dir):
    ckpt_dir = tmp_path / "ckpt"
    out = run(ckpt_dir, digits_dir, "--steps", "40", "--stop-at", "14")
    assert not (ckpt_dir / "COMPLETED").exists()
    assert "ERROR" in out.stderr and "without ckpt.finish()" in out.stderr, out.stderr[-2000:]


@pytest.mark.parametrize("case", ["file", "other-framework"])
def test_recipe_failures_exit_with_the_contract_codes(tmp_path, digits_dir, case):
    ckpt_dir = tmp_path / "ckpt"
    expected = 74
    if case == "file":
        ckpt_dir.write_text("not a directory")
    else:
        expected = 78
        assert run(ckpt_dir, digits_dir, "--steps", "10", "--every-steps", "5").returncode == 0
        (ckpt_dir / "COMPLETED").unlink()
        if case == "other-framework":
            for manifest in ckpt_dir.glob("ckpt-*/manifest.json"):
                manifest.write_text(manifest.read_text().replace('"pytorch"', '"tensorflow"'))
    out = run(ckpt_dir, digits_dir, "--steps", "20")
    assert out.returncode == expected, out.stderr[-2000:]
    assert str(ckpt_dir) in out.stderr and "Traceback" not in out.stderr, out.stderr[-2000:]


def test_changed_optimizer_or_batch_size_is_refused_before_loading(tmp_path, digits_dir):
    import re

    ckpt_dir = tmp_path / "ckpt"
    assert run(ckpt_dir, digits_dir, "--steps", "10", "--every-steps", "5").returncode == 0
    (ckpt_dir / "COMPLETED").unlink()
    for flag, value, words in [("--optimizer", "adamw", "optimizer 'SGD'.*'AdamW'"),
                               ("--batch-size", "16", "batch size per rank 32.*16")]:
        out = run(ckpt_dir, digits_dir, "--steps", "20", flag, value)
        assert out.returncode == 78, (flag, out.stderr[-2000:])
        assert re.search(rf"ckpt-0*10'.*{words}", out.stderr), (flag, out.stderr[-2000:])
        assert "restored" not in out.stderr and "Traceback" not in out.stderr, (flag, out.stderr[-2000:])
