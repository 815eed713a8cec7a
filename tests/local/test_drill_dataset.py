"""``spot-train local drill --dataset-uri s3://bucket/prefix/``: the user's files go to a prefix of the
local S3 as ``aws s3 sync`` puts them, the stack is deployed with ``-c dataset_uri=...``, and the agent
brings that prefix onto the empty data volume. The whole drill with a dataset runs in minutes (see
docs/localmode.md for a dated run); these tests check its parts: the options, the upload followed by
the agent's own sync, the command line, and what the report reads from the agents' logs."""

from __future__ import annotations

import json
from pathlib import Path

import boto3
import pytest

from spot_training.agent import dataset
from spot_training.cli import format_report, main
from spot_training.local import drill
from spot_training.local.drill import DrillOptions, dataset_prefix, dataset_syncs, upload_dataset


def _files(root: Path) -> dict[str, bytes]:
    files = {"digits/train.npz": b"x" * 70_000, "digits/test.npz": b"y" * 1000, "labels/classes.txt": b"0\n1\n"}
    for name, body in files.items():
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        (root / name).write_bytes(body)
    return files


@pytest.mark.parametrize("uri", ["https://b/x/", "s3://b-1/one-object.npz", "s3://b-1/../etc/", "s3://B/x/", None])
def test_a_dataset_uri_that_is_not_a_prefix_is_refused(uri):
    with pytest.raises(ValueError, match="dataset_uri must be s3://bucket/prefix/"):
        dataset_prefix(uri)
    if uri is not None:
        with pytest.raises(ValueError, match="dataset_uri"):
            DrillOptions(dataset_uri=uri).validate()


def test_dataset_options_are_checked_before_anything_starts(tmp_path):
    assert dataset_prefix("s3://my-data/jobs/digits/") == ("my-data", "jobs/digits/")
    assert dataset_prefix("s3://my-data/") == ("my-data", "")
    DrillOptions(dataset_uri="s3://my-data/jobs/digits/").validate()
    with pytest.raises(ValueError, match="needs a dataset_uri"):
        DrillOptions(dataset_dir=tmp_path).validate()
    (tmp_path / "empty").mkdir()
    with pytest.raises(ValueError, match="directory holding the dataset's files"):
        DrillOptions(dataset_uri="s3://my-data/x/", dataset_dir=tmp_path / "empty").validate()


def test_the_command_line_passes_the_dataset_to_the_drill(tmp_path, monkeypatch, capsys):
    seen = []

    def run(options, on_event=None):
        seen.append(options)
        return {"work_dir": str(tmp_path), "passed": True, "phases_s": {}}

    monkeypatch.setattr(drill, "run_drill", run)
    data = tmp_path / "data"
    _files(data)
    assert main(["local", "drill", "--work-dir", str(tmp_path / "w"), "--dataset-uri", "s3://my-data/digits/",
                 "--dataset-dir", str(data)]) == 0
    assert (seen[0].dataset_uri, seen[0].dataset_dir) == ("s3://my-data/digits/", data)
    assert main(["local", "drill", "--work-dir", str(tmp_path / "w"), "--dataset-uri", "s3://my-data/one.npz"]) == 2
    assert "dataset_uri must be s3://bucket/prefix/" in capsys.readouterr().err
    assert main(["local", "drill", "--cluster", "--dataset-uri", "s3://my-data/digits/"]) == 2
    assert "not of --cluster or --sweep" in capsys.readouterr().err
    assert len(seen) == 1


def test_the_upload_is_what_the_agent_brings_onto_an_empty_volume(moto_server, tmp_path):
    """upload_dataset puts the user's tree under the prefix (creating the bucket), as ``aws s3 sync``
    would; the agent's sync of the same URI onto an empty directory gives back the same tree, verified."""
    s3 = boto3.client("s3", region_name="us-east-1", endpoint_url=moto_server.endpoint_url,
                      aws_access_key_id="testing", aws_secret_access_key="testing")
    files = _files(tmp_path / "user")
    uploaded = upload_dataset(s3, "s3://user-bucket/jobs/digits/", tmp_path / "user")
    assert uploaded["objects"] == 3 and uploaded["bytes"] == sum(map(len, files.values()))
    listed = s3.list_objects_v2(Bucket="user-bucket")["Contents"]
    assert sorted(o["Key"] for o in listed) == sorted(f"jobs/digits/{name}" for name in files) == uploaded["keys"]
    upload_dataset(s3, "s3://user-bucket/jobs/digits/", tmp_path / "user")  # the bucket exists now: still fine

    volume = tmp_path / "vol" / "datasets"
    result = dataset.sync_dataset(s3, "s3://user-bucket/jobs/digits/", volume)
    assert result["status"] == "synced" and result["objects"] == 3
    assert {p.relative_to(volume).as_posix(): p.read_bytes() for p in volume.rglob("*")
            if p.is_file() and not p.name.startswith(".spot-training-")} == files


def test_the_report_says_how_each_node_found_the_dataset(tmp_path):
    """The first node synced the prefix onto the empty volume; its replacement found it on the volume."""
    logs = []
    for name, time, status, size in (("i-2", "2026-11-28T15:01:00.000Z", "present", 0),
                                     ("i-1", "2026-11-28T15:00:00.000Z", "synced", 71_004)):
        path = tmp_path / name / "agent.log"
        path.parent.mkdir()
        path.write_text("not json\n" + json.dumps({"time": time, "message": "dataset ready", "dataset": {
            "status": status, "objects": 3, "downloaded_bytes": size}}) + "\n")
        logs.append(path)
    syncs = dataset_syncs(logs)
    assert [(s["status"], s["downloaded_bytes"]) for s in syncs] == [("synced", 71_004), ("present", 0)]
    text = format_report({"passed": True, "phases_s": {}, "dataset": {
        "uri": "s3://user-bucket/jobs/digits/", "objects": 3, "bytes": 71_004, "syncs": syncs}})
    assert "s3://user-bucket/jobs/digits/ (3 objects, 71004 bytes uploaded)" in text
    assert "synced 71004 bytes, present" in text
