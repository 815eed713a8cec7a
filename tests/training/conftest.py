"""Fixtures for the TensorFlow/Keras tests (TensorFlow runs only in subprocesses)."""

from __future__ import annotations

import pytest

from keras_jobs import Job, load_weights, prepare_digits


@pytest.fixture(scope="session")
def digits_dir(tmp_path_factory):
    return prepare_digits(tmp_path_factory.mktemp("datasets"))


@pytest.fixture
def job(tmp_path, digits_dir) -> Job:
    return Job(tmp_path / "job", digits_dir)


@pytest.fixture(scope="session")
def keras_reference(tmp_path_factory, digits_dir):
    """Weights (model + optimizer) of one uninterrupted Keras run with the tests' seed."""
    ref = Job(tmp_path_factory.mktemp("keras-reference"), digits_dir)
    rc = ref.run()
    assert rc == 0, ref.stderr_text()
    return load_weights(ref.final_weights)
