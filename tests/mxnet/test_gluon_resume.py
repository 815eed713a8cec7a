"""Real MXNet training interrupted by real signals, resumed, compared bitwise with an uninterrupted run.

Each trainer is ``spot_training/training/examples/gluon_resnet.py`` in its own process (90 steps, checkpoints every
20 steps, seed 7). The interruption step is random; its value is in the assertion messages.
"""

from __future__ import annotations

import json
import random
import signal

import pytest
from gluon_jobs import SAVE_EVERY, TOTAL_STEPS, assert_bitwise_equal, load_params

from spot_training.training.store import CheckpointStore

pytestmark = pytest.mark.mxnet

ALL_STEPS = list(range(1, TOTAL_STEPS + 1))


def _committed_step(job) -> int:
    latest = CheckpointStore(job.checkpoint_dir, framework="mxnet").latest()
    return latest.step if latest is not None else 0


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["background", "sync"])
def test_sigterm_at_a_random_step_exits_0_and_resumes_bitwise_equal(job, reference_params, mode):
    if mode == "sync":
        job.extra_args = ("--sync",)
    at = random.randrange(3, TOTAL_STEPS - 5)
    proc = job.start()
    job.wait_for_rows(proc, at)
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(timeout=60) == 0, f"SIGTERM after step {at}: {job.stderr_text()}"
    stopped = job.logged_steps()
    assert stopped == list(range(1, len(stopped) + 1)) and len(stopped) >= at
    assert len(stopped) < TOTAL_STEPS, "the run finished before the signal took effect"
    # The notice cost nothing: the checkpoint holds every step that ran.
    assert _committed_step(job) == len(stopped), f"SIGTERM after step {at}"
    assert not (job.checkpoint_dir / "COMPLETED").exists()
    assert not job.final_params.exists()

    assert job.run() == 0, job.stderr_text()
    # Exactly once: no step skipped, none repeated.
    assert job.logged_steps() == ALL_STEPS, f"SIGTERM after step {at}"
    assert_bitwise_equal(load_params(job.final_params), reference_params)
    completed = json.loads((job.checkpoint_dir / "COMPLETED").read_text())
    assert completed["step"] == TOTAL_STEPS
    # The total the node agent publishes for an ETA, as the Keras and PyTorch examples write it.
    assert json.loads(job.log_path.with_name("progress.json").read_text()) == {"steps_total": TOTAL_STEPS}


@pytest.mark.slow
def test_sigkill_at_a_random_step_repeats_only_steps_after_the_last_checkpoint(job, reference_params):
    at = random.randrange(SAVE_EVERY + 2, TOTAL_STEPS - 5)
    proc = job.start()
    job.wait_for_rows(proc, at)
    # Kill only once a checkpoint has been committed, so that the resume really restores one (on a
    # busy machine the background write of step 20 can still be running a few steps later).
    job.wait_for_file(proc, job.checkpoint_dir / "LATEST")
    proc.send_signal(signal.SIGKILL)
    assert proc.wait(timeout=60) == -signal.SIGKILL
    before = job.logged_steps()
    committed = _committed_step(job)
    assert before == list(range(1, len(before) + 1))
    assert committed % SAVE_EVERY == 0 and 0 < committed <= len(before), (at, committed, before[-1])

    assert job.run() == 0, job.stderr_text()
    after = job.logged_steps()[len(before):]
    # The resumed run starts right after the last committed checkpoint and runs to the end:
    # nothing skipped, and the only repeats are the steps between that checkpoint and the kill.
    assert after == list(range(committed + 1, TOTAL_STEPS + 1)), f"SIGKILL after step {at}"
    repeated = sorted(set(before) & set(after))
    assert repeated == list(range(committed + 1, len(before) + 1))
    assert sorted(set(before) | set(after)) == ALL_STEPS
    assert_bitwise_equal(load_params(job.final_params), reference_params)


@pytest.mark.slow
def test_sigusr1_and_request_file_add_checkpoints_without_stopping(job):
    job.extra_args = ("--save-every-steps", "0", "--keep", "5")  # no cadence: only requested saves
    proc = job.start()
    job.request_checkpoints(proc, 10, 40, "rebalance recommendation\n")
    assert proc.wait(timeout=60) == 0, job.stderr_text()
    assert job.logged_steps() == ALL_STEPS
    assert not job.request_file.exists(), "the request file is consumed"
    steps = sorted(c.step for c in CheckpointStore(job.checkpoint_dir, framework="mxnet").checkpoints())
    assert len(steps) == 3 and steps[-1] == TOTAL_STEPS, steps
    assert 10 <= steps[0] < 40 <= steps[1] < TOTAL_STEPS, steps


@pytest.mark.slow
def test_a_completed_job_restarted_runs_no_step(job):
    job.extra_args = ("--steps", "25")  # overrides TOTAL_STEPS (argparse keeps the last value)
    assert job.run() == 0, job.stderr_text()
    assert job.logged_steps() == list(range(1, 26))
    assert job.run() == 0, job.stderr_text()
    assert job.logged_steps() == list(range(1, 26))
    assert json.loads((job.checkpoint_dir / "COMPLETED").read_text())["step"] == 25
