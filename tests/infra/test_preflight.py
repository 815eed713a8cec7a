"""``spot-train preflight`` (spot_training/infra/preflight.py) against a real moto server over HTTP, and, for the two
APIs moto 5.2 does not answer for EC2 (Service Quotas' ec2 codes, GetSpotPlacementScores), against
botocore's Stubber with AWS's documented response shapes. What moto cannot answer must come out
``unknown`` with exit code 3, never as a pass."""

from __future__ import annotations

import json
from pathlib import Path

import boto3
import pytest
from botocore.stub import Stubber

from spot_training.infra import preflight
from spot_training.cli import main

ROOT = Path(__file__).resolve().parents[2]
REGION = "us-east-1"


def _run(capsys: pytest.CaptureFixture[str], endpoint: str, *extra: str) -> tuple[int, dict[str, dict[str, str]]]:
    code = main(["preflight", "--region", REGION, "--endpoint-url", endpoint, "--cdk-json", str(ROOT / "cdk.json"), "--json", *extra])
    out = json.loads(capsys.readouterr().out)
    assert out["exit_code"] == code
    return code, {c["name"]: c for c in out["checks"]}


def test_fresh_account_fails_with_the_commands_that_fix_it(moto_server, capsys) -> None:
    code, checks = _run(capsys, moto_server.endpoint_url)
    assert code == preflight.EXIT_FAILED
    spotfleet = checks["service-linked-role:AWSServiceRoleForEC2SpotFleet"]
    spot = checks["service-linked-role:AWSServiceRoleForEC2Spot"]
    assert (spotfleet["status"], spot["status"]) == ("fail", "fail")
    assert spotfleet["fix"] == "aws iam create-service-linked-role --aws-service-name spotfleet.amazonaws.com"
    assert spot["fix"] == "aws iam create-service-linked-role --aws-service-name spot.amazonaws.com"
    ami = checks["ami"]
    assert ami["status"] == "fail" and "base-oss-nvidia-driver-gpu-ubuntu-22.04" in ami["detail"]
    assert "get-parameters-by-path" in ami["fix"]
    # The default types exist in moto's catalogue, with their real vCPU counts.
    for t in ("g6.xlarge", "g5.xlarge", "g4dn.xlarge"):
        assert checks[f"instance-type:{t}"]["status"] == "pass", checks[f"instance-type:{t}"]
    # moto answers neither ec2 quotas nor placement scores: reported as unknown, not as a pass.
    assert checks["spot-quota:G"]["status"] == "unknown"
    assert checks["capacity"]["status"] == "unknown"


def test_account_with_roles_and_ami_exits_3_because_moto_cannot_answer_quota_and_capacity(moto_server, capsys) -> None:
    iam = boto3.client("iam", region_name=REGION, endpoint_url=moto_server.endpoint_url)
    # The names AWS gives these service-linked roles (moto's create_service_linked_role names them differently).
    for role, service in preflight.SERVICE_LINKED_ROLES:
        iam.create_role(RoleName=role, Path=f"/aws-service-role/{service}/", AssumeRolePolicyDocument=json.dumps({
            "Version": "2012-10-17", "Statement": [{"Effect": "Allow", "Principal": {"Service": service}, "Action": "sts:AssumeRole"}]}))
    image_id = _dlami(moto_server.endpoint_url)
    ssm = boto3.client("ssm", region_name=REGION, endpoint_url=moto_server.endpoint_url)
    # moto refuses names under /aws/, so the test points ami_ssm_parameter at a parameter of its own.
    ssm.put_parameter(Name="/spot-training-test/ami-id", Value=image_id, Type="String")
    code, checks = _run(capsys, moto_server.endpoint_url, "-c", "ami_ssm_parameter=/spot-training-test/ami-id")
    assert code == preflight.EXIT_UNKNOWN
    assert {name: c["status"] for name, c in checks.items() if c["status"] != "unknown"} == {
        "service-linked-role:AWSServiceRoleForEC2SpotFleet": "pass", "service-linked-role:AWSServiceRoleForEC2Spot": "pass",
        "instance-type:g6.xlarge": "pass", "instance-type:g5.xlarge": "pass", "instance-type:g4dn.xlarge": "pass", "ami": "pass",
        "ami-image": "pass"}
    assert image_id in checks["ami"]["detail"]
    # The image the parameter names is checked too, and what only a boot can tell is said.
    assert "Python 3.10" in checks["ami-image"]["detail"] and "not checkable without booting" in checks["ami-image"]["detail"]
    assert "mkfs.xfs" in checks["ami-image"]["detail"]
    assert "did not answer" in checks["capacity"]["fix"]


def _dlami(endpoint: str, name: str = "Deep Learning Base OSS Nvidia Driver GPU AMI (Ubuntu 22.04) 20261120") -> str:
    """An x86_64 Linux image named ``name``, made in the moto server (CreateImage of an instance: moto's
    RegisterImage keeps no architecture)."""
    ec2 = boto3.client("ec2", region_name=REGION, endpoint_url=endpoint)
    instance = ec2.run_instances(ImageId="ami-12345678", MinCount=1, MaxCount=1)["Instances"][0]["InstanceId"]
    return ec2.create_image(InstanceId=instance, Name=name)["ImageId"]


def test_an_image_that_does_not_exist_fails_preflight(moto_server, capsys) -> None:
    code, checks = _run(capsys, moto_server.endpoint_url, "-c", "image_id=ami-0000000000000dead")
    assert code == preflight.EXIT_FAILED
    assert checks["ami"]["status"] == "fail" and "does not exist" in checks["ami"]["detail"]


def test_an_image_that_is_not_a_listed_dlami_is_a_warning_naming_what_the_boot_checks(moto_server, capsys) -> None:
    image_id = _dlami(moto_server.endpoint_url, name="my-team-ubuntu-22.04-20261120")
    _, checks = _run(capsys, moto_server.endpoint_url, "-c", f"image_id={image_id}")
    check = checks["ami-image"]
    assert check["status"] == "warn", check
    assert "not a Deep Learning AMI listed" in check["detail"] and "python3-venv" in check["fix"]


@pytest.mark.parametrize(("image", "problem"), [
    ({"Architecture": "arm64"}, "architecture arm64 is not supported by g5.xlarge (g5.xlarge: x86_64)"),
    ({"RootDeviceType": "instance-store"}, "root device is 'instance-store'"),
    ({"Platform": "windows"}, "Windows image"),
    ({"State": "deregistered"}, "state is 'deregistered'"),
])
def test_an_image_the_fleet_cannot_boot_fails(image: dict, problem: str) -> None:
    # DescribeImages / DescribeInstanceTypes shapes as the EC2 API Reference documents them (moto's
    # RegisterImage keeps neither architecture nor root device type).
    ec2 = _client("ec2")
    described = {"ImageId": "ami-1", "Name": "Deep Learning Base OSS Nvidia Driver GPU AMI (Ubuntu 22.04) 20261120",
                 "Architecture": "x86_64", "RootDeviceType": "ebs", "State": "available", **image}
    with Stubber(ec2) as stub:
        stub.add_response("describe_images", {"Images": [described]}, {"ImageIds": ["ami-1"]})
        stub.add_response("describe_instance_types", {"InstanceTypes": [
            {"InstanceType": "g5.xlarge", "ProcessorInfo": {"SupportedArchitectures": ["x86_64"]}}]},
            {"InstanceTypes": ["g5.xlarge"]})
        check = preflight.check_ami_image(ec2, "ami-1", ["g5.xlarge"])
    assert check.status == "fail" and problem in check.detail, check


def test_dlami_release_table_matches_names_by_their_longest_prefix_and_judges_botocore() -> None:
    arm = preflight.dlami_release("Deep Learning ARM64 Base OSS Nvidia Driver GPU AMI (Ubuntu 24.04) 20261120")
    assert (arm.architecture, arm.python) == ("arm64", "3.12")
    assert preflight.dlami_release("Deep Learning Base OSS Nvidia Driver GPU AMI (Ubuntu 22.04) 20261120").architecture == "x86_64"
    assert preflight.dlami_release("my-own-ami") is None
    for release in preflight.DLAMI_RELEASES:
        assert release.source.startswith("https://docs.aws.amazon.com/dlami/")
        assert preflight._version(release.botocore) >= preflight.MIN_BOTOCORE_FOR_INITIALIZATION_RATE


def test_an_old_dlami_botocore_fails_only_with_an_initialization_rate(monkeypatch) -> None:
    old = preflight.DlamiRelease("Deep Learning Test AMI", "20250101", "x86_64", "Ubuntu 22.04", "3.10", "1.34.46", "https://example")
    monkeypatch.setattr(preflight, "DLAMI_RELEASES", (old,))
    ec2 = _client("ec2")
    image = {"ImageId": "ami-1", "Name": "Deep Learning Test AMI 20250101", "Architecture": "x86_64", "RootDeviceType": "ebs",
             "State": "available"}
    for rate, status in ((None, "pass"), (300, "fail")):
        with Stubber(ec2) as stub:
            stub.add_response("describe_images", {"Images": [image]}, {"ImageIds": ["ami-1"]})
            stub.add_response("describe_instance_types", {"InstanceTypes": [
                {"InstanceType": "g5.xlarge", "ProcessorInfo": {"SupportedArchitectures": ["x86_64"]}}]},
                {"InstanceTypes": ["g5.xlarge"]})
            check = preflight.check_ami_image(ec2, "ami-1", ["g5.xlarge"], initialization_rate_mibps=rate)
        assert check.status == status, check
    assert "botocore 1.34.46 is older than 1.38.10" in check.detail


def test_type_the_region_does_not_offer_fails_and_p3_is_warned_about(moto_server, capsys) -> None:
    code, checks = _run(capsys, moto_server.endpoint_url, "-c", "instance_types=zz9.xlarge,m5.large")
    assert code == preflight.EXIT_FAILED
    assert checks["instance-type:zz9.xlarge"]["status"] == "fail" and "not offered" in checks["instance-type:zz9.xlarge"]["detail"]
    # m5 is offered but not a Deep Learning Base AMI GPU family: a warning, with the way out.
    assert checks["instance-type:m5.large"]["status"] == "warn"
    assert "supported_ec2_instances" in checks["instance-type:m5.large"]["detail"]


def test_bad_context_value_exits_2_before_any_call(capsys) -> None:
    code = main(["preflight", "--region", REGION, "--endpoint-url", "http://127.0.0.1:9", "--cdk-json", str(ROOT / "cdk.json"),
                 "-c", "target_capacity=-1"])
    assert code == preflight.EXIT_USAGE
    assert "target_capacity" in capsys.readouterr().err


def _client(service: str):
    return boto3.client(service, region_name=REGION, aws_access_key_id="x", aws_secret_access_key="x")


@pytest.mark.parametrize(("value", "status"), [(0.0, "fail"), (8.0, "pass")])
def test_spot_quota_below_the_largest_type_times_target_fails_with_the_increase_request(value: float, status: str) -> None:
    quotas = _client("service-quotas")
    with Stubber(quotas) as stub:
        stub.add_response("get_service_quota", {"Quota": {"ServiceCode": "ec2", "QuotaCode": "L-3819A6DF", "Value": value}},
                          {"ServiceCode": "ec2", "QuotaCode": "L-3819A6DF"})
        (check,) = preflight.check_spot_quotas(quotas, {"g5.xlarge": 4, "g4dn.xlarge": 4, "g6.2xlarge": 8}, 1, REGION)
        stub.assert_no_pending_responses()
    assert (check.name, check.status) == ("spot-quota:G", status)
    assert "need 8" in check.detail
    if status == "fail":
        assert check.fix == ("aws service-quotas request-service-quota-increase --service-code ec2 --quota-code L-3819A6DF "
                             "--desired-value 8 --region us-east-1")


def test_quota_classes_follow_the_aws_spot_quota_names() -> None:
    assert [preflight.quota_class(t) for t in ("g5.xlarge", "vt1.3xlarge", "p3.2xlarge", "p4d.24xlarge", "m5.large",
                                                "t3.micro", "p5.48xlarge", "inf2.xlarge", "dl1.24xlarge", "x2idn.16xlarge")] == [
        "G", "G", "P", "P", "Standard", "Standard", None, None, None, None]


@pytest.mark.parametrize(("scores", "status"), [({"use1-az1": 9, "use1-az2": 2}, "pass"), ({"use1-az2": 2}, "warn"), ({}, "fail")])
def test_capacity_from_spot_placement_scores(scores: dict[str, int], status: str) -> None:
    ec2 = _client("ec2")
    with Stubber(ec2) as stub:
        stub.add_response("describe_availability_zones", {"AvailabilityZones": [
            {"ZoneName": "us-east-1a", "ZoneId": "use1-az1"}, {"ZoneName": "us-east-1b", "ZoneId": "use1-az2"}]})
        stub.add_response("get_spot_placement_scores", {"SpotPlacementScores": [
            {"Region": REGION, "AvailabilityZoneId": zone, "Score": score} for zone, score in scores.items()]}, {
            "InstanceTypes": ["g5.xlarge"], "TargetCapacity": 1, "TargetCapacityUnitType": "units",
            "SingleAvailabilityZone": True, "RegionNames": [REGION]})
        check = preflight.check_capacity(ec2, region=REGION, instance_types=["g5.xlarge"], target_capacity=1,
                                         availability_zones=["us-east-1a", "us-east-1b"])
    assert check.status == status
    if scores:
        assert "us-east-1b=2" in check.detail


def test_exit_codes() -> None:
    C = preflight.Check
    assert preflight.exit_code([C("a", "pass", ""), C("b", "warn", "")]) == 0
    assert preflight.exit_code([C("a", "unknown", ""), C("b", "fail", "")]) == 1
    assert preflight.exit_code([C("a", "unknown", ""), C("b", "pass", "")]) == 3


def test_cluster_target_is_the_worker_fleet_at_its_largest() -> None:
    context = json.loads((ROOT / "cdk.json").read_text())["context"]
    target = preflight.target_from_context({**context, "cluster_max_workers": "6"}, stack="cluster", region=REGION)
    assert target.instance_types == ("g6.xlarge", "g5.xlarge", "g4dn.xlarge")
    assert target.target_capacity == 6  # the quota must allow the most workers the fleet may be raised to
    single = preflight.target_from_context(context, stack="single", region=REGION)
    assert (single.target_capacity, single.image_id) == (1, None)
    assert single.ami_ssm_parameter.endswith("/base-oss-nvidia-driver-gpu-ubuntu-22.04/latest/ami-id")
