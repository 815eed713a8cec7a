"""The default dataset asset (spot_training/infra/dataset.py): the arrays the examples train on, in
bytes that never change between synths (so the asset, and the node config, stay the same)."""

from __future__ import annotations

import io

import numpy as np
import pytest

from spot_training.infra.dataset import digits_npz, split_uri
from spot_training.training.examples.prepare_data import prepare_digits


def test_digits_asset_holds_prepare_datas_arrays_in_stable_bytes(tmp_path):
    files = digits_npz()
    assert files == digits_npz()  # the same bytes every synth: fixed zip times, no compression
    written = prepare_digits(tmp_path)
    for split in ("train", "test"):
        with np.load(io.BytesIO(files[f"digits/{split}.npz"])) as ours, np.load(written[split]) as theirs:
            assert sorted(ours.files) == sorted(theirs.files) == ["x", "y"]
            for key in ("x", "y"):
                assert ours[key].dtype == theirs[key].dtype and np.array_equal(ours[key], theirs[key])


@pytest.mark.parametrize("uri", ["https://b/x/", "s3://B/x/", "s3://bucket", "s3://bucket/a/../b/", "s3://bucket/x*"])
def test_bad_dataset_uris_fail_naming_the_key(uri):
    with pytest.raises(ValueError, match="context key 'dataset_uri'"):
        split_uri(uri)
