"""Cleanup cancels only our stack's spot fleet: against a moto server over HTTP."""

from __future__ import annotations

import pytest

from spot_training.agent.cleanup import FLEET_REQUEST_TAG, cancel_own_fleet, find_fleet_request_id

STACK = "SpotTraining"


def _fleet(ec2, *, stack: str | None, capacity: int = 1) -> tuple[str, list[str]]:
    """A spot fleet from a launch template, tagged with ``stack`` (or untagged); its instance ids."""
    name = f"lt-{stack or 'none'}-{capacity}"
    ec2.create_launch_template(LaunchTemplateName=name, LaunchTemplateData={
        "ImageId": "ami-12c6146b", "InstanceType": "p3.2xlarge",
        "MetadataOptions": {"HttpTokens": "required", "HttpEndpoint": "enabled"}})
    config = {
        "IamFleetRole": "arn:aws:iam::123456789012:role/fleet", "TargetCapacity": capacity,
        "AllocationStrategy": "priceCapacityOptimized", "Type": "maintain",
        "LaunchTemplateConfigs": [{"LaunchTemplateSpecification": {"LaunchTemplateName": name, "Version": "$Latest"}}],
    }
    if stack is not None:
        config["TagSpecifications"] = [{"ResourceType": "spot-fleet-request",
                                        "Tags": [{"Key": "spot-training:stack", "Value": stack}]}]
    fleet_id = ec2.request_spot_fleet(SpotFleetRequestConfig=config)["SpotFleetRequestId"]
    instances = [i["InstanceId"] for i in ec2.describe_spot_fleet_instances(SpotFleetRequestId=fleet_id)["ActiveInstances"]]
    assert len(instances) == capacity
    return fleet_id, instances


def _running(ec2, instance_ids: list[str]) -> list[str]:
    reservations = ec2.describe_instances(InstanceIds=instance_ids)["Reservations"]
    return [i["InstanceId"] for r in reservations for i in r["Instances"] if i["State"]["Name"] == "running"]


def _fleet_ids(ec2) -> set[str]:
    return {f["SpotFleetRequestId"] for f in ec2.describe_spot_fleet_requests()["SpotFleetRequestConfigs"]
            if f["SpotFleetRequestState"] == "active"}


def test_cancels_our_fleet_and_terminates_its_instances(ec2):
    ours, our_instances = _fleet(ec2, stack=STACK, capacity=2)
    theirs, their_instances = _fleet(ec2, stack="SomeoneElse")
    assert cancel_own_fleet(ec2=ec2, instance_id=our_instances[0], stack_name=STACK) == ours
    assert _fleet_ids(ec2) == {theirs}
    assert _running(ec2, our_instances) == []
    assert _running(ec2, their_instances) == their_instances


def test_leaves_another_stacks_fleet_alone(ec2):
    theirs, their_instances = _fleet(ec2, stack="SomeoneElse")
    assert cancel_own_fleet(ec2=ec2, instance_id=their_instances[0], stack_name=STACK) is None
    assert _fleet_ids(ec2) == {theirs}
    assert _running(ec2, their_instances) == their_instances


def test_leaves_an_untagged_fleet_alone(ec2):
    untagged, instances = _fleet(ec2, stack=None)
    assert cancel_own_fleet(ec2=ec2, instance_id=instances[0], stack_name=STACK) is None
    assert _fleet_ids(ec2) == {untagged}


def test_instance_without_a_fleet_is_left_alone(ec2):
    _fleet(ec2, stack=STACK)
    lone = ec2.run_instances(ImageId="ami-12c6146b", MinCount=1, MaxCount=1)["Instances"][0]["InstanceId"]
    before = _fleet_ids(ec2)
    assert cancel_own_fleet(ec2=ec2, instance_id=lone, stack_name=STACK) is None
    assert _fleet_ids(ec2) == before and _running(ec2, [lone]) == [lone]


def test_finds_the_fleet_by_tag_and_without_it(ec2):
    _fleet(ec2, stack="Other")
    ours, instances = _fleet(ec2, stack=STACK, capacity=2)
    tags = ec2.describe_instances(InstanceIds=instances[:1])["Reservations"][0]["Instances"][0].get("Tags", [])
    assert {"Key": FLEET_REQUEST_TAG, "Value": ours} in tags  # EC2 (and our moto bridge) tags fleet instances
    assert find_fleet_request_id(ec2, instances[1]) == ours
    # Without the tag (moto without our bridge; instances of older fleets): found through the fleet's instances.
    ec2.delete_tags(Resources=[instances[1]], Tags=[{"Key": FLEET_REQUEST_TAG}])
    tags = ec2.describe_instances(InstanceIds=instances[1:])["Reservations"][0]["Instances"][0].get("Tags", [])
    assert all(t["Key"] != FLEET_REQUEST_TAG for t in tags)
    assert find_fleet_request_id(ec2, instances[1]) == ours
    assert cancel_own_fleet(ec2=ec2, instance_id=instances[1], stack_name=STACK) == ours
    assert ours not in _fleet_ids(ec2)


def test_second_cleanup_is_harmless(ec2):
    ours, instances = _fleet(ec2, stack=STACK)
    assert cancel_own_fleet(ec2=ec2, instance_id=instances[0], stack_name=STACK) == ours
    # A rerun (agent restarted after cancelling): nothing left to cancel, no error.
    assert cancel_own_fleet(ec2=ec2, instance_id=instances[0], stack_name=STACK) in (None, ours)


def test_unknown_instance_is_an_api_error(ec2):
    from botocore.exceptions import ClientError

    with pytest.raises(ClientError, match="InvalidInstanceID"):
        cancel_own_fleet(ec2=ec2, instance_id="i-0000000000000dead", stack_name=STACK)
