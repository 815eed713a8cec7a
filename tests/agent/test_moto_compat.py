"""spot_training.local.moto_compat's bridges, observed over HTTP through a real moto server process."""

from __future__ import annotations

import json

import boto3
import pytest
from botocore.exceptions import ClientError

from spot_training.local.moto_compat import FLEET_TAG, snapshot_dir, volume_dir

IMAGE_ID = "ami-0123456789abcdef0"  # moto does not validate AMI ids


def _image(ec2) -> str:
    return IMAGE_ID


def _instance(ec2, az: str) -> str:
    return ec2.run_instances(ImageId=_image(ec2), MinCount=1, MaxCount=1, InstanceType="t3.micro",
                             Placement={"AvailabilityZone": az})["Instances"][0]["InstanceId"]


def _client(moto_server, service: str, region: str = "us-east-1"):
    return boto3.client(service, region_name=region, endpoint_url=moto_server.endpoint_url)


def test_snapshot_and_restore_copy_the_volume_bytes(ec2, moto_server):
    volume_id = ec2.create_volume(AvailabilityZone="us-east-1a", Size=10)["VolumeId"]
    data = volume_dir(moto_server.ebs_dir, volume_id)
    assert data.is_dir()
    (data / "checkpoints").mkdir()
    (data / "checkpoints" / "step-7.ckpt").write_bytes(b"weights")

    snapshot_id = ec2.create_snapshot(VolumeId=volume_id)["SnapshotId"]
    assert (snapshot_dir(moto_server.ebs_dir, snapshot_id) / "checkpoints" / "step-7.ckpt").read_bytes() == b"weights"

    copy_id = ec2.create_volume(AvailabilityZone="us-east-1b", SnapshotId=snapshot_id)["VolumeId"]
    assert (volume_dir(moto_server.ebs_dir, copy_id) / "checkpoints" / "step-7.ckpt").read_bytes() == b"weights"

    # Writes to the copy do not reach the source (separate bytes, as on EBS).
    (volume_dir(moto_server.ebs_dir, copy_id) / "new").write_text("x")
    assert not (data / "new").exists()

    ec2.delete_snapshot(SnapshotId=snapshot_id)
    ec2.delete_volume(VolumeId=volume_id)
    assert not snapshot_dir(moto_server.ebs_dir, snapshot_id).exists()
    assert not data.exists()
    assert volume_dir(moto_server.ebs_dir, copy_id).is_dir()


def test_rejected_delete_keeps_the_bytes(ec2, moto_server):
    instance_id = _instance(ec2, "us-east-1a")
    volume_id = ec2.create_volume(AvailabilityZone="us-east-1a", Size=10)["VolumeId"]
    ec2.attach_volume(VolumeId=volume_id, InstanceId=instance_id, Device="/dev/sdf")
    (volume_dir(moto_server.ebs_dir, volume_id) / "keep").write_text("data")
    with pytest.raises(ClientError, match="VolumeInUse"):
        ec2.delete_volume(VolumeId=volume_id)
    assert (volume_dir(moto_server.ebs_dir, volume_id) / "keep").read_text() == "data"


def test_volume_keeps_type_iops_throughput_encryption_and_kms_key(ec2):
    key_id = "arn:aws:kms:us-east-1:123456789012:key/11111111-2222-3333-4444-555555555555"
    volume_id = ec2.create_volume(AvailabilityZone="us-east-1a", Size=50, VolumeType="gp3", Iops=4000,
                                  Throughput=250, Encrypted=True, KmsKeyId=key_id)["VolumeId"]
    volume = ec2.describe_volumes(VolumeIds=[volume_id])["Volumes"][0]
    assert (volume["VolumeType"], volume["Iops"], volume["Throughput"], volume["Encrypted"], volume["KmsKeyId"]) == (
        "gp3", 4000, 250, True, key_id)


def test_attach_is_an_arbiter_already_attached_volume_is_refused(ec2):
    first, second = _instance(ec2, "us-east-1a"), _instance(ec2, "us-east-1a")
    volume_id = ec2.create_volume(AvailabilityZone="us-east-1a", Size=10)["VolumeId"]
    ec2.attach_volume(VolumeId=volume_id, InstanceId=first, Device="/dev/sdf")
    with pytest.raises(ClientError) as error:
        ec2.attach_volume(VolumeId=volume_id, InstanceId=second, Device="/dev/sdf")
    assert error.value.response["Error"]["Code"] == "VolumeInUse"
    attachments = ec2.describe_volumes(VolumeIds=[volume_id])["Volumes"][0]["Attachments"]
    assert [a["InstanceId"] for a in attachments] == [first]


def test_attach_across_zones_is_refused(ec2):
    instance_id = _instance(ec2, "us-east-1b")
    volume_id = ec2.create_volume(AvailabilityZone="us-east-1a", Size=10)["VolumeId"]
    with pytest.raises(ClientError) as error:
        ec2.attach_volume(VolumeId=volume_id, InstanceId=instance_id, Device="/dev/sdf")
    assert error.value.response["Error"]["Code"] == "InvalidVolume.ZoneMismatch"
    assert ec2.describe_volumes(VolumeIds=[volume_id])["Volumes"][0]["State"] == "available"


def test_detach_without_instance_id(ec2):
    instance_id = _instance(ec2, "us-east-1a")
    volume_id = ec2.create_volume(AvailabilityZone="us-east-1a", Size=10)["VolumeId"]
    ec2.attach_volume(VolumeId=volume_id, InstanceId=instance_id, Device="/dev/sdf")
    ec2.detach_volume(VolumeId=volume_id)
    assert ec2.describe_volumes(VolumeIds=[volume_id])["Volumes"][0]["State"] == "available"


def test_spot_fleet_instances_carry_the_fleet_request_id_tag(ec2):
    fleet_id = ec2.request_spot_fleet(SpotFleetRequestConfig={
        "TargetCapacity": 1, "IamFleetRole": "arn:aws:iam::123456789012:role/fleet",
        "AllocationStrategy": "lowestPrice",
        "LaunchSpecifications": [{"ImageId": _image(ec2), "InstanceType": "t3.micro"}],
    })["SpotFleetRequestId"]
    instance_ids = [i["InstanceId"] for i in ec2.describe_spot_fleet_instances(SpotFleetRequestId=fleet_id)["ActiveInstances"]]
    assert len(instance_ids) == 1
    tags = ec2.describe_instances(InstanceIds=instance_ids)["Reservations"][0]["Instances"][0]["Tags"]
    assert {"Key": FLEET_TAG, "Value": fleet_id} in tags


def test_cloudformation_volume_spot_fleet_from_launch_template_and_get_azs(moto_server):
    region = "eu-west-1"
    ec2 = _client(moto_server, "ec2", region)
    image_id = _image(ec2)
    template = {
        "Resources": {
            "Data": {"Type": "AWS::EC2::Volume", "Properties": {
                "AvailabilityZone": {"Fn::Select": [1, {"Fn::GetAZs": ""}]},
                "Size": 20, "VolumeType": "gp3", "Iops": 3000, "Throughput": 200, "Encrypted": True,
                "Tags": [{"Key": "spot-training:stack", "Value": "Compat"},
                         {"Key": "spot-training:purpose", "Value": "data-volume"}]}},
            "Template": {"Type": "AWS::EC2::LaunchTemplate", "Properties": {
                "LaunchTemplateName": "compat-lt",
                "LaunchTemplateData": {"ImageId": image_id, "InstanceType": "t3.micro",
                                       "MetadataOptions": {"HttpTokens": "required"}}}},
            "Fleet": {"Type": "AWS::EC2::SpotFleet", "Properties": {"SpotFleetRequestConfigData": {
                "TargetCapacity": 1, "IamFleetRole": "arn:aws:iam::123456789012:role/fleet",
                "AllocationStrategy": "priceCapacityOptimized", "Type": "maintain",
                "LaunchTemplateConfigs": [{"LaunchTemplateSpecification": {
                    "LaunchTemplateId": {"Ref": "Template"},
                    "Version": {"Fn::GetAtt": ["Template", "LatestVersionNumber"]}}}]}}},
        }
    }
    cfn = _client(moto_server, "cloudformation", region)
    cfn.create_stack(StackName="Compat", TemplateBody=json.dumps(template))
    volumes = ec2.describe_volumes(Filters=[{"Name": "tag:spot-training:stack", "Values": ["Compat"]}])["Volumes"]
    assert len(volumes) == 1
    volume = volumes[0]
    assert volume["AvailabilityZone"] == "eu-west-1b"
    assert (volume["VolumeType"], volume["Iops"], volume["Throughput"], volume["Encrypted"]) == ("gp3", 3000, 200, True)
    fleets = ec2.describe_spot_fleet_requests()["SpotFleetRequestConfigs"]
    assert len(fleets) == 1
    active = ec2.describe_spot_fleet_instances(SpotFleetRequestId=fleets[0]["SpotFleetRequestId"])["ActiveInstances"]
    assert len(active) == 1
