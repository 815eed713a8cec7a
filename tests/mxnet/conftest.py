"""Fixtures for the MXNet Gluon tests (this directory runs in its own pytest process: MXNet 1.9.1
segfaults when TensorFlow was imported first, see the Makefile's `test` target).

Training runs in subprocesses of ``training/examples/gluon_resnet.py`` with small settings (90 steps
of batch 32 on the 8x8 digits, about 3 s each), with ``OMP_NUM_THREADS=1`` as the example sets it.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
from gluon_jobs import TOTAL_STEPS, Job, load_params

from training.examples.prepare_data import prepare_digits


@pytest.fixture(scope="session")
def digits_dir(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("datasets")
    prepare_digits(out)
    return out


@pytest.fixture
def job(tmp_path, digits_dir) -> Iterator[Job]:
    """A fresh job; any trainer it started that is still running at teardown is killed."""
    (tmp_path / "job").mkdir()
    job = Job(root=tmp_path / "job", data_dir=digits_dir)
    try:
        yield job
    finally:
        job.kill_leftovers()


@pytest.fixture(scope="session")
def reference_params(tmp_path_factory, digits_dir) -> dict[str, np.ndarray]:
    """Final parameters of one uninterrupted run (background saves every SAVE_EVERY steps)."""
    root = tmp_path_factory.mktemp("reference")
    ref = Job(root=root, data_dir=digits_dir)
    code = ref.run()
    assert code == 0, ref.stderr_text()
    assert ref.logged_steps() == list(range(1, TOTAL_STEPS + 1))
    return load_params(ref.final_params)
