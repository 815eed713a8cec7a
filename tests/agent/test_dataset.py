"""spot_training.agent.dataset against a real moto server over HTTP: the dataset reaches the volume
once, verified against the manifest, resumes after a cut, and is never downloaded again."""

from __future__ import annotations

import hashlib
import io
import json
import zipfile
from pathlib import Path

import boto3
import pytest
from botocore.config import Config

from spot_training.agent import dataset
from spot_training.agent.config import DatasetConfig, parse_config
from spot_training.agent.errors import ConfigError, TemporaryError

BUCKET = "job-data"
FILES = {"digits/train.npz": b"t" * 300_000 + b"rain", "digits/test.npz": b"test-bytes" * 1000, "README": b"hello"}


class CountingS3:
    """A boto3 S3 client that counts GetObject calls and bytes, and can cut a body short once."""

    def __init__(self, client, *, cut_key: str | None = None, cut_after: int = 0) -> None:
        self.client, self.cut_key, self.cut_after = client, cut_key, cut_after
        self.gets: list[tuple[str, str | None]] = []
        self.lists = 0

    def get_paginator(self, name):
        self.lists += 1
        return self.client.get_paginator(name)

    def head_object(self, **kwargs):
        return self.client.head_object(**kwargs)

    def get_object(self, **kwargs):
        self.gets.append((kwargs["Key"], kwargs.get("Range")))
        response = self.client.get_object(**kwargs)
        if kwargs["Key"] == self.cut_key:
            self.cut_key = None
            body, limit = response["Body"], self.cut_after

            class Cut:
                sent = 0

                def read(self, n=-1):
                    if Cut.sent >= limit:
                        raise ConnectionResetError("connection cut by the test")
                    block = body.read(min(n, limit - Cut.sent))
                    Cut.sent += len(block)
                    return block
            response = {**response, "Body": Cut()}
        return response


@pytest.fixture
def s3(moto_server):
    client = boto3.client("s3", region_name="us-east-1", endpoint_url=moto_server.endpoint_url,
                          aws_access_key_id="testing", aws_secret_access_key="testing",
                          config=Config(retries={"mode": "standard"}))
    client.create_bucket(Bucket=BUCKET)
    for name, body in FILES.items():
        client.put_object(Bucket=BUCKET, Key=f"jobs/one/{name}", Body=body)
    client.put_object(Bucket=BUCKET, Key="jobs/other/secret", Body=b"not ours")
    return client


def _tree(root: Path) -> dict[str, bytes]:
    return {p.relative_to(root).as_posix(): p.read_bytes() for p in root.rglob("*") if p.is_file()
            and not p.name.startswith(".spot-training-")}


def test_fresh_sync_brings_every_object_verified_then_never_again(s3, tmp_path):
    target = tmp_path / "vol" / "datasets"
    counting = CountingS3(s3)
    result = dataset.sync_dataset(counting, f"s3://{BUCKET}/jobs/one/", target)
    assert result["status"] == "synced" and result["objects"] == 3
    assert result["downloaded_bytes"] == sum(map(len, FILES.values()))
    assert _tree(target) == FILES  # nothing from jobs/other/
    marker = json.loads((target / dataset.MARKER_NAME).read_text())
    assert marker["complete"] is True and marker["uri"] == f"s3://{BUCKET}/jobs/one/"
    assert {o["path"]: o["etag"] for o in marker["objects"]} == {
        k: '"' + hashlib.md5(v).hexdigest() + '"' for k, v in FILES.items()}
    assert not (target / dataset.PROGRESS_NAME).exists()

    again = CountingS3(s3)
    assert dataset.sync_dataset(again, f"s3://{BUCKET}/jobs/one/", target)["status"] == "present"
    assert again.gets == [] and again.lists == 0  # complete: not listed, not downloaded


def test_a_sync_cut_mid_object_resumes_from_the_partial_file_and_verifies(s3, tmp_path):
    target = tmp_path / "datasets"
    uri = f"s3://{BUCKET}/jobs/one/"
    cut = CountingS3(s3, cut_key="jobs/one/digits/train.npz", cut_after=100_000)
    with pytest.raises(TemporaryError, match="still failing"):
        dataset.sync_dataset(cut, uri, target, deadline_s=0)  # no retry: the agent exits 75, systemd runs it again
    assert not (target / dataset.MARKER_NAME).exists()
    partial = target / "digits" / f".train.npz{dataset.PARTIAL_SUFFIX}"
    assert partial.stat().st_size == 100_000
    done_before = json.loads((target / dataset.PROGRESS_NAME).read_text())["done"]
    assert "jobs/one/README" in done_before  # objects before the cut stay verified

    resumed = CountingS3(s3)
    result = dataset.sync_dataset(resumed, uri, target)
    assert result["status"] == "synced"
    assert ("jobs/one/digits/train.npz", "bytes=100000-") in resumed.gets  # ranged: the rest only
    # README and digits/test.npz (listed before train.npz) were verified before the cut: skipped
    assert [key for key, _ in resumed.gets] == ["jobs/one/digits/train.npz"]
    assert result["downloaded_bytes"] == len(FILES["digits/train.npz"]) - 100_000
    assert _tree(target) == FILES and not partial.exists()


#: A node's agent syncing the dataset in a process of its own; its GetObject of the big object hands over
#: one block, then says so in ``<target>.cut`` and hangs, as a transfer does when the instance is reclaimed.
_SYNC_UNTIL_KILLED = """
import sys, time
from pathlib import Path
import boto3
from botocore.config import Config
from spot_training.agent import dataset

endpoint, uri, target, key, block = sys.argv[1], sys.argv[2], Path(sys.argv[3]), sys.argv[4], int(sys.argv[5])
client = boto3.client("s3", region_name="us-east-1", endpoint_url=endpoint, aws_access_key_id="testing",
                      aws_secret_access_key="testing", config=Config(retries={"mode": "standard"}))

class Hangs:
    def __init__(self, body):
        self.body, self.sent = body, False
    def read(self, n=-1):
        if self.sent:
            Path(str(target) + ".cut").write_text("cut")
            time.sleep(600)
        self.sent = True
        return self.body.read(block)

class S3:
    def __getattr__(self, name):
        return getattr(client, name)
    def get_object(self, **kwargs):
        response = client.get_object(**kwargs)
        return {**response, "Body": Hangs(response["Body"])} if kwargs["Key"] == key else response

dataset.sync_dataset(S3(), uri, target)
"""


def test_a_sync_killed_by_an_interruption_resumes_on_the_replacement_and_verifies(s3, moto_server, tmp_path):
    """The node is reclaimed mid-download (its agent killed with SIGKILL, as EC2 ends an instance when
    the two-minute notice runs out); the replacement finds the volume as it was left: the objects
    verified before the cut are skipped, the cut one continues from its partial file with a ranged GET,
    and everything is verified before the marker is written."""
    import os
    import signal
    import subprocess
    import sys
    import time

    target = tmp_path / "vol" / "datasets"
    uri, key = f"s3://{BUCKET}/jobs/one/", "jobs/one/digits/train.npz"
    node = subprocess.Popen([sys.executable, "-c", _SYNC_UNTIL_KILLED, moto_server.endpoint_url, uri, str(target),
                             key, "65536"], start_new_session=True)
    try:
        deadline = time.monotonic() + 60
        while not Path(f"{target}.cut").exists():
            assert node.poll() is None and time.monotonic() < deadline, "the node's sync ended before the cut"
            time.sleep(0.05)
    finally:
        os.killpg(node.pid, signal.SIGKILL)
        node.wait(timeout=10)
    assert node.returncode == -signal.SIGKILL
    partial = target / "digits" / f".train.npz{dataset.PARTIAL_SUFFIX}"
    assert partial.stat().st_size == 65536 and not (target / dataset.MARKER_NAME).exists()

    resumed = CountingS3(s3)
    result = dataset.sync_dataset(resumed, uri, target)
    assert result["status"] == "synced" and result["downloaded_bytes"] == len(FILES["digits/train.npz"]) - 65536
    assert resumed.gets == [(key, "bytes=65536-")]  # README and test.npz were verified before the cut
    assert _tree(target) == FILES and not partial.exists()
    assert json.loads((target / dataset.MARKER_NAME).read_text())["complete"] is True


def test_a_corrupt_partial_file_fails_verification_and_the_object_is_fetched_again(s3, tmp_path):
    target = tmp_path / "datasets"
    (target / "digits").mkdir(parents=True)
    (target / "digits" / f".test.npz{dataset.PARTIAL_SUFFIX}").write_bytes(b"garbage!")  # same length prefix, wrong bytes
    with pytest.raises(TemporaryError, match="MD5"):
        dataset.sync_dataset(s3, f"s3://{BUCKET}/jobs/one/", target, deadline_s=0)
    assert not (target / "digits" / "test.npz").exists() and not (target / dataset.MARKER_NAME).exists()
    assert dataset.sync_dataset(s3, f"s3://{BUCKET}/jobs/one/", target)["status"] == "synced"
    assert _tree(target) == FILES


def test_an_object_changed_after_the_manifest_is_refused_by_its_etag(s3, tmp_path):
    entries = dataset.manifest(s3, f"s3://{BUCKET}/jobs/one/")
    s3.put_object(Bucket=BUCKET, Key="jobs/one/README", Body=b"changed")
    entry = next(e for e in entries if e.key == "jobs/one/README")
    from botocore.exceptions import ClientError

    with pytest.raises(ClientError, match="PreconditionFailed|412"):
        dataset._download(s3, BUCKET, entry, tmp_path / "README", None)


def test_a_zip_object_is_verified_then_unpacked(s3, tmp_path):
    buffer = io.BytesIO()
    with zipfile.ZipFile(buffer, "w") as zf:
        for name, body in FILES.items():
            zf.writestr(name, body)
    s3.put_object(Bucket=BUCKET, Key="assets/abc123.zip", Body=buffer.getvalue())
    target = tmp_path / "datasets"
    result = dataset.sync_dataset(s3, f"s3://{BUCKET}/assets/abc123.zip", target, unpack=True)
    assert result["status"] == "synced" and _tree(target) == FILES
    assert not (target / "abc123.zip").exists()
    assert dataset.sync_dataset(s3, f"s3://{BUCKET}/assets/abc123.zip", target, unpack=True)["status"] == "present"


def test_nothing_under_the_uri_and_a_missing_bucket_are_final(s3, tmp_path):
    with pytest.raises(ConfigError, match="no object found"):
        dataset.sync_dataset(s3, f"s3://{BUCKET}/jobs/none/", tmp_path / "d")
    with pytest.raises(ConfigError, match="NoSuchBucket"):
        dataset.sync_dataset(s3, "s3://no-such-bucket/x/", tmp_path / "d")


def _config(**dataset_section) -> dict:
    return {"schema_version": 1, "region": "us-east-1", "stack_name": "S", "node_role": "single",
            "volume": {"tags": {"spot-training:stack": "S", "spot-training:purpose": "data-volume"},
                       "device_name": "/dev/sdf", "mount_point": "/dltraining", "fs_type": "xfs", "keep_snapshots": 2},
            "training": {"framework": "tensorflow", "python": "/usr/bin/python3", "command": ["{python}", "t.py"],
                         "user": "ubuntu", "checkpoint_dir": "/dltraining/checkpoints",
                         "code": {"type": "asset", "path": "/opt/code"}},
            "dataset": dataset_section}


def test_config_takes_a_dataset_section_and_rejects_bad_ones():
    assert parse_config(_config(uri="s3://b-1/p/")).dataset == DatasetConfig("s3://b-1/p/", False)
    config = parse_config(_config(uri="s3://b-1/k.zip", unpack=True))
    assert (config.dataset.uri, config.dataset.unpack) == ("s3://b-1/k.zip", True)
    for bad, where in (({"uri": "https://x/y"}, "dataset.uri"), ({"uri": "s3://b-1/../etc/"}, "dataset.uri"),
                       ({"uri": "s3://b-1/p/", "unpack": True}, "dataset.unpack"),
                       ({"uri": "s3://b-1/p/", "extra": 1}, "dataset.extra")):
        with pytest.raises(ConfigError, match=where.replace(".", r"\.")):
            parse_config(_config(**bad))


@pytest.mark.parametrize("uri", ["s3://b-1", "s3://b-1/x*", "s3://b-1/x?/", "s3://b-1//etc/"])
def test_the_agent_refuses_the_dataset_uris_the_stack_refuses(uri):
    """One check (contract.split_dataset_uri) for the stack's dataset_uri and the node config's
    dataset.uri: a URI the stack would not synthesize is no node config either."""
    with pytest.raises(ConfigError, match=r"dataset\.uri.*s3://bucket/prefix/"):
        parse_config(_config(uri=uri))
    with pytest.raises(ConfigError, match=r"dataset\.uri"):
        dataset.sync_dataset(None, uri, Path("/nonexistent"))
