"""``spot-train status | logs | cost`` (spot_training.ops.operations) against the moto server over HTTP: what
the agent's publisher puts is what the CLI reads back; the hang alarm evaluated as CloudWatch would;
a stack that does not exist; the Price List API unreachable."""

from __future__ import annotations

import csv
import datetime as dt
import json
import logging
import time
from pathlib import Path

import boto3
import pytest
from botocore.config import Config

from spot_training.agent.config import MonitoringConfig
from spot_training.agent.publish import Publisher
from spot_training.ops import operations as ops
from spot_training.cli import main

STACK = "OpsTest"
GROUP = f"/spot-training/{STACK}"
TAGS = [{"Key": "spot-training:stack", "Value": STACK}]
MONITORING = MonitoringConfig(enabled=True, log_group=GROUP, namespace=f"SpotTraining/{STACK}", interval_s=1.0)


def _client(server, service):
    return boto3.client(service, region_name="us-east-1", endpoint_url=server.endpoint_url,
                        aws_access_key_id="testing", aws_secret_access_key="testing",
                        config=Config(retries={"mode": "standard"}))


class FakeClock:
    def __init__(self, start: float) -> None:
        self.now = start

    def __call__(self) -> float:
        return self.now


def _stack(server) -> dict:
    """A deployed 'stack' in moto: CloudFormation stack with the log group, a tagged data volume, a
    spot fleet request, and two spot instances of it (the first interrupted, terminated)."""
    ec2 = _client(server, "ec2")
    template = {"Resources": {"NodeLogs": {"Type": "AWS::Logs::LogGroup", "Properties": {"LogGroupName": GROUP}}},
                "Outputs": {"Group": {"Value": {"Ref": "NodeLogs"}}}}
    _client(server, "cloudformation").create_stack(StackName=STACK, TemplateBody=json.dumps(template))
    volume = ec2.create_volume(AvailabilityZone="us-east-1a", Size=100, VolumeType="gp3", TagSpecifications=[
        {"ResourceType": "volume", "Tags": TAGS + [{"Key": "spot-training:purpose", "Value": "data-volume"}]}])
    instances = []
    for az in ("us-east-1a", "us-east-1b"):
        instances.append(ec2.run_instances(
            ImageId="ami-12c6146b", MinCount=1, MaxCount=1, InstanceType="g5.xlarge", Placement={"AvailabilityZone": az},
            InstanceMarketOptions={"MarketType": "spot"},
            TagSpecifications=[{"ResourceType": "instance", "Tags": TAGS}])["Instances"][0]["InstanceId"])
    ec2.terminate_instances(InstanceIds=[instances[0]])
    return {"volume_id": volume["VolumeId"], "instances": instances}


def _write_rows(log_dir: Path, rows: list[tuple[int, float, float]]) -> None:
    log_dir.mkdir(parents=True, exist_ok=True)
    path = log_dir / "training_log.csv"
    new = not path.exists()
    with open(path, "a", newline="") as handle:
        writer = csv.writer(handle)
        if new:
            writer.writerow(["step", "epoch", "loss", "accuracy", "wall_time"])
        for step, loss, wall in rows:
            writer.writerow([step, 0, loss, 0.5, wall])


def _node(tmp_path: Path, server, instance_id: str, az: str, clock=time.time, boot_time=None) -> Publisher:
    root = tmp_path / instance_id
    return Publisher(MONITORING, stack_name=STACK, instance_id=instance_id, instance_type="g5.xlarge",
                     availability_zone=az, log_dir=root / "logs", checkpoint_dir=root / "checkpoints",
                     logs_client=_client(server, "logs"), cloudwatch_client=_client(server, "cloudwatch"),
                     wall_clock=clock, boot_time=boot_time)


@pytest.fixture
def agent_logger():
    logger = logging.getLogger("spot_training.agent.ops-test")
    root = logging.getLogger("spot_training.agent")
    before = root.level
    root.setLevel(logging.INFO)
    yield logger
    root.setLevel(before)


def _run(capsys, *argv: str) -> tuple[int, str, str]:
    code = main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


def test_status_of_a_stack_that_does_not_exist_is_exit_3_with_a_clear_error(moto_server, capsys):
    code, out, err = _run(capsys, "status", "--stack", "NoSuchStack", "--endpoint-url", moto_server.endpoint_url,
                          "--region", "us-east-1")
    assert code == ops.Exit.STACK_NOT_FOUND == 3
    assert "stack 'NoSuchStack' does not exist in us-east-1" in err and out == ""
    for command in ("logs", "cost"):
        assert _run(capsys, command, "--stack", "NoSuchStack", "--endpoint-url", moto_server.endpoint_url)[0] == 3


def test_what_the_agents_publish_is_what_status_logs_and_cost_read_back(moto_server, tmp_path, capsys, agent_logger):
    deployed = _stack(moto_server)
    first, second = deployed["instances"]
    now = time.time()
    # Node 1: trains steps 1..50, gets a notice, its trainer checkpoints at 50.
    # Node 1 ran three minutes ago: one instance at a time, so the two nodes' points fall in different periods.
    node1 = _node(tmp_path, moto_server, first, "us-east-1a", clock=FakeClock(now - 180))
    handler = node1.log_handler()
    logging.getLogger("spot_training.agent").addHandler(handler)
    try:
        agent_logger.info("instance identity", extra={"instance_id": first, "availability_zone": "us-east-1a"})
        _write_rows(node1.log_dir, [(s, 2.0 / s, now - 180) for s in range(1, 51)])
        (node1.log_dir / "progress.json").write_text(json.dumps({"steps_total": 200}))
        node1.round()
        agent_logger.warning("spot interruption notice: stopping the trainer", extra={"event": "spot_interruption_notice"})
        node1.checkpoint_dir.mkdir(parents=True)
        (node1.checkpoint_dir / "LATEST").write_text(json.dumps({"step": 50}))
        node1.round(final=True)  # the agent's last round, after its trainer exited
    finally:
        logging.getLogger("spot_training.agent").removeHandler(handler)
    # Node 2 (another AZ): the volume moved there, training resumes at 51 and goes on to 120.
    node2 = _node(tmp_path, moto_server, second, "us-east-1b", clock=FakeClock(now), boot_time=now - 20)
    handler = node2.log_handler()
    logging.getLogger("spot_training.agent").addHandler(handler)
    try:
        agent_logger.info("instance identity", extra={"instance_id": second, "availability_zone": "us-east-1b"})
        agent_logger.info("new volume attached and its device present", extra={"event": "copy_verified"})
        _write_rows(node2.log_dir, [(s, 2.0 / s, now + 1) for s in range(51, 121)])
        (node2.log_dir / "progress.json").write_text(json.dumps({"steps_total": 200}))
        node2.add_line("trainer says hello")
        node2.round()
    finally:
        logging.getLogger("spot_training.agent").removeHandler(handler)
    target = ("--stack", STACK, "--endpoint-url", moto_server.endpoint_url, "--region", "us-east-1")

    code, out, err = _run(capsys, "status", *target, "--json")
    assert code == 0, err
    status = json.loads(out)
    assert status["training"]["step"] == 120 and status["training"]["steps_total"] == 200
    assert status["training"]["loss"] == pytest.approx(2.0 / 120, abs=1e-4)
    assert status["training"]["completed"] is False
    assert [i["instance_id"] for i in status["instances"]] == [first, second]
    assert [i["state"] for i in status["instances"]] == ["terminated", "running"]
    assert status["data_volume"][0]["volume_id"] == deployed["volume_id"] and status["data_volume"][0]["size_gib"] == 100
    [interruption] = status["interruptions"]
    assert interruption["instance_id"] == first and interruption["availability_zone"] == "us-east-1a"
    assert interruption["checkpoint_step"] == 50 and interruption["notice_to_checkpoint_s"] >= 0
    assert interruption["replacement_instance_id"] == second and interruption["replacement_availability_zone"] == "us-east-1b"
    assert interruption["volume_moved"] is True and interruption["resumed_at_step"] == 51
    assert interruption["boot_to_resume_s"] == pytest.approx(21.0)

    code, text, _ = _run(capsys, "status", *target)
    assert code == 0 and "step 120/200" in text and "moved" in text and first in text
    assert max(len(line) for line in text.splitlines()) <= 100

    code, out, _ = _run(capsys, "logs", *target)
    assert code == 0
    lines = out.splitlines()
    assert any(first in line and "spot interruption notice" in line for line in lines)
    assert any(second in line and "trainer" in line and "trainer says hello" in line for line in lines)
    stamps = [line.split()[0] for line in lines]
    assert stamps == sorted(stamps)  # merged across instances in time order
    code, out, _ = _run(capsys, "logs", *target, "--instance", second, "--json")
    assert code == 0 and {json.loads(line)["instance_id"] for line in out.splitlines()} == {second}
    code, out, err = _run(capsys, "logs", *target, "--instance", "i-0123456789abcdef0")
    assert (code, out) == (1, "") and "'i-0123456789abcdef0' has no log stream" in err and second in err

    # Cost: the local AWS's spot price history against a stated on-demand price.
    code, out, err = _run(capsys, "cost", *target, "--json", "--on-demand-price", "g5.xlarge=1.006",
                          "--ebs-gb-month-price", "0.08")
    assert code == 0, err
    cost = json.loads(out)
    ec2 = _client(moto_server, "ec2")
    assert {(r["instance_type"], r["availability_zone"], r["instances"]) for r in cost["rows"]} == {
        ("g5.xlarge", "us-east-1a", 1), ("g5.xlarge", "us-east-1b", 1)}
    for row in cost["rows"]:  # each zone at its own spot price, as EC2 prices them
        price = float(ec2.describe_spot_price_history(InstanceTypes=["g5.xlarge"], AvailabilityZone=row["availability_zone"])[
            "SpotPriceHistory"][0]["SpotPrice"])
        assert row["spot_cost_usd"] == pytest.approx(row["hours"] * price)
        assert row["on_demand_cost_usd"] == pytest.approx(row["hours"] * 1.006)
    assert cost["savings_pct"] == pytest.approx((1 - cost["spot_cost_usd"] / cost["on_demand_cost_usd"]) * 100)
    assert cost["on_demand_source"] == {"g5.xlarge": "given"}
    assert cost["storage"]["volume_cost_usd"] == pytest.approx(cost["storage"]["volume_gib_hours"] / 730 * 0.08)


def test_cost_bills_on_demand_instances_at_the_on_demand_price(moto_server, capsys):
    """A cluster's scheduler and servers run on demand (Auto Scaling groups): their hours are billed at
    the on-demand price, not the spot price history, and the savings count them as paid."""
    _stack(moto_server)
    ec2 = _client(moto_server, "ec2")
    ec2.run_instances(ImageId="ami-12c6146b", MinCount=1, MaxCount=1, InstanceType="m5.large",
                      Placement={"AvailabilityZone": "us-east-1a"},
                      TagSpecifications=[{"ResourceType": "instance", "Tags": TAGS}])
    code, out, err = _run(capsys, "cost", "--stack", STACK, "--endpoint-url", moto_server.endpoint_url, "--json",
                          "--on-demand-price", "g5.xlarge=1.006", "--on-demand-price", "m5.large=0.096")
    assert code == 0, err
    cost = json.loads(out)
    (scheduler,) = [r for r in cost["rows"] if r["lifecycle"] == "on-demand"]
    assert scheduler["instance_type"] == "m5.large" and scheduler["spot_cost_usd"] is None
    assert scheduler["cost_usd"] == pytest.approx(scheduler["on_demand_cost_usd"]) == pytest.approx(scheduler["hours"] * 0.096)
    spot = [r for r in cost["rows"] if r["lifecycle"] == "spot"]
    assert {r["instance_type"] for r in spot} == {"g5.xlarge"} and all(r["cost_usd"] == r["spot_cost_usd"] for r in spot)
    assert cost["spot_cost_usd"] == pytest.approx(sum(r["spot_cost_usd"] for r in spot))
    assert cost["cost_usd"] == pytest.approx(cost["spot_cost_usd"] + scheduler["cost_usd"])
    assert cost["savings_pct"] == pytest.approx((1 - cost["cost_usd"] / cost["on_demand_cost_usd"]) * 100)
    code, text, _ = _run(capsys, "cost", "--stack", STACK, "--endpoint-url", moto_server.endpoint_url,
                         "--on-demand-price", "g5.xlarge=1.006", "--on-demand-price", "m5.large=0.096")
    assert code == 0 and "on-demand" in text and "cost (all)" in text
    assert max(len(line) for line in text.splitlines()) <= 100


def test_cost_without_a_price_list_says_so_and_prints_spot_cost_only(moto_server, capsys):
    _stack(moto_server)
    code, out, err = _run(capsys, "cost", "--stack", STACK, "--endpoint-url", moto_server.endpoint_url, "--json")
    assert code == 0, err
    cost = json.loads(out)
    assert cost["spot_cost_usd"] > 0
    assert cost["on_demand_cost_usd"] is None and cost["savings_pct"] is None
    assert any("on-demand price of g5.xlarge unknown" in note and "spot cost only" in note for note in cost["notes"])
    code, text, _ = _run(capsys, "cost", "--stack", STACK, "--endpoint-url", moto_server.endpoint_url)
    assert "savings             n/a (no spot or no on-demand cost)" in text and "on-demand cost      n/a" in text


def test_bad_on_demand_price_is_a_usage_error(capsys):
    code, _, err = _run(capsys, "cost", "--stack", STACK, "--on-demand-price", "g5.xlarge=cheap")
    assert code == 2 and "--on-demand-price: got 'g5.xlarge=cheap'" in err


# ---- the hang alarm, evaluated as CloudWatch would ---------------------------------------------------------
@pytest.fixture(scope="module")
def hang_alarm() -> dict:
    """The NoProgress alarm's definition as the SpotTraining stack synthesizes it (TrainingMonitoring)."""
    import aws_cdk as cdk
    from aws_cdk import assertions

    from spot_training.infra.monitoring import RETENTION_DAYS, TrainingMonitoring

    app = cdk.App()
    stack = cdk.Stack(app, STACK)
    TrainingMonitoring(stack, "Monitoring", stack_tag_value=STACK, log_retention=RETENTION_DAYS[30],
                       no_progress_minutes=10, no_capacity_minutes=60)
    alarms = assertions.Template.from_stack(stack).find_resources("AWS::CloudWatch::Alarm")
    return next(v["Properties"] for k, v in alarms.items() if k.startswith("MonitoringNoProgress"))


def test_a_hung_trainer_raises_the_hang_alarm_and_a_gap_does_not(moto_server, tmp_path, hang_alarm):
    cloudwatch = _client(moto_server, "cloudwatch")
    start = time.time() - 3600
    clock = FakeClock(start)
    node = _node(tmp_path, moto_server, "i-0aaaaaaaaaaaaaaaa", "us-east-1a", clock=clock)
    # 10 minutes of progress, then the trainer hangs (its log stops growing) for 12 minutes while the
    # agent keeps publishing, then the instance is gone (no data) for 15 minutes.
    for minute in range(10):
        _write_rows(node.log_dir, [(minute * 10 + s, 1.0, clock.now) for s in range(1, 11)])
        node.round()
        clock.now += 60
    hung_from = clock.now
    for _ in range(12):
        node.round()
        clock.now += 60
    gone_from = clock.now
    assert node.failures == 0
    points = cloudwatch.get_metric_statistics(
        Namespace=hang_alarm["Namespace"], MetricName=hang_alarm["MetricName"], Dimensions=hang_alarm["Dimensions"],
        StartTime=dt.datetime.fromtimestamp(start - 60, dt.timezone.utc),
        EndTime=dt.datetime.fromtimestamp(gone_from + 1200, dt.timezone.utc),
        Period=hang_alarm["Period"], Statistics=[hang_alarm["Statistic"]])["Datapoints"]
    series = [(p["Timestamp"], p[hang_alarm["Statistic"]]) for p in points]
    period, n = hang_alarm["Period"], hang_alarm["EvaluationPeriods"]

    def state_at(epoch: float) -> str:
        at = dt.datetime.fromtimestamp(epoch, dt.timezone.utc)
        return ops.evaluate_alarm(hang_alarm, ops.period_values(series, end=at, period_s=period, periods=n,
                                                                statistic=hang_alarm["Statistic"]))

    assert state_at(hung_from) == "OK"  # steps in every period
    assert state_at(hung_from + 5 * 60) == "OK"  # hung 5 min < 10 min
    assert state_at(hung_from + 11 * 60) == "ALARM"  # 10 periods of 0 steps
    assert state_at(gone_from + 14 * 60) == "OK"  # no node, no data: notBreaching (the capacity alarm's case)
    # The same definition in the local AWS (moto stores it; it does not evaluate alarms).
    cloudwatch.put_metric_alarm(AlarmName=f"{STACK}-NoProgress", **{k: v for k, v in hang_alarm.items()})
    assert cloudwatch.describe_alarms(AlarmNamePrefix=f"{STACK}-")["MetricAlarms"][0]["TreatMissingData"] == "notBreaching"
    # `spot-train status` evaluates it the same way from what it reads back.
    aws = ops.connect(region="us-east-1", endpoint_url=moto_server.endpoint_url, credentials=("testing", "testing"))
    at = lambda epoch: dt.datetime.fromtimestamp(epoch, dt.timezone.utc)  # noqa: E731
    # (Half a period off the rounds: moto returns each point's own timestamp, truncated to microseconds,
    # so a period boundary exactly on a round would be an artefact of this fake clock.)
    assert [a["evaluated"] for a in ops.alarms(aws, STACK, now=at(hung_from + 11 * 60 + 30))] == ["ALARM"]
    assert [a["evaluated"] for a in ops.alarms(aws, STACK, now=at(hung_from + 30))] == ["OK"]


@pytest.mark.parametrize("values, treat, expected", [
    ([0, 0, 0], "notBreaching", "ALARM"),
    ([0, None, 0], "notBreaching", "OK"),
    ([0, None, 0], "breaching", "ALARM"),
    ([None, None, None], "missing", "INSUFFICIENT_DATA"),
    ([5, 0, 0], "notBreaching", "OK"),
])
def test_alarm_evaluation_follows_cloudwatch_missing_data_rules(values, treat, expected):
    alarm = {"EvaluationPeriods": 3, "DatapointsToAlarm": 3, "Threshold": 0,
             "ComparisonOperator": "LessThanOrEqualToThreshold", "TreatMissingData": treat}
    assert ops.evaluate_alarm(alarm, values) == expected


def test_tables_fit_100_columns():
    text = ops.table(["instance", "message"], [["i-0123456789abcdef0", "x" * 300]])
    assert max(len(line) for line in text.splitlines()) <= 100
    assert ops.progress_bar(50, 200).endswith(" 25.0%") and ops.progress_bar(None, 200).startswith("[?")


# ---- jobs: found by their identity, not the stack name ------------------------------------------------
def _job(server, job: str, instance_type: str) -> dict:
    """A job (TrainingJob) in moto: its data volume, its spot fleet request and one spot instance, all
    tagged spot-training:stack = job id."""
    ec2 = _client(server, "ec2")
    tags = [{"Key": "spot-training:stack", "Value": job}]
    volume = ec2.create_volume(AvailabilityZone="us-east-1a", Size=50, VolumeType="gp3", TagSpecifications=[
        {"ResourceType": "volume", "Tags": tags + [{"Key": "spot-training:purpose", "Value": "data-volume"}]}])
    fleet = ec2.request_spot_fleet(SpotFleetRequestConfig={
        "IamFleetRole": "arn:aws:iam::123456789012:role/fleet", "TargetCapacity": 0, "Type": "maintain",
        "AllocationStrategy": "priceCapacityOptimized",
        "LaunchSpecifications": [{"ImageId": "ami-12c6146b", "InstanceType": instance_type}],
        "TagSpecifications": [{"ResourceType": "spot-fleet-request", "Tags": tags}]})["SpotFleetRequestId"]
    instance = ec2.run_instances(
        ImageId="ami-12c6146b", MinCount=1, MaxCount=1, InstanceType=instance_type, InstanceMarketOptions={"MarketType": "spot"},
        Placement={"AvailabilityZone": "us-east-1a"}, TagSpecifications=[{"ResourceType": "instance", "Tags": tags}],
    )["Instances"][0]["InstanceId"]
    return {"volume_id": volume["VolumeId"], "fleet": fleet, "instance": instance}


def test_status_and_cost_find_each_job_of_one_stack_by_its_id(moto_server, capsys):
    """Two jobs in one stack ("Team"), tagged with their own ids: status and cost with --job show each
    job's own fleet, instance, volume and cost, whatever the stack is called."""
    template = {"Resources": {"Nothing": {"Type": "AWS::Logs::LogGroup", "Properties": {"LogGroupName": "/other"}}}}
    _client(moto_server, "cloudformation").create_stack(StackName="Team", TemplateBody=json.dumps(template))
    jobs = {"resnet-a": _job(moto_server, "resnet-a", "g5.xlarge"), "bert-b": _job(moto_server, "bert-b", "g6.xlarge")}
    for job, made in jobs.items():
        code, out, err = _run(capsys, "status", "--job", job, "--endpoint-url", moto_server.endpoint_url,
                              "--region", "us-east-1", "--json")
        assert code == 0, err
        report = json.loads(out)
        assert report["job"] == job and report["stack"] is None
        assert report["fleet"]["id"] == made["fleet"]
        assert [i["instance_id"] for i in report["instances"]] == [made["instance"]]
        assert [v["volume_id"] for v in report["data_volume"]] == [made["volume_id"]]
        code, out, err = _run(capsys, "cost", "--job", job, "--stack", "Team", "--endpoint-url", moto_server.endpoint_url,
                              "--region", "us-east-1", "--json", "--on-demand-price", "g5.xlarge=1.006",
                              "--on-demand-price", "g6.xlarge=0.805")
        assert code == 0, err
        cost = json.loads(out)
        assert cost["job"] == job and cost["stack"] == "Team"
        assert [r["instance_type"] for r in cost["rows"]] == ["g5.xlarge" if job == "resnet-a" else "g6.xlarge"]
    code, text, _ = _run(capsys, "status", "--job", "bert-b", "--stack", "Team", "--endpoint-url", moto_server.endpoint_url,
                         "--region", "us-east-1")
    assert code == 0 and text.startswith("job bert-b of stack Team (CREATE_COMPLETE) in us-east-1")
    code, _, err = _run(capsys, "status", "--job", "no-such-job", "--endpoint-url", moto_server.endpoint_url,
                        "--region", "us-east-1")
    assert code == 3 and "job 'no-such-job' has no fleet request, instance or data volume" in err
