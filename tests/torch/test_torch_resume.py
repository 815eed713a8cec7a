"""PyTorch resumes bitwise after real SIGTERM and SIGKILL at random steps (CPU, deterministic
algorithms; BatchNorm, Dropout, OneCycleLR, AdamW, augmentation from torch's generator)."""

from __future__ import annotations

import os
import random
import re
import signal
import time

import pytest
from job_helpers import child_pids
from torch_jobs import SAVE_EVERY, TOTAL_STEPS, Job, assert_bitwise_equal, load_state

from spot_training.training.store import TMP_PREFIX, CheckpointStore

pytestmark = pytest.mark.torch


def _interrupt(job: Job, sig: signal.Signals, at_rows: int, *more: str) -> int:
    proc = job.start(*more, "--step-delay", "0.01")
    job.wait_for_rows(proc, at_rows)
    os.kill(proc.pid, sig)
    return proc.wait(timeout=120)


@pytest.mark.integration
def test_sigterm_at_random_steps_resumes_bitwise(job, reference_state):
    rng = random.Random()
    stops = sorted(rng.sample(range(3, TOTAL_STEPS - 5), 2))
    for at in stops:
        before = len(job.logged_steps())
        assert _interrupt(job, signal.SIGTERM, at) == 0, job.stderr_text()
        stopped = job.logged_steps()[-1]
        assert stopped >= at and stopped > before
        # The stop saved exactly the step it stopped at (waited for before exit 0).
        latest = CheckpointStore(job.checkpoint_dir, framework="pytorch").latest()
        assert latest.step == stopped, f"stops {stops}"
    assert job.run() == 0, job.stderr_text()
    assert job.restored_step(job.started[-1]) == stopped
    # Every step ran exactly once: the resumed run continued at the step after the stop.
    assert job.logged_steps() == list(range(1, TOTAL_STEPS + 1)), f"stops {stops}"
    assert (job.checkpoint_dir / "COMPLETED").is_file()
    assert_bitwise_equal(load_state(job.final_weights), reference_state)


@pytest.mark.integration
def test_sigkill_at_random_steps_resumes_from_the_newest_checkpoint(job, reference_state):
    rng = random.Random()
    kills = sorted(rng.sample(range(SAVE_EVERY + 2, TOTAL_STEPS - 3), 2))
    for at in kills:
        assert _interrupt(job, signal.SIGKILL, at) == -signal.SIGKILL
        newest = CheckpointStore(job.checkpoint_dir, framework="pytorch").latest().step
        proc = job.start("--step-delay", "0.01") if at != kills[-1] else None
        if proc is not None:
            job.wait_for_rows(proc, len(job.logged_steps()) + 1)
            assert job.restored_step(proc) == newest
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    assert job.run() == 0, job.stderr_text()
    restored = job.restored_step(job.started[-1])
    assert restored is not None and restored % SAVE_EVERY == 0
    # What SIGKILL lost: at most one interval plus the write in flight; redone, not skipped.
    logged = job.logged_steps()
    assert sorted(set(logged)) == list(range(1, TOTAL_STEPS + 1))
    assert_bitwise_equal(load_state(job.final_weights), reference_state)


@pytest.mark.integration
def test_corrupt_newest_checkpoint_falls_back_to_the_previous_one(job, reference_state):
    assert _interrupt(job, signal.SIGTERM, 25) == 0
    store = CheckpointStore(job.checkpoint_dir, framework="pytorch")
    newest, previous = store.checkpoints()[:2]
    blob = newest.path / "tensors.bin"
    data = bytearray(blob.read_bytes())
    data[len(data) // 2] ^= 0xFF
    blob.write_bytes(bytes(data))
    assert job.run() == 0, job.stderr_text()
    text = job.stderr_text(job.started[-1])
    assert "falling back" in text and str(newest.path) in text
    assert job.restored_step(job.started[-1]) == previous.step
    assert_bitwise_equal(load_state(job.final_weights), reference_state)


@pytest.mark.integration
def test_sigterm_while_torch_is_imported_exits_0_without_a_step(job):
    """The example installs its SIGTERM handler before ``import torch`` (seconds): a notice in that
    window ends the job with exit 0 before any step instead of -15."""
    proc = job.start()
    deadline = time.monotonic() + 60
    while not _catches_sigterm(proc.pid):
        assert proc.poll() is None and time.monotonic() < deadline, job.stderr_text(proc)
        time.sleep(0.002)
    os.kill(proc.pid, signal.SIGTERM)
    assert proc.wait(timeout=120) == 0, job.stderr_text(proc)
    assert "stop requested before the first step" in job.stderr_text(proc)
    assert job.logged_steps() == []
    assert CheckpointStore(job.checkpoint_dir, framework="pytorch").latest() is None


def _catches_sigterm(pid: int) -> bool:
    for line in open(f"/proc/{pid}/status"):
        if line.startswith("SigCgt:"):
            return bool(int(line.split()[1], 16) & (1 << (signal.SIGTERM - 1)))
    return False


@pytest.mark.slow
def test_compiled_and_plain_models_restore_each_others_checkpoints(job, reference_state):
    """torch.compile'd (``_orig_mod.`` keys inside) -> plain -> compiled: one key space, bitwise result."""
    assert _interrupt(job, signal.SIGTERM, 15, "--compile", "eager") == 0, job.stderr_text()
    first = job.logged_steps()[-1]
    assert _interrupt(job, signal.SIGTERM, first + 10) == 0, job.stderr_text()
    assert job.restored_step(job.started[-1]) == first
    second = job.logged_steps()[-1]
    assert job.run("--compile", "eager") == 0, job.stderr_text()
    assert job.restored_step(job.started[-1]) == second
    assert_bitwise_equal(load_state(job.final_weights), reference_state)


@pytest.mark.slow
def test_torture_sigkill_during_checkpoint_writes(job, reference_state):
    """>= 20 SIGKILLs while the writer thread writes (a save every step, background): every restart
    resumes from the newest checkpoint that verifies, progress never goes back, the end is bitwise equal."""
    rng = random.Random()
    seed = rng.randrange(2**32)
    rng.seed(seed)
    expected, killed_mid_write, kills = 0, 0, 20
    for attempt in range(kills):
        proc = job.start("--save-every-steps", "1", "--keep", "2")
        job.wait_for_rows(proc, len(job.logged_steps()) + rng.randint(1, 3))
        restored = job.restored_step(proc) or 0
        assert restored == expected, f"seed {seed}, kill {attempt}: restored {restored}, expected {expected}"
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
        if any(p.name.startswith(TMP_PREFIX) for p in job.checkpoint_dir.iterdir()):
            killed_mid_write += 1
        latest = CheckpointStore(job.checkpoint_dir, framework="pytorch").latest()
        # A kill before the first write committed leaves none (a fresh start); never one older than before.
        latest_step = latest.step if latest is not None else 0
        assert latest_step >= expected and (latest is not None or expected == 0), f"seed {seed}, kill {attempt}"
        expected = latest_step
        if expected >= TOTAL_STEPS:
            break
    assert killed_mid_write >= 3, f"seed {seed}: only {killed_mid_write} of {kills} kills landed during a write"
    assert job.run("--save-every-steps", "1", "--keep", "2") == 0, job.stderr_text()
    assert_bitwise_equal(load_state(job.final_weights), reference_state)


@pytest.mark.slow
def test_ddp_sigterm_to_one_rank_saves_once_on_both_at_the_same_step(tmp_path, digits_dir):
    """torchrun --standalone --nproc-per-node=2 (gloo): SIGTERM to rank 1 only -> one save at one
    step, every rank exits 0, the resumed job ends bitwise equal to an uninterrupted DDP run."""
    ref = Job(root=tmp_path / "ref", data_dir=digits_dir, nproc=2)
    ref.root.mkdir()
    job = Job(root=tmp_path / "job", data_dir=digits_dir, nproc=2)
    job.root.mkdir()
    try:
        assert ref.run(timeout=300) == 0, ref.stderr_text()
        proc = job.start("--step-delay", "0.02")
        job.wait_for_rows(proc, 12)
        workers = child_pids(proc.pid)
        assert len(workers) == 2, workers
        os.kill(workers[-1], signal.SIGTERM)  # the higher pid: rank 1 in practice; either rank must do
        assert proc.wait(timeout=120) == 0, job.stderr_text()
        stopped = job.logged_steps()[-1]
        # Both ranks stopped after the same step (one agreed save; rank 1 got the signal, rank 0 did not).
        assert re.findall(r"checkpoint at step (\d+) written", job.stderr_text(proc)) == [str(stopped)] * 2
        store = CheckpointStore(job.checkpoint_dir, framework="pytorch")
        assert store.latest().step == stopped
        assert store.latest().metadata["world_size"] == 2
        assert job.run(timeout=300) == 0, job.stderr_text()
        assert job.logged_steps() == list(range(1, job.logged_steps()[-1] + 1))
        assert_bitwise_equal(load_state(job.final_weights), load_state(ref.final_weights))
    finally:
        ref.kill_leftovers()
        job.kill_leftovers()
