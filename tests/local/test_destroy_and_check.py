"""The drills' shared teardown (:func:`spot_training.local.deploy.destroy_and_check`), in-process: a fake
CDK CLI and fake boto3 clients that answer the orphan check's describe calls from what they hold."""

from __future__ import annotations

import json
from typing import Any

import pytest

from spot_training.contract import STACK_TAG
from spot_training.local.deploy import Clients, destroy_and_check

STACK = "Drill"


def _tagged(resource: dict[str, Any], filters: list[dict[str, Any]]) -> bool:
    tags = {t["Key"]: t["Value"] for t in resource.get("Tags", [])}
    return all(tags.get(f["Name"].removeprefix("tag:")) in f["Values"] for f in filters)


class FakeEc2:
    """What a destroy left: instances and volumes with their tags."""

    def __init__(self) -> None:
        self.instances: list[dict[str, Any]] = []
        self.volumes: list[dict[str, Any]] = []

    def describe_instances(self, Filters: list[dict[str, Any]]) -> dict[str, Any]:  # noqa: N803 - boto3's name
        return {"Reservations": [{"Instances": [i for i in self.instances if _tagged(i, Filters)]}]}

    def describe_volumes(self, Filters: list[dict[str, Any]]) -> dict[str, Any]:  # noqa: N803
        return {"Volumes": [v for v in self.volumes if _tagged(v, Filters)]}

    def describe_snapshots(self, OwnerIds: list[str], Filters: list[dict[str, Any]]) -> dict[str, Any]:  # noqa: N803
        return {"Snapshots": []}

    def describe_spot_fleet_requests(self) -> dict[str, Any]:
        return {"SpotFleetRequestConfigs": []}


class FakeCloudFormation:
    def __init__(self) -> None:
        self.status = "DELETE_COMPLETE"

    def list_stacks(self) -> dict[str, Any]:
        return {"StackSummaries": [{"StackName": STACK, "StackStatus": self.status}]}


class FakeCdk:
    """Records its calls; ``fail`` makes destroy raise like a failed CLI run."""

    def __init__(self, calls: list[str], fail: bool = False) -> None:
        self.calls, self.fail = calls, fail

    def destroy(self, stack: str, *, context: dict[str, str]) -> str:
        self.calls.append(f"destroy {stack} {context}")
        if self.fail:
            raise RuntimeError("cdk destroy failed: DELETE_FAILED")
        return ""


def _instance(instance_id: str, tags: dict[str, str], state: str = "running") -> dict[str, Any]:
    return {"InstanceId": instance_id, "State": {"Name": state}, "Tags": [{"Key": k, "Value": v} for k, v in tags.items()]}


def _run(aws: Clients, cdk: FakeCdk, **kwargs: Any) -> tuple[list[str], dict[str, Any], list[dict[str, Any]]]:
    report: dict[str, Any] = {"phases_s": {}}
    events: list[dict[str, Any]] = []
    orphans = destroy_and_check(cdk, aws, STACK, context={"k": "v"}, report=report, record=events.append, **kwargs)
    return orphans, report, events


@pytest.fixture
def aws() -> Clients:
    return Clients(ec2=FakeEc2(), cloudformation=FakeCloudFormation(), s3=None)


def test_a_clean_destroy_leaves_no_orphans(aws):
    calls: list[str] = []
    aws.ec2.instances.append(_instance("i-gone", {STACK_TAG: STACK}, state="terminated"))
    orphans, report, events = _run(aws, FakeCdk(calls))
    assert orphans == [] and report["orphans_after_destroy"] == [] and "destroy_error" not in report
    assert calls == ["destroy Drill {'k': 'v'}"] and report["phases_s"]["destroy"] >= 0
    assert [e["event"] for e in events] == ["phase", "destroyed"] and events[-1]["orphans"] == []


def test_every_kind_of_orphan_is_reported(aws):
    aws.ec2.instances += [_instance("i-stack", {STACK_TAG: STACK}),
                          _instance("i-fleet", {"aws:ec2spot:fleet-request-id": "sfr-1"}),
                          _instance("i-job", {STACK_TAG: "job-a"}, state="stopped"),
                          _instance("i-other", {STACK_TAG: "SomeoneElse"})]
    aws.ec2.volumes.append({"VolumeId": "vol-job", "State": "available", "Tags": [{"Key": STACK_TAG, "Value": "job-b"}]})
    aws.cloudformation.status = "DELETE_FAILED"
    orphans, report, events = _run(aws, FakeCdk([]), fleet_request_ids=["sfr-1"], jobs={"job-a": [], "job-b": []},
                                   more_orphans=lambda: ["auto-scaling-group g", "instance i-stack (running)"])
    assert orphans == ["instance i-stack (running)", "instance i-fleet (running)", "stack Drill (DELETE_FAILED)",
                       "instance i-job (stopped)", "volume vol-job (available)", "auto-scaling-group g"]
    assert report["orphans_after_destroy"] == orphans == events[-1]["orphans"]


def test_a_failed_destroy_is_recorded_and_still_checked(aws):
    calls: list[str] = []
    aws.ec2.instances.append(_instance("i-left", {STACK_TAG: STACK}))
    orphans, report, _ = _run(aws, FakeCdk(calls, fail=True), before_destroy=lambda: calls.append("empty bucket"))
    assert calls == ["empty bucket", "destroy Drill {'k': 'v'}"]
    assert report["destroy_error"] == "cdk destroy failed: DELETE_FAILED"
    assert orphans == ["instance i-left (running)"]


def test_local_down_reports_what_destroy_left(aws, tmp_path, monkeypatch, capsys):
    """``spot-train local down`` uses the same teardown: a failed destroy is printed, a leftover fails it."""
    from spot_training import cli
    from spot_training.local import deploy

    calls: list[str] = []
    aws.ec2.instances.append(_instance("i-left", {"aws:ec2spot:fleet-request-id": "sfr-9"}))
    monkeypatch.setattr(deploy, "CdkCli", lambda endpoint_url, work_dir: FakeCdk(calls, fail=True))
    monkeypatch.setattr(deploy, "clients", lambda endpoint_url: aws)
    alive = iter([True, False])  # the moto server: up, then gone after SIGTERM
    monkeypatch.setattr(cli, "pid_alive", lambda pid: pid == 4242 and next(alive))
    monkeypatch.setattr(cli.os, "killpg", lambda pid, sig: calls.append(f"killpg {pid}"))
    state = {"pid": 4242, "keeper_pid": None, "endpoint_url": "http://127.0.0.1:1", "work_dir": str(tmp_path),
             "stack": STACK, "context": {"k": "v"}, "fleet_request_id": "sfr-9"}
    (tmp_path / cli.STATE_FILE).write_text(json.dumps(state))
    assert cli.main(["local", "down", "--work-dir", str(tmp_path)]) == 1
    assert calls == ["destroy Drill {'k': 'v'}", "killpg 4242"]
    captured = capsys.readouterr()
    assert "cdk destroy failed: cdk destroy failed: DELETE_FAILED" in captured.err
    assert "orphans: ['instance i-left (running)']" in captured.out
