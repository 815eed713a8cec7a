"""Dataset helpers shared by the Keras and MXNet Gluon examples (numpy only, no framework imports).

The dataset format on the data volume is one directory per dataset under the dataset root
(``SPOT_TRAINING_DATA_DIR``, default ``/dltraining/datasets``, see docs/contracts.md)::

    <dataset_dir>/digits/train.npz   x: uint8 (N, 8, 8) in [0, 16], y: int64 (N,)
    <dataset_dir>/digits/test.npz

written by ``python -m spot_training.training.examples.prepare_data``.

Exact resume depends on :func:`batch_indices`: the batch a step trains on is a pure function of
``(step, batch_size, n, seed)``, so a run resumed at step ``k`` sees exactly the batches that an
uninterrupted run would have seen from step ``k`` on. No iterator state has to be checkpointed;
the step counter is the data position.
"""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np

from spot_training.contract import (CHECKPOINTS_DIR, DATASETS_DIR, DEFAULT_MOUNT_POINT, ENV_CHECKPOINT_DIR, ENV_DATA_DIR,
                           ENV_LOG_DIR, LOGS_DIR)

DATA_DIR_ENV = ENV_DATA_DIR
CHECKPOINT_DIR_ENV = ENV_CHECKPOINT_DIR
LOG_DIR_ENV = ENV_LOG_DIR

#: Off a node (no agent, no environment): the node's layout under the data volume's default mount point.
DEFAULT_DATA_DIR = f"{DEFAULT_MOUNT_POINT}/{DATASETS_DIR}"
DEFAULT_CHECKPOINT_DIR = f"{DEFAULT_MOUNT_POINT}/{CHECKPOINTS_DIR}"
DEFAULT_LOG_DIR = f"{DEFAULT_MOUNT_POINT}/{LOGS_DIR}"

SPLITS = ("train", "test")
LAYOUTS = ("NHWC", "NCHW")
#: Pixel values of scikit-learn's digits are integers 0..16; loaders divide by this.
DIGITS_MAX_VALUE = 16.0
DIGITS_NUM_CLASSES = 10
PREPARE_HINT = "python -m spot_training.training.examples.prepare_data"


class DatasetError(Exception):
    """A dataset file is missing or not in the expected format (the message names the path)."""


def default_data_dir() -> Path:
    """Dataset root: env ``SPOT_TRAINING_DATA_DIR``, default ``/dltraining/datasets``."""
    return Path(os.environ.get(DATA_DIR_ENV) or DEFAULT_DATA_DIR)


def default_checkpoint_dir() -> Path:
    """Checkpoint directory: env ``SPOT_TRAINING_CHECKPOINT_DIR``, default ``/dltraining/checkpoints``."""
    return Path(os.environ.get(CHECKPOINT_DIR_ENV) or DEFAULT_CHECKPOINT_DIR)


def default_log_dir() -> Path:
    """Log directory (``training_log.csv`` goes here): env ``SPOT_TRAINING_LOG_DIR``, default ``/dltraining/logs``."""
    return Path(os.environ.get(LOG_DIR_ENV) or DEFAULT_LOG_DIR)


def digits_path(dataset_dir: str | os.PathLike, split: str) -> Path:
    """Path of one split of the digits dataset: ``<dataset_dir>/digits/<split>.npz``.

    Args:
        dataset_dir: the dataset root.
        split: ``"train"`` or ``"test"``.

    Returns:
        ``<dataset_dir>/digits/<split>.npz`` (not checked to exist).

    Raises:
        ValueError: ``split`` is not ``"train"`` or ``"test"``.
    """
    if split not in SPLITS:
        raise ValueError(f"split must be one of {SPLITS}, got split={split!r}")
    return Path(dataset_dir) / "digits" / f"{split}.npz"


def load_digits(
    dataset_dir: str | os.PathLike, split: str, *, layout: str = "NHWC"
) -> tuple[np.ndarray, np.ndarray]:
    """Load one split of the 8x8 digits dataset written by ``prepare_data``.

    Args:
        dataset_dir: the dataset root (e.g. :func:`default_data_dir`); the file read is
            ``<dataset_dir>/digits/<split>.npz``.
        split: ``"train"`` or ``"test"``.
        layout: ``"NHWC"`` (default; Keras/TensorFlow) gives x of shape (N, 8, 8, 1);
            ``"NCHW"`` (MXNet Gluon's default) gives (N, 1, 8, 8).

    Returns:
        ``(x, y)``: x float32 in [0, 1] (pixel value / 16), y int64 class labels 0..9 of shape (N,).

    Raises:
        ValueError: bad ``split`` or ``layout``.
        DatasetError: the file is missing (the message names it and suggests
            ``python -m spot_training.training.examples.prepare_data``) or its arrays have the wrong shape.
    """
    if layout not in LAYOUTS:
        raise ValueError(f"layout must be one of {LAYOUTS}, got layout={layout!r}")
    path = digits_path(dataset_dir, split)
    if not path.is_file():
        raise DatasetError(
            f"digits dataset not found: {path} does not exist. Create it with "
            f"`{PREPARE_HINT} --out {Path(dataset_dir)}` (or set {DATA_DIR_ENV} to the "
            f"directory that holds digits/{split}.npz)."
        )
    try:
        with np.load(path, allow_pickle=False) as data:
            images = np.asarray(data["x"])
            labels = np.asarray(data["y"])
    except (KeyError, ValueError, OSError) as exc:
        raise DatasetError(
            f"{path} is not a digits dataset file (expected arrays 'x' and 'y'): {exc}. "
            f"Recreate it with `{PREPARE_HINT} --out {Path(dataset_dir)}`."
        ) from exc
    if images.ndim != 3 or images.shape[1:] != (8, 8) or labels.shape != (images.shape[0],):
        raise DatasetError(
            f"{path} has x of shape {images.shape} and y of shape {labels.shape}; expected "
            f"x (N, 8, 8) and y (N,). Recreate it with `{PREPARE_HINT} --out {Path(dataset_dir)}`."
        )
    x = (images.astype(np.float32) / np.float32(DIGITS_MAX_VALUE))
    x = x[:, None, :, :] if layout == "NCHW" else x[:, :, :, None]
    return np.ascontiguousarray(x), labels.astype(np.int64)


def _check_positive_int(name: str, value: object) -> int:
    # bool is an int subclass: reject it explicitly (style.md).
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value <= 0:
        raise ValueError(f"{name} must be a positive integer, got {name}={value!r}")
    return int(value)


def steps_per_epoch(n: int, batch_size: int) -> int:
    """Number of full batches in one epoch of ``n`` examples: ``n // batch_size``.

    The remainder (``n % batch_size`` examples) is left out of that epoch; because every epoch
    draws a new permutation, a different remainder is left out each time. Full batches only keep
    every step's input shape fixed (one compiled graph in Keras, one cached graph in Gluon).

    Args:
        n: examples in the dataset, >= 1.
        batch_size: examples per step, ``1 <= batch_size <= n``.

    Returns:
        full batches per epoch.

    Raises:
        ValueError: ``n`` or ``batch_size`` not a positive integer, or ``batch_size > n``.
    """
    n = _check_positive_int("n", n)
    batch_size = _check_positive_int("batch_size", batch_size)
    if batch_size > n:
        raise ValueError(
            f"batch_size must be <= the number of examples, got batch_size={batch_size}, n={n}"
        )
    return n // batch_size


def epoch_permutation(epoch: int, *, n: int, seed: int) -> np.ndarray:
    """The order of the ``n`` examples in epoch ``epoch`` (0-based), seeded by ``(seed, epoch)``.

    Args:
        epoch: the 0-based epoch, >= 0.
        n: examples in the dataset, >= 1.
        seed: permutation seed, >= 0 (numpy's ``default_rng([seed, epoch])``, PCG64).

    Returns:
        int64 array of shape ``(n,)``, a permutation of ``0..n-1``.

    Raises:
        ValueError: a negative or non-integer ``epoch`` or ``seed``, or ``n`` not a positive integer.
    """
    if isinstance(epoch, bool) or not isinstance(epoch, (int, np.integer)) or epoch < 0:
        raise ValueError(f"epoch must be a non-negative integer, got epoch={epoch!r}")
    if isinstance(seed, bool) or not isinstance(seed, (int, np.integer)) or seed < 0:
        raise ValueError(f"seed must be a non-negative integer, got seed={seed!r}")
    n = _check_positive_int("n", n)
    rng = np.random.default_rng([int(seed), int(epoch)])
    return rng.permutation(n).astype(np.int64)


def batch_indices(step: int, *, batch_size: int, n: int, seed: int) -> np.ndarray:
    """Indices of the examples in global step ``step`` (0-based), int64 of shape (batch_size,).

    Step ``s`` belongs to epoch ``s // steps_per_epoch(n, batch_size)`` and takes the
    ``s % steps_per_epoch``-th slice of that epoch's permutation (:func:`epoch_permutation`,
    seeded by ``(seed, epoch)`` with numpy's PCG64). The result depends on the arguments only,
    never on earlier calls, so a resumed run gets the same batches as an uninterrupted one.

    Args:
        step: the 0-based global step, >= 0.
        batch_size: examples per step, ``1 <= batch_size <= n``.
        n: examples in the dataset.
        seed: permutation seed, >= 0.

    Returns:
        int64 array of shape ``(batch_size,)``.

    Raises:
        ValueError: negative ``step`` or ``seed``; non-positive ``n`` or ``batch_size``;
            ``batch_size > n``.
    """
    if isinstance(step, bool) or not isinstance(step, (int, np.integer)) or step < 0:
        raise ValueError(f"step must be a non-negative integer, got step={step!r}")
    spe = steps_per_epoch(n, batch_size)
    epoch, index = divmod(int(step), spe)
    perm = epoch_permutation(epoch, n=n, seed=seed)
    return perm[index * batch_size : (index + 1) * batch_size]


def epoch_of_step(step: int, *, batch_size: int, n: int) -> int:
    """The 0-based epoch that global step ``step`` belongs to: ``step // steps_per_epoch(n, batch_size)``.

    Args:
        step: the 0-based global step, >= 0.
        batch_size: examples per step, ``1 <= batch_size <= n``.
        n: examples in the dataset.

    Returns:
        the epoch.

    Raises:
        ValueError: a negative or non-integer ``step``, or what :func:`steps_per_epoch` raises.
    """
    if isinstance(step, bool) or not isinstance(step, (int, np.integer)) or step < 0:
        raise ValueError(f"step must be a non-negative integer, got step={step!r}")
    return int(step) // steps_per_epoch(n, batch_size)
