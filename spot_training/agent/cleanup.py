"""Cancel this instance's spot fleet when training has completed.

The fleet request is found through the instance's ``aws:ec2spot:fleet-request-id`` tag (EC2 adds it to
fleet instances), or, where that tag is missing, by asking ``DescribeSpotFleetRequests`` +
``DescribeSpotFleetInstances`` which active request holds the instance. It is cancelled with
``TerminateInstances=True`` only if the request carries ``spot-training:stack`` = our stack name
(docs/contracts.md); a fleet that belongs to someone else, or no fleet at all (an instance launched by
hand), is logged and left alone.

boto3 clients are injected (``Config(retries={"mode": "standard"})`` retries throttling and transient
errors; see :func:`ec2_client`).
"""

from __future__ import annotations

import logging
from typing import Any

from spot_training.agent.config import STACK_TAG
from spot_training.agent.errors import TemporaryError

log = logging.getLogger(__name__)

FLEET_REQUEST_TAG = "aws:ec2spot:fleet-request-id"
#: Fleet request states that still hold instances (cancelled_running fleets keep theirs).
_LIVE_STATES = ("submitted", "active", "modifying", "cancelled_running")


def ec2_client(region: str, **kwargs: Any) -> Any:
    """A boto3 EC2 client for ``region`` with the agent's client config (``spot_training.agent.retry.client_config``:
    standard retry mode, throttling and 5xx retried with jittered backoff; bounded timeouts). ``kwargs``
    go to ``boto3.client`` (e.g. ``endpoint_url``); the endpoint otherwise follows
    ``AWS_ENDPOINT_URL``/``AWS_ENDPOINT_URL_EC2`` as boto3 does."""
    import boto3

    from spot_training.agent.retry import client_config

    return boto3.client("ec2", region_name=region, config=client_config(), **kwargs)


def find_fleet_request_id(ec2: Any, instance_id: str) -> str | None:
    """The spot fleet request id that launched ``instance_id``, or None when no fleet holds it.

    First the instance's ``aws:ec2spot:fleet-request-id`` tag (one DescribeInstances call), then every
    live fleet request's instances (DescribeSpotFleetRequests, DescribeSpotFleetInstances, paginated).

    Args:
        ec2: a boto3 EC2 client.
        instance_id: the instance (``i-…``).

    Returns:
        the request id (``sfr-…``), or None.

    Raises:
        botocore.exceptions.ClientError: API failures other than throttling (retried by the client).
    """
    reservations = ec2.describe_instances(InstanceIds=[instance_id])["Reservations"]
    for reservation in reservations:
        for instance in reservation["Instances"]:
            for tag in instance.get("Tags", []):
                if tag["Key"] == FLEET_REQUEST_TAG:
                    return tag["Value"]
    for fleet in fleet_requests(ec2):
        if fleet.get("SpotFleetRequestState") not in _LIVE_STATES:
            continue
        fleet_id = fleet["SpotFleetRequestId"]
        token = None
        while True:
            page = ec2.describe_spot_fleet_instances(SpotFleetRequestId=fleet_id, **({"NextToken": token} if token else {}))
            if any(active.get("InstanceId") == instance_id for active in page.get("ActiveInstances", [])):
                return fleet_id
            token = page.get("NextToken")
            if not token:
                break
    return None


def fleet_requests(ec2: Any, ids: list[str] | None = None) -> list[dict[str, Any]]:
    """Every spot fleet request (or those of ``ids``), all pages of DescribeSpotFleetRequests.

    Args:
        ec2: a boto3 EC2 client.
        ids: the request ids to describe (default None: all of the account's in the region).

    Returns:
        the ``SpotFleetRequestConfigs`` entries.

    Raises:
        botocore.exceptions.ClientError: API failures other than throttling.
    """
    kwargs: dict[str, Any] = {"SpotFleetRequestIds": ids} if ids else {}
    fleets: list[dict[str, Any]] = []
    token = None
    while True:
        page = ec2.describe_spot_fleet_requests(**kwargs, **({"NextToken": token} if token else {}))
        fleets.extend(page.get("SpotFleetRequestConfigs", []))
        token = page.get("NextToken")
        if not token:
            return fleets


def cancel_own_fleet(*, ec2: Any, instance_id: str, stack_name: str) -> str | None:
    """Cancel (with TerminateInstances=True) the spot fleet request of ``instance_id`` if it is this stack's.

    Ours: it carries ``spot-training:stack`` = ``stack_name``. Idempotent: a request already cancelled
    is reported, not cancelled again.

    Args:
        ec2: a boto3 EC2 client.
        instance_id: this instance (``i-…``).
        stack_name: this deployment's stack name.

    Returns:
        the cancelled request id, or None when there is no fleet or it is not ours (logged).

    Raises:
        TemporaryError: EC2 reports the cancellation as unsuccessful.
        botocore.exceptions.ClientError: other API failures.
    """
    fleet_id = find_fleet_request_id(ec2, instance_id)
    if fleet_id is None:
        log.warning("no spot fleet request holds this instance; nothing to cancel", extra={"instance_id": instance_id})
        return None
    fleets = fleet_requests(ec2, [fleet_id])
    if not fleets:
        log.info("the spot fleet request no longer exists; nothing to cancel", extra={"fleet_request_id": fleet_id})
        return None
    fleet = fleets[0]
    tags = {t["Key"]: t["Value"] for t in fleet.get("Tags", [])}
    owner = tags.get(STACK_TAG)
    if owner != stack_name:
        log.warning("the spot fleet request does not belong to this stack; leaving it alone",
                    extra={"fleet_request_id": fleet_id, "stack_name": stack_name, "fleet_stack_tag": owner})
        return None
    state = fleet.get("SpotFleetRequestState")
    if state in ("cancelled", "cancelled_terminating"):
        log.info("the spot fleet request is already cancelled", extra={"fleet_request_id": fleet_id, "state": state})
        return fleet_id
    answer = ec2.cancel_spot_fleet_requests(SpotFleetRequestIds=[fleet_id], TerminateInstances=True)
    failed = answer.get("UnsuccessfulFleetRequests", [])
    if failed:
        error = failed[0].get("Error", {})
        raise TemporaryError(f"cancelling spot fleet request {fleet_id} failed: {error.get('Code')}: "
                             f"{error.get('Message')}")
    log.info("cancelled the spot fleet request and its instances (training completed)",
             extra={"fleet_request_id": fleet_id, "instance_id": instance_id})
    return fleet_id
