"""spot_training.agent.ebs.prepare_data_volume in-process against the moto server over HTTP, volumes as directories."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest
from storage_helpers import (
    FAST,
    aws_state,
    create_data_volume,
    data_volumes,
    make_config,
    migration_snapshots,
    run_instance,
)

from spot_training.agent.blockdev import DirectoryBlockDevices
from spot_training.agent.ebs import MOVE_STATE_TAG, SOURCE_VOLUME_TAG, VolumeTimeouts, prepare_data_volume, verify_mounted
from spot_training.agent.errors import ConfigError, TemporaryError
from spot_training.agent.lease import LEASE_TAG
from spot_training.local.moto_compat import volume_dir

LOG = logging.getLogger("tests.ebs")


def _prepare(ec2, moto_server, config, instance_id, az, **overrides):
    return prepare_data_volume(ec2=ec2, config=config, instance_id=instance_id, availability_zone=az,
                               blockdev=DirectoryBlockDevices(moto_server.volumes_dir), log=LOG,
                               timeouts=VolumeTimeouts(**{**FAST, **overrides}))


def _count_calls(ec2) -> list[str]:
    calls: list[str] = []
    ec2.meta.events.register("before-call.ec2", lambda model, **_: calls.append(model.name))
    return calls


def _tags(resource) -> dict[str, str]:
    return {t["Key"]: t["Value"] for t in resource.get("Tags", [])}


def test_same_az_attaches_mounts_formats_once_and_keeps_the_volume(ec2, moto_server, tmp_path):
    config, _ = make_config(tmp_path)
    volume_id = create_data_volume(ec2, "us-east-1a")
    instance_id = run_instance(ec2, "us-east-1a")
    calls = _count_calls(ec2)

    mount_point = _prepare(ec2, moto_server, config, instance_id, "us-east-1a")
    agent_calls = list(calls)

    assert mount_point == config.volume.mount_point
    [volume] = data_volumes(ec2)
    assert volume["VolumeId"] == volume_id
    assert [(a["InstanceId"], a["State"]) for a in volume["Attachments"]] == [(instance_id, "attached")]
    assert LEASE_TAG not in _tags(volume)  # released once attached
    assert mount_point.resolve() == volume_dir(moto_server.ebs_dir, volume_id).resolve()
    assert (volume_dir(moto_server.ebs_dir, volume_id) / DirectoryBlockDevices.FS_MARKER).read_text() == "xfs"
    assert migration_snapshots(ec2) == []
    # The article's three calls (it described twice, attached once); AttachVolume is the arbiter here;
    # plus one DescribeVolumes after the attach: did a move of this volume commit meanwhile?
    assert agent_calls == ["DescribeVolumes", "AttachVolume", "DescribeVolumes", "DescribeVolumes"]
    verify_mounted(DirectoryBlockDevices(moto_server.volumes_dir), volume_id, mount_point)


def test_rerun_when_attached_and_mounted_makes_one_call_and_changes_nothing(ec2, moto_server, tmp_path):
    config, _ = make_config(tmp_path)
    create_data_volume(ec2, "us-east-1a")
    instance_id = run_instance(ec2, "us-east-1a")
    _prepare(ec2, moto_server, config, instance_id, "us-east-1a")
    (config.volume.mount_point / "checkpoint").write_text("step 10")
    before = aws_state(ec2)
    calls = _count_calls(ec2)

    _prepare(ec2, moto_server, config, instance_id, "us-east-1a")
    agent_calls = list(calls)

    assert agent_calls == ["DescribeVolumes"]
    assert aws_state(ec2) == before
    assert (config.volume.mount_point / "checkpoint").read_text() == "step 10"  # not reformatted


def test_cross_az_move_preserves_data_and_properties_and_retires_the_old_volume(ec2, moto_server, tmp_path):
    config, _ = make_config(tmp_path)
    key_id = "arn:aws:kms:us-east-1:123456789012:key/11111111-2222-3333-4444-555555555555"
    old_id = create_data_volume(ec2, "us-east-1a", Size=50, VolumeType="gp3", Iops=4000, Throughput=250,
                                Encrypted=True, KmsKeyId=key_id, extra_tags={"team": "vision"})
    old_dir = volume_dir(moto_server.ebs_dir, old_id)
    (old_dir / DirectoryBlockDevices.FS_MARKER).write_text("xfs")
    (old_dir / "checkpoints").mkdir()
    (old_dir / "checkpoints" / "step-500.ckpt").write_bytes(b"weights at step 500")
    instance_id = run_instance(ec2, "us-east-1b")

    mount_point = _prepare(ec2, moto_server, config, instance_id, "us-east-1b")

    assert (mount_point / "checkpoints" / "step-500.ckpt").read_bytes() == b"weights at step 500"
    [new] = data_volumes(ec2)
    assert new["VolumeId"] != old_id
    assert new["AvailabilityZone"] == "us-east-1b"
    assert (new["Size"], new["VolumeType"], new["Iops"], new["Throughput"], new["Encrypted"], new["KmsKeyId"]) == (
        50, "gp3", 4000, 250, True, key_id)
    tags = _tags(new)
    assert tags["team"] == "vision"
    assert tags[SOURCE_VOLUME_TAG] == old_id
    assert tags[MOVE_STATE_TAG] == "verified"
    assert LEASE_TAG not in tags
    assert [a["InstanceId"] for a in new["Attachments"]] == [instance_id]
    assert not old_dir.exists()
    [snapshot] = migration_snapshots(ec2)
    assert snapshot["VolumeId"] == old_id
    assert _tags(snapshot)[SOURCE_VOLUME_TAG] == old_id


def test_moves_keep_only_the_newest_snapshots(ec2, moto_server, tmp_path):
    config, _ = make_config(tmp_path, keep_snapshots=2)
    create_data_volume(ec2, "us-east-1a")
    seen = []
    for hop, az in enumerate(["us-east-1b", "us-east-1c", "us-east-1a", "us-east-1b"]):
        instance_id = run_instance(ec2, az)
        _prepare(ec2, moto_server, config, instance_id, az)
        ec2.terminate_instances(InstanceIds=[instance_id])  # detaches the volume, as a spot interruption does
        snapshots = migration_snapshots(ec2)
        seen.append(len(snapshots))
        assert len(data_volumes(ec2)) == 1
    assert seen == [1, 2, 2, 2]


def _volume_held_by_another_instance(ec2) -> tuple[str, str]:
    """A data volume in us-east-1a attached to one instance there, and a second instance in that AZ.
    Returns (the holder's instance ID, the second instance's)."""
    volume_id = create_data_volume(ec2, "us-east-1a")
    holder = run_instance(ec2, "us-east-1a")
    ec2.attach_volume(VolumeId=volume_id, InstanceId=holder, Device="/dev/sdf")
    return holder, run_instance(ec2, "us-east-1a")


def test_waits_for_a_terminated_instance_to_release_the_volume(ec2, moto_server, tmp_path):
    config, _ = make_config(tmp_path)
    old_instance, new_instance = _volume_held_by_another_instance(ec2)
    ec2.terminate_instances(InstanceIds=[old_instance])

    _prepare(ec2, moto_server, config, new_instance, "us-east-1a")

    [volume] = data_volumes(ec2)
    assert [a["InstanceId"] for a in volume["Attachments"]] == [new_instance]


def test_volume_held_by_a_running_instance_is_a_temporary_failure(ec2, moto_server, tmp_path):
    config, _ = make_config(tmp_path)
    holder, me = _volume_held_by_another_instance(ec2)

    with pytest.raises(TemporaryError, match="volume_available"):
        _prepare(ec2, moto_server, config, me, "us-east-1a", detach_wait_s=1.0)

    [volume] = data_volumes(ec2)
    assert [a["InstanceId"] for a in volume["Attachments"]] == [holder]
    assert LEASE_TAG not in _tags(volume)  # released on failure
    assert not config.volume.mount_point.exists()


def test_fails_when_no_volume_carries_the_tags_and_touches_nothing(ec2, moto_server, tmp_path):
    config, _ = make_config(tmp_path)
    create_data_volume(ec2, "us-east-1a", stack="OtherStack")  # another stack's volume is never taken
    ec2.create_volume(AvailabilityZone="us-east-1a", Size=20,
                      TagSpecifications=[{"ResourceType": "volume", "Tags": [{"Key": "Name", "Value": "SpotTraining"}]}])
    instance_id = run_instance(ec2, "us-east-1a")
    before = aws_state(ec2)

    with pytest.raises(ConfigError, match=r"no EBS volume.*spot-training:stack.*SpotTraining.*volume.tags"):
        _prepare(ec2, moto_server, config, instance_id, "us-east-1a")

    assert aws_state(ec2) == before
    assert not config.volume.mount_point.exists()


def test_fails_on_two_independent_data_volumes_naming_both_and_touches_nothing(ec2, moto_server, tmp_path):
    config, _ = make_config(tmp_path)
    first, second = create_data_volume(ec2, "us-east-1a"), create_data_volume(ec2, "us-east-1b")
    instance_id = run_instance(ec2, "us-east-1a")
    before = aws_state(ec2)

    with pytest.raises(ConfigError, match=rf"2 independent EBS volumes.*({first}.*{second}|{second}.*{first})"):
        _prepare(ec2, moto_server, config, instance_id, "us-east-1a")

    assert aws_state(ec2) == before


def test_refuses_to_mount_over_another_mount(ec2, moto_server, tmp_path):
    config, _ = make_config(tmp_path)
    create_data_volume(ec2, "us-east-1a")
    other = tmp_path / "other-disk"
    other.mkdir()
    config.volume.mount_point.symlink_to(other)  # something else is "mounted" there
    instance_id = run_instance(ec2, "us-east-1a")

    with pytest.raises(TemporaryError, match="already has .*other-disk mounted"):
        _prepare(ec2, moto_server, config, instance_id, "us-east-1a")


def test_verify_mounted_refuses_when_the_volume_is_not_mounted(tmp_path):
    root = tmp_path / "volumes"
    (root / "vol-0123456789abcdef0").mkdir(parents=True)
    (tmp_path / "root-disk").mkdir()
    devices = DirectoryBlockDevices(root)
    with pytest.raises(TemporaryError, match="not mounted at .*dltraining.*refusing to start training on the root disk"):
        verify_mounted(devices, "vol-0123456789abcdef0", tmp_path / "dltraining")
    (tmp_path / "dltraining").symlink_to(tmp_path / "root-disk")  # something, but not the volume
    with pytest.raises(TemporaryError, match="root-disk"):
        verify_mounted(devices, "vol-0123456789abcdef0", tmp_path / "dltraining")


def _formatted_source(ec2, moto_server, epoch: str | None = None) -> tuple[str, Path]:
    """A data volume in us-east-1a holding a file system (and an ``epoch`` file when given).
    Returns (its volume ID, its directory)."""
    source_id = create_data_volume(ec2, "us-east-1a")
    source_dir = volume_dir(moto_server.ebs_dir, source_id)
    (source_dir / DirectoryBlockDevices.FS_MARKER).write_text("xfs")
    if epoch is not None:
        (source_dir / "epoch").write_text(epoch)
    return source_id, source_dir


def _attached_move_copy(client, source_id: str, state: str, mover: str) -> str:
    """A copy of ``source_id`` in us-east-1b as ``mover``'s move leaves it in ``state``: made from a
    snapshot, tagged, attached to ``mover``. Returns its volume ID."""
    snapshot_id = client.create_snapshot(VolumeId=source_id)["SnapshotId"]
    copy_id = client.create_volume(AvailabilityZone="us-east-1b", SnapshotId=snapshot_id, VolumeType="gp3",
                                   TagSpecifications=[{"ResourceType": "volume", "Tags": [
                                       {"Key": "spot-training:stack", "Value": "SpotTraining"},
                                       {"Key": "spot-training:purpose", "Value": "data-volume"},
                                       {"Key": SOURCE_VOLUME_TAG, "Value": source_id},
                                       {"Key": MOVE_STATE_TAG, "Value": state},
                                       {"Key": "spot-training:created-by", "Value": mover}]}])["VolumeId"]
    client.attach_volume(VolumeId=copy_id, InstanceId=mover, Device="/dev/sdf")
    return copy_id


def test_copy_is_abandoned_when_the_source_was_attached_during_the_move(ec2, moto_server, tmp_path):
    """Another instance attached (and trained on) the source after our snapshot: our copy may be stale,
    so it is never verified; once the source is free again, a fresh move carries the newer data."""
    config, _ = make_config(tmp_path)
    source_id, source_dir = _formatted_source(ec2, moto_server, epoch="1")
    me = run_instance(ec2, "us-east-1b")
    # A half-made move of ours (as left by a kill after 'volume_attached').
    copy_id = _attached_move_copy(ec2, source_id, "copying", me)
    # Meanwhile an instance in the source's AZ attached the source and trained on.
    other = run_instance(ec2, "us-east-1a")
    ec2.attach_volume(VolumeId=source_id, InstanceId=other, Device="/dev/sdf")
    (source_dir / "epoch").write_text("2")

    with pytest.raises(TemporaryError, match="attached to .* during the move.*abandoned"):
        _prepare(ec2, moto_server, config, me, "us-east-1b")
    copy = ec2.describe_volumes(VolumeIds=[copy_id])["Volumes"][0]
    assert _tags(copy)[MOVE_STATE_TAG] == "abandoned"
    assert (source_dir / "epoch").read_text() == "2"  # the source is untouched

    ec2.terminate_instances(InstanceIds=[other])  # the other instance is interrupted in turn
    mount_point = _prepare(ec2, moto_server, config, me, "us-east-1b")

    assert (mount_point / "epoch").read_text() == "2"  # the newer data, not the abandoned copy's
    [volume] = data_volumes(ec2)
    assert volume["VolumeId"] not in (source_id, copy_id)
    assert [a["InstanceId"] for a in volume["Attachments"]] == [me]


# ---- a lease-free attach in the source's AZ racing a move --------------------------
def _other_client(moto_server):
    import boto3
    from botocore.config import Config

    return boto3.client("ec2", region_name="us-east-1", endpoint_url=moto_server.endpoint_url,
                        aws_access_key_id="testing", aws_secret_access_key="testing",
                        config=Config(retries={"mode": "standard"}))


def test_source_attached_between_the_final_recheck_and_the_delete_is_never_retired(ec2, moto_server, tmp_path):
    """The mover re-checked the source (free) and marked its copy verified; right then an agent in the
    source's AZ attaches the source (no lease needed there) and trains on. The mover's DeleteVolume
    fails with VolumeInUse: its copy must not stay 'verified' (the next boot would retire the source
    that was trained on); the newer data wins."""
    config, _ = make_config(tmp_path)
    source_id, source_dir = _formatted_source(ec2, moto_server, epoch="1")
    mover = run_instance(ec2, "us-east-1b")
    other = run_instance(ec2, "us-east-1a")
    other_ec2 = _other_client(moto_server)
    attached: list[str] = []

    def attach_right_after_verified(params, **_):
        tags = {t["Key"]: t["Value"] for t in params.get("Tags", [])}
        if tags.get(MOVE_STATE_TAG) == "verified" and not attached:
            attached.append(source_id)
            other_ec2.attach_volume(VolumeId=source_id, InstanceId=other, Device="/dev/sdf")
            (source_dir / "epoch").write_text("2")  # the other node trains on the source

    calls: list[dict] = []  # CreateTags requests; right after the one marking the copy verified, attach
    ec2.meta.events.register("before-parameter-build.ec2.CreateTags", lambda params, **kw: calls.append(dict(params)))
    ec2.meta.events.register("after-call.ec2.CreateTags",
                             lambda **kw: attach_right_after_verified(calls[-1]) if calls else None)

    with pytest.raises(TemporaryError):
        _prepare(ec2, moto_server, config, mover, "us-east-1b")
    copies = [v for v in data_volumes(ec2) if v["VolumeId"] != source_id]
    assert copies and all(_tags(c).get(MOVE_STATE_TAG) != "verified" for c in copies), [_tags(c) for c in copies]
    assert (source_dir / "epoch").read_text() == "2"

    # The other node is interrupted in turn; the mover's agent boots again and moves the source afresh.
    ec2.terminate_instances(InstanceIds=[other])
    mount_point = _prepare(ec2, moto_server, config, mover, "us-east-1b")
    assert (mount_point / "epoch").read_text() == "2"  # the data trained on after the first move attempt
    [volume] = data_volumes(ec2)
    assert [a["InstanceId"] for a in volume["Attachments"]] == [mover]


def test_lease_free_attach_backs_off_when_a_move_committed_meanwhile(ec2, moto_server, tmp_path):
    """An agent in the volume's AZ saw no lease and attaches without one; between its read and its
    AttachVolume a mover elsewhere finished and marked its copy verified (the source is about to be
    retired). The attacher must re-read the move state after attaching, detach and exit 75 instead
    of training on a volume that the next boot retires."""
    config, _ = make_config(tmp_path)
    source_id, source_dir = _formatted_source(ec2, moto_server)
    me = run_instance(ec2, "us-east-1a")
    mover = run_instance(ec2, "us-east-1b")
    other_ec2 = _other_client(moto_server)
    done: list[str] = []

    def mover_commits(**_):
        if done:
            return
        done.append(_attached_move_copy(other_ec2, source_id, "verified", mover))

    ec2.meta.events.register("before-call.ec2.AttachVolume", mover_commits)
    with pytest.raises(TemporaryError, match="verified copy"):
        _prepare(ec2, moto_server, config, me, "us-east-1a")
    source = ec2.describe_volumes(VolumeIds=[source_id])["Volumes"][0]
    assert source["State"] == "available" and not source.get("Attachments")  # let go again
    assert not (tmp_path / "dltraining").exists()  # never mounted, so never trained on
