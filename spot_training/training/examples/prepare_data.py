"""Write a dataset onto the data volume in the format :mod:`spot_training.training.datasets` reads.

    python -m spot_training.training.examples.prepare_data [--out DIR] [--dataset digits|cifar10] [--test-size 0.2] [--seed 0]

``digits`` (default): scikit-learn's bundled 8x8 digits (1,797 images, 10 classes; shipped inside
scikit-learn, so no network is needed), split train/test stratified by class with a fixed seed, into
``<out>/digits/train.npz`` and ``<out>/digits/test.npz`` (x uint8 (N, 8, 8) in 0..16, y int64 (N,)).

``cifar10``: downloads the CIFAR-10 python archive (170 MB) and writes ``<out>/cifar10/{train,test}.npz``
(x uint8 (N, 32, 32, 3), y int64 (N,)); exits 2 with a clear message when it cannot be fetched.

``--out`` defaults to ``SPOT_TRAINING_DATA_DIR`` (``/dltraining/datasets``). Every file is written to
a temporary file in the same directory, fsynced and renamed over the target (``os.replace``), so a
crash never leaves a half-written dataset behind and an existing one is replaced only by a complete file.
"""

from __future__ import annotations

import argparse
import io
import os
import pickle
import sys
import tarfile
import tempfile
import urllib.error
import urllib.request
from pathlib import Path

import numpy as np

from spot_training.training.datasets import default_data_dir

CIFAR10_URL = "https://www.cs.toronto.edu/~kriz/cifar-10-python.tar.gz"
DATASETS = ("digits", "cifar10")
EXIT_FETCH_FAILED = 2


def write_npz_atomic(path: Path, **arrays: np.ndarray) -> Path:
    """Write ``arrays`` to ``path`` (npz, uncompressed) atomically: temp file beside it, fsync, ``os.replace``.

    The parent directory is created if needed and fsynced after the rename. On any error the
    temporary file is removed and an existing ``path`` is left untouched.
    """
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp_name = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "wb") as handle:
            np.savez(handle, **arrays)
            handle.flush()
            os.fsync(handle.fileno())
        os.replace(tmp_name, path)
    except BaseException:
        if os.path.exists(tmp_name):
            os.unlink(tmp_name)
        raise
    dir_fd = os.open(path.parent, os.O_RDONLY)
    try:
        os.fsync(dir_fd)
    finally:
        os.close(dir_fd)
    return path


def prepare_digits(out: Path, *, test_size: float = 0.2, seed: int = 0) -> dict[str, Path]:
    """Split scikit-learn's digits (1,797 images) stratified by class and write them under ``out/digits``.

    Args:
        out: dataset root.
        test_size: fraction of images in the test split, 0 < test_size < 1 (default 0.2: 1,437 train / 360 test).
        seed: ``random_state`` of the split (default 0), so every node writes identical files.

    Returns:
        ``{"train": path, "test": path}``.

    Raises:
        ValueError: ``test_size`` outside (0, 1).
    """
    if not 0.0 < test_size < 1.0:
        raise ValueError(f"test_size must be between 0 and 1 (exclusive), got test_size={test_size!r}")
    from sklearn.datasets import load_digits as sklearn_load_digits
    from sklearn.model_selection import train_test_split

    bunch = sklearn_load_digits()
    images = bunch.images.astype(np.uint8)  # (1797, 8, 8), integer values 0..16
    labels = bunch.target.astype(np.int64)
    x_train, x_test, y_train, y_test = train_test_split(
        images, labels, test_size=test_size, random_state=seed, stratify=labels
    )
    root = Path(out) / "digits"
    return {
        "train": write_npz_atomic(root / "train.npz", x=x_train, y=y_train),
        "test": write_npz_atomic(root / "test.npz", x=x_test, y=y_test),
    }


def _cifar_batches(archive: tarfile.TarFile, names: list[str]) -> tuple[np.ndarray, np.ndarray]:
    xs, ys = [], []
    for name in names:
        member = archive.extractfile(f"cifar-10-batches-py/{name}")
        if member is None:
            raise ValueError(f"CIFAR-10 archive lacks cifar-10-batches-py/{name}")
        batch = pickle.load(member, encoding="bytes")  # the archive's own format (python pickles)
        xs.append(np.asarray(batch[b"data"], dtype=np.uint8).reshape(-1, 3, 32, 32).transpose(0, 2, 3, 1))
        ys.append(np.asarray(batch[b"labels"], dtype=np.int64))
    return np.concatenate(xs), np.concatenate(ys)


def prepare_cifar10(out: Path, *, url: str = CIFAR10_URL, timeout: float = 30.0) -> dict[str, Path]:
    """Download CIFAR-10 (python version) and write ``out/cifar10/{train,test}.npz`` (50,000 / 10,000 images).

    A plain ``urllib`` download: the frameworks' own fetchers (``keras.datasets.cifar10``,
    ``mxnet.gluon.data.vision.CIFAR10``) would pull a whole framework into a data-preparation step.

    Args:
        out: the dataset root; ``out/cifar10/`` is created.
        url: the archive's address (default :data:`CIFAR10_URL`, the CIFAR-10 python version).
        timeout: seconds the download's connection may wait (default 30).

    Returns:
        ``{"train": path, "test": path}`` of the written ``.npz`` files.

    Raises:
        ConnectionError: the archive cannot be fetched within ``timeout`` seconds (no network).
    """
    try:
        with urllib.request.urlopen(url, timeout=timeout) as response:  # noqa: S310 (fixed https URL)
            payload = response.read()
    except (urllib.error.URLError, OSError) as exc:
        raise ConnectionError(
            f"cannot fetch CIFAR-10 from {url}: {exc}. CIFAR-10 needs network access; "
            f"use --dataset digits (bundled with scikit-learn) on machines without it."
        ) from exc
    with tarfile.open(fileobj=io.BytesIO(payload), mode="r:gz") as archive:
        x_train, y_train = _cifar_batches(archive, [f"data_batch_{i}" for i in range(1, 6)])
        x_test, y_test = _cifar_batches(archive, ["test_batch"])
    root = Path(out) / "cifar10"
    return {
        "train": write_npz_atomic(root / "train.npz", x=x_train, y=y_train),
        "test": write_npz_atomic(root / "test.npz", x=x_test, y=y_test),
    }


def main(argv: list[str] | None = None) -> int:
    """Command-line entry point; returns the exit status (0 written, 2 CIFAR-10 could not be fetched)."""
    parser = argparse.ArgumentParser(
        prog="python -m spot_training.training.examples.prepare_data", description=__doc__.split("\n\n")[0]
    )
    parser.add_argument("--out", type=Path, default=None,
                        help="dataset root (default: $SPOT_TRAINING_DATA_DIR or /dltraining/datasets)")
    parser.add_argument("--dataset", choices=DATASETS, default="digits",
                        help="digits (bundled with scikit-learn, default) or cifar10 (needs network)")
    parser.add_argument("--test-size", type=float, default=0.2, help="digits: test fraction (default 0.2)")
    parser.add_argument("--seed", type=int, default=0, help="digits: split seed (default 0)")
    parser.add_argument("--cifar10-url", default=CIFAR10_URL,
                        help=f"cifar10: archive URL, e.g. a local mirror or file:// path (default {CIFAR10_URL})")
    args = parser.parse_args(argv)
    out = args.out if args.out is not None else default_data_dir()
    if args.dataset == "digits":
        if not 0.0 < args.test_size < 1.0:
            parser.error(f"--test-size must be between 0 and 1 (exclusive), got {args.test_size}")
        paths = prepare_digits(out, test_size=args.test_size, seed=args.seed)
    else:
        try:
            paths = prepare_cifar10(out, url=args.cifar10_url)
        except ConnectionError as exc:
            print(f"prepare_data: {exc}", file=sys.stderr)
            return EXIT_FETCH_FAILED
    for split, path in paths.items():
        with np.load(path) as data:
            print(f"{args.dataset} {split}: {data['x'].shape[0]} examples -> {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
