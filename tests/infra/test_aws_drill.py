"""``spot-train drill --aws`` (spot_training/ops/aws_drill.py): the orchestration against the moto server over HTTP.

What moto cannot be here stands in for it, and only that: the cdk CLI (a fake that creates what the
stack's deploy would, the fleet, its volume, and removes them on destroy), the node's checkpoint pointer
(read through SSM Run Command on AWS), and AWS's side of the interruption (FIS on AWS sends the notice
and EC2 terminates the instance; moto's FIS records the experiment and does nothing, so the test's
clock tick terminates the instance and the fleet's replacement appears). Preflight, the fleet's
instances, FIS StartExperiment, the orphan check and the Spot price history are moto's.
"""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import boto3
import pytest

from spot_training.infra import preflight
from spot_training.local.spot_prices import load_table
from spot_training.ops.aws_drill import FLEET_TAG, AwsDrill, AwsDrillOptions
from spot_training.cli import main

REGION = "us-east-1"
STACK = "SpotTraining"
AMI_PARAMETER = "/spot-training-test/ami-id"


class World:
    """moto plus the stand-ins: the cdk CLI, the checkpoint probe, and AWS's side of an interruption."""

    def __init__(self, endpoint: str, tmp_path: Path) -> None:
        self.endpoint = endpoint
        self.ec2, self.fis = self.client("ec2"), self.client("fis")
        self.commands: list[list[str]] = []
        self.fleet_id = ""
        self.volume_id = ""
        self.now = 0.0
        self.interrupted: str | None = None
        self.replacement: str | None = None
        self.probes: dict[str, list[int]] = {}

    def client(self, service: str):
        return boto3.client(service, region_name=REGION, endpoint_url=self.endpoint)

    # -- the cdk CLI ----------------------------------------------------------------------------------
    def run(self, argv):
        self.commands.append(list(argv))
        if argv[1] == "deploy":
            outputs_file = Path(argv[argv.index("--outputs-file") + 1])
            self.ec2.create_launch_template(LaunchTemplateName="drill", LaunchTemplateData={
                "ImageId": "ami-0123456789abcdef0", "InstanceType": "g4dn.xlarge"})
            self.fleet_id = self.ec2.request_spot_fleet(SpotFleetRequestConfig={
                "IamFleetRole": "arn:aws:iam::123456789012:role/fleet", "TargetCapacity": 1, "Type": "maintain",
                "AllocationStrategy": "priceCapacityOptimized",
                "LaunchTemplateConfigs": [{"LaunchTemplateSpecification": {"LaunchTemplateName": "drill", "Version": "$Latest"}}],
                "TagSpecifications": [{"ResourceType": "spot-fleet-request", "Tags": [{"Key": "spot-training:stack", "Value": STACK}]}],
            })["SpotFleetRequestId"]
            self.volume_id = self.ec2.create_volume(AvailabilityZone="us-east-1a", Size=20, TagSpecifications=[{
                "ResourceType": "volume", "Tags": [{"Key": "spot-training:stack", "Value": STACK}]}])["VolumeId"]
            template_id = self.fis.create_experiment_template(
                description="drill", roleArn="arn:aws:iam::123456789012:role/fis", stopConditions=[{"source": "none"}],
                targets={"SpotInstances": {"resourceType": "aws:ec2:spot-instance", "selectionMode": "COUNT(1)",
                                           "resourceTags": {"spot-training:stack": STACK}}},
                actions={"InterruptSpotInstance": {"actionId": "aws:ec2:send-spot-instance-interruptions",
                                                   "parameters": {"durationBeforeInterruption": "PT2M"},
                                                   "targets": {"SpotInstances": "SpotInstances"}}},
            )["experimentTemplate"]["id"]
            outputs_file.write_text(json.dumps({STACK: {"FleetRequestId": self.fleet_id, "FisExperimentTemplateId": template_id,
                                                        "DataVolumeId": self.volume_id}}))
        elif argv[1] == "destroy":
            # Cancelling with TerminateInstances also ends the replacement tagged with the fleet id
            # (spot_training.local.moto_compat, as on AWS).
            self.ec2.cancel_spot_fleet_requests(SpotFleetRequestIds=[self.fleet_id], TerminateInstances=True)
            self.ec2.delete_volume(VolumeId=self.volume_id)
        return subprocess.CompletedProcess(argv, 0)

    def fleet_instances(self) -> list[str]:
        return [i["InstanceId"] for r in self.ec2.describe_instances(Filters=[
            {"Name": f"tag:{FLEET_TAG}", "Values": [self.fleet_id]}])["Reservations"] for i in r["Instances"]]

    # -- the node's checkpoint pointer ------------------------------------------------------------------
    def probe(self, instance_id: str):
        steps = self.probes.setdefault(instance_id, [100, 100] if instance_id != self.replacement else [120, 150])
        step = steps.pop(0) if len(steps) > 1 else steps[0]
        return {"latest": {"step": step}, "completed": None}

    # -- time passes; AWS acts on a started experiment -------------------------------------------------
    def sleep(self, seconds: float) -> None:
        self.now += seconds
        if self.interrupted is None and self.fis.list_experiments()["experiments"]:
            [running] = [i for i in self.fleet_instances()
                         if self.ec2.describe_instances(InstanceIds=[i])["Reservations"][0]["Instances"][0]["State"]["Name"] == "running"]
            self.interrupted = running
            self.ec2.terminate_instances(InstanceIds=[running])  # the notice's two minutes are over
            self.replacement = self.ec2.run_instances(
                ImageId="ami-0123456789abcdef0", InstanceType="g5.xlarge", MinCount=1, MaxCount=1,
                Placement={"AvailabilityZone": "us-east-1b"},
                TagSpecifications=[{"ResourceType": "instance", "Tags": [{"Key": FLEET_TAG, "Value": self.fleet_id},
                                                                         {"Key": "spot-training:stack", "Value": STACK}]}],
            )["Instances"][0]["InstanceId"]


def _account_ready(world: World) -> None:
    iam = world.client("iam")
    for role, service in preflight.SERVICE_LINKED_ROLES:
        iam.create_role(RoleName=role, Path=f"/aws-service-role/{service}/", AssumeRolePolicyDocument="{}")
    # The parameter names an image that exists (preflight's ami-image check describes it): an x86_64 image
    # with a Deep Learning AMI's name, made from an instance (moto's RegisterImage keeps no architecture).
    ec2 = world.client("ec2")
    instance = ec2.run_instances(ImageId="ami-12345678", MinCount=1, MaxCount=1)["Instances"][0]["InstanceId"]
    image_id = ec2.create_image(InstanceId=instance, Name="Deep Learning Base OSS Nvidia Driver GPU AMI (Ubuntu 22.04) 20261120")["ImageId"]
    ec2.terminate_instances(InstanceIds=[instance])
    world.client("ssm").put_parameter(Name=AMI_PARAMETER, Value=image_id, Type="String")


def _drill(world: World, tmp_path: Path) -> AwsDrill:
    options = AwsDrillOptions(region=REGION, context=(f"ami_ssm_parameter={AMI_PARAMETER}",), work_dir=tmp_path / "drill",
                              poll_s=1.0, launch_timeout_s=60, progress_timeout_s=60)
    return AwsDrill(options, client=world.client, run=world.run, probe=world.probe, clock=lambda: world.now,
                    sleep=world.sleep, say=lambda line: None)


def test_drill_deploys_interrupts_checks_the_resume_destroys_and_prices(moto_server, tmp_path):
    world = World(moto_server.endpoint_url, tmp_path)
    _account_ready(world)
    report = _drill(world, tmp_path).run()

    assert report["passed"] is True, report.get("error")
    deploy, destroy = world.commands
    assert deploy[:3] == ["cdk", "deploy", STACK] and "fis_drill=true" in deploy and "instance_types=g4dn.xlarge,g5.xlarge,g6.xlarge" in deploy
    assert destroy[:4] == ["cdk", "destroy", STACK, "--force"]
    interruption = report["interruption"]
    assert (interruption["interrupted"], interruption["replacement"]) == (world.interrupted, world.replacement)
    assert (interruption["step_before_notice"], interruption["step_found_by_replacement"], interruption["step_after_resume"]) == (100, 120, 150)
    assert (interruption["az_from"], interruption["az_to"], interruption["resumed"]) == ("us-east-1a", "us-east-1b", True)
    [experiment] = world.fis.list_experiments()["experiments"]
    assert experiment["id"] == interruption["experiment_id"]
    assert report["orphans_after_destroy"] == []
    cost = report["cost"]
    assert sorted(r["instance_id"] for r in cost["by_instance"]) == sorted([world.interrupted, world.replacement])
    # The local AWS serves local mode's dated price table (spot_training/local/spot_prices.json), not moto's placeholder.
    table = load_table().spot
    assert all(any(r["spot_price_usd_per_hour"] == pytest.approx(p) for p in table[r["instance_type"]].values())
               for r in cost["by_instance"]), cost["by_instance"]
    assert "EBS" in cost["not_counted"]
    assert json.loads((tmp_path / "drill" / "report.json").read_text())["passed"] is True


def test_a_failed_preflight_stops_the_drill_before_anything_is_deployed(moto_server, tmp_path):
    world = World(moto_server.endpoint_url, tmp_path)  # no service-linked roles, no AMI parameter
    report = _drill(world, tmp_path).run()
    assert report["passed"] is False and "preflight failed" in report["error"]
    assert world.commands == []
    failed = {c["name"] for c in report["preflight"] if c["status"] == "fail"}
    assert "service-linked-role:AWSServiceRoleForEC2SpotFleet" in failed and "ami" in failed


def test_orphans_fail_the_drill(moto_server, tmp_path):
    world = World(moto_server.endpoint_url, tmp_path)
    _account_ready(world)
    original = world.run

    def leaky(argv):
        if argv[1] == "destroy":  # a destroy that leaves the volume behind
            world.ec2.cancel_spot_fleet_requests(SpotFleetRequestIds=[world.fleet_id], TerminateInstances=True)
            return subprocess.CompletedProcess(argv, 0)
        return original(argv)

    world.run = leaky
    report = _drill(world, tmp_path).run()
    assert report["passed"] is False
    assert report["orphans_after_destroy"] == [f"volume {world.volume_id} (available)"]


def test_without_yes_it_only_prints_the_plan(capsys):
    assert main(["drill", "--aws", "--region", REGION]) == 2
    out = capsys.readouterr().out
    assert "add --yes" in out and "cdk deploy SpotTraining --require-approval never" in out and "fis_drill=true" in out
    assert "cdk destroy SpotTraining --force" in out
