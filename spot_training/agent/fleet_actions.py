"""What a cluster node does with EC2 when it is done: cancel the workers' spot fleet, or leave it.

Only fleets tagged ``spot-training:stack`` with this stack are touched (as spot_training/agent/cleanup.py).
"""

from __future__ import annotations

import logging
from typing import Any, Callable

from spot_training.agent.cleanup import cancel_own_fleet, fleet_requests, find_fleet_request_id
from spot_training.agent.config import STACK_TAG
from spot_training.agent.interruption import MEMBER_TAG_REMOVED

log = logging.getLogger("spot_training.agent.cluster")

__all__ = ["leave_fleet", "finish_node"]


def leave_fleet(*, ec2: Any, instance_id: str, stack_name: str) -> str | None:
    """After a worker left because its member tag was removed: lower its fleet's target capacity, then terminate it.

    The spot fleet's target capacity is lowered by one (``ExcessCapacityTerminationPolicy=noTermination``,
    so the fleet picks no other victim), then this instance is terminated. Without the lower target a
    ``maintain`` fleet would launch a replacement. Only a fleet tagged ``spot-training:stack`` =
    ``stack_name`` is touched (as :mod:`spot_training.agent.cleanup`). Source: Amazon EC2 API Reference,
    "ModifySpotFleetRequest".

    Args:
        ec2: a boto3 EC2 client.
        instance_id: this instance (``i-…``).
        stack_name: this deployment's stack name.

    Returns:
        the fleet request id, or None when no fleet of ours holds the instance (then nothing is changed;
        the instance is left running for whoever launched it).

    Raises:
        botocore.exceptions.ClientError: an API call failed (after the client's retries).
    """
    fleet_id = find_fleet_request_id(ec2, instance_id)
    fleets = fleet_requests(ec2, [fleet_id]) if fleet_id else []
    tags = {t["Key"]: t["Value"] for t in (fleets[0].get("Tags", []) if fleets else [])}
    if not fleets or tags.get(STACK_TAG) != stack_name:
        log.warning("no spot fleet of this stack holds the instance; leaving capacity and instance alone",
                    extra={"instance_id": instance_id, "fleet_request_id": fleet_id})
        return None
    target = int(fleets[0]["SpotFleetRequestConfig"]["TargetCapacity"])
    ec2.modify_spot_fleet_request(SpotFleetRequestId=fleet_id, TargetCapacity=max(0, target - 1),
                                  ExcessCapacityTerminationPolicy="noTermination")
    ec2.terminate_instances(InstanceIds=[instance_id])
    log.info("left the spot fleet: target capacity lowered and this instance terminated",
             extra={"fleet_request_id": fleet_id, "target_capacity": max(0, target - 1)})
    return fleet_id



def finish_node(outcome: str, *, role: str, leave_reason: str | None, cancel_fleet_on_success: bool,
                ec2_factory: Callable[[], Any], instance_id: str, stack_name: str) -> str | None:
    """What a cluster node does with EC2 after ``NodeAgent.run`` or ``TorchWorker.run`` returned ``outcome``.

    - ``"completed"`` on a worker with ``cleanup.cancel_fleet_on_success`` (what the DistributedTraining
      stack writes for workers): cancel the workers' spot fleet with its instances through
      :func:`spot_training.agent.cleanup.cancel_own_fleet` (docs/architecture.md, "The user's story", step 4; only a fleet tagged with our stack;
      idempotent, so every worker may try and the first one wins). Scheduler and servers run in
      on-demand Auto Scaling groups, not a fleet: their agents have stopped their processes and exit 0,
      the instances stay (idle, billed on demand) until ``cdk destroy``.
    - ``"left"`` after the member tag was removed: :func:`leave_fleet`.
    - anything else: nothing.

    Args:
        outcome: what the run returned (``"completed"``, ``"left"``, ``"stopped"``...).
        role: this node's role (``scheduler``, ``server``, ``worker``).
        leave_reason: the event kind that made a worker leave (``member-tag-removed``...), or None.
        cancel_fleet_on_success: the config's ``cleanup.cancel_fleet_on_success``.
        ec2_factory: returns a boto3 EC2 client (called only when EC2 is needed).
        instance_id: this instance (``i-…``).
        stack_name: this deployment's stack name.

    Returns:
        the fleet request id acted on, or None.

    Raises:
        botocore.exceptions.ClientError: an EC2 call failed.
        TemporaryError: EC2 refuses the cancellation (:mod:`spot_training.agent.errors`).
    """
    if outcome == "completed" and role == "worker" and cancel_fleet_on_success:
        return cancel_own_fleet(ec2=ec2_factory(), instance_id=instance_id, stack_name=stack_name)
    if outcome == "left" and leave_reason == MEMBER_TAG_REMOVED:
        return leave_fleet(ec2=ec2_factory(), instance_id=instance_id, stack_name=stack_name)
    return None
