"""Torture: SIGKILL the Gluon adapter in the middle of its real checkpoint writes, over and over.

Every restart must restore the newest checkpoint that was committed before the kill (the store's
atomic rename keeps a torn write invisible), and progress never goes backwards. The test also
counts kills that left a write in progress behind, to show that the kills did land mid-write.
"""

from __future__ import annotations

import os
import random
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from gluon_jobs import REPO

from spot_training.training.store import TMP_PREFIX, CheckpointStore

pytestmark = pytest.mark.mxnet

WORKER = Path(__file__).with_name("torture_worker.py")
KILLS = 20


def _start(directory: Path, mode: str) -> subprocess.Popen:
    env = dict(os.environ, PYTHONPATH=str(REPO), OMP_NUM_THREADS="1")
    return subprocess.Popen([sys.executable, str(WORKER), str(directory), mode], cwd=REPO, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True)


def _read_restored(proc: subprocess.Popen) -> int:
    line = proc.stdout.readline()
    if not line.startswith("restored "):
        proc.kill()
        raise AssertionError(f"worker did not restore: {line!r}\n{proc.stderr.read()}")
    return int(line.split()[1])


@pytest.mark.slow
def test_sigkill_during_gluon_checkpoint_writes_always_leaves_a_valid_checkpoint(tmp_path):
    directory = tmp_path / "checkpoints"
    rng = random.Random()
    seed = rng.randrange(2**32)
    rng.seed(seed)
    expected = 0  # the step the next restore must find
    killed_mid_write = 0
    history = []
    for attempt in range(KILLS):
        mode = "background" if attempt % 2 else "sync"
        proc = _start(directory, mode)
        try:
            restored = _read_restored(proc)
            assert restored == expected, f"seed {seed}, kill {attempt}: restored {restored}, expected {expected}"
            assert restored >= (history[-1] if history else 0)
            history.append(restored)
            # Let it save a few checkpoints, then kill. Background mode prints "saved" right after
            # handing the write to its thread, so a kill just then hits the write; sync mode is
            # killed at a random moment (most of its time goes to writing).
            for _ in range(rng.randint(2, 5)):
                proc.stdout.readline()
            time.sleep(rng.uniform(0.0, 0.01) if mode == "background" else rng.uniform(0.0, 0.2))
        finally:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
            proc.stdout.close()
            proc.stderr.close()
        if any(p.name.startswith(TMP_PREFIX + "ckpt-") for p in directory.iterdir()):
            killed_mid_write += 1
        # What a restart must find: the newest checkpoint that verifies (checked with the store,
        # before the restarted worker's store removes the torn write).
        latest = _peek_latest(directory, tmp_path / f"peek-{attempt}")
        assert latest is not None, f"seed {seed}, kill {attempt}: no valid checkpoint left"
        assert latest >= expected
        expected = latest
    final = _start(directory, "sync")
    try:
        assert _read_restored(final) == expected
    finally:
        os.killpg(final.pid, signal.SIGKILL)
        final.wait()
        final.stdout.close()
        final.stderr.close()
    print(f"torture: {killed_mid_write}/{KILLS} kills mid-write, restored steps {history}")
    assert killed_mid_write >= KILLS // 4, (
        f"only {killed_mid_write} of {KILLS} kills hit a write in progress (seed {seed}); the test did not torture")
    assert history[-1] > history[1], "training made no progress across restarts"


def _peek_latest(directory: Path, scratch: Path) -> int | None:
    """Newest verified checkpoint step, read from a copy: a store opened on ``directory`` itself would
    remove the torn temporary directory that the next worker has to cope with."""
    shutil.copytree(directory, scratch)
    try:
        ckpt = CheckpointStore(scratch, framework="mxnet").latest()
        return ckpt.step if ckpt is not None else None
    finally:
        shutil.rmtree(scratch)
