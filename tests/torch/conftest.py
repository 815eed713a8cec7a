"""Fixtures for the PyTorch tests (this directory runs in its own pytest process in .venv-torch, with
``--confcutdir=tests/torch``: the Makefile's ``test`` target).

Training runs in subprocesses of ``training/examples/torch_resnet.py`` on CPU with deterministic
algorithms and one thread: 60 steps of batch 32 on the 8x8 digits, a few seconds each.
"""

from __future__ import annotations

import sys
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

sys.path.insert(0, str(Path(__file__).parent))

try:
    import torch  # noqa: F401
except ImportError:  # collected by the main environment's pytest: these run in .venv-torch (Makefile)
    collect_ignore_glob = ["test_*.py"]

from torch_jobs import TOTAL_STEPS, Job, load_state  # noqa: E402

from training.examples.prepare_data import prepare_digits  # noqa: E402


@pytest.fixture(scope="session")
def digits_dir(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("datasets")
    prepare_digits(out)
    return out


@pytest.fixture
def job(tmp_path, digits_dir) -> Iterator[Job]:
    """A fresh job; any trainer it started that still runs at teardown is killed."""
    (tmp_path / "job").mkdir()
    job = Job(root=tmp_path / "job", data_dir=digits_dir)
    try:
        yield job
    finally:
        job.kill_leftovers()


@pytest.fixture(scope="session")
def reference_state(tmp_path_factory, digits_dir) -> dict[str, np.ndarray]:
    """Final model and optimizer state of one uninterrupted run (background saves on the cadence)."""
    ref = Job(root=tmp_path_factory.mktemp("reference"), data_dir=digits_dir)
    code = ref.run()
    assert code == 0, ref.stderr_text()
    assert ref.logged_steps() == list(range(1, TOTAL_STEPS + 1))
    return load_state(ref.final_weights)
