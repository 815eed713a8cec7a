"""Dataset helpers and prepare_data: real files on disk, real scikit-learn digits, no framework imports."""

from __future__ import annotations

import io
import pickle
import subprocess
import sys
import tarfile
from pathlib import Path

import numpy as np
import pytest

from spot_training.training import datasets
from spot_training.training.datasets import (
    DatasetError,
    batch_indices,
    epoch_of_step,
    load_digits,
    steps_per_epoch,
)
from spot_training.training.examples import prepare_data

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def digits_dir(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("datasets")
    prepare_data.prepare_digits(out)
    return out


def test_prepare_data_writes_a_stratified_split_of_all_1797_digits(digits_dir):
    x_train, y_train = load_digits(digits_dir, "train")
    x_test, y_test = load_digits(digits_dir, "test")
    assert x_train.shape == (1437, 8, 8, 1) and x_test.shape == (360, 8, 8, 1)
    assert x_train.dtype == np.float32 and y_train.dtype == np.int64
    assert 0.0 == x_train.min() and x_train.max() == 1.0
    # Stratified: each class keeps its share in the test split (36 +- 1 of 360 per class).
    counts = np.bincount(y_test, minlength=10)
    assert counts.min() >= 35 and counts.max() <= 37, counts
    # Nothing lost, nothing duplicated: train + test is exactly scikit-learn's set.
    from sklearn.datasets import load_digits as sk_load

    bunch = sk_load()
    ours = np.concatenate([x_train, x_test])[..., 0] * 16.0
    ours_sorted = sorted(map(bytes, np.concatenate([ours.reshape(len(ours), -1).astype(np.uint8)])))
    theirs_sorted = sorted(map(bytes, bunch.images.reshape(1797, -1).astype(np.uint8)))
    assert ours_sorted == theirs_sorted
    assert np.array_equal(np.bincount(np.concatenate([y_train, y_test])), np.bincount(bunch.target))


def test_prepare_data_is_reproducible_and_leaves_no_temp_files(tmp_path):
    a, b = tmp_path / "a", tmp_path / "b"
    prepare_data.prepare_digits(a)
    prepare_data.prepare_digits(b)
    for split in ("train", "test"):
        assert (a / "digits" / f"{split}.npz").read_bytes() == (b / "digits" / f"{split}.npz").read_bytes()
    assert sorted(p.name for p in (a / "digits").iterdir()) == ["test.npz", "train.npz"]


def test_nchw_layout_is_the_transpose_of_nhwc(digits_dir):
    x_nhwc, y1 = load_digits(digits_dir, "test")
    x_nchw, y2 = load_digits(digits_dir, "test", layout="NCHW")
    assert x_nchw.shape == (360, 1, 8, 8)
    assert np.array_equal(x_nchw, x_nhwc.transpose(0, 3, 1, 2)) and np.array_equal(y1, y2)


def test_fails_when_dataset_is_missing_naming_path_and_fix(tmp_path):
    with pytest.raises(DatasetError) as info:
        load_digits(tmp_path, "train")
    message = str(info.value)
    assert str(tmp_path / "digits" / "train.npz") in message
    assert "python -m spot_training.training.examples.prepare_data" in message


def test_fails_when_file_is_not_a_dataset(tmp_path):
    bad = tmp_path / "digits" / "train.npz"
    bad.parent.mkdir()
    np.savez(bad, images=np.zeros((3, 8, 8)))
    with pytest.raises(DatasetError, match=str(bad)):
        load_digits(tmp_path, "train")
    assert bad.exists()  # bad input loses nothing
    np.savez(bad, x=np.zeros((3, 4, 4)), y=np.zeros(3, dtype=np.int64))
    with pytest.raises(DatasetError, match=r"\(3, 4, 4\)"):
        load_digits(tmp_path, "train")


@pytest.mark.parametrize(
    "kwargs, match",
    [({"split": "validation"}, "split must be one of"), ({"split": "train", "layout": "CHW"}, "layout must be one of")],
)
def test_fails_when_split_or_layout_is_unknown(digits_dir, kwargs, match):
    with pytest.raises(ValueError, match=match):
        load_digits(digits_dir, **kwargs)


def test_steps_per_epoch_counts_full_batches():
    assert steps_per_epoch(1437, 32) == 44
    assert steps_per_epoch(64, 32) == 2
    with pytest.raises(ValueError, match="batch_size=64, n=32"):
        steps_per_epoch(32, 64)
    with pytest.raises(ValueError, match="batch_size=True"):
        steps_per_epoch(32, True)
    with pytest.raises(ValueError, match="n=0"):
        steps_per_epoch(0, 1)


def test_each_epoch_visits_distinct_examples_in_a_new_order():
    n, bs, seed = 100, 8, 7
    spe = steps_per_epoch(n, bs)
    epoch0 = np.concatenate([batch_indices(s, batch_size=bs, n=n, seed=seed) for s in range(spe)])
    epoch1 = np.concatenate([batch_indices(s, batch_size=bs, n=n, seed=seed) for s in range(spe, 2 * spe)])
    assert len(set(epoch0.tolist())) == spe * bs  # no example twice within an epoch
    assert epoch0.min() >= 0 and epoch0.max() < n
    assert not np.array_equal(epoch0, epoch1)
    assert epoch_of_step(spe - 1, batch_size=bs, n=n) == 0 and epoch_of_step(spe, batch_size=bs, n=n) == 1


def test_batches_depend_on_step_alone_so_a_resumed_run_sees_the_same_data():
    n, bs = 1437, 32
    uninterrupted = [batch_indices(s, batch_size=bs, n=n, seed=3) for s in range(150)]
    # A "resumed" run starts computing at step 97 with nothing carried over.
    resumed = [batch_indices(s, batch_size=bs, n=n, seed=3) for s in range(97, 150)]
    for a, b in zip(uninterrupted[97:], resumed):
        assert np.array_equal(a, b)
    other_seed = batch_indices(0, batch_size=bs, n=n, seed=4)
    assert not np.array_equal(uninterrupted[0], other_seed)


@pytest.mark.parametrize("bad", [{"step": -1}, {"step": 1.0}, {"step": True}, {"seed": -2}])
def test_fails_when_step_or_seed_is_invalid(bad):
    kwargs = {"step": 0, "batch_size": 4, "n": 10, "seed": 0, **bad}
    name, value = next(iter(bad.items()))
    with pytest.raises(ValueError, match=f"{name}={value!r}"):
        batch_indices(**kwargs)


def test_default_dirs_follow_the_contract_environment(monkeypatch, tmp_path):
    for var in ("SPOT_TRAINING_DATA_DIR", "SPOT_TRAINING_CHECKPOINT_DIR", "SPOT_TRAINING_LOG_DIR"):
        monkeypatch.delenv(var, raising=False)
    assert datasets.default_data_dir() == Path("/dltraining/datasets")
    assert datasets.default_checkpoint_dir() == Path("/dltraining/checkpoints")
    assert datasets.default_log_dir() == Path("/dltraining/logs")
    monkeypatch.setenv("SPOT_TRAINING_DATA_DIR", str(tmp_path / "d"))
    monkeypatch.setenv("SPOT_TRAINING_CHECKPOINT_DIR", str(tmp_path / "c"))
    monkeypatch.setenv("SPOT_TRAINING_LOG_DIR", str(tmp_path / "l"))
    assert datasets.default_data_dir() == tmp_path / "d"
    assert datasets.default_checkpoint_dir() == tmp_path / "c"
    assert datasets.default_log_dir() == tmp_path / "l"


@pytest.mark.integration
def test_cli_writes_to_the_env_data_dir(tmp_path):
    env = {"SPOT_TRAINING_DATA_DIR": str(tmp_path), "PATH": "/usr/bin:/bin"}
    result = subprocess.run(
        [sys.executable, "-m", "spot_training.training.examples.prepare_data"],
        cwd=REPO, env=env, capture_output=True, text=True, timeout=120,
    )
    assert result.returncode == 0, result.stderr
    assert "1437 examples" in result.stdout and "360 examples" in result.stdout
    assert load_digits(tmp_path, "test")[0].shape[0] == 360


@pytest.mark.integration
def test_cli_fails_clearly_when_cifar10_cannot_be_fetched(tmp_path):
    # Port 1 on loopback refuses the connection at once: the "no network" case without waiting.
    code = prepare_data.main(["--dataset", "cifar10", "--out", str(tmp_path),
                              "--cifar10-url", "http://127.0.0.1:1/cifar-10-python.tar.gz"])
    assert code == prepare_data.EXIT_FETCH_FAILED
    assert not (tmp_path / "cifar10").exists()


def _fake_cifar_archive(path: Path) -> None:
    rng = np.random.default_rng(0)
    with tarfile.open(path, "w:gz") as archive:
        for name, count in [(f"data_batch_{i}", 3) for i in range(1, 6)] + [("test_batch", 2)]:
            batch = {b"data": rng.integers(0, 256, (count, 3072), dtype=np.uint8),
                     b"labels": list(range(count))}
            payload = pickle.dumps(batch)
            info = tarfile.TarInfo(f"cifar-10-batches-py/{name}")
            info.size = len(payload)
            archive.addfile(info, io.BytesIO(payload))


def test_cifar10_archive_is_converted_to_nhwc_npz(tmp_path, capsys):
    archive = tmp_path / "cifar.tar.gz"
    _fake_cifar_archive(archive)
    code = prepare_data.main(["--dataset", "cifar10", "--out", str(tmp_path / "out"),
                              "--cifar10-url", archive.as_uri()])
    assert code == 0
    with np.load(tmp_path / "out" / "cifar10" / "train.npz") as data:
        assert data["x"].shape == (15, 32, 32, 3) and data["y"].shape == (15,)
    with np.load(tmp_path / "out" / "cifar10" / "test.npz") as data:
        assert data["x"].shape == (2, 32, 32, 3)
        assert data["y"].tolist() == [0, 1]
