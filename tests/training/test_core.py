"""The framework-neutral driver (spot_training/training/core.py) with a numpy adapter: no framework imported.

The "model" is one float64 vector updated each step with draws from numpy's and Python's global
generators, so a resume is bitwise equal only if the driver restores the step, the adapter's state
and both host generator states.
"""

from __future__ import annotations

import errno
import random
import warnings
from pathlib import Path

import numpy as np
import pytest

from spot_training.training.core import (
    HOST_RNG_FILE,
    CheckpointDiskFullError,
    CheckpointDriver,
    StateAdapter,
    check_writable,
    renamed_option,
)
from spot_training.training.notice import NoticeHandler
from spot_training.training.store import CheckpointError, CheckpointPathError, ShapeMismatchError, write_file


class VectorAdapter(StateAdapter):
    framework = "pytorch"  # any framework name the store knows; the adapter name is what is checked
    adapter = "test-vector"

    def __init__(self, size: int = 8) -> None:
        self.w = np.zeros(size)
        self._buf = np.empty(size)
        self.snapshots = 0

    def snapshot(self, directory: Path):
        np.copyto(self._buf, self.w)
        self.snapshots += 1
        buf = self._buf
        return lambda: {"w.npy.raw": write_file(directory / "w.npy.raw", [buf])}

    def load(self, ckpt) -> None:
        raw = np.fromfile(ckpt.path / "w.npy.raw", dtype=np.float64)
        if raw.shape != self.w.shape:
            raise ShapeMismatchError(f"checkpoint {str(ckpt.path)!r}: w has shape {raw.shape}, model {self.w.shape}")
        self.w[:] = raw


def train(adapter: VectorAdapter, step: int) -> None:
    adapter.w += np.random.standard_normal(adapter.w.shape) * 1e-3 + random.random() + step


def run(directory: Path, total: int, *, stop_after: int | None = None, background: bool = True, seed: int = 0):
    np.random.seed(seed)
    random.seed(seed)
    adapter = VectorAdapter()
    notices = NoticeHandler(request_file=None, stop_signals=(), checkpoint_signals=())
    driver = CheckpointDriver(adapter, checkpoint_dir=directory, every_steps=5, background=background,
                              notices=notices, steps_per_epoch=4)
    ran = []
    try:
        for step in driver.steps(total):
            train(adapter, step)
            ran.append(step)
            if stop_after is not None and len(ran) == stop_after:
                notices.request_stop()
    except SystemExit as exit_:
        assert exit_.code == 0
    return adapter, driver, ran


@pytest.mark.parametrize("background", [True, False])
def test_stop_and_resume_is_bitwise_equal_to_an_uninterrupted_run(tmp_path: Path, background: bool) -> None:
    reference, _, ran_ref = run(tmp_path / "ref", 23, background=background)
    assert ran_ref == list(range(23))
    _, driver, first = run(tmp_path / "job", 23, stop_after=7, background=background)
    assert first == list(range(7))
    assert driver.store.latest().step == 7 and not driver.store.is_complete()
    assert (driver.store.latest().path / HOST_RNG_FILE).is_file()
    # The resumed process starts with other generator seeds: only a restore makes the draws match.
    resumed, driver2, second = run(tmp_path / "job", 23, background=background, seed=99)
    assert second == list(range(7, 23))
    assert driver2.restored.step == 7
    assert resumed.w.tobytes() == reference.w.tobytes()
    assert driver2.store.is_complete()


def test_completed_directory_yields_nothing(tmp_path: Path) -> None:
    run(tmp_path / "job", 10)
    adapter, driver, ran = run(tmp_path / "job", 10)
    assert ran == [] and driver.step == 10 and adapter.snapshots == 0


def test_stop_before_first_step_writes_nothing(tmp_path: Path) -> None:
    adapter = VectorAdapter()
    notices = NoticeHandler(request_file=None, stop_signals=(), checkpoint_signals=())
    notices.request_stop()
    driver = CheckpointDriver(adapter, checkpoint_dir=tmp_path, notices=notices)
    with pytest.raises(SystemExit) as exit_:
        for _ in driver.steps(10):
            pytest.fail("no step may run after a stop that came before the first step")
    assert exit_.value.code == 0 and driver.store.latest() is None


def test_cadence_from_environment(tmp_path: Path, monkeypatch) -> None:
    monkeypatch.setenv("SPOT_TRAINING_CHECKPOINT_EVERY_STEPS", "3")
    adapter = VectorAdapter()
    driver = CheckpointDriver(adapter, checkpoint_dir=tmp_path, background=False,
                              notices=NoticeHandler(request_file=None, stop_signals=(), checkpoint_signals=()))
    for step in driver.steps(7):
        train(adapter, step)
    assert driver.schedule.every_steps == 3
    assert [c.step for c in driver.store.checkpoints()] == [7, 6, 3]


def test_bad_cadence_in_environment_names_the_variable(tmp_path: Path, monkeypatch) -> None:
    monkeypatch.setenv("SPOT_TRAINING_CHECKPOINT_EVERY_STEPS", "often")
    with pytest.raises(ValueError, match="SPOT_TRAINING_CHECKPOINT_EVERY_STEPS"):
        CheckpointDriver(VectorAdapter(), checkpoint_dir=tmp_path)


def test_another_adapters_checkpoint_is_refused_and_kept(tmp_path: Path) -> None:
    run(tmp_path / "job", 10)

    class Other(VectorAdapter):
        adapter = "someone-else"

    driver = CheckpointDriver(Other(), checkpoint_dir=tmp_path / "job")
    with pytest.raises(CheckpointError, match="test-vector"):
        driver.restore()
    assert driver.store.latest().step == 10


def test_changed_model_is_refused_with_the_path(tmp_path: Path) -> None:
    run(tmp_path / "job", 10)
    driver = CheckpointDriver(VectorAdapter(size=3), checkpoint_dir=tmp_path / "job")
    with pytest.raises(ShapeMismatchError, match="ckpt-000000000010"):
        driver.restore()


def test_path_that_is_a_file_is_refused(tmp_path: Path) -> None:
    (tmp_path / "f").write_text("x")
    with pytest.raises(CheckpointPathError, match=str(tmp_path / "f")):
        check_writable(tmp_path / "f")


def test_disk_full_names_the_directory_and_keeps_the_previous_checkpoint(tmp_path: Path) -> None:
    adapter = VectorAdapter()
    driver = CheckpointDriver(adapter, checkpoint_dir=tmp_path, background=True,
                              notices=NoticeHandler(request_file=None, stop_signals=(), checkpoint_signals=()))
    driver.step = 5
    driver.save(wait=True)

    def full(directory: Path):
        def write():
            (directory / "part").write_bytes(b"x" * 100)
            raise OSError(errno.ENOSPC, "No space left on device")
        return write

    adapter.snapshot = full
    driver.step = 10
    with pytest.raises(CheckpointDiskFullError, match=str(tmp_path)) as err:
        driver.save(wait=True)
    assert "100 bytes" in str(err.value) and "free" in str(err.value)
    assert driver.store.latest().step == 5
    assert not list(tmp_path.glob(".tmp-*"))
    driver.close()


def test_renamed_option_warns_and_maps() -> None:
    opts = {"save_every_steps": 7}
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        value = renamed_option(opts, "save_every_steps", "every_steps", 50, owner="X", unset=50)
    assert value == 7 and opts == {}
    assert "every_steps" in str(caught[0].message) and caught[0].category is DeprecationWarning
    with pytest.raises(TypeError, match="not both"):
        renamed_option({"save_every_steps": 7}, "save_every_steps", "every_steps", 9, owner="X", unset=50)


def test_before_save_runs_on_every_rank_and_only_the_writer_snapshots(tmp_path: Path) -> None:
    """A distributed job's non-writing ranks still meet the adapter before each save (where a
    PyTorch job gathers every rank's generator states to rank 0), once per saved step."""

    class Rank(VectorAdapter):
        def __init__(self, writer: bool) -> None:
            super().__init__()
            self.is_writer = writer
            self.before = 0

        def before_save(self) -> None:
            self.before += 1

    for writer in (True, False):
        adapter = Rank(writer)
        driver = CheckpointDriver(adapter, checkpoint_dir=tmp_path / str(writer), every_steps=2, background=False,
                                  notices=NoticeHandler(request_file=None, stop_signals=(), checkpoint_signals=()))
        for step in driver.steps(5):
            train(adapter, step)
        assert adapter.before == 3  # steps 2, 4 and the final 5
        assert adapter.snapshots == (3 if writer else 0)


def test_stop_training_ends_early_with_a_final_checkpoint_and_completed(tmp_path: Path) -> None:
    driver = CheckpointDriver(VectorAdapter(), checkpoint_dir=tmp_path, every_steps=None, background=False,
                              notices=NoticeHandler(request_file=None, stop_signals=(), checkpoint_signals=()))
    for step in driver.steps(20):
        train(driver.adapter, step)
        if step == 6:  # early stopping after the 7th step
            driver.stop_training = True
    assert driver.store.latest().step == 7
    assert driver.store.is_complete()


def test_break_out_of_steps_is_refused_loudly_and_writes_no_completed(tmp_path: Path, caplog) -> None:
    driver = CheckpointDriver(VectorAdapter(), checkpoint_dir=tmp_path, every_steps=None, background=False,
                              notices=NoticeHandler(request_file=None, stop_signals=(), checkpoint_signals=()))
    for step in driver.steps(20):
        train(driver.adapter, step)
        if step == 6:
            break
    assert not driver.store.is_complete()
    errors = [r for r in caplog.records if r.levelname == "ERROR"]
    assert errors and "left during step 6 of 20" in errors[0].getMessage()
    assert "stop_training = True" in errors[0].getMessage()
