"""The cost ledger: ``spot-train cost`` and ``status`` count every instance the agents recorded, also
after EC2 forgot it (a terminated instance is listed for about an hour only). In-process moto
(``mock_aws``): its backend is the only way to make EC2 forget an instance, as AWS does."""

from __future__ import annotations

import datetime as dt
import json
import logging

import boto3
import pytest
from moto import mock_aws

from spot_training.agent import cli as agent_cli
from spot_training.agent.logs import JsonLineFormatter
from spot_training.ops import operations as ops

STACK = "LedgerTest"
GROUP = f"/spot-training/{STACK}"
TAGS = [{"Key": "spot-training:stack", "Value": STACK}]


class _Imds:
    def get(self, path):
        return (200, "spot") if path == "meta-data/instance-life-cycle" else (404, "")


def _ledger_line(instance_id: str, az: str, launch: dt.datetime) -> str:
    """The agent's own ledger record (spot_training.agent.cli._record_ledger), formatted as it publishes it."""
    records: list[logging.LogRecord] = []

    class Keep(logging.Handler):
        def emit(self, record):
            records.append(record)

    handler = Keep()
    agent_cli.log.addHandler(handler)
    level = agent_cli.log.level
    agent_cli.log.setLevel(logging.INFO)
    try:
        config = type("C", (), {"node_role": "single"})()
        agent_cli._record_ledger(config, _Imds(), agent_cli.Identity(instance_id, az, "us-east-1"),
                                 instance_type="g5.xlarge", boot_time=launch.timestamp())
    finally:
        agent_cli.log.removeHandler(handler)
        agent_cli.log.setLevel(level)
    (record,) = records
    return JsonLineFormatter().format(record)


@pytest.fixture
def aws(monkeypatch):
    for name, value in {"AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing",
                        "AWS_DEFAULT_REGION": "us-east-1"}.items():
        monkeypatch.setenv(name, value)
    monkeypatch.delenv("AWS_ENDPOINT_URL", raising=False)
    with mock_aws():
        yield ops.connect(region="us-east-1", credentials=("testing", "testing"))


def test_cost_counts_instances_that_aged_out_of_describe_instances(aws):
    from moto.core import DEFAULT_ACCOUNT_ID
    from moto.ec2.models import ec2_backends

    template = {"Resources": {"NodeLogs": {"Type": "AWS::Logs::LogGroup", "Properties": {"LogGroupName": GROUP}}}}
    boto3.client("cloudformation", region_name="us-east-1").create_stack(StackName=STACK, TemplateBody=json.dumps(template))
    logs = boto3.client("logs", region_name="us-east-1")
    now = dt.datetime.now(dt.timezone.utc).replace(microsecond=0)
    ids = []
    for index, az in enumerate(("us-east-1a", "us-east-1b", "us-east-1a")):
        instance_id = aws.ec2.run_instances(
            ImageId="ami-12c6146b", MinCount=1, MaxCount=1, InstanceType="g5.xlarge", Placement={"AvailabilityZone": az},
            InstanceMarketOptions={"MarketType": "spot"}, TagSpecifications=[{"ResourceType": "instance", "Tags": TAGS}],
        )["Instances"][0]["InstanceId"]
        ids.append(instance_id)
        launch = now - dt.timedelta(hours=3 - index)
        logs.create_log_stream(logGroupName=GROUP, logStreamName=instance_id)
        # the ledger record at launch, then the agent's lines until it stopped 50 minutes later
        events = [(launch, _ledger_line(instance_id, az, launch)),
                  (launch + dt.timedelta(minutes=50), json.dumps({"message": "supervision ended"}))]
        logs.put_log_events(logGroupName=GROUP, logStreamName=instance_id, logEvents=[
            {"timestamp": int(t.timestamp() * 1000), "message": m} for t, m in events])
    aws.ec2.terminate_instances(InstanceIds=ids)
    # An hour later EC2 lists only the last one; the first two are gone from DescribeInstances.
    backend = ec2_backends[DEFAULT_ACCOUNT_ID]["us-east-1"]
    for reservation_id, reservation in list(backend.reservations.items()):
        if reservation.instances[0].id in ids[:2]:
            del backend.reservations[reservation_id]
    listed = [i["InstanceId"] for r in aws.ec2.describe_instances()["Reservations"] for i in r["Instances"]]
    assert listed == [ids[2]]

    cost = ops.cost_report(aws, STACK, now=now, on_demand={"g5.xlarge": 1.006})
    assert sum(r["instances"] for r in cost["rows"]) == 3
    aged_out_hours = 2 * 50 / 60  # from each ledger record to its stream's last event
    assert cost["instance_hours"] == pytest.approx(aged_out_hours, abs=0.02)
    assert {(r["availability_zone"], r["lifecycle"]) for r in cost["rows"]} == {("us-east-1a", "spot"), ("us-east-1b", "spot")}
    status = ops.status_report(aws, STACK, now=now)
    assert sorted(i["instance_id"] for i in status["instances"]) == sorted(ids)
    assert [i.get("source") for i in status["instances"] if i["instance_id"] in ids[:2]] == ["ledger", "ledger"]
