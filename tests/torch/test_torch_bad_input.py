"""Bad checkpoint input: a clear error naming the path, nothing deleted, exit 74 (storage full or
unusable) or 78 (a checkpoint that cannot serve this job): restarting cannot help, and the node
agent's supervisor does not restart either (docs/contracts.md); the trainer exits at once."""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import pytest
from torch_jobs import Job

from spot_training.training.store import CheckpointStore, write_file

pytestmark = pytest.mark.torch

EXIT_STORAGE = 74
EXIT_MISMATCH = 78


def _tree(path: Path) -> dict[str, bytes]:
    return {str(p.relative_to(path)): p.read_bytes() for p in sorted(path.rglob("*")) if p.is_file()}


@pytest.mark.integration
def test_checkpoint_path_that_is_a_file(job):
    job.checkpoint_dir.write_text("not a directory")
    assert job.run() == EXIT_STORAGE
    text = job.stderr_text()
    assert str(job.checkpoint_dir) in text and "not a directory" in text
    assert job.checkpoint_dir.read_text() == "not a directory"
    assert job.logged_steps() == []  # refused before the first step


@pytest.fixture
def read_only_dir(tmp_path):
    """A read-only bind mount (the tests run as root, who could write to a chmod-ed directory)."""
    target = tmp_path / "ro"
    target.mkdir()
    (target / "keep.txt").write_text("kept")
    if subprocess.run(["mount", "--bind", str(target), str(target)], capture_output=True).returncode != 0:
        pytest.fail("mount --bind failed: make test runs as root (as CI does), which this test needs")
    try:
        subprocess.run(["mount", "-o", "remount,ro,bind", str(target)], check=True, capture_output=True)
        yield target
    finally:
        subprocess.run(["umount", str(target)], check=False, capture_output=True)


@pytest.mark.integration
def test_read_only_checkpoint_directory(job, read_only_dir):
    job.extra_args = ("--checkpoint-dir", str(read_only_dir))
    assert job.run() == EXIT_STORAGE
    text = job.stderr_text()
    assert str(read_only_dir) in text and "not writable" in text
    assert _tree(read_only_dir) == {"keep.txt": b"kept"}
    assert job.logged_steps() == []


@pytest.fixture
def small_tmpfs(tmp_path):
    target = tmp_path / "small"
    target.mkdir()
    # Room for a few checkpoints of the ~0.3 MB state, not for keep=3 of them plus a write.
    if subprocess.run(["mount", "-t", "tmpfs", "-o", "size=600k", "tmpfs", str(target)],
                      capture_output=True).returncode != 0:
        pytest.fail("mount -t tmpfs failed: make test runs as root (as CI does), which this test needs")
    try:
        yield target
    finally:
        subprocess.run(["umount", str(target)], check=False, capture_output=True)


@pytest.mark.integration
def test_disk_full_names_the_path_keeps_the_previous_checkpoint_and_exits(job, small_tmpfs):
    job.extra_args = ("--checkpoint-dir", str(small_tmpfs), "--save-every-steps", "5")
    assert job.run() == EXIT_STORAGE, job.stderr_text()
    text = job.stderr_text()
    assert "no space left" in text and str(small_tmpfs) in text and "bytes free" in text
    store = CheckpointStore(small_tmpfs, framework="pytorch")
    kept = store.latest()
    assert kept is not None and kept.step > 0  # the previous checkpoint verifies
    before = _tree(kept.path)
    # A restart resumes from it, meets the full disk again and exits again: no loop inside.
    assert job.run() == EXIT_STORAGE
    assert f"restored {kept.path}" in job.stderr_text(job.started[-1])
    assert _tree(kept.path) == before


@pytest.mark.integration
def test_another_frameworks_checkpoint_is_refused_and_kept(job):
    store = CheckpointStore(job.checkpoint_dir, framework="tensorflow")
    store.save(lambda d: write_file(d / "weights.bin", [b"\0" * 64]), step=10, epoch=0)
    before = _tree(job.checkpoint_dir)
    assert job.run() == EXIT_MISMATCH
    text = job.stderr_text()
    assert "tensorflow" in text and str(job.checkpoint_dir / "ckpt-000000000010") in text
    assert _tree(job.checkpoint_dir) == before


@pytest.mark.integration
def test_changed_model_is_refused_naming_path_and_variable(job):
    assert job.run("--steps", "10") == 0  # a finished 10-step job with the default 16 channels
    before = _tree(job.checkpoint_dir)
    shutil.rmtree(job.root / "logs")
    assert job.run("--steps", "20", "--channels", "8") == EXIT_MISMATCH
    text = job.stderr_text(job.started[-1])
    assert "ShapeMismatch" in text or "shape" in text
    assert str(job.checkpoint_dir / "ckpt-000000000010") in text and "'0.weight'" in text
    assert _tree(job.checkpoint_dir) == before
    assert job.logged_steps() == []
