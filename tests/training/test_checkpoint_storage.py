"""Checkpoint storage that cannot take a checkpoint, with the Keras example job and real
file systems: a read-only bind mount (found before the first step, the path named) and a small
tmpfs that fills up during a save (the path, bytes and free space named, the previous checkpoint
kept, exit 74 so the node agent does not restart it: docs/contracts.md). Needs root for mount(8)."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from keras_jobs import REPO, SAVE_EVERY, STEP_DELAY
from spot_training.training.store import CheckpointStore

pytestmark = [pytest.mark.tensorflow, pytest.mark.slow]


def mount(*args: str) -> None:
    subprocess.run(["mount", *args], check=True, capture_output=True)


@pytest.fixture
def mounts():
    made = []
    if os.geteuid() != 0:
        pytest.fail("mount(8) needs root: make test runs as root (as CI does)")
    yield made
    for path in reversed(made):
        subprocess.run(["umount", "-l", str(path)], capture_output=True)


def test_read_only_checkpoint_directory_fails_before_the_first_step_naming_the_path(job, mounts):
    job.checkpoint_dir.mkdir(parents=True)
    (job.checkpoint_dir / "keep-me").write_text("x")
    mount("--bind", str(job.checkpoint_dir), str(job.checkpoint_dir))
    mounts.append(job.checkpoint_dir)
    mount("-o", "remount,ro,bind", str(job.checkpoint_dir))
    rc = job.run()
    err = job.stderr_text()
    assert rc != 0
    assert "CheckpointPathError" in err and f"checkpoint directory '{job.checkpoint_dir}' is not writable" in err
    assert "Read-only file system" in err
    assert job.logged_steps() == [], "training started although no checkpoint could ever be written"
    assert (job.checkpoint_dir / "keep-me").read_text() == "x"


def test_disk_full_during_a_save_names_path_and_sizes_keeps_the_previous_checkpoint_and_exits_74(job, mounts):
    job.checkpoint_dir.mkdir(parents=True)
    # One checkpoint of the example model takes ~400 kB of tmpfs (197 files of 4 kB pages or more;
    # 165 kB of data): room for one, not two.
    mount("-t", "tmpfs", "-o", "size=600k", "tmpfs", str(job.checkpoint_dir))
    mounts.append(job.checkpoint_dir)
    job.extra_args = ("--step-delay", STEP_DELAY)
    rc = job.run()
    err = job.stderr_text()
    assert rc == 74, err[-3000:]
    match = re.search(r"no space left writing a checkpoint at step (\d+) into '([^']+)': (\d+) bytes written "
                      r"before the device filled, (\d+) bytes free", err)
    assert match, err[-3000:]
    assert match.group(2) == str(job.checkpoint_dir) and int(match.group(1)) == 2 * SAVE_EVERY
    store = CheckpointStore(job.checkpoint_dir, framework="tensorflow")
    assert [c.step for c in store.checkpoints()] == [SAVE_EVERY]
    assert json.loads((job.checkpoint_dir / "LATEST").read_text())["step"] == SAVE_EVERY
    assert not list(job.checkpoint_dir.glob(".tmp-*")), "the partial write was not removed"
    assert not (job.checkpoint_dir / "COMPLETED").exists()
    # A restart (what a supervisor without the exit-74 rule would do) resumes from the kept checkpoint.
    rc = job.run()
    assert rc == 74
    assert job.logged_steps().count(SAVE_EVERY + 1) == 2


def test_read_only_checkpoint_directory_exits_74_from_the_plain_keras_recipe(tmp_path, mounts):
    # The documented recipe without run_script: ResumableFit itself ends the process with 74.
    ckpt = tmp_path / "ckpt"
    ckpt.mkdir()
    mount("--bind", str(ckpt), str(ckpt))
    mounts.append(ckpt)
    mount("-o", "remount,ro,bind", str(ckpt))
    env = {k: v for k, v in os.environ.items() if not k.startswith("SPOT_TRAINING_")}
    env.update(PYTHONPATH=str(REPO), TF_CPP_MIN_LOG_LEVEL="2")
    proc = subprocess.run([sys.executable, str(Path(__file__).with_name("phase_job.py")), "keras", str(ckpt)],
                          env=env, cwd=REPO, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 74, proc.stderr[-3000:]
    assert "CheckpointPathError" in proc.stderr and f"checkpoint directory '{ckpt}' is not writable" in proc.stderr
    assert "Traceback" not in proc.stderr
