"""The job's dataset: an S3 location the node agent brings onto the data volume, and the IAM to read it.

Context key ``dataset_uri`` (docs/infra.md, "Your data"):

- ``s3://bucket/prefix/``: the agent copies every object under the prefix into
  ``<mount_point>/datasets/`` before the trainer starts, once, verified against a manifest
  (spot_training/agent/dataset.py); the node role may only ``s3:GetObject`` under the prefix and
  ``s3:ListBucket`` the bucket with an ``s3:prefix`` condition on it;
- not set: the default examples' dataset, scikit-learn's digits split 80/20 (seed 0) into
  ``digits/{train,test}.npz``, written at synth into a CDK S3 asset of the stack (a zip the agent
  verifies and extracts: the same path, no Docker);
- ``none``: no dataset step (a trainer that fetches its own data).
"""

from __future__ import annotations

import atexit
import hashlib
import io
import shutil
import tempfile
import zipfile
from pathlib import Path
from typing import Any

import aws_cdk as cdk
import constructs
from aws_cdk import aws_iam as iam
from aws_cdk import aws_s3_assets as s3_assets

from .config import split_uri

#: The digits split the examples train on (spot_training/training/examples/prepare_data.py writes the same arrays).
DIGITS_TEST_SIZE, DIGITS_SEED = 0.2, 0
#: A fixed zip timestamp, so the same arrays always give the same bytes and the same asset hash.
_ZIP_TIME = (1980, 1, 1, 0, 0, 0)


def dataset_read_statements(bucket_arn: str, key: str) -> list[iam.PolicyStatement]:
    """The node role's statements for reading ``key`` of the bucket ``bucket_arn``.

    ``s3:GetObject`` on ``<bucket>/<key>*`` (or the one object) and ``s3:ListBucket`` on the bucket,
    limited by the ``s3:prefix`` condition key to that prefix (Amazon S3 User Guide, "Condition key
    examples", s3:prefix).

    Args:
        bucket_arn: the bucket's ARN (may be a token).
        key: a prefix ending in ``/`` (every object under it), one object's key, or ``""`` (the bucket).

    Returns:
        two statements, ``DatasetRead`` and ``DatasetList``.
    """
    objects = f"{bucket_arn}/{key}*" if key.endswith("/") or not key else f"{bucket_arn}/{key}"
    return [
        iam.PolicyStatement(sid="DatasetRead", actions=["s3:GetObject"], resources=[objects]),
        iam.PolicyStatement(sid="DatasetList", actions=["s3:ListBucket"], resources=[bucket_arn],
                            conditions={"StringLike": {"s3:prefix": [f"{key}*" if key.endswith("/") or not key else key]}}),
    ]


def digits_npz() -> dict[str, bytes]:
    """``{"digits/train.npz": bytes, "digits/test.npz": bytes}``: scikit-learn's 1,797 digits as
    uint8 (N, 8, 8) images and int64 labels, split stratified (test 0.2, seed 0) exactly as
    ``prepare_data.prepare_digits`` splits them, each an uncompressed npz with fixed zip times.

    Raises:
        RuntimeError: numpy or scikit-learn is missing (names the fix).
    """
    try:
        import numpy as np
        from sklearn.datasets import load_digits
        from sklearn.model_selection import train_test_split
    except ImportError as exc:
        raise RuntimeError(f"the default dataset (digits) is written at synth with numpy and scikit-learn ({exc}); "
                           "install them (pip install 'spot-training[train]'), or give -c dataset_uri=s3://bucket/prefix/ "
                           "(or -c dataset_uri=none)") from exc
    bunch = load_digits()
    images, labels = bunch.images.astype(np.uint8), bunch.target.astype(np.int64)
    x_train, x_test, y_train, y_test = train_test_split(images, labels, test_size=DIGITS_TEST_SIZE,
                                                        random_state=DIGITS_SEED, stratify=labels)
    out = {}
    for split, (x, y) in {"train": (x_train, y_train), "test": (x_test, y_test)}.items():
        buffer = io.BytesIO()
        with zipfile.ZipFile(buffer, "w", zipfile.ZIP_STORED) as zf:
            for name, array in (("x", x), ("y", y)):
                member = io.BytesIO()
                np.lib.format.write_array(member, np.ascontiguousarray(array), allow_pickle=False)
                zf.writestr(zipfile.ZipInfo(f"{name}.npy", date_time=_ZIP_TIME), member.getvalue())
        out[f"digits/{split}.npz"] = buffer.getvalue()
    return out


class DatasetAsset(constructs.Construct):
    """The default examples' dataset (:func:`digits_npz`) as one CDK S3 asset: a zip holding
    ``digits/train.npz`` and ``digits/test.npz``, hashed by its content so an unchanged dataset is
    never uploaded or synced again.

    Args:
        scope: the parent construct.
        construct_id: the construct's id, unique within ``scope``.

    Raises:
        RuntimeError: numpy or scikit-learn is missing at synth (:func:`digits_npz`).

    Attributes:
        asset: the ``s3_assets.Asset``.
    """

    def __init__(self, scope: constructs.Construct, construct_id: str) -> None:
        super().__init__(scope, construct_id)
        files = digits_npz()
        staging = Path(tempfile.mkdtemp(prefix="spot-training-dataset-"))
        atexit.register(shutil.rmtree, staging, True)
        digest = hashlib.sha256()
        for name, data in sorted(files.items()):
            (staging / name).parent.mkdir(parents=True, exist_ok=True)
            (staging / name).write_bytes(data)
            digest.update(name.encode() + b"\0" + data)
        self.asset = s3_assets.Asset(self, "Resource", path=str(staging), asset_hash_type=cdk.AssetHashType.CUSTOM,
                                     asset_hash=digest.hexdigest())

    def node_section(self) -> dict[str, Any]:
        """The node config's ``dataset`` section: this asset's object, unpacked by the agent."""
        return {"uri": self.asset.s3_object_url, "unpack": True}

    def read_statements(self) -> list[iam.PolicyStatement]:
        """:func:`dataset_read_statements` for this asset's one object."""
        return dataset_read_statements(self.asset.bucket.bucket_arn, self.asset.s3_object_key)


def add_dataset(scope: constructs.Construct, dataset_uri: str | None,
                role: iam.IRole) -> tuple[DatasetAsset | None, dict[str, Any] | None]:
    """Give ``role`` read access to the job's dataset and return ``(asset, node config section)``.

    Args:
        scope: where the :class:`DatasetAsset` is defined (id ``DatasetAsset``) when one is needed.
        dataset_uri: None: the default :class:`DatasetAsset`; ``s3://bucket/prefix/`` or
            ``s3://bucket/key``: the user's data (no asset); ``none``: no dataset.
        role: the node role that reads it.

    Returns:
        ``(asset or None, the node config's dataset section or None)``.

    Raises:
        ValueError: a bad ``dataset_uri`` (:func:`split_uri`).
    """
    if dataset_uri is not None and dataset_uri.lower() == "none":
        return None, None
    if dataset_uri is None:
        asset = DatasetAsset(scope, "DatasetAsset")
        section, statements = asset.node_section(), asset.read_statements()
    else:
        bucket, key = split_uri(dataset_uri)
        asset, section = None, {"uri": dataset_uri, "unpack": False}
        statements = dataset_read_statements(f"arn:{cdk.Aws.PARTITION}:s3:::{bucket}", key)
    for statement in statements:
        role.add_to_principal_policy(statement)
    return asset, section
