"""spot_training.agent.fleet_actions.leave_fleet against a moto server over HTTP: a worker whose member tag was removed
lowers its own fleet's target and terminates itself; another stack's fleet is never touched."""

from __future__ import annotations

from spot_training.agent.fleet_actions import leave_fleet

STACK = "DistributedTraining"


def _fleet(ec2, *, stack: str, capacity: int) -> tuple[str, list[str]]:
    name = f"lt-{stack}-{capacity}"
    ec2.create_launch_template(LaunchTemplateName=name, LaunchTemplateData={
        "ImageId": "ami-12c6146b", "InstanceType": "m5.large",
        "MetadataOptions": {"HttpTokens": "required", "HttpEndpoint": "enabled", "InstanceMetadataTags": "enabled"}})
    fleet_id = ec2.request_spot_fleet(SpotFleetRequestConfig={
        "IamFleetRole": "arn:aws:iam::123456789012:role/fleet", "TargetCapacity": capacity,
        "AllocationStrategy": "priceCapacityOptimized", "Type": "maintain",
        "LaunchTemplateConfigs": [{"LaunchTemplateSpecification": {"LaunchTemplateName": name, "Version": "$Latest"}}],
        "TagSpecifications": [{"ResourceType": "spot-fleet-request", "Tags": [{"Key": "spot-training:stack",
                                                                               "Value": stack}]}],
    })["SpotFleetRequestId"]
    instances = [i["InstanceId"] for i in ec2.describe_spot_fleet_instances(SpotFleetRequestId=fleet_id)["ActiveInstances"]]
    return fleet_id, instances


def _target(ec2, fleet_id: str) -> int:
    config = ec2.describe_spot_fleet_requests(SpotFleetRequestIds=[fleet_id])["SpotFleetRequestConfigs"][0]
    return config["SpotFleetRequestConfig"]["TargetCapacity"]


def _state(ec2, instance_id: str) -> str:
    return ec2.describe_instances(InstanceIds=[instance_id])["Reservations"][0]["Instances"][0]["State"]["Name"]


def test_untagged_worker_lowers_the_target_and_terminates_only_itself(ec2):
    fleet_id, instances = _fleet(ec2, stack=STACK, capacity=3)
    assert leave_fleet(ec2=ec2, instance_id=instances[0], stack_name=STACK) == fleet_id
    assert _target(ec2, fleet_id) == 2
    assert _state(ec2, instances[0]) in ("shutting-down", "terminated")
    assert [_state(ec2, i) for i in instances[1:]] == ["running", "running"]


def test_another_stacks_fleet_is_left_alone(ec2):
    fleet_id, instances = _fleet(ec2, stack="SomeoneElse", capacity=2)
    assert leave_fleet(ec2=ec2, instance_id=instances[0], stack_name=STACK) is None
    assert _target(ec2, fleet_id) == 2
    assert _state(ec2, instances[0]) == "running"
