"""What a stack leaves behind after ``cdk destroy``: the orphan check of local mode's drills and of the
drill on a real account (:mod:`spot_training.ops.aws_drill`). boto3 calls only."""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

from spot_training.contract import STACK_TAG as STACK_TAG_KEY

#: The tag EC2 Spot Fleet puts on the instances it launches.
FLEET_TAG = "aws:ec2spot:fleet-request-id"


@dataclasses.dataclass
class Clients:
    """boto3 clients of one account and region (local mode: the moto server; standard retry mode)."""

    ec2: Any
    cloudformation: Any
    s3: Any


def find_orphans(aws: Clients, stack: str, *, fleet_request_ids: Sequence[str] = ()) -> list[str]:
    """What of ``stack`` still exists in the account (or the moto server): a list of ``"kind id (state)"`` strings.

    Looks for instances (not terminated) and volumes and snapshots tagged
    ``spot-training:stack=<stack>``, instances tagged with one of ``fleet_request_ids``, spot fleet
    requests that are tagged with the stack or listed in ``fleet_request_ids`` and not cancelled,
    and the CloudFormation stack itself. An empty list means nothing is left.

    Args:
        aws: the EC2 and CloudFormation clients (``s3`` unused here).
        stack: the stack name (its ``spot-training:stack`` tag value).
        fleet_request_ids: spot fleet requests known to be the stack's (default none).

    Returns:
        what is left; empty when nothing is.

    Raises:
        botocore.exceptions.ClientError: a call failed.
    """
    orphans: list[str] = []
    tagged = [{"Name": f"tag:{STACK_TAG_KEY}", "Values": [stack]}]
    instance_filters = [tagged]
    if fleet_request_ids:
        instance_filters.append([{"Name": f"tag:{FLEET_TAG}", "Values": list(fleet_request_ids)}])
    seen: set[str] = set()
    for filters in instance_filters:
        for reservation in aws.ec2.describe_instances(Filters=filters)["Reservations"]:
            for instance in reservation["Instances"]:
                state = instance["State"]["Name"]
                if state != "terminated" and instance["InstanceId"] not in seen:
                    seen.add(instance["InstanceId"])
                    orphans.append(f"instance {instance['InstanceId']} ({state})")
    for volume in aws.ec2.describe_volumes(Filters=tagged)["Volumes"]:
        orphans.append(f"volume {volume['VolumeId']} ({volume['State']})")
    for snapshot in aws.ec2.describe_snapshots(OwnerIds=["self"], Filters=tagged)["Snapshots"]:
        orphans.append(f"snapshot {snapshot['SnapshotId']} ({snapshot['State']})")
    for request in aws.ec2.describe_spot_fleet_requests()["SpotFleetRequestConfigs"]:
        tags = {t["Key"]: t["Value"] for t in request.get("Tags", [])}
        state = request["SpotFleetRequestState"]
        ours = tags.get(STACK_TAG_KEY) == stack or request["SpotFleetRequestId"] in fleet_request_ids
        if ours and not state.startswith("cancelled"):
            orphans.append(f"spot-fleet-request {request['SpotFleetRequestId']} ({state})")
    for summary in aws.cloudformation.list_stacks()["StackSummaries"]:
        if summary["StackName"] == stack and summary["StackStatus"] != "DELETE_COMPLETE":
            orphans.append(f"stack {stack} ({summary['StackStatus']})")
    return orphans
