"""The constructs on their own, each in a fresh stack: props, validation errors, what they render."""

from __future__ import annotations

import aws_cdk as cdk
import cdk_nag
import pytest
from aws_cdk import assertions
from aws_cdk import aws_ec2 as ec2
from aws_cdk import aws_iam as iam

from spot_training.infra import AllocationStrategy, SharedFileSystem, SpotFleetRole, SpotTrainingFleet, TrainingNodeRole, TrainingVolume
from spot_training.infra.nag import apply_nag

Match = assertions.Match


def _fleet(stack: cdk.Stack, **overrides: object) -> SpotTrainingFleet:
    vpc = ec2.Vpc(stack, "Vpc", nat_gateways=0, subnet_configuration=[ec2.SubnetConfiguration(name="P", subnet_type=ec2.SubnetType.PUBLIC)])
    role = TrainingNodeRole(stack, "NodeRole")
    props: dict[str, object] = {
        "vpc": vpc,
        "machine_image": ec2.MachineImage.latest_amazon_linux2023(),
        "instance_profile": role.instance_profile,
    }
    props.update(overrides)
    return SpotTrainingFleet(stack, "Fleet", **props)  # type: ignore[arg-type]


# ---- TrainingVolume ----------------------------------------------------------------------------


def test_volume_defaults(stack: cdk.Stack) -> None:
    TrainingVolume(stack, "Data", availability_zone="us-east-1a")
    template = assertions.Template.from_stack(stack)
    template.has_resource(
        "AWS::EC2::Volume",
        {
            "DeletionPolicy": "Retain",
            "Properties": Match.object_like(
                {
                    "AvailabilityZone": "us-east-1a",
                    "Encrypted": True,
                    "VolumeType": "gp3",
                    "Size": 100,
                    "Iops": 3000,
                    "Throughput": 125,
                    "Tags": Match.array_with(
                        [{"Key": "spot-training:purpose", "Value": "data-volume"}, {"Key": "spot-training:stack", "Value": "TestStack"}]
                    ),
                }
            ),
        },
    )


def test_volume_with_kms_key_and_destroy(stack: cdk.Stack) -> None:
    from aws_cdk import aws_kms as kms

    key = kms.Key(stack, "Key", enable_key_rotation=True)
    TrainingVolume(stack, "Data", availability_zone="us-east-1a", size_gib=500, iops=6000, throughput_mibps=500,
                   encryption_key=key, removal_policy=cdk.RemovalPolicy.DESTROY, stack_tag_value="Other")
    template = assertions.Template.from_stack(stack)
    template.has_resource("AWS::EC2::Volume", {"DeletionPolicy": "Delete", "Properties": Match.object_like(
        {"KmsKeyId": Match.any_value(), "Size": 500, "Iops": 6000, "Throughput": 500,
         "Tags": Match.array_with([{"Key": "spot-training:stack", "Value": "Other"}])})})


@pytest.mark.parametrize(
    ("props", "message"),
    [
        ({"size_gib": 0}, r"size_gib must be an integer from 1 to 16384 \(GiB\), got 0"),
        ({"size_gib": 16385}, r"size_gib must be an integer from 1 to 16384 \(GiB\), got 16385"),
        ({"iops": 2000}, r"iops must be an integer from 3000 to 16000 \(IOPS\), got 2000"),
        ({"throughput_mibps": 2000}, r"throughput_mibps must be an integer from 125 to 1000 \(MiB/s\), got 2000"),
        ({"size_gib": 10, "iops": 6000}, r"iops must be at most 500 per GiB .* got iops=6000 with size_gib=10 \(max 5000\)"),
        ({"iops": 3000, "throughput_mibps": 1000}, r"throughput_mibps must be at most iops/4 .*\(max 750\)"),
    ],
)
def test_fails_when_volume_props_are_out_of_range(stack: cdk.Stack, props: dict[str, int], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        TrainingVolume(stack, "Data", availability_zone="us-east-1a", **props)


# ---- SpotTrainingFleet -------------------------------------------------------------------------


def test_fleet_with_custom_capacity_settings(stack: cdk.Stack) -> None:
    _fleet(stack, instance_types=["g5.2xlarge"], target_capacity=3, allocation_strategy=AllocationStrategy.DIVERSIFIED, max_price="1.25")
    template = assertions.Template.from_stack(stack)
    template.has_resource_properties(
        "AWS::EC2::SpotFleet",
        {"SpotFleetRequestConfigData": Match.object_like(
            {"AllocationStrategy": "diversified", "TargetCapacity": 3, "SpotPrice": "1.25", "Type": "maintain",
             "TagSpecifications": [{"ResourceType": "spot-fleet-request", "Tags": [{"Key": "spot-training:stack", "Value": "TestStack"}]}]})},
    )
    template.has_resource_properties("AWS::EC2::LaunchTemplate", {"LaunchTemplateData": Match.object_like(
        {"MetadataOptions": Match.object_like({"HttpTokens": "required"}), "KeyName": Match.absent()})})
    template.has_resource_properties("AWS::EC2::SecurityGroup", {"SecurityGroupIngress": Match.absent()})


@pytest.mark.parametrize(
    ("props", "message"),
    [
        ({"instance_types": []}, r"instance_types must be a non-empty list of EC2 instance types .* got \[\]"),
        ({"instance_types": "g5.xlarge"}, r"instance_types must be a non-empty list .* got 'g5.xlarge'"),
        ({"instance_types": ["g5.xlarge", "bad type"]}, r"instance_types: 'bad type' is not an EC2 instance type; allowed: FAMILY.SIZE"),
        ({"instance_types": ["g5.xlarge", "g5.xlarge"]}, r"instance_types must not repeat a type"),
        ({"target_capacity": -1}, r"target_capacity must be an integer >= 0 \(instances\), got -1"),
        ({"target_capacity": True}, r"target_capacity must be an integer >= 0 \(instances\), got True"),
        ({"allocation_strategy": "lowestPrice"}, r"allocation_strategy must be an AllocationStrategy .*got 'lowestPrice'"),
        ({"max_price": "free"}, r"max_price must be a positive decimal string .* got 'free'"),
        ({"root_volume_size_gib": 4}, r"root_volume_size_gib must be an integer from 8 to 16384 \(GiB\), got 4"),
    ],
)
def test_fails_when_fleet_props_are_bad(stack: cdk.Stack, props: dict[str, object], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        _fleet(stack, **props)


# ---- roles ---------------------------------------------------------------------------------------


def test_node_role_statements_are_tag_scoped(stack: cdk.Stack) -> None:
    TrainingNodeRole(stack, "NodeRole", stack_tag_value="Mine")
    template = assertions.Template.from_stack(stack)
    template.has_resource_properties(
        "AWS::IAM::Policy",
        {"PolicyDocument": Match.object_like({"Statement": Match.array_with([Match.object_like(
            {"Action": "ec2:CancelSpotFleetRequests",
             "Condition": {"StringEquals": {"aws:ResourceTag/spot-training:stack": "Mine"}}})])})},
    )
    template.resource_count_is("AWS::IAM::InstanceProfile", 1)


def test_fails_when_stack_tag_value_is_empty(stack: cdk.Stack) -> None:
    with pytest.raises(ValueError, match=r"stack_tag_value must be a non-empty string .* got ''"):
        TrainingNodeRole(stack, "NodeRole", stack_tag_value="")


def test_spot_fleet_role(stack: cdk.Stack) -> None:
    SpotFleetRole(stack, "FleetRole")
    template = assertions.Template.from_stack(stack)
    template.has_resource_properties("AWS::IAM::Role", {
        "AssumeRolePolicyDocument": Match.object_like({"Statement": [Match.object_like({"Principal": {"Service": "spotfleet.amazonaws.com"}})]}),
        "ManagedPolicyArns": [{"Fn::Join": ["", ["arn:", {"Ref": "AWS::Partition"}, ":iam::aws:policy/service-role/AmazonEC2SpotFleetTaggingRole"]]}],
    })


# ---- SharedFileSystem ----------------------------------------------------------------------------


def test_file_system_opens_nfs_only_to_what_is_allowed(stack: cdk.Stack) -> None:
    fleet = _fleet(stack)
    fs = SharedFileSystem(stack, "Shared", vpc=stack.node.find_child("Vpc"))  # type: ignore[arg-type]
    fs.allow_from(fleet.connections)
    fs.grant_read_write(iam.Role(stack, "Reader", assumed_by=iam.ServicePrincipal("ec2.amazonaws.com")))
    template = assertions.Template.from_stack(stack)
    template.has_resource("AWS::EFS::FileSystem", {"DeletionPolicy": "Retain", "Properties": Match.object_like(
        {"Encrypted": True, "ThroughputMode": "elastic", "BackupPolicy": {"Status": "ENABLED"}})})
    template.has_resource_properties("AWS::EFS::AccessPoint", Match.object_like(
        {"RootDirectory": {"CreationInfo": {"OwnerUid": "1000", "OwnerGid": "1000", "Permissions": "750"}, "Path": "/spot-training"}}))
    template.resource_count_is("AWS::EC2::SecurityGroupIngress", 1)
    template.has_resource_properties("AWS::EC2::SecurityGroupIngress", {
        "FromPort": 2049, "ToPort": 2049, "IpProtocol": "tcp",
        "SourceSecurityGroupId": {"Fn::GetAtt": [Match.string_like_regexp("^FleetSecurityGroup"), "GroupId"]}})


@pytest.mark.parametrize(("props", "message"), [
    ({"access_point_path": "data"}, r"access_point_path must be an absolute directory below / .* got 'data'"),
    ({"posix_uid": -1}, r"posix_uid must be an integer >= 0, got -1"),
])
def test_fails_when_file_system_props_are_bad(stack: cdk.Stack, props: dict[str, object], message: str) -> None:
    vpc = ec2.Vpc(stack, "Vpc", nat_gateways=0)
    with pytest.raises(ValueError, match=message):
        SharedFileSystem(stack, "Shared", vpc=vpc, **props)  # type: ignore[arg-type]


# ---- the nag gate can fail ------------------------------------------------------------------------


def test_nag_flags_an_unacknowledged_wildcard() -> None:
    """Proves the zero-findings gate detects findings: a wildcard outside our acknowledged constructs."""
    app = cdk.App()
    stack = cdk.Stack(app, "Nagged")
    role = iam.Role(stack, "Loose", assumed_by=iam.ServicePrincipal("ec2.amazonaws.com"))
    role.add_to_policy(iam.PolicyStatement(actions=["ec2:DeleteVolume"], resources=["*"]))
    TrainingNodeRole(stack, "NodeRole")  # acknowledged: must not appear
    apply_nag(app)
    errors = assertions.Annotations.from_stack(stack).find_error("*", Match.string_like_regexp("AwsSolutions-IAM5"))
    paths = {e.id for e in errors}
    assert paths == {"/Nagged/Loose/DefaultPolicy/Resource"}, paths
    assert isinstance(cdk_nag.AwsSolutionsChecks(), cdk_nag.NagPack)
