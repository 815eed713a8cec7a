"""The data-cleanup custom resource handler against a moto server over HTTP."""

from __future__ import annotations


import importlib.util
from pathlib import Path

import pytest

IMAGE_ID = "ami-0123456789abcdef0"  # moto does not validate AMI ids

HANDLER_PATH = Path(__file__).resolve().parents[2] / "spot_training" / "infra" / "handlers" / "data_cleanup" / "index.py"
STACK = "SpotTraining"


def _load_handler():
    spec = importlib.util.spec_from_file_location("data_cleanup_index", HANDLER_PATH)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


cleanup = _load_handler()


def _tags(stack: str, purpose: str) -> list[dict[str, str]]:
    return [{"Key": "spot-training:stack", "Value": stack}, {"Key": "spot-training:purpose", "Value": purpose}]


def _volume(ec2, stack: str, az: str = "us-east-1a") -> str:
    return ec2.create_volume(
        AvailabilityZone=az, Size=10, VolumeType="gp3",
        TagSpecifications=[{"ResourceType": "volume", "Tags": _tags(stack, "data-volume")}],
    )["VolumeId"]


def _snapshot(ec2, volume_id: str, stack: str) -> str:
    return ec2.create_snapshot(
        VolumeId=volume_id,
        TagSpecifications=[{"ResourceType": "snapshot", "Tags": _tags(stack, "migration-snapshot")}],
    )["SnapshotId"]


def _instance(ec2, az: str = "us-east-1a") -> str:
    image_id = IMAGE_ID
    return ec2.run_instances(
        ImageId=image_id, MinCount=1, MaxCount=1, InstanceType="t3.micro", Placement={"AvailabilityZone": az}
    )["Instances"][0]["InstanceId"]


def _event(request_type: str, retain: str = "false", **extra) -> dict:
    return {
        "RequestType": request_type,
        "ResourceProperties": {
            "ServiceToken": "arn:aws:lambda:us-east-1:123456789012:function:provider",
            "StackName": STACK, "TagKey": "spot-training:stack", "TagValue": STACK, "RetainData": retain,
        },
        **extra,
    }


def _state(ec2) -> tuple[set[str], set[str]]:
    volumes = {v["VolumeId"] for v in ec2.describe_volumes()["Volumes"]}
    snapshots = {s["SnapshotId"] for s in ec2.describe_snapshots(OwnerIds=["self"])["Snapshots"]}
    return volumes, snapshots


@pytest.fixture
def resources(ec2):
    """Two tagged volumes with one tagged snapshot each, plus another stack's volume and snapshot."""
    ours = [_volume(ec2, STACK, "us-east-1a"), _volume(ec2, STACK, "us-east-1b")]
    our_snaps = [_snapshot(ec2, v, STACK) for v in ours]
    other = _volume(ec2, "OtherStack")
    other_snap = _snapshot(ec2, other, "OtherStack")
    return {"ours": ours, "our_snaps": our_snaps, "other": other, "other_snap": other_snap}


@pytest.mark.parametrize("request_type", ["Create", "Update"])
def test_create_and_update_change_nothing(ec2, resources, request_type):
    before = _state(ec2)
    extra = {"PhysicalResourceId": "data-cleanup-SpotTraining"} if request_type == "Update" else {}
    result = cleanup.handler(_event(request_type, **extra), None)
    assert result["PhysicalResourceId"] == "data-cleanup-SpotTraining"
    assert _state(ec2) == before


def test_delete_removes_only_the_stacks_volumes_and_snapshots(ec2, resources):
    volumes_before, snapshots_before = _state(ec2)
    result = cleanup.handler(_event("Delete", PhysicalResourceId="data-cleanup-SpotTraining"), None)
    volumes, snapshots = _state(ec2)
    assert volumes == volumes_before - set(resources["ours"])
    assert resources["other"] in volumes
    assert snapshots == snapshots_before - set(resources["our_snaps"])
    assert resources["other_snap"] in snapshots
    assert set(result["Data"]["DeletedVolumes"].split(",")) == set(resources["ours"])
    assert set(result["Data"]["DeletedSnapshots"].split(",")) == set(resources["our_snaps"])
    # A repeated Delete (CloudFormation retries) finds nothing more and succeeds.
    again = cleanup.handler(_event("Delete", PhysicalResourceId="data-cleanup-SpotTraining"), None)
    assert again["Data"]["DeletedVolumes"] == ""


def test_delete_with_retain_data_keeps_everything(ec2, resources):
    before = _state(ec2)
    result = cleanup.handler(_event("Delete", retain="true"), None)
    assert _state(ec2) == before
    assert result["Data"]["Retained"] == "true"


def test_delete_waits_for_volume_of_terminated_instance(ec2, resources):
    instance_id = _instance(ec2)
    ec2.attach_volume(VolumeId=resources["ours"][0], InstanceId=instance_id, Device="/dev/sdf")
    ec2.terminate_instances(InstanceIds=[instance_id])
    cleanup.handler(_event("Delete"), None)
    volumes, _ = _state(ec2)
    assert not volumes & set(resources["ours"])


def test_fails_when_a_volume_is_attached_to_a_running_instance_and_deletes_nothing(ec2, resources):
    instance_id = _instance(ec2)
    ec2.attach_volume(VolumeId=resources["ours"][0], InstanceId=instance_id, Device="/dev/sdf")
    before = _state(ec2)
    with pytest.raises(RuntimeError, match=f"{resources['ours'][0]}.*{instance_id}.*running"):
        cleanup.handler(_event("Delete"), None)
    assert _state(ec2) == before


@pytest.mark.parametrize(
    ("props", "message"),
    [
        ({"StackName": ""}, "StackName"),
        ({"StackName": STACK, "RetainData": "yes"}, "RetainData.*'yes'"),
        ({"StackName": STACK, "TagKey": ""}, "TagKey"),
    ],
)
def test_fails_on_bad_properties_and_touches_nothing(ec2, resources, props, message):
    before = _state(ec2)
    with pytest.raises(ValueError, match=message):
        cleanup.handler({"RequestType": "Delete", "ResourceProperties": props}, None)
    assert _state(ec2) == before


def test_fails_on_unknown_request_type(moto_server):
    with pytest.raises(ValueError, match="RequestType.*'Destroy'"):
        cleanup.handler({"RequestType": "Destroy", "ResourceProperties": {"StackName": STACK}}, None)


def test_a_volume_that_disappears_while_waited_for_is_done(ec2, resources, monkeypatch):
    """A root volume (DeleteOnTermination) of an instance that is shutting down: EC2 deletes it with the
    instance while the handler waits for it to become available. Gone is done, not an error (it
    was once: `cdk destroy` failed with 'did not become available ... InvalidVolume.NotFound')."""
    import boto3

    root_volume = _volume(ec2, STACK)
    instance_id = _instance(ec2)
    ec2.attach_volume(VolumeId=root_volume, InstanceId=instance_id, Device="/dev/sda1")
    ec2.stop_instances(InstanceIds=[instance_id])  # on its way out: the handler waits for the volume
    real_client = boto3.client

    def client_that_sees_ec2_delete_the_volume(*args, **kwargs):
        client = real_client(*args, **kwargs)

        def ec2_deletes_it(params, **_):
            if params.get("VolumeIds") == [root_volume] and root_volume in _state(ec2)[0]:
                ec2.detach_volume(VolumeId=root_volume, Force=True)
                ec2.delete_volume(VolumeId=root_volume)

        client.meta.events.register("before-parameter-build.ec2.DescribeVolumes", ec2_deletes_it)
        return client

    monkeypatch.setattr(cleanup.boto3, "client", client_that_sees_ec2_delete_the_volume)
    result = cleanup.handler(_event("Delete"), None)
    volumes, snapshots = _state(ec2)
    assert not volumes & {root_volume, *resources["ours"]}
    assert not snapshots & set(resources["our_snaps"])
    assert set(resources["ours"]) <= set(result["Data"]["DeletedVolumes"].split(","))
