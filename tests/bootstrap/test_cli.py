"""``python -m bootstrap`` as a real subprocess against the moto server and the IMDS emulator."""

from __future__ import annotations

import copy
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from bootstrap.errors import ExitCode
from localmode.imds_emulator import ImdsEmulator
from test_supervisor import base_config

REPO = Path(__file__).resolve().parents[2]
STACK = "SpotTraining"
STACK_TAGS = [{"Key": "spot-training:stack", "Value": STACK}, {"Key": "spot-training:purpose", "Value": "data-volume"}]


def agent(command: str, config_path: Path, *, timeout: float = 120, env: dict | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "bootstrap", command, "--config", str(config_path)], cwd=REPO,
                          env=dict(os.environ, PYTHONPATH=str(REPO), **(env or {})), capture_output=True, text=True,
                          timeout=timeout)


def aws_state(ec2) -> dict:
    """Everything the agent could create, change or delete, as moto reports it."""
    return {
        "volumes": ec2.describe_volumes()["Volumes"],
        "snapshots": ec2.describe_snapshots(OwnerIds=["self"])["Snapshots"],
        "instances": ec2.describe_instances()["Reservations"],
        "fleets": ec2.describe_spot_fleet_requests()["SpotFleetRequestConfigs"],
        "tags": ec2.describe_tags()["Tags"],
    }


def our_fleet(ec2, stack: str = STACK) -> tuple[str, str]:
    ec2.create_launch_template(LaunchTemplateName=f"lt-{stack}", LaunchTemplateData={
        "ImageId": "ami-12c6146b", "InstanceType": "p3.2xlarge", "MetadataOptions": {"HttpTokens": "required"}})
    fleet_id = ec2.request_spot_fleet(SpotFleetRequestConfig={
        "IamFleetRole": "arn:aws:iam::123456789012:role/fleet", "TargetCapacity": 1, "Type": "maintain",
        "AllocationStrategy": "priceCapacityOptimized",
        "LaunchTemplateConfigs": [{"LaunchTemplateSpecification": {"LaunchTemplateName": f"lt-{stack}",
                                                                   "Version": "$Latest"}}],
        "TagSpecifications": [{"ResourceType": "spot-fleet-request",
                               "Tags": [{"Key": "spot-training:stack", "Value": stack}]}]})["SpotFleetRequestId"]
    instance_id = ec2.describe_spot_fleet_instances(SpotFleetRequestId=fleet_id)["ActiveInstances"][0]["InstanceId"]
    return fleet_id, instance_id


@pytest.fixture
def node(ec2, tmp_path):
    """A fleet instance of our stack, its data volume in moto, an IMDS emulator for it, a valid config."""
    fleet_id, instance_id = our_fleet(ec2)
    az = ec2.describe_instances(InstanceIds=[instance_id])["Reservations"][0]["Instances"][0]["Placement"]["AvailabilityZone"]
    ec2.create_volume(AvailabilityZone=az, Size=10, VolumeType="gp3", Encrypted=True,
                      TagSpecifications=[{"ResourceType": "volume", "Tags": STACK_TAGS}])
    with ImdsEmulator.from_moto(ec2, instance_id) as imds:
        config = base_config(tmp_path)
        config["imds_endpoint"] = imds.endpoint
        yield {"fleet_id": fleet_id, "instance_id": instance_id, "imds": imds, "config": config, "dir": tmp_path}


def _write(path: Path, config) -> Path:
    path.write_text(config if isinstance(config, str) else json.dumps(config))
    return path


def _without(config: dict, *keys: str) -> dict:
    config = copy.deepcopy(config)
    section = config
    for key in keys[:-1]:
        section = section[key]
    del section[keys[-1]]
    return config


def _with(config: dict, value, *keys: str) -> dict:
    config = copy.deepcopy(config)
    section = config
    for key in keys[:-1]:
        section = section[key]
    section[keys[-1]] = value
    return config


BAD_CONFIGS = {
    "missing training": (lambda c: _without(c, "training"), r"training: missing; expected a value"),
    "missing volume tags": (lambda c: _without(c, "volume", "tags"), r"volume.tags: missing"),
    "wrong type keep_snapshots": (lambda c: _with(c, "two", "volume", "keep_snapshots"),
                                  r'volume.keep_snapshots: got "two"; expected an integer >= 1'),
    "bool is not an int": (lambda c: _with(c, True, "schema_version"), r"schema_version: got true"),
    "command not a list": (lambda c: _with(c, "python train.py", "training", "command"),
                           r'training.command: got "python train.py"; expected a non-empty list'),
    "unknown region": (lambda c: _with(c, "mars-east-1", "region"),
                       r'region: got "mars-east-1"; expected an AWS region known to botocore'),
    "relative mount point": (lambda c: _with(c, "dltraining", "volume", "mount_point"),
                             r'volume.mount_point: got "dltraining"; expected an absolute path'),
    "relative checkpoint dir": (lambda c: _with(c, "../ckpt", "training", "checkpoint_dir"),
                                r'training.checkpoint_dir: got "../ckpt"; expected an absolute path'),
    "unknown framework": (lambda c: _with(c, "pytorch", "training", "framework"),
                          r"training.framework: got \"pytorch\"; expected one of 'tensorflow', 'mxnet'"),
    "another stack's volume tags": (lambda c: _with(c, "Other", "volume", "tags", "spot-training:stack"),
                                    r"volume.tags.spot-training:stack: got \"Other\"; expected the stack name"),
    "typo in a key": (lambda c: _with(c, "/x", "volume", "mount_pont"), r"volume.mount_pont: got \"/x\"; expected no such key"),
    "not json": (lambda c: '{"schema_version": 1,', r"is not valid JSON: .* line 1 column"),
}


@pytest.mark.parametrize("case", list(BAD_CONFIGS))
def test_bad_config_exits_78_naming_the_problem_and_touches_nothing(case, ec2, node):
    make, message = BAD_CONFIGS[case]
    path = _write(node["dir"] / "config.json", make(node["config"]))
    before = aws_state(ec2)
    result = agent("run", path)
    assert result.returncode == ExitCode.CONFIG, result.stderr
    assert __import__("re").search(message, result.stderr), result.stderr
    assert aws_state(ec2) == before
    assert node["imds"].stats["requests"] == []  # not even IMDS was asked
    # The JSON log line on stdout carries the same message and the exit code.
    last = json.loads(result.stdout.strip().splitlines()[-1])
    assert last["level"] == "ERROR" and last["exit_code"] == 78


def test_missing_config_file_exits_78(tmp_path):
    result = agent("run", tmp_path / "nope.json")
    assert result.returncode == ExitCode.CONFIG
    assert "nope.json' does not exist; pass --config" in result.stderr


def test_every_problem_is_reported_at_once(ec2, node):
    config = _with(_with(node["config"], "mars-east-1", "region"), "rel/path", "training", "log_dir")
    result = agent("check-config", _write(node["dir"] / "config.json", config))
    assert result.returncode == ExitCode.CONFIG
    assert 'region: got "mars-east-1"' in result.stderr and 'training.log_dir: got "rel/path"' in result.stderr


def test_region_that_is_not_the_instances_exits_78_before_touching_aws(ec2, node):
    path = _write(node["dir"] / "config.json", _with(node["config"], "us-west-2", "region"))
    before = aws_state(ec2)
    result = agent("run", path)
    assert result.returncode == ExitCode.CONFIG, result.stderr
    assert "region: got 'us-west-2' but this instance runs in 'us-east-1'" in result.stderr
    assert aws_state(ec2) == before


def test_check_config_prints_a_summary(node):
    result = agent("check-config", _write(node["dir"] / "config.json", node["config"]))
    assert result.returncode == 0, result.stderr
    summary = json.loads(result.stdout.strip().splitlines()[-1])
    assert summary["config"] == "valid" and summary["command"] == [sys.executable, "trainer.py"]


def test_imds_403_exits_78(ec2, node):
    node["imds"].set_fail_mode(status=403)
    before = aws_state(ec2)
    result = agent("cleanup", _write(node["dir"] / "config.json", node["config"]))
    assert result.returncode == ExitCode.CONFIG
    assert "403 Forbidden" in result.stderr
    assert aws_state(ec2) == before


def test_imds_unreachable_exits_75(node):
    config = _with(node["config"], "http://127.0.0.1:9", "imds_endpoint")
    result = agent("cleanup", _write(node["dir"] / "config.json", config), timeout=60)
    assert result.returncode == ExitCode.TEMPFAIL
    assert "did not answer" in result.stderr


def test_cleanup_command_cancels_our_fleet(ec2, node):
    other_fleet, _ = our_fleet(ec2, stack="Other")
    result = agent("cleanup", _write(node["dir"] / "config.json", node["config"]))
    assert result.returncode == 0, result.stderr
    assert json.loads(result.stdout.strip().splitlines()[-1]) == {"cancelled_fleet_request_id": node["fleet_id"]}
    fleets = {f["SpotFleetRequestId"] for f in ec2.describe_spot_fleet_requests()["SpotFleetRequestConfigs"]}
    assert fleets == {other_fleet}
    state = ec2.describe_instances(InstanceIds=[node["instance_id"]])["Reservations"][0]["Instances"][0]["State"]["Name"]
    assert state == "terminated"
