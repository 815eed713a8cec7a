"""spot_training.agent.fleet_actions.finish_node against a moto server over HTTP: on COMPLETED a worker cancels its
stack's spot fleet with its instances (docs/architecture.md, "The user's story", step 4); scheduler/server nodes and other stacks'
fleets are never touched."""

from __future__ import annotations

from test_leave_fleet import STACK, _fleet, _state

from spot_training.agent.fleet_actions import finish_node


def _fleet_state(ec2, fleet_id: str) -> str:
    """The request's state; moto drops a cancelled request from DescribeSpotFleetRequests: "gone"."""
    configs = ec2.describe_spot_fleet_requests(SpotFleetRequestIds=[fleet_id])["SpotFleetRequestConfigs"]
    return configs[0]["SpotFleetRequestState"] if configs else "gone"


def _finish(ec2, outcome: str, instance_id: str, *, role: str = "worker", cancel: bool = True, stack: str = STACK):
    return finish_node(outcome, role=role, leave_reason=None, cancel_fleet_on_success=cancel,
                       ec2_factory=lambda: ec2, instance_id=instance_id, stack_name=stack)


def test_a_completed_worker_cancels_its_fleet_with_every_worker(ec2):
    fleet_id, instances = _fleet(ec2, stack=STACK, capacity=3)
    assert _finish(ec2, "completed", instances[0]) == fleet_id
    assert _fleet_state(ec2, fleet_id) in ("gone", "cancelled", "cancelled_terminating")
    assert {_state(ec2, i) for i in instances} <= {"shutting-down", "terminated"}
    # The other workers finish too: no error on the cancelled fleet, nothing else touched.
    assert _finish(ec2, "completed", instances[1]) in (fleet_id, None)


def test_nothing_is_cancelled_by_servers_without_the_flag_or_before_completion(ec2):
    fleet_id, instances = _fleet(ec2, stack=STACK, capacity=2)
    assert _finish(ec2, "completed", instances[0], role="server") is None
    assert _finish(ec2, "completed", instances[0], cancel=False) is None
    assert _finish(ec2, "stopped", instances[0]) is None
    assert _finish(ec2, "left", instances[0]) is None  # a spot notice: the fleet replaces the worker
    assert _fleet_state(ec2, fleet_id) == "active"
    assert [_state(ec2, i) for i in instances] == ["running", "running"]


def test_another_stacks_fleet_is_left_running(ec2):
    fleet_id, instances = _fleet(ec2, stack="SomeoneElse", capacity=2)
    assert _finish(ec2, "completed", instances[0]) is None
    assert _fleet_state(ec2, fleet_id) == "active"
    assert [_state(ec2, i) for i in instances] == ["running", "running"]
