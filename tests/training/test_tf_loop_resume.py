"""Custom TensorFlow loops through TFCheckpointer (tf.train.Checkpoint written via the store):
real TensorFlow in subprocesses, real signals, bitwise comparisons (no tolerance; deterministic
ops, one thread, batches from the step number)."""

from __future__ import annotations

import json
import random
import signal

import pytest

from keras_jobs import EPOCHS, SAVE_EVERY, STEP_DELAY, TF_LOOP_JOB, Job, assert_bitwise_equal, load_weights

TOTAL = EPOCHS * 44
pytestmark = [pytest.mark.tensorflow, pytest.mark.slow]


@pytest.fixture(scope="session")
def loop_reference(tmp_path_factory, digits_dir):
    ref = Job(tmp_path_factory.mktemp("tf-loop-reference"), digits_dir, script=TF_LOOP_JOB)
    assert ref.run() == 0, ref.stderr_text()
    return load_weights(ref.final_weights)


@pytest.fixture
def loop_job(tmp_path, digits_dir) -> Job:
    return Job(tmp_path / "loop", digits_dir, script=TF_LOOP_JOB)


def committed_step(job) -> int:
    return json.loads((job.checkpoint_dir / "LATEST").read_text())["step"]


def test_sigterm_after_several_background_saves_resumes_bitwise_equal(loop_job, loop_reference):
    # Two or more asynchronous tf.train.Checkpoint writes before the stop: the resumed state comes
    # from TensorFlow's async writer (and the Keras variable fix in spot_training/training/tf_loop.py).
    loop_job.extra_args = ("--step-delay", STEP_DELAY)
    at = random.randint(2 * SAVE_EVERY + 1, TOTAL - 5)
    proc = loop_job.signal_at(at, signal.SIGTERM)
    assert proc.wait(timeout=60) == 0, loop_job.stderr_text()
    stopped = loop_job.logged_steps()[-1]
    assert committed_step(loop_job) == stopped >= at

    assert loop_job.run() == 0, loop_job.stderr_text()
    assert loop_job.logged_steps() == list(range(1, TOTAL + 1))
    assert (loop_job.checkpoint_dir / "COMPLETED").exists()
    assert_bitwise_equal(load_weights(loop_job.final_weights), loop_reference)


def test_sigkill_resumes_from_the_last_background_checkpoint_bitwise_equal(loop_job, loop_reference):
    loop_job.extra_args = ("--step-delay", STEP_DELAY)
    at = random.randint(2 * SAVE_EVERY + 2, TOTAL - 5)
    proc = loop_job.signal_at(at, signal.SIGKILL)
    proc.wait(timeout=30)
    killed_at, resumed_from = loop_job.logged_steps()[-1], committed_step(loop_job)
    # Background saves: the newest write may still be under way at the kill, so up to two intervals.
    assert 0 < killed_at - resumed_from <= 2 * SAVE_EVERY

    assert loop_job.run() == 0, loop_job.stderr_text()
    assert loop_job.logged_steps() == list(range(1, killed_at + 1)) + list(range(resumed_from + 1, TOTAL + 1))
    assert_bitwise_equal(load_weights(loop_job.final_weights), loop_reference)


def test_fails_when_model_shapes_do_not_match_and_deletes_nothing(loop_job):
    loop_job.extra_args = ("--sync", "--step-delay", STEP_DELAY)
    proc = loop_job.start()
    loop_job.wait_for_rows(proc, SAVE_EVERY + 2)
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(timeout=60) == 0, loop_job.stderr_text()
    before = loop_job.tree()
    assert loop_job.run("--channels", "8") != 0
    err = loop_job.stderr_text()
    assert "ShapeMismatchError" in err and str(loop_job.checkpoint_dir / "ckpt-") in err
    assert "shape" in err and "16" in err and "8" in err
    assert loop_job.tree() == before
