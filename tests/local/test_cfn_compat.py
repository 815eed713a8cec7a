"""spot_training.local.cfn_compat against a real moto server over HTTP (the session server of tests/conftest.py).

Each test deploys a small CloudFormation template with boto3 ``create_stack`` and checks with boto3
what exists, then deletes the stack and checks what is gone.
"""

from __future__ import annotations

import json

import boto3
import pytest
from botocore.config import Config

from spot_training.local.cfn_compat import deletion_order, references

REGION = "us-east-1"
IMAGE_ID = "ami-0123456789abcdef0"  # moto does not validate AMI ids


def _client(server, service: str):
    return boto3.client(
        service, region_name=REGION, endpoint_url=server.endpoint_url, aws_access_key_id="testing",
        aws_secret_access_key="testing", config=Config(retries={"mode": "standard"}),
    )


def _role(name: str, service: str) -> dict:
    return {
        "Type": "AWS::IAM::Role",
        "Properties": {
            "RoleName": name,
            "AssumeRolePolicyDocument": {
                "Version": "2012-10-17",
                "Statement": [{"Effect": "Allow", "Principal": {"Service": service}, "Action": "sts:AssumeRole"}],
            },
        },
    }


def _fleet_template() -> dict:
    return {
        "Resources": {
            "Vpc": {"Type": "AWS::EC2::VPC", "Properties": {"CidrBlock": "10.30.0.0/16"}},
            "SubnetB": {"Type": "AWS::EC2::Subnet", "Properties": {
                "VpcId": {"Ref": "Vpc"}, "CidrBlock": "10.30.1.0/24", "AvailabilityZone": "us-east-1b"}},
            "RouteTable": {"Type": "AWS::EC2::RouteTable", "Properties": {"VpcId": {"Ref": "Vpc"}}},
            "Association": {"Type": "AWS::EC2::SubnetRouteTableAssociation", "Properties": {
                "RouteTableId": {"Ref": "RouteTable"}, "SubnetId": {"Ref": "SubnetB"}}},
            "Gateway": {"Type": "AWS::EC2::InternetGateway", "Properties": {}},
            "GatewayAttachment": {"Type": "AWS::EC2::VPCGatewayAttachment", "Properties": {
                "VpcId": {"Ref": "Vpc"}, "InternetGatewayId": {"Ref": "Gateway"}}},
            "DefaultRoute": {"Type": "AWS::EC2::Route", "DependsOn": ["GatewayAttachment"], "Properties": {
                "RouteTableId": {"Ref": "RouteTable"}, "DestinationCidrBlock": "0.0.0.0/0",
                "GatewayId": {"Ref": "Gateway"}}},
            "LaunchTemplate": {"Type": "AWS::EC2::LaunchTemplate", "Properties": {"LaunchTemplateData": {
                "ImageId": IMAGE_ID, "InstanceType": "g5.xlarge",
                "MetadataOptions": {"HttpTokens": "required", "HttpEndpoint": "enabled"},
                "UserData": {"Fn::Base64": "#!/bin/bash\necho hello\n"}}}},
            "FleetRole": _role("cfn-compat-fleet-role", "spotfleet.amazonaws.com"),
            "Fleet": {"Type": "AWS::EC2::SpotFleet", "Properties": {"SpotFleetRequestConfigData": {
                "IamFleetRole": {"Fn::GetAtt": ["FleetRole", "Arn"]},
                "TargetCapacity": 1,
                "AllocationStrategy": "priceCapacityOptimized",
                "Type": "maintain",
                "LaunchTemplateConfigs": [{
                    "LaunchTemplateSpecification": {
                        "LaunchTemplateId": {"Ref": "LaunchTemplate"},
                        "Version": {"Fn::GetAtt": ["LaunchTemplate", "LatestVersionNumber"]}},
                    "Overrides": [{"SubnetId": {"Ref": "SubnetB"}, "InstanceType": "g5.xlarge"}]}],
                "TagSpecifications": [{"ResourceType": "spot-fleet-request",
                                       "Tags": [{"Key": "spot-training:stack", "Value": "CfnCompatFleet"}]}]}}},
        }
    }


def test_spot_fleet_from_launch_template_configs_launches_and_stack_delete_cancels_it(moto_server):
    cloudformation, ec2 = _client(moto_server, "cloudformation"), _client(moto_server, "ec2")
    cloudformation.create_stack(StackName="CfnCompatFleet", TemplateBody=json.dumps(_fleet_template()))
    resources = {r["LogicalResourceId"]: r["PhysicalResourceId"]
                 for r in cloudformation.describe_stack_resources(StackName="CfnCompatFleet")["StackResources"]}
    fleet_id = resources["Fleet"]
    assert fleet_id.startswith("sfr-")
    [config] = ec2.describe_spot_fleet_requests(SpotFleetRequestIds=[fleet_id])["SpotFleetRequestConfigs"]
    assert {"Key": "spot-training:stack", "Value": "CfnCompatFleet"} in config["Tags"]
    [active] = ec2.describe_spot_fleet_instances(SpotFleetRequestId=fleet_id)["ActiveInstances"]
    [reservation] = ec2.describe_instances(InstanceIds=[active["InstanceId"]])["Reservations"]
    instance = reservation["Instances"][0]
    assert instance["SubnetId"] == resources["SubnetB"]
    assert instance["Placement"]["AvailabilityZone"] == "us-east-1b"
    assert instance["InstanceType"] == "g5.xlarge"

    cloudformation.delete_stack(StackName="CfnCompatFleet")

    [stack] = [s for s in cloudformation.list_stacks()["StackSummaries"] if s["StackName"] == "CfnCompatFleet"]
    assert stack["StackStatus"] == "DELETE_COMPLETE"
    assert ec2.describe_spot_fleet_requests()["SpotFleetRequestConfigs"] == []
    [reservation] = ec2.describe_instances(InstanceIds=[active["InstanceId"]])["Reservations"]
    assert reservation["Instances"][0]["State"]["Name"] == "terminated"
    vpcs = ec2.describe_vpcs(Filters=[{"Name": "vpc-id", "Values": [resources["Vpc"]]}])["Vpcs"]
    assert vpcs == []
    assert ec2.describe_route_tables(Filters=[{"Name": "route-table-id", "Values": [resources["RouteTable"]]}])["RouteTables"] == []
    assert ec2.describe_internet_gateways(Filters=[{"Name": "internet-gateway-id", "Values": [resources["Gateway"]]}])["InternetGateways"] == []


# The handler makes a tagged volume on Create (its id becomes the physical id) and deletes it on
# Delete: it proves the handler runs on both events and talks to this moto server over HTTP.
HANDLER = '''
import boto3
def handler(event, context):
    ec2 = boto3.client("ec2")
    props = event["ResourceProperties"]
    if event["RequestType"] == "Create":
        volume = ec2.create_volume(AvailabilityZone="us-east-1a", Size=1, TagSpecifications=[
            {"ResourceType": "volume", "Tags": [{"Key": "made-by", "Value": props["Marker"]}]}])
        return {"PhysicalResourceId": volume["VolumeId"], "Data": {"Marker": props["Marker"]}}
    if event["RequestType"] == "Delete":
        ec2.delete_volume(VolumeId=event["PhysicalResourceId"])
    return {"PhysicalResourceId": event["PhysicalResourceId"]}
'''


def _custom_resource_template() -> dict:
    return {
        "Resources": {
            "HandlerRole": _role("cfn-compat-handler-role", "lambda.amazonaws.com"),
            "Handler": {"Type": "AWS::Lambda::Function", "Properties": {
                "Runtime": "python3.12", "Handler": "index.handler", "Timeout": 60,
                "Role": {"Fn::GetAtt": ["HandlerRole", "Arn"]}, "Code": {"ZipFile": HANDLER}}},
            # A stand-in for aws_cdk.custom_resources.Provider's Node.js framework function.
            "Framework": {"Type": "AWS::Lambda::Function", "Properties": {
                "Runtime": "nodejs20.x", "Handler": "framework.onEvent", "Timeout": 60,
                "Role": {"Fn::GetAtt": ["HandlerRole", "Arn"]}, "Code": {"ZipFile": "exports.onEvent = 1;"},
                "Environment": {"Variables": {"USER_ON_EVENT_FUNCTION_ARN": {"Fn::GetAtt": ["Handler", "Arn"]}}}}},
            "Direct": {"Type": "Custom::Direct", "Properties": {
                "ServiceToken": {"Fn::GetAtt": ["Handler", "Arn"]}, "Marker": "direct"}},
            "ViaProvider": {"Type": "Custom::ViaProvider", "Properties": {
                "ServiceToken": {"Fn::GetAtt": ["Framework", "Arn"]}, "Marker": "provider"}},
        }
    }


def test_custom_resources_run_their_python_handler_on_create_and_delete(moto_server):
    cloudformation, ec2 = _client(moto_server, "cloudformation"), _client(moto_server, "ec2")
    cloudformation.create_stack(StackName="CfnCompatCustom", TemplateBody=json.dumps(_custom_resource_template()))
    resources = {r["LogicalResourceId"]: r["PhysicalResourceId"]
                 for r in cloudformation.describe_stack_resources(StackName="CfnCompatCustom")["StackResources"]}
    made = {
        tag["Value"]: volume["VolumeId"]
        for volume in ec2.describe_volumes(Filters=[{"Name": "tag-key", "Values": ["made-by"]}])["Volumes"]
        for tag in volume["Tags"] if tag["Key"] == "made-by"
    }
    assert set(made) == {"direct", "provider"}
    assert resources["Direct"] == made["direct"]
    assert resources["ViaProvider"] == made["provider"]

    cloudformation.delete_stack(StackName="CfnCompatCustom")

    assert ec2.describe_volumes(Filters=[{"Name": "tag-key", "Values": ["made-by"]}])["Volumes"] == []
    [stack] = [s for s in cloudformation.list_stacks()["StackSummaries"] if s["StackName"] == "CfnCompatCustom"]
    assert stack["StackStatus"] == "DELETE_COMPLETE"


def test_deletion_order_deletes_dependents_first():
    resources = {
        "Cleanup": {"Type": "Custom::X", "Properties": {"ServiceToken": {"Fn::GetAtt": ["Fn", "Arn"]}}},
        "Fn": {"Type": "AWS::Lambda::Function", "Properties": {"Role": {"Fn::GetAtt": "Role.Arn"}}},
        "Role": {"Type": "AWS::IAM::Role", "Properties": {}},
        "Fleet": {"Type": "AWS::EC2::SpotFleet", "DependsOn": "Cleanup",
                  "Properties": {"X": {"Fn::Sub": "${Template}-${Role.Arn}"}}},
        "Template": {"Type": "AWS::EC2::LaunchTemplate", "Properties": {}},
    }
    order = deletion_order(resources)
    assert sorted(order) == sorted(resources)
    position = {name: i for i, name in enumerate(order)}
    assert position["Fleet"] < position["Cleanup"] < position["Fn"] < position["Role"]
    assert position["Fleet"] < position["Template"]


def test_references_reads_ref_getatt_and_sub():
    names = {"A", "B", "C", "D"}
    fragment = {"x": [{"Ref": "A"}, {"Fn::GetAtt": "B.Arn"}], "y": {"Fn::Sub": ["${C}-${AWS::Region}-${v}", {"v": {"Ref": "D"}}]},
                "z": {"Ref": "AWS::StackName"}}
    assert references(fragment, names) == {"A", "B", "C", "D"}


@pytest.mark.parametrize("endpoint", ["http://10.0.0.5:5000", "https://127.0.0.1:5000", "127.0.0.1:5000"])
def test_fails_when_endpoint_is_not_loopback_http(endpoint, tmp_path):
    from spot_training.local import cfn_compat

    with pytest.raises(ValueError, match="endpoint_url must be http://127.0.0.1:PORT"):
        cfn_compat.apply(endpoint_url=endpoint, work_dir=tmp_path)


def test_cancel_with_terminate_stops_replacements_launched_for_the_fleet(moto_server):
    """After an interruption the fleet's own instance is gone and local mode launched a replacement
    tagged with the fleet id: cancelling must terminate it and must not fail on the empty fleet."""
    cloudformation, ec2 = _client(moto_server, "cloudformation"), _client(moto_server, "ec2")
    cloudformation.create_stack(StackName="CfnCompatCancel", TemplateBody=json.dumps(_fleet_template()))
    resources = {r["LogicalResourceId"]: r["PhysicalResourceId"]
                 for r in cloudformation.describe_stack_resources(StackName="CfnCompatCancel")["StackResources"]}
    fleet_id = resources["Fleet"]
    [active] = ec2.describe_spot_fleet_instances(SpotFleetRequestId=fleet_id)["ActiveInstances"]
    ec2.terminate_instances(InstanceIds=[active["InstanceId"]])
    replacement = ec2.run_instances(
        LaunchTemplate={"LaunchTemplateId": resources["LaunchTemplate"], "Version": "$Latest"},
        SubnetId=resources["SubnetB"], MinCount=1, MaxCount=1,
        TagSpecifications=[{"ResourceType": "instance", "Tags": [{"Key": "aws:ec2spot:fleet-request-id", "Value": fleet_id}]}],
    )["Instances"][0]["InstanceId"]

    answer = ec2.cancel_spot_fleet_requests(SpotFleetRequestIds=[fleet_id], TerminateInstances=True)

    assert [c["SpotFleetRequestId"] for c in answer["SuccessfulFleetRequests"]] == [fleet_id]
    [reservation] = ec2.describe_instances(InstanceIds=[replacement])["Reservations"]
    assert reservation["Instances"][0]["State"]["Name"] == "terminated"
    assert ec2.describe_spot_fleet_requests()["SpotFleetRequestConfigs"] == []
    cloudformation.delete_stack(StackName="CfnCompatCancel")
    [stack] = [s for s in cloudformation.list_stacks()["StackSummaries"] if s["StackName"] == "CfnCompatCancel"]
    assert stack["StackStatus"] == "DELETE_COMPLETE"


def test_a_second_cancel_of_the_same_fleet_succeeds_and_changes_nothing(moto_server):
    """Two cluster workers that finish together both cancel their fleet (spot_training.agent.cleanup.cancel_own_fleet
    reads the state, then cancels): the later call must not answer HTTP 500 (it did: KeyError in the bridge)."""
    cloudformation, ec2 = _client(moto_server, "cloudformation"), _client(moto_server, "ec2")
    cloudformation.create_stack(StackName="CfnCompatCancelTwice", TemplateBody=json.dumps(_fleet_template()))
    fleet_id = {r["LogicalResourceId"]: r["PhysicalResourceId"] for r in
                cloudformation.describe_stack_resources(StackName="CfnCompatCancelTwice")["StackResources"]}["Fleet"]
    [active] = ec2.describe_spot_fleet_instances(SpotFleetRequestId=fleet_id)["ActiveInstances"]

    first = ec2.cancel_spot_fleet_requests(SpotFleetRequestIds=[fleet_id], TerminateInstances=True)
    second = ec2.cancel_spot_fleet_requests(SpotFleetRequestIds=[fleet_id], TerminateInstances=True)

    assert [c["SpotFleetRequestId"] for c in first["SuccessfulFleetRequests"]] == [fleet_id]
    assert second["ResponseMetadata"]["HTTPStatusCode"] == 200
    assert second.get("SuccessfulFleetRequests", []) == []
    [reservation] = ec2.describe_instances(InstanceIds=[active["InstanceId"]])["Reservations"]
    assert reservation["Instances"][0]["State"]["Name"] == "terminated"
    cloudformation.delete_stack(StackName="CfnCompatCancelTwice")


def test_efs_refs_and_attributes_resolve_and_the_file_system_is_deleted_with_the_stack(moto_server):
    """Bridge 6: Ref of an access point is its fsap- id and Fn::GetAtt of a file system gives its ARN
    (moto 5.2.5 gave the object's repr and HTTP 500); DeletionPolicy Delete removes them with the stack."""
    cloudformation, efs = _client(moto_server, "cloudformation"), _client(moto_server, "efs")
    template = {"Resources": {
        "FileSystem": {"Type": "AWS::EFS::FileSystem", "DeletionPolicy": "Delete", "Properties": {"Encrypted": True}},
        "AccessPoint": {"Type": "AWS::EFS::AccessPoint", "Properties": {"FileSystemId": {"Ref": "FileSystem"}}},
        # Carries both values where describe_stack_resources and we can read them back.
        "Marker": {"Type": "AWS::SSM::Parameter", "Properties": {
            "Type": "String", "Name": "/cfn-compat/efs",
            "Value": {"Fn::Join": [" ", [{"Ref": "AccessPoint"}, {"Fn::GetAtt": ["FileSystem", "Arn"]}]]}}},
    }}
    cloudformation.create_stack(StackName="CfnCompatEfs", TemplateBody=json.dumps(template))
    resources = {r["LogicalResourceId"]: r.get("PhysicalResourceId")
                 for r in cloudformation.describe_stack_resources(StackName="CfnCompatEfs")["StackResources"]}
    fs_id, ap_id = resources["FileSystem"], resources["AccessPoint"]
    assert fs_id.startswith("fs-") and ap_id.startswith("fsap-")
    value = _client(moto_server, "ssm").get_parameter(Name="/cfn-compat/efs")["Parameter"]["Value"]
    assert value == f"{ap_id} arn:aws:elasticfilesystem:{REGION}:123456789012:file-system/{fs_id}"

    cloudformation.delete_stack(StackName="CfnCompatEfs")

    assert [fs for fs in efs.describe_file_systems()["FileSystems"] if fs["FileSystemId"] == fs_id] == []


def test_update_and_delete_after_the_agent_cancelled_the_fleet_on_completion_succeed(moto_server):
    """The agent cancels its own fleet when training completes (spot_training.agent.cleanup.cancel_own_fleet, with
    TerminateInstances). A later stack update (here: new user data, a new launch template version the
    fleet's Version follows) and the stack's deletion must still complete and leave nothing behind.
    moto keeps the cancelled fleet's physical id on that update instead of replacing the fleet as
    CloudFormation does (docs/infra.md, "Stack updates"); what moto can show is that neither the update
    nor the delete fails on the cancelled request."""
    cloudformation, ec2 = _client(moto_server, "cloudformation"), _client(moto_server, "ec2")
    template = _fleet_template()
    cloudformation.create_stack(StackName="CfnCompatDone", TemplateBody=json.dumps(template))
    resources = {r["LogicalResourceId"]: r["PhysicalResourceId"]
                 for r in cloudformation.describe_stack_resources(StackName="CfnCompatDone")["StackResources"]}
    [active] = ec2.describe_spot_fleet_instances(SpotFleetRequestId=resources["Fleet"])["ActiveInstances"]
    answer = ec2.cancel_spot_fleet_requests(SpotFleetRequestIds=[resources["Fleet"]], TerminateInstances=True)
    assert [c["SpotFleetRequestId"] for c in answer["SuccessfulFleetRequests"]] == [resources["Fleet"]]

    template["Resources"]["LaunchTemplate"]["Properties"]["LaunchTemplateData"]["UserData"] = {
        "Fn::Base64": "#!/bin/bash\necho changed user data\n"}
    cloudformation.update_stack(StackName="CfnCompatDone", TemplateBody=json.dumps(template))
    [stack] = cloudformation.describe_stacks(StackName="CfnCompatDone")["Stacks"]
    assert stack["StackStatus"] == "UPDATE_COMPLETE"
    [lt] = ec2.describe_launch_templates(LaunchTemplateIds=[resources["LaunchTemplate"]])["LaunchTemplates"]
    assert lt["LatestVersionNumber"] == 2

    cloudformation.delete_stack(StackName="CfnCompatDone")
    [summary] = [s for s in cloudformation.list_stacks()["StackSummaries"] if s["StackName"] == "CfnCompatDone"]
    assert summary["StackStatus"] == "DELETE_COMPLETE"
    assert ec2.describe_spot_fleet_requests()["SpotFleetRequestConfigs"] == []
    states = {i["InstanceId"]: i["State"]["Name"] for r in ec2.describe_instances()["Reservations"] for i in r["Instances"]}
    assert states[active["InstanceId"]] == "terminated" and set(states.values()) == {"terminated"}
