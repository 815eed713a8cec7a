"""Keras ``model.fit`` through ResumableFit: real TensorFlow in subprocesses, real signals.

Every comparison is bitwise (the bytes of every model and optimizer variable), no tolerance: the
job runs with deterministic ops and one thread (spot_training/training/examples/keras_resnet.py explains why).
"""

from __future__ import annotations

import json
import random
import signal

import pytest

from keras_jobs import EPOCHS, SAVE_EVERY, STEP_DELAY, assert_bitwise_equal, load_weights
from spot_training.training.store import CheckpointStore

TOTAL = EPOCHS * 44
pytestmark = [pytest.mark.tensorflow, pytest.mark.slow]


def committed_step(job) -> int:
    return json.loads((job.checkpoint_dir / "LATEST").read_text())["step"]


@pytest.mark.parametrize("mode", ["background", "sync"])
def test_sigterm_at_a_random_step_exits_0_and_resumes_bitwise_equal(job, keras_reference, mode):
    extra = ("--step-delay", STEP_DELAY) + (("--sync",) if mode == "sync" else ())
    job.extra_args = extra
    at = random.randint(5, TOTAL - 10)
    proc = job.start()
    job.wait_for_rows(proc, at)
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(timeout=60) == 0, job.stderr_text()
    stopped = job.logged_steps()[-1]
    assert at <= stopped < TOTAL, f"signal at step {at}, stopped at {stopped}"
    assert committed_step(job) == stopped, "the SIGTERM save is committed before exit 0"
    assert not (job.checkpoint_dir / "COMPLETED").exists()

    assert job.run() == 0, job.stderr_text()
    assert job.logged_steps() == list(range(1, TOTAL + 1)), f"steps skipped or repeated (SIGTERM at {stopped})"
    assert (job.checkpoint_dir / "COMPLETED").exists()
    assert_bitwise_equal(load_weights(job.final_weights), keras_reference)


@pytest.mark.parametrize("mode,bound", [("sync", SAVE_EVERY), ("background", 2 * SAVE_EVERY)])
def test_sigkill_at_a_random_step_repeats_only_steps_after_the_last_checkpoint(job, keras_reference, mode, bound):
    # Lost steps: at most the save interval with synchronous saves; with background saves the write
    # of the newest checkpoint may still be under way when the kill lands, so at most two intervals.
    job.extra_args = ("--step-delay", STEP_DELAY) + (("--sync",) if mode == "sync" else ())
    at = random.randint(SAVE_EVERY + 2, TOTAL - 5)
    proc = job.start()
    job.wait_for_rows(proc, at)
    proc.send_signal(signal.SIGKILL)
    proc.wait(timeout=30)
    killed_at = job.logged_steps()[-1]
    resumed_from = committed_step(job)
    assert 0 < killed_at - resumed_from <= bound, (killed_at, resumed_from)

    assert job.run() == 0, job.stderr_text()
    expected = list(range(1, killed_at + 1)) + list(range(resumed_from + 1, TOTAL + 1))
    assert job.logged_steps() == expected, "only the steps after the last checkpoint ran twice"
    assert_bitwise_equal(load_weights(job.final_weights), keras_reference)


def test_newest_checkpoint_corrupted_resume_falls_back_and_still_ends_bitwise_equal(job, keras_reference):
    job.extra_args = ("--step-delay", STEP_DELAY)
    proc = job.start()
    job.wait_for_rows(proc, 2 * SAVE_EVERY + 3)
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(timeout=60) == 0, job.stderr_text()
    stopped = committed_step(job)
    newest = job.checkpoint_dir / f"ckpt-{stopped:012d}"
    victim = max((newest / "keras.variables").glob("*.npy"), key=lambda p: p.stat().st_size)
    data = bytearray(victim.read_bytes())
    data[len(data) // 2] ^= 0xFF  # one flipped byte, same size: only the checksum can tell
    victim.write_bytes(bytes(data))

    assert job.run() == 0, job.stderr_text()
    assert f"skipping checkpoint {newest}" in job.stderr_text()
    steps = job.logged_steps()
    assert steps == list(range(1, stopped + 1)) + list(range(2 * SAVE_EVERY + 1, TOTAL + 1))
    assert_bitwise_equal(load_weights(job.final_weights), keras_reference)


def test_sigusr1_and_request_file_add_checkpoints_without_stopping(job):
    job.extra_args = ("--step-delay", "0.05", "--save-every-steps", "0")
    proc = job.start()
    job.request_checkpoints(proc, 5, 15)
    assert proc.wait(timeout=120) == 0, job.stderr_text()
    store = CheckpointStore(job.checkpoint_dir, framework="tensorflow", keep=3)
    steps = [c.step for c in store.checkpoints()]
    assert steps[0] == TOTAL and len(steps) == 3, steps
    assert all(5 <= s < TOTAL for s in steps[1:]), f"extra checkpoints were not taken: {steps}"
    assert not job.request_file.exists(), "the request file is consumed"
    assert job.logged_steps() == list(range(1, TOTAL + 1))


def test_a_completed_job_restarted_runs_no_step(job):
    assert job.run() == 0, job.stderr_text()
    before = job.logged_steps()
    assert job.run() == 0, job.stderr_text()
    assert job.logged_steps() == before == list(range(1, TOTAL + 1))


def test_fails_when_model_shapes_do_not_match_and_deletes_nothing(job):
    job.extra_args = ("--step-delay", STEP_DELAY)
    proc = job.start()
    job.wait_for_rows(proc, SAVE_EVERY + 2)
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(timeout=60) == 0
    before = job.tree()
    assert job.run("--channels", "8") == 78  # docs/contracts.md: the checkpoint cannot serve this job
    err = job.stderr_text()
    assert "ShapeMismatchError" in err and str(job.checkpoint_dir / "ckpt-") in err
    assert "expects (3, 3, 1, 8)" in err and "(3, 3, 1, 16)" in err
    assert job.tree() == before


def test_fails_when_checkpoint_is_of_the_other_framework_and_deletes_nothing(job):
    CheckpointStore(job.checkpoint_dir, framework="mxnet", framework_version="1.9.1").save(
        lambda d: (d / "model.params.npz").write_bytes(b"mxnet"), step=30, epoch=0)
    before = job.tree()
    assert job.run() == 78
    err = job.stderr_text()
    assert "FrameworkMismatchError" in err and str(job.checkpoint_dir / "ckpt-000000000030") in err
    assert "'mxnet'" in err and "'tensorflow'" in err
    assert job.tree() == before


def test_fails_when_checkpoint_path_is_a_file(job):
    job.root.mkdir(parents=True)
    job.checkpoint_dir.write_text("keep me")
    assert job.run() == 74  # docs/contracts.md: checkpoint storage unusable
    err = job.stderr_text()
    assert "CheckpointPathError" in err and str(job.checkpoint_dir) in err and "not a directory" in err
    assert job.checkpoint_dir.read_text() == "keep me"
