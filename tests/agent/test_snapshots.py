"""Periodic snapshots (spot_training/agent/snapshots.py) and the provisioned initialization rate of a moved volume
(spot_training/agent/ebs.py), against the moto server over HTTP; the node config fields that drive them."""

from __future__ import annotations

import dataclasses
import logging
import time

import pytest
from botocore.stub import Stubber
from storage_helpers import FAST, config_dict, create_data_volume, data_volumes, make_config, run_instance

from spot_training.agent.blockdev import DirectoryBlockDevices
from spot_training.agent.config import PERIODIC_SNAPSHOT_PURPOSE, parse_config
from spot_training.agent.ebs import VolumeTimeouts, prepare_data_volume
from spot_training.agent.errors import ConfigError
from spot_training.agent.snapshots import PeriodicSnapshots
from spot_training.local.moto_compat import volume_dir

LOG = logging.getLogger("test.snapshots")


def _periodic(ec2) -> list[dict]:
    return ec2.describe_snapshots(OwnerIds=["self"], Filters=[
        {"Name": "tag:spot-training:purpose", "Values": [PERIODIC_SNAPSHOT_PURPOSE]}])["Snapshots"]


def _attached(ec2, tmp_path, *, keep: int = 2, interval_s: int = 3600):
    config, _ = make_config(tmp_path, keep_snapshots=keep)
    volume = dataclasses.replace(config.volume, snapshot_interval_s=interval_s)
    volume_id = create_data_volume(ec2, "us-east-1a")
    instance_id = run_instance(ec2, "us-east-1a")
    ec2.attach_volume(VolumeId=volume_id, InstanceId=instance_id, Device="/dev/sdf")
    return PeriodicSnapshots(ec2=ec2, stack_name=config.stack_name, volume=volume, instance_id=instance_id, log=LOG), volume_id


def test_each_round_snapshots_the_attached_volume_tagged_and_keeps_the_newest(ec2, tmp_path):
    periodic, volume_id = _attached(ec2, tmp_path, keep=2)
    taken = []
    for _ in range(4):
        taken.append(periodic.take())
        time.sleep(1.1)  # moto's StartTime has a resolution of a second or so; keep the order unambiguous
    snapshots = _periodic(ec2)
    assert sorted(s["SnapshotId"] for s in snapshots) == sorted(taken[-2:])  # the two newest, never the newest deleted
    for snapshot in snapshots:
        tags = {t["Key"]: t["Value"] for t in snapshot["Tags"]}
        assert tags == {"spot-training:stack": "SpotTraining", "spot-training:purpose": PERIODIC_SNAPSHOT_PURPOSE,
                        "spot-training:source-volume": volume_id, "spot-training:created-by": periodic.instance_id}
        assert snapshot["VolumeId"] == volume_id


def test_no_attached_volume_no_snapshot(ec2, tmp_path):
    config, _ = make_config(tmp_path)
    create_data_volume(ec2, "us-east-1a")  # exists, but attached to nobody
    periodic = PeriodicSnapshots(ec2=ec2, stack_name=config.stack_name, volume=config.volume,
                                 instance_id=run_instance(ec2, "us-east-1a"), log=LOG)
    assert periodic.take() is None and _periodic(ec2) == []


def test_the_thread_takes_snapshots_at_the_interval_and_stops(ec2, tmp_path):
    periodic, _ = _attached(ec2, tmp_path, keep=5, interval_s=1)
    periodic.start()
    try:
        deadline = time.monotonic() + 20
        while len(_periodic(ec2)) < 2 and time.monotonic() < deadline:
            time.sleep(0.2)
    finally:
        periodic.stop()
    count = len(_periodic(ec2))
    assert count >= 2
    time.sleep(1.5)
    assert len(_periodic(ec2)) == count  # stopped: no more


def test_interval_zero_starts_no_thread(ec2, tmp_path):
    periodic, _ = _attached(ec2, tmp_path, interval_s=0)
    periodic.start()
    assert periodic._thread is None
    periodic.stop()


def test_a_pending_snapshot_is_never_deleted_and_blocks_the_next(tmp_path):
    """moto completes snapshots at once, so the pending case runs against botocore's Stubber."""
    import boto3

    config, _ = make_config(tmp_path, keep_snapshots=1)
    ec2 = boto3.client("ec2", region_name="us-east-1", aws_access_key_id="x", aws_secret_access_key="x")
    periodic = PeriodicSnapshots(ec2=ec2, stack_name="SpotTraining", volume=config.volume, instance_id="i-0123456789abcdef0", log=LOG)
    with Stubber(ec2) as stub:
        stub.add_response("describe_volumes", {"Volumes": [{"VolumeId": "vol-0123456789abcdef0"}]})
        stub.add_response("describe_snapshots", {"Snapshots": [
            {"SnapshotId": "snap-0000000000000000a", "State": "pending"}]})
        assert periodic.take() is None
        stub.add_response("describe_snapshots", {"Snapshots": [
            {"SnapshotId": "snap-0000000000000000a", "State": "pending", "StartTime": "2026-01-01T03:00:00Z"},
            {"SnapshotId": "snap-0000000000000000b", "State": "completed", "StartTime": "2026-01-01T02:00:00Z"},
            {"SnapshotId": "snap-0000000000000000c", "State": "completed", "StartTime": "2026-01-01T01:00:00Z"}]})
        stub.add_response("delete_snapshot", {}, {"SnapshotId": "snap-0000000000000000c"})
        assert periodic.prune() == ["snap-0000000000000000c"]
        stub.assert_no_pending_responses()


def test_a_move_asks_for_the_provisioned_initialization_rate(ec2, moto_server, tmp_path):
    """moto 5.2 accepts and ignores VolumeInitializationRate: the request itself is what is checked."""
    data = config_dict(tmp_path)
    data["volume"]["initialization_rate_mibps"] = 300
    config = parse_config(data)
    old_id = create_data_volume(ec2, "us-east-1a")
    (volume_dir(moto_server.ebs_dir, old_id) / DirectoryBlockDevices.FS_MARKER).write_text("xfs")
    requests = []
    ec2.meta.events.register("provide-client-params.ec2.CreateVolume", lambda params, **_: requests.append(dict(params)))
    instance_id = run_instance(ec2, "us-east-1b")
    prepare_data_volume(ec2=ec2, config=config, instance_id=instance_id, availability_zone="us-east-1b",
                        blockdev=DirectoryBlockDevices(moto_server.volumes_dir), log=LOG, timeouts=VolumeTimeouts(**FAST))
    [request] = requests
    assert request["VolumeInitializationRate"] == 300 and request["SnapshotId"].startswith("snap-")
    [moved] = data_volumes(ec2)
    assert moved["AvailabilityZone"] == "us-east-1b"


def test_without_a_rate_the_request_has_none(ec2, moto_server, tmp_path):
    config, _ = make_config(tmp_path)
    old_id = create_data_volume(ec2, "us-east-1a")
    (volume_dir(moto_server.ebs_dir, old_id) / DirectoryBlockDevices.FS_MARKER).write_text("xfs")
    requests = []
    ec2.meta.events.register("provide-client-params.ec2.CreateVolume", lambda params, **_: requests.append(dict(params)))
    prepare_data_volume(ec2=ec2, config=config, instance_id=run_instance(ec2, "us-east-1b"), availability_zone="us-east-1b",
                        blockdev=DirectoryBlockDevices(moto_server.volumes_dir), log=LOG, timeouts=VolumeTimeouts(**FAST))
    assert [r.get("VolumeInitializationRate") for r in requests] == [None]


@pytest.mark.parametrize(("field", "value", "allowed"), [
    ("snapshot_interval_s", 30, r"0 \(no periodic snapshots\) or an integer >= 60"),
    ("snapshot_interval_s", -1, r"an integer >= 0"),
    ("initialization_rate_mibps", 50, r"null or an integer from 100 to 300"),
    ("initialization_rate_mibps", True, r"null or an integer from 100 to 300"),
])
def test_bad_volume_fields_are_config_errors(tmp_path, field, value, allowed):
    data = config_dict(tmp_path)
    data["volume"][field] = value
    with pytest.raises(ConfigError, match=rf"volume\.{field}.*{allowed}"):
        parse_config(data)


def test_defaults_and_good_values(tmp_path):
    assert (parse_config(config_dict(tmp_path)).volume.snapshot_interval_s,
            parse_config(config_dict(tmp_path)).volume.initialization_rate_mibps) == (0, None)
    data = config_dict(tmp_path)
    data["volume"].update(snapshot_interval_s=3600, initialization_rate_mibps=100)
    volume = parse_config(data).volume
    assert (volume.snapshot_interval_s, volume.initialization_rate_mibps) == (3600, 100)


def test_first_snapshot_is_taken_as_soon_as_environment_and_dataset_are_in_place(ec2, tmp_path):
    """With an hour's interval, nothing is snapshotted at start; take_soon (called by the agent once
    the trainer's environment and the dataset are on the volume) snapshots at once, so a move later
    copies only what training wrote since."""
    periodic, volume_id = _attached(ec2, tmp_path, interval_s=3600)
    periodic.start()
    try:
        time.sleep(0.5)
        assert _periodic(ec2) == []
        periodic.take_soon()
        deadline = time.monotonic() + 10
        while not _periodic(ec2) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert [s["VolumeId"] for s in _periodic(ec2)] == [volume_id]
    finally:
        periodic.stop()
    assert periodic._thread is not None and not periodic._thread.is_alive()  # stop ends the wait at once
