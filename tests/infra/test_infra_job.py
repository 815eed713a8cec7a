"""TrainingJob: any number of jobs in one stack, each with its own identity; the CDK conventions of the parts."""

from __future__ import annotations

import json
from typing import Any

import aws_cdk as cdk
import pytest
from aws_cdk import assertions
from aws_cdk import aws_ec2 as ec2
from aws_cdk import aws_efs as efs
from aws_cdk import aws_iam as iam
from aws_cdk import aws_s3 as s3
from infra_helpers import as_list, render_intrinsics

from spot_training.infra import SpotTrainingFleet, SpotTrainingStack, TrainingJob, TrainingNodeRole, TrainingVolume
from spot_training.infra.userdata import extract_config

STACK_TAG = "spot-training:stack"


def _vpc(stack: cdk.Stack) -> ec2.Vpc:
    return ec2.Vpc(stack, "Vpc", nat_gateways=0, max_azs=2,
                   subnet_configuration=[ec2.SubnetConfiguration(name="Public", subnet_type=ec2.SubnetType.PUBLIC)])


@pytest.fixture(scope="module")
def two_jobs() -> dict[str, Any]:
    """One stack, two jobs (one with an explicit id, one with the default), synthesized once."""
    app = cdk.App()
    stack = cdk.Stack(app, "Team")
    cdk.Tags.of(stack).add(STACK_TAG, "Team")  # as SettingsStack does: the job's tag must still win
    vpc = _vpc(stack)
    first = TrainingJob(stack, "Resnet", vpc=vpc, job_id="resnet-a", training_command=["python", "a.py"])
    second = TrainingJob(stack, "Bert", vpc=vpc, training_command=["python", "b.py"])
    template = assertions.Template.from_stack(stack)
    return {"stack": stack, "jobs": (first, second), "template": template, "data": template.to_json()}


def _of(data: dict[str, Any], cfn_type: str) -> dict[str, dict[str, Any]]:
    return {k: v for k, v in data["Resources"].items() if v["Type"] == cfn_type}


def _tags(resource: dict[str, Any]) -> dict[str, Any]:
    return {t["Key"]: t["Value"] for t in resource["Properties"].get("Tags", [])}


def test_two_jobs_have_distinct_ids_and_volume_tags(two_jobs: dict[str, Any]) -> None:
    first, second = two_jobs["jobs"]
    assert first.job_id == "resnet-a"
    assert second.job_id == "Team-Bert"
    volumes = _of(two_jobs["data"], "AWS::EC2::Volume")
    assert sorted(_tags(v)[STACK_TAG] for v in volumes.values()) == ["Team-Bert", "resnet-a"]


def test_each_job_tags_its_instances_and_fleet_request_with_its_own_id(two_jobs: dict[str, Any]) -> None:
    templates = _of(two_jobs["data"], "AWS::EC2::LaunchTemplate")
    instance_tags = sorted(
        next(t["Value"] for spec in lt["Properties"]["LaunchTemplateData"]["TagSpecifications"]
             if spec["ResourceType"] == "instance" for t in spec["Tags"] if t["Key"] == STACK_TAG)
        for lt in templates.values())
    assert instance_tags == ["Team-Bert", "resnet-a"]
    fleets = _of(two_jobs["data"], "AWS::EC2::SpotFleet")
    fleet_tags = sorted(f["Properties"]["SpotFleetRequestConfigData"]["TagSpecifications"][0]["Tags"][0]["Value"]
                        for f in fleets.values())
    assert fleet_tags == ["Team-Bert", "resnet-a"]


def test_each_job_role_may_touch_only_its_own_resources(two_jobs: dict[str, Any]) -> None:
    data = two_jobs["data"]
    for job in two_jobs["jobs"]:
        role_id = two_jobs["stack"].get_logical_id(job.node_role.role.node.default_child)
        policies = [p for p in _of(data, "AWS::IAM::Policy").values()
                    if {"Ref": role_id} in p["Properties"]["Roles"]]
        conditions = json.dumps([s.get("Condition") for p in policies for s in p["Properties"]["PolicyDocument"]["Statement"]])
        assert f'"aws:ResourceTag/{STACK_TAG}": "{job.job_id}"' in conditions
        other = next(j for j in two_jobs["jobs"] if j is not job)
        assert other.job_id not in conditions


def test_each_job_node_config_names_its_own_id_and_log_group(two_jobs: dict[str, Any]) -> None:
    configs = []
    for lt in _of(two_jobs["data"], "AWS::EC2::LaunchTemplate").values():
        configs.append(extract_config(render_intrinsics(lt["Properties"]["LaunchTemplateData"]["UserData"]["Fn::Base64"])))
    by_id = {c["stack_name"]: c for c in configs}
    assert sorted(by_id) == ["Team-Bert", "resnet-a"]
    for job_id, config in by_id.items():
        assert config["volume"]["tags"][STACK_TAG] == job_id
        assert config["monitoring"]["log_group"] == f"/spot-training/{job_id}"
    assert by_id["resnet-a"]["training"]["command"] == ["python", "a.py"]
    groups = sorted(g["Properties"]["LogGroupName"] for g in _of(two_jobs["data"], "AWS::Logs::LogGroup").values()
                    if "LogGroupName" in g["Properties"])
    assert groups == ["/spot-training/Team-Bert", "/spot-training/resnet-a"]


def test_a_repeated_or_malformed_job_id_fails_synth() -> None:
    app = cdk.App()
    vpc = _vpc(cdk.Stack(app, "One"))
    TrainingJob(vpc.stack, "A", vpc=vpc, job_id="same")
    other = cdk.Stack(app, "Two")
    with pytest.raises(ValueError, match=r"job_id 'same' is already used by One/A"):
        TrainingJob(other, "B", vpc=_vpc(other), job_id="same")
    with pytest.raises(ValueError, match=r"job_id must start with a letter .* got 'my_job'"):
        TrainingJob(other, "C", vpc=vpc, job_id="my_job")
    with pytest.raises(ValueError, match=r"node_options: unknown key\(s\) \['stack_name'\]"):
        TrainingJob(other, "D", vpc=vpc, node_options={"stack_name": "x"})


def test_job_is_grantable_and_connectable() -> None:
    stack = cdk.Stack(cdk.App(), "Conventions")
    vpc = _vpc(stack)
    job = TrainingJob(stack, "Job", vpc=vpc)
    bucket = s3.Bucket(stack, "Datasets", enforce_ssl=True)
    bucket.grant_read(job)
    fs = efs.FileSystem(stack, "Fs", vpc=vpc)
    fs.connections.allow_default_port_from(job)
    template = assertions.Template.from_stack(stack)
    role_id = stack.get_logical_id(job.node_role.role.node.default_child)
    policies = [p for p in template.find_resources("AWS::IAM::Policy").values() if {"Ref": role_id} in p["Properties"]["Roles"]]
    reads = [s for p in policies for s in p["Properties"]["PolicyDocument"]["Statement"] if "s3:GetObject*" in as_list(s["Action"])]
    assert reads and any("Datasets" in json.dumps(s["Resource"]) for s in reads)
    sg_id = stack.get_logical_id(job.fleet.security_group.node.default_child)
    template.has_resource_properties("AWS::EC2::SecurityGroupIngress", {
        "FromPort": 2049, "SourceSecurityGroupId": {"Fn::GetAtt": [sg_id, "GroupId"]}})


def test_parts_follow_cdk_conventions(stack: cdk.Stack) -> None:
    vpc = _vpc(stack)
    role = TrainingNodeRole(stack, "NodeRole")
    bucket = s3.Bucket(stack, "Bucket", enforce_ssl=True)
    bucket.grant_read(role)                                  # IGrantable
    volume = TrainingVolume(stack, "Data", availability_zone="us-east-1a", size_gib=cdk.Size.gibibytes(200))
    other = iam.Role(stack, "Other", assumed_by=iam.ServicePrincipal("ec2.amazonaws.com"))
    grant = volume.grant_attach_volume(other)
    assert grant.success
    fleet = SpotTrainingFleet(stack, "Fleet", vpc=vpc, machine_image=ec2.MachineImage.latest_amazon_linux2023(),
                              instance_profile=role.instance_profile, max_price=0.5,
                              instance_types=[ec2.InstanceType("g5.xlarge"), "g6.xlarge"],
                              root_volume_size_gib=cdk.Size.gibibytes(200))
    peer = ec2.SecurityGroup(stack, "Peer", vpc=vpc)
    peer.connections.allow_from(fleet, ec2.Port.tcp(22))  # IConnectable
    template = assertions.Template.from_stack(stack)
    template.has_resource_properties("AWS::EC2::Volume", {"Size": 200})
    template.has_resource_properties("AWS::EC2::SpotFleet", {"SpotFleetRequestConfigData": assertions.Match.object_like(
        {"SpotPrice": "0.5"})})
    template.has_resource_properties("AWS::IAM::Policy", {"PolicyDocument": {"Statement": assertions.Match.array_with([
        assertions.Match.object_like({"Action": ["ec2:AttachVolume", "ec2:DetachVolume"],
                                      "Condition": {"StringEquals": {f"aws:ResourceTag/{STACK_TAG}": "TestStack"}}})])}})
    template.has_resource_properties("AWS::EC2::SecurityGroupIngress", {"FromPort": 22})


def test_wrong_kind_and_unknown_types_fail_synth(stack: cdk.Stack) -> None:
    vpc = _vpc(stack)
    role = TrainingNodeRole(stack, "NodeRole")
    image = ec2.MachineImage.latest_amazon_linux2023()
    with pytest.raises(ValueError, match=r"instance_profile must be an iam.IInstanceProfile, got TrainingNodeRole \(pass the role's .instance_profile\)"):
        SpotTrainingFleet(stack, "F1", vpc=vpc, machine_image=image, instance_profile=role)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=r"instance_types: 'z9.xlarge' is not an EC2 instance type botocore knows"):
        SpotTrainingFleet(stack, "F2", vpc=vpc, machine_image=image, instance_profile=role.instance_profile,
                          instance_types=["z9.xlarge"])
    with pytest.raises(ValueError, match=r"vpc must be an ec2.IVpc"):
        SpotTrainingStack(cdk.App(), vpc="vpc-123")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=r"file_system must be a SharedFileSystem .* got FileSystem"):
        TrainingJob(stack, "J1", vpc=vpc, file_system=efs.FileSystem(stack, "Fs", vpc=vpc))  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=r"machine_image must be an ec2.IMachineImage .* got str"):
        TrainingJob(stack, "J2", vpc=vpc, machine_image="ami-0123456789abcdef0")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=r"vpc must be an ec2.IVpc .* got str"):
        TrainingJob(stack, "J3", vpc="vpc-123")  # type: ignore[arg-type]


def test_unsupported_instance_type_warns(stack: cdk.Stack) -> None:
    role = TrainingNodeRole(stack, "NodeRole")
    SpotTrainingFleet(stack, "Fleet", vpc=_vpc(stack), machine_image=ec2.MachineImage.latest_amazon_linux2023(),
                      instance_profile=role.instance_profile, instance_types=["p3.2xlarge", "g5.xlarge"])
    warnings = assertions.Annotations.from_stack(stack).find_warning("*", assertions.Match.string_like_regexp("p3.2xlarge"))
    assert len(warnings) == 1 and "Deep Learning Base AMI" in str(warnings[0].entry.data)


def test_stack_takes_an_ivpc_and_buckets_to_read() -> None:
    app = cdk.App()
    shared = cdk.Stack(app, "Network")
    vpc = ec2.Vpc(shared, "Vpc", ip_addresses=ec2.IpAddresses.cidr("10.99.0.0/16"), nat_gateways=0, max_azs=2,
                  subnet_configuration=[ec2.SubnetConfiguration(name="Public", subnet_type=ec2.SubnetType.PUBLIC)])
    bucket = s3.Bucket(shared, "Data", enforce_ssl=True)
    stack = SpotTrainingStack(app, vpc=vpc, read_buckets=[bucket])
    template = assertions.Template.from_stack(stack)
    template.resource_count_is("AWS::EC2::VPC", 0)
    statements = [s for p in template.find_resources("AWS::IAM::Policy").values()
                  for s in p["Properties"]["PolicyDocument"]["Statement"]]
    assert any("s3:GetObject*" in as_list(s["Action"]) and "Data" in json.dumps(s["Resource"]) for s in statements)


def _docs_example(name: str) -> dict[str, Any]:
    """Run the python block after ``<!-- docs-example: NAME -->`` in docs/infra.md; its namespace."""
    from pathlib import Path

    text = (Path(__file__).resolve().parents[2] / "docs" / "infra.md").read_text()
    block = text.split(f"<!-- docs-example: {name} -->\n```python\n", 1)[1].split("\n```", 1)[0]
    namespace: dict[str, Any] = {}
    exec(compile(block, f"docs/infra.md:{name}", "exec"), namespace)  # noqa: S102 - our own documentation
    return namespace


def test_docs_hand_wiring_trains_user_data_and_job_tag_on_instances() -> None:
    """The pieces as docs/infra.md wires them: the launch template starts the agent with a config for the
    job, the instances carry the job's tag (what the role's conditions require), and cdk-nag is clean."""
    ns = _docs_example("pieces")
    stack = ns["stack"]
    data = assertions.Template.from_stack(stack).to_json()
    (lt,) = _of(data, "AWS::EC2::LaunchTemplate").values()
    config = extract_config(render_intrinsics(lt["Properties"]["LaunchTemplateData"]["UserData"]["Fn::Base64"]))
    assert config["stack_name"] == "my-job" and config["volume"]["tags"][STACK_TAG] == "my-job"
    (instance_spec,) = [s for s in lt["Properties"]["LaunchTemplateData"]["TagSpecifications"] if s["ResourceType"] == "instance"]
    assert {"Key": STACK_TAG, "Value": "my-job"} in instance_spec["Tags"]
    errors = assertions.Annotations.from_stack(stack).find_error("*", assertions.Match.any_value())
    assert errors == []


def test_docs_jobs_example_gives_each_job_its_own_volume() -> None:
    ns = _docs_example("jobs")
    data = assertions.Template.from_stack(ns["stack"]).to_json()
    assert sorted(_tags(v)[STACK_TAG] for v in _of(data, "AWS::EC2::Volume").values()) == ["vision-resnet", "vision-vit"]


def test_cluster_stack_takes_an_ivpc_and_subnets() -> None:
    from spot_training.infra import DistributedTrainingStack

    app = cdk.App()
    network = cdk.Stack(app, "Network")
    vpc = ec2.Vpc(network, "Vpc", ip_addresses=ec2.IpAddresses.cidr("10.99.0.0/16"), nat_gateways=0, max_azs=2,
                  subnet_configuration=[ec2.SubnetConfiguration(name="Nodes", subnet_type=ec2.SubnetType.PUBLIC)])
    stack = DistributedTrainingStack(app, vpc=vpc, vpc_subnets=ec2.SubnetSelection(subnet_group_name="Nodes"))
    template = assertions.Template.from_stack(stack)
    template.resource_count_is("AWS::EC2::VPC", 0)
    template.resource_count_is("AWS::EFS::MountTarget", 2)
    with pytest.raises(ValueError, match=r"vpc must be an ec2.IVpc .* got str"):
        DistributedTrainingStack(cdk.App(), vpc="vpc-0abc")  # type: ignore[arg-type]


def test_stack_settings_defaults_are_the_constructs_defaults() -> None:
    """SpotTrainingStack passes only what the user set; the constructs own the defaults. Each settings
    default must equal the construct's, or a user who leaves a key out would get another value than
    docs/infra.md's table says."""
    import dataclasses
    import inspect

    from spot_training.infra import StackSettings
    from spot_training.infra.stack import CONSTRUCT_OWNED

    defaults = {f.name: f.default for f in dataclasses.fields(StackSettings)}
    construct_defaults = {}
    for cls, renames in ((TrainingJob, {}), (TrainingVolume, {"size_gib": "volume_size", "iops": "volume_iops",
                                                                "throughput_mibps": "volume_throughput_mibps"}),
                         (SpotTrainingFleet, {"root_volume_size_gib": "root_volume_size"})):
        for name, parameter in inspect.signature(cls.__init__).parameters.items():
            if parameter.default is not inspect.Parameter.empty and (parameter.default is not None
                                                                     or renames.get(name, name) not in construct_defaults):
                construct_defaults[renames.get(name, name)] = parameter.default
    for key, prop in CONSTRUCT_OWNED.items():
        expected = construct_defaults[prop]
        assert (tuple(expected) if isinstance(expected, (list, tuple)) else expected) == defaults[key], (key, prop)


def test_stack_passes_only_what_the_user_set() -> None:
    from spot_training.infra import StackSettings
    from spot_training.infra.stack import user_set

    settings = StackSettings.from_mapping({"volume_size_gib": "500", "target_capacity": "2"})
    given = user_set(settings)
    assert given["volume_size_gib"] == 500 and given["target_capacity"] == 2
    assert "volume_iops" not in given and "instance_types" not in given and "monitoring" not in given
