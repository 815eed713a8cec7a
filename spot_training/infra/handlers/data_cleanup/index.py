"""CloudFormation custom resource: on stack delete, remove the volumes and snapshots the stack's agents made.

Runs as the ``onEvent`` handler of an ``aws_cdk.custom_resources.Provider`` (the framework sends the
CloudFormation response; this handler returns a dict or raises). boto3 only.

ResourceProperties (all strings, as CloudFormation passes them):
    StackName: the stack's name (required).
    TagKey: tag key that marks the stack's resources (default ``spot-training:stack``).
    TagValue: tag value (default: ``StackName``).
    DeploymentTagValue: when given, only volumes and snapshots that also carry
        ``spot-training:deployment`` = this value are deleted (this deployment's; data retained from an
        earlier deployment of the same stack name stays). Default: none (stack tag only).
    RetainData: ``"true"`` keeps every volume and snapshot; ``"false"`` (default) deletes them on Delete.

Create and Update do nothing but return a ``PhysicalResourceId``. Delete, unless ``RetainData`` is
``"true"``, deletes every EBS snapshot (owned by this account) and every EBS volume carrying
``TagKey=TagValue``. A volume is deleted only once it is ``available``: one still attached to an
instance that is shutting down or stopping is waited for with the boto3 ``volume_available`` waiter
(bounded by the Lambda's remaining time), and one that disappears meanwhile (a root volume EC2 deletes
with its instance: ``InvalidVolume.NotFound``) is done; one attached to a running instance is an error, because
the stack's fleet should already be gone (make the fleet depend on this resource so CloudFormation
deletes the fleet first).

Returns ``{"PhysicalResourceId": str, "Data": {"DeletedVolumes": "vol-a,vol-b", "DeletedSnapshots": ...}}``.

Raises:
    ValueError: a property is missing or malformed (the message names it and the value received).
    RuntimeError: a volume is attached to a running instance, or did not detach in time.
    botocore.exceptions.ClientError: any other EC2 error (after boto3's standard retries).
"""

from __future__ import annotations

import logging
from typing import Any, Callable

import boto3
from botocore.config import Config
from botocore.exceptions import ClientError, WaiterError

LOG = logging.getLogger(__name__)
LOG.setLevel(logging.INFO)

DEFAULT_TAG_KEY = "spot-training:stack"
#: Tag naming one deployment of the stack (spot_training.infra.tags.DEPLOYMENT_TAG_KEY; the handler is packaged alone).
DEPLOYMENT_TAG_KEY = "spot-training:deployment"
#: Seconds between checks while a volume detaches, and the most seconds to wait for one volume.
WAIT_DELAY_S = 5
MAX_WAIT_S = 600
#: Keep this many milliseconds of Lambda time for reporting the result.
SAFETY_MARGIN_MS = 30_000
#: Instance states in which an attached volume is on its way to ``available``.
DETACHING_INSTANCE_STATES = frozenset({"shutting-down", "terminated", "stopping", "stopped"})


def handler(event: dict[str, Any], context: Any) -> dict[str, Any]:
    """Provider-framework ``onEvent`` entry point (see the module docstring for the contract)."""
    request_type = event.get("RequestType")
    if request_type not in ("Create", "Update", "Delete"):
        raise ValueError(f"RequestType must be Create, Update or Delete, got {request_type!r}")
    props = _properties(event.get("ResourceProperties") or {})
    physical_id = event.get("PhysicalResourceId") or f"data-cleanup-{props['StackName']}"
    result: dict[str, Any] = {"PhysicalResourceId": physical_id}
    if request_type != "Delete":
        return result
    if props["RetainData"]:
        LOG.info("RetainData is true: keeping every volume and snapshot tagged %s=%s", props["TagKey"], props["TagValue"])
        return {**result, "Data": {"DeletedVolumes": "", "DeletedSnapshots": "", "Retained": "true"}}

    ec2 = boto3.client("ec2", config=Config(retries={"mode": "standard"}))
    tag_filter = [{"Name": f"tag:{props['TagKey']}", "Values": [props["TagValue"]]}]
    if props["DeploymentTagValue"]:
        tag_filter.append({"Name": f"tag:{DEPLOYMENT_TAG_KEY}", "Values": [props["DeploymentTagValue"]]})
    volumes = _tagged_volumes_not_held(ec2, tag_filter)  # raises before anything is deleted
    snapshots = _delete_snapshots(ec2, tag_filter)
    volumes = _delete_volumes(ec2, volumes, _max_wait_s(context))
    LOG.info("deleted volumes %s and snapshots %s", volumes, snapshots)
    return {**result, "Data": {"DeletedVolumes": ",".join(volumes), "DeletedSnapshots": ",".join(snapshots)}}


def _properties(raw: dict[str, Any]) -> dict[str, Any]:
    stack_name = raw.get("StackName")
    if not isinstance(stack_name, str) or not stack_name:
        raise ValueError(f"ResourceProperties.StackName must be a non-empty string, got {stack_name!r}")
    tag_key = raw.get("TagKey", DEFAULT_TAG_KEY)
    if not isinstance(tag_key, str) or not tag_key:
        raise ValueError(f"ResourceProperties.TagKey must be a non-empty string, got {tag_key!r}")
    tag_value = raw.get("TagValue", stack_name)
    if not isinstance(tag_value, str) or not tag_value:
        raise ValueError(f"ResourceProperties.TagValue must be a non-empty string, got {tag_value!r}")
    deployment = raw.get("DeploymentTagValue")
    if deployment is not None and (not isinstance(deployment, str) or not deployment):
        raise ValueError(f"ResourceProperties.DeploymentTagValue must be a non-empty string or absent, got {deployment!r}")
    retain = raw.get("RetainData", "false")
    retain_text = str(retain).lower()
    if retain_text not in ("true", "false"):
        raise ValueError(f'ResourceProperties.RetainData must be "true" or "false", got {retain!r}')
    return {"StackName": stack_name, "TagKey": tag_key, "TagValue": tag_value, "DeploymentTagValue": deployment,
            "RetainData": retain_text == "true"}


def _max_wait_s(context: Any) -> int:
    remaining = getattr(context, "get_remaining_time_in_millis", None)
    if remaining is None:
        return MAX_WAIT_S
    return max(WAIT_DELAY_S, min(MAX_WAIT_S, (remaining() - SAFETY_MARGIN_MS) // 1000))


def _unless_not_found(call: Callable[..., dict[str, Any]], not_found_code: str, **kwargs: Any) -> dict[str, Any] | None:
    """``call(**kwargs)``'s response, or None when EC2 answers ``not_found_code`` (such as
    ``InvalidVolume.NotFound``: the resource is already gone). Any other ``ClientError`` propagates."""
    try:
        return call(**kwargs)
    except ClientError as error:
        if error.response["Error"]["Code"] == not_found_code:
            return None
        raise


def _delete_snapshots(ec2: Any, tag_filter: list[dict[str, Any]]) -> list[str]:
    deleted = []
    for page in ec2.get_paginator("describe_snapshots").paginate(OwnerIds=["self"], Filters=tag_filter):
        for snapshot in page["Snapshots"]:
            snapshot_id = snapshot["SnapshotId"]
            _unless_not_found(ec2.delete_snapshot, "InvalidSnapshot.NotFound", SnapshotId=snapshot_id)
            deleted.append(snapshot_id)
    return deleted


def _tagged_volumes_not_held(ec2: Any, tag_filter: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The tagged volumes; RuntimeError if one is attached to an instance that is not going away."""
    volumes = [v for page in ec2.get_paginator("describe_volumes").paginate(Filters=tag_filter) for v in page["Volumes"]]
    for volume in volumes:
        for attachment in volume.get("Attachments", []):
            state = _instance_state(ec2, attachment["InstanceId"])
            if state is not None and state not in DETACHING_INSTANCE_STATES:
                raise RuntimeError(
                    f"volume {volume['VolumeId']} is attached to instance {attachment['InstanceId']} "
                    f"which is {state}; stop or terminate it (delete the spot fleet first) and retry the stack delete"
                )
    return volumes


def _delete_volumes(ec2: Any, volumes: list[dict[str, Any]], max_wait_s: int) -> list[str]:
    deleted = []
    waiter = ec2.get_waiter("volume_available")
    for volume in volumes:
        volume_id = volume["VolumeId"]
        if volume["State"] in ("deleting", "deleted"):
            continue  # already on its way out (a repeated Delete, or deleted by hand)
        if volume["State"] != "available":
            try:
                waiter.wait(
                    VolumeIds=[volume_id],
                    WaiterConfig={"Delay": WAIT_DELAY_S, "MaxAttempts": max(1, max_wait_s // WAIT_DELAY_S)},
                )
            except WaiterError as error:
                if _gone(ec2, volume_id):
                    # A root volume (DeleteOnTermination) that EC2 deleted with its instance: done.
                    LOG.info("volume %s was deleted by EC2 while waiting for it; nothing to do", volume_id)
                    continue
                raise RuntimeError(f"volume {volume_id} did not become available within {max_wait_s} s: {error}") from error
        _unless_not_found(ec2.delete_volume, "InvalidVolume.NotFound", VolumeId=volume_id)
        deleted.append(volume_id)
    return deleted


def _gone(ec2: Any, volume_id: str) -> bool:
    """True when ``volume_id`` no longer exists (``InvalidVolume.NotFound``) or is being deleted."""
    response = _unless_not_found(ec2.describe_volumes, "InvalidVolume.NotFound", VolumeIds=[volume_id])
    return response is None or all(v["State"] in ("deleting", "deleted") for v in response["Volumes"])


def _instance_state(ec2: Any, instance_id: str) -> str | None:
    response = _unless_not_found(ec2.describe_instances, "InvalidInstanceID.NotFound", InstanceIds=[instance_id])
    if response is None:
        return None
    for reservation in response["Reservations"]:
        for instance in reservation["Instances"]:
            return instance["State"]["Name"]
    return None
