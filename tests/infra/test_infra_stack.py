"""The synthesized SpotTraining stack: gates (cfn-lint, cdk-nag, security assertions) and wiring."""

from __future__ import annotations

import json
import zipfile
from pathlib import Path
from typing import Any

from aws_cdk import assertions
from infra_helpers import (Synth, as_list, assert_resource_star_only_where_no_resource_level_permissions, cfn_lint_errors,
                           render_intrinsics)

from spot_training.infra.tags import DEPLOYMENT_TAG_KEY, STACK_TAG_KEY
from spot_training.infra.userdata import extract_config

Match = assertions.Match
#: Logical ids of the stateful resources: a change here replaces the resource and loses its data.
PINNED_VOLUME_ID = "DataVolumeE23556DE"
PINNED_FILE_SYSTEM_ID = "SharedFileSystem442D9C2E"
READ_ONLY_PREFIXES = ("Describe", "Get", "List")


# ---- gates -------------------------------------------------------------------------------------


def test_cfn_lint_reports_no_errors(default_synth: Synth, efs_synth: Synth, pinned_synth: Synth) -> None:
    for synth in (default_synth, efs_synth, pinned_synth):
        assert cfn_lint_errors(synth.template_file) == [], synth.template_file


def test_cdk_nag_reports_no_unacknowledged_findings(default_synth: Synth, efs_synth: Synth, pinned_synth: Synth) -> None:
    for synth in (default_synth, efs_synth, pinned_synth):
        assert synth.nag_errors == []


def test_no_ingress_from_anywhere(default_synth: Synth, efs_synth: Synth) -> None:
    for synth in (default_synth, efs_synth):
        for sg in synth.resources("AWS::EC2::SecurityGroup").values():
            for rule in sg["Properties"].get("SecurityGroupIngress", []):
                assert rule.get("CidrIp") != "0.0.0.0/0" and rule.get("CidrIpv6") != "::/0", rule
        for rule in synth.resources("AWS::EC2::SecurityGroupIngress").values():
            assert rule["Properties"].get("CidrIp") != "0.0.0.0/0" and rule["Properties"].get("CidrIpv6") != "::/0"


def test_fleet_security_group_has_no_ingress(default_synth: Synth) -> None:
    groups = default_synth.resources("AWS::EC2::SecurityGroup")
    fleet_sg = next(v for k, v in groups.items() if k.startswith("FleetSecurityGroup"))
    assert "SecurityGroupIngress" not in fleet_sg["Properties"]
    assert default_synth.resources("AWS::EC2::SecurityGroupIngress") == {}


def _policy_statements(synth: Synth, logical_prefix: str) -> list[dict[str, Any]]:
    statements = []
    for logical_id, policy in synth.resources("AWS::IAM::Policy").items():
        if logical_id.startswith(logical_prefix):
            statements += policy["Properties"]["PolicyDocument"]["Statement"]
    assert statements, f"no IAM policy starting with {logical_prefix}"
    return statements


_as_list = as_list


def test_every_mutating_ec2_action_is_conditioned_on_the_stack_tag(default_synth: Synth) -> None:
    tag_keys = {f"aws:ResourceTag/{STACK_TAG_KEY}", f"aws:RequestTag/{STACK_TAG_KEY}"}
    checked = set()
    for synth_policy in ("NodeRole", "DataCleanupHandler"):
        for st in _policy_statements(default_synth, synth_policy):
            mutating = [a for a in _as_list(st["Action"]) if a.startswith("ec2:") and not a.split(":")[1].startswith(READ_ONLY_PREFIXES)]
            if not mutating:
                continue
            conditions = st.get("Condition", {}).get("StringEquals", {})
            assert tag_keys & set(conditions), f"unconditioned mutating EC2 statement: {st}"
            assert all(conditions[k] == "SpotTraining" for k in tag_keys & set(conditions))
            assert "*" not in _as_list(st["Resource"]), st
            checked.update(mutating)
    # The agent's whole mutating surface was seen (so the loop above cannot pass vacuously).
    assert checked >= {
        "ec2:CreateVolume", "ec2:CreateSnapshot", "ec2:AttachVolume", "ec2:DetachVolume", "ec2:DeleteVolume",
        "ec2:DeleteSnapshot", "ec2:CreateTags", "ec2:DeleteTags", "ec2:CancelSpotFleetRequests",
    }


def test_only_describe_statements_and_namespaced_metrics_use_resource_star(default_synth: Synth) -> None:
    for prefix in ("NodeRole", "DataCleanupHandler"):
        assert_resource_star_only_where_no_resource_level_permissions(_policy_statements(default_synth, prefix))


def test_cancel_is_scoped_to_this_stacks_fleet_request(default_synth: Synth) -> None:
    cancel = [s for s in _policy_statements(default_synth, "NodeRole") if "ec2:CancelSpotFleetRequests" in _as_list(s["Action"])]
    assert len(cancel) == 1
    assert cancel[0]["Condition"] == {"StringEquals": {f"aws:ResourceTag/{STACK_TAG_KEY}": "SpotTraining"}}
    assert "spot-fleet-request/*" in json.dumps(cancel[0]["Resource"])


def test_the_stack_tag_itself_cannot_be_changed_by_nodes(default_synth: Synth) -> None:
    retag = [s for s in _policy_statements(default_synth, "NodeRole") if "ec2:DeleteTags" in _as_list(s["Action"])]
    # Neither identity tag (stack, deployment) may be removed or changed by a node.
    assert retag and all({STACK_TAG_KEY, DEPLOYMENT_TAG_KEY} <= set(_as_list(s["Condition"]["ForAllValues:StringNotEquals"]["aws:TagKeys"]))
                         for s in retag)


# ---- Must show ---------------------------------------------------------------------------------


def test_spot_fleet_uses_launch_template_configs(default_synth: Synth) -> None:
    default_synth.template.resource_count_is("AWS::EC2::SpotFleet", 1)
    default_synth.template.has_resource_properties(
        "AWS::EC2::SpotFleet",
        {
            "SpotFleetRequestConfigData": Match.object_like(
                {
                    "Type": "maintain",
                    "AllocationStrategy": "priceCapacityOptimized",
                    "TargetCapacity": 1,
                    "LaunchTemplateConfigs": Match.any_value(),
                    "LaunchSpecifications": Match.absent(),
                    "SpotPrice": Match.absent(),
                    "TagSpecifications": [
                        {"ResourceType": "spot-fleet-request", "Tags": [{"Key": STACK_TAG_KEY, "Value": "SpotTraining"}]}
                    ],
                }
            )
        },
    )


def test_one_override_per_instance_type_and_subnet(default_synth: Synth) -> None:
    (fleet,) = default_synth.resources("AWS::EC2::SpotFleet").values()
    (config,) = fleet["Properties"]["SpotFleetRequestConfigData"]["LaunchTemplateConfigs"]
    pairs = {(o["InstanceType"], o["SubnetId"]["Ref"]) for o in config["Overrides"]}
    subnets = [k for k in default_synth.resources("AWS::EC2::Subnet")]
    assert len(subnets) == 2  # environment-agnostic: CDK gives two AZs
    assert pairs == {(t, s) for t in ("g6.xlarge", "g5.xlarge", "g4dn.xlarge") for s in subnets}


def test_launch_template_requires_imdsv2_and_encrypts_the_root_volume(default_synth: Synth) -> None:
    default_synth.template.has_resource_properties(
        "AWS::EC2::LaunchTemplate",
        {
            "LaunchTemplateData": Match.object_like(
                {
                    "MetadataOptions": {"HttpTokens": "required", "HttpPutResponseHopLimit": 2, "HttpEndpoint": "enabled"},
                    "BlockDeviceMappings": [
                        {"DeviceName": "/dev/sda1", "Ebs": Match.object_like({"Encrypted": True, "VolumeType": "gp3", "VolumeSize": 150})}
                    ],
                    "KeyName": Match.absent(),
                    "IamInstanceProfile": Match.any_value(),
                }
            )
        },
    )


def test_a_node_that_powers_itself_off_is_terminated_and_replaced(default_synth: Synth) -> None:
    # The agent powers off a node that can no longer work (IMDS 403 during training);
    # EC2's default for an OS shutdown is stop, which would leave the spot fleet's capacity stuck.
    (lt,) = default_synth.resources("AWS::EC2::LaunchTemplate").values()
    assert lt["Properties"]["LaunchTemplateData"]["InstanceInitiatedShutdownBehavior"] == "terminate"


def test_launch_template_tags_instances_but_not_root_volumes_with_the_stack_tag(default_synth: Synth) -> None:
    # Root volumes must not carry the tag the instance role may delete by; the
    # instance needs it (AttachVolume and the fleet lookup are conditioned on it).
    (lt,) = default_synth.resources("AWS::EC2::LaunchTemplate").values()
    specs = {s["ResourceType"]: s["Tags"] for s in lt["Properties"]["LaunchTemplateData"]["TagSpecifications"]}
    assert {"Key": STACK_TAG_KEY, "Value": "SpotTraining"} in specs["instance"]
    assert all(t["Key"] != STACK_TAG_KEY for t in specs.get("volume", []))


def test_data_volume_is_encrypted_gp3_tagged_and_retained(default_synth: Synth) -> None:
    volumes = default_synth.resources("AWS::EC2::Volume")
    assert list(volumes) == [PINNED_VOLUME_ID]
    volume = volumes[PINNED_VOLUME_ID]
    assert volume["DeletionPolicy"] == "Retain" and volume["UpdateReplacePolicy"] == "Retain"
    props = volume["Properties"]
    assert (props["Encrypted"], props["VolumeType"], props["Size"], props["Iops"], props["Throughput"]) == (True, "gp3", 100, 3000, 125)
    assert {"Key": "spot-training:purpose", "Value": "data-volume"} in props["Tags"]
    assert {"Key": STACK_TAG_KEY, "Value": "SpotTraining"} in props["Tags"]


def test_instance_role_and_fleet_role(default_synth: Synth) -> None:
    roles = default_synth.resources("AWS::IAM::Role")
    principals = {k: json.dumps(v["Properties"]["AssumeRolePolicyDocument"]) for k, v in roles.items()}
    node = [k for k, p in principals.items() if "ec2.amazonaws.com" in p]
    fleet = [k for k, p in principals.items() if "spotfleet.amazonaws.com" in p]
    assert len(node) == 1 and len(fleet) == 1
    # Session Manager through the role's own statement (tests/infra/test_least_privilege.py), no managed policy.
    assert "ManagedPolicyArns" not in roles[node[0]]["Properties"]
    assert "service-role/AmazonEC2SpotFleetTaggingRole" in json.dumps(roles[fleet[0]]["Properties"]["ManagedPolicyArns"])
    default_synth.template.resource_count_is("AWS::IAM::InstanceProfile", 1)


def test_bootstrap_asset_holds_agent_and_training_code_only(default_synth: Synth) -> None:
    manifest = json.loads(next(default_synth.outdir.glob("*.assets.json")).read_text())
    asset_hash = default_synth.stack.bootstrap_asset.asset.asset_hash
    assert asset_hash in manifest["files"]
    source = default_synth.outdir / manifest["files"][asset_hash]["source"]["path"]
    files = {p.relative_to(source).as_posix() for p in source.rglob("*") if p.is_file()}
    assert "spot_training/agent/__init__.py" in files and "spot_training/training/__init__.py" in files
    assert not [f for f in files if "__pycache__" in f or f.endswith(".pyc") or "/tests/" in f or f.startswith("tests/")]
    assert {"/".join(f.split("/")[:2]) for f in files} == {"spot_training/__init__.py", "spot_training/contract", "spot_training/agent", "spot_training/training"}


def test_outputs(default_synth: Synth) -> None:
    outputs = default_synth.data["Outputs"]
    assert outputs["FleetRequestId"]["Value"] == {"Ref": next(iter(default_synth.resources("AWS::EC2::SpotFleet")))}
    assert outputs["DataVolumeId"]["Value"] == {"Ref": PINNED_VOLUME_ID}
    logs = json.dumps(outputs["Logs"]["Value"])
    assert "journalctl -u spot-training-agent" in logs and "/dltraining/logs" in logs
    (handler_logs,) = [k for k in default_synth.resources("AWS::Logs::LogGroup") if k.startswith("DataCleanupHandlerLogs")]
    assert {"Ref": handler_logs} in outputs["Logs"]["Value"]["Fn::Join"][1]


def test_default_ami_is_the_deep_learning_ami_ssm_parameter(default_synth: Synth) -> None:
    params = default_synth.data["Parameters"]
    ami = [p for p in params.values() if p["Type"] == "AWS::SSM::Parameter::Value<AWS::EC2::Image::Id>"]
    assert [p["Default"] for p in ami] == ["/aws/service/deeplearning/ami/x86_64/base-oss-nvidia-driver-gpu-ubuntu-22.04/latest/ami-id"]


def test_new_vpc_has_public_subnets_no_nat_and_flow_logs(default_synth: Synth) -> None:
    default_synth.template.resource_count_is("AWS::EC2::NatGateway", 0)
    default_synth.template.resource_count_is("AWS::EC2::FlowLog", 1)
    for subnet in default_synth.resources("AWS::EC2::Subnet").values():
        assert subnet["Properties"]["MapPublicIpOnLaunch"] is True


# ---- cleanup custom resource --------------------------------------------------------------------


def test_cleanup_runs_after_the_fleet_is_deleted(default_synth: Synth) -> None:
    (cleanup_id,) = default_synth.resources("Custom::SpotTrainingDataCleanup")
    (fleet,) = default_synth.resources("AWS::EC2::SpotFleet").values()
    # CloudFormation deletes dependents first: the fleet depends on the cleanup, so it goes first.
    assert cleanup_id in fleet["DependsOn"]
    cleanup = default_synth.data["Resources"][cleanup_id]
    assert cleanup["Properties"]["StackName"] == "SpotTraining"
    assert cleanup["Properties"]["TagKey"] == STACK_TAG_KEY
    assert cleanup["Properties"]["TagValue"] == "SpotTraining"
    assert cleanup["Properties"]["RetainData"] == "false"


def test_cleanup_handler_is_the_colleagues_python_handler(default_synth: Synth) -> None:
    default_synth.template.has_resource_properties(
        "AWS::Lambda::Function",
        {"Handler": "index.handler", "Runtime": Match.string_like_regexp(r"^python3\.\d+$"), "Timeout": 900},
    )


def test_retain_data_reaches_the_custom_resource(pinned_synth: Synth) -> None:
    (cleanup,) = pinned_synth.resources("Custom::SpotTrainingDataCleanup").values()
    assert cleanup["Properties"]["RetainData"] == "true"


# ---- node config in user data --------------------------------------------------------------------


def _stack_refs(logical_id: str) -> str | None:
    """Physical ids for the Refs our user data makes beyond the pseudo parameters."""
    # Logical ids of the EFS resources stand for their physical ids.
    if logical_id.startswith("SharedFileSystemAccessPoint"):
        return "fsap-0123456789abcdef0"
    if logical_id.startswith("SharedFileSystem"):
        return "fs-0123456789abcdef0"
    if logical_id == "AWS::StackId":  # its UUID part is the deployment tag
        return "arn:aws:cloudformation:us-east-1:123456789012:stack/SpotTraining/1f2e3d4c-0000-4000-8000-00000000abcd"
    return None


def _render(value: Any, pseudo: dict[str, str]) -> str:
    """Render the few intrinsics our user data uses (Fn::Join, Fn::Sub, Ref to pseudo parameters and
    the EFS resources, Fn::Select of an Fn::Split of the stack id)."""
    return render_intrinsics(value, pseudo, _stack_refs)


def _user_data(synth: Synth, pseudo: dict[str, str]) -> str:
    (lt,) = synth.resources("AWS::EC2::LaunchTemplate").values()
    encoded = lt["Properties"]["LaunchTemplateData"]["UserData"]["Fn::Base64"]
    return _render(encoded, pseudo)


PSEUDO = {"AWS::Region": "us-east-1", "AWS::AccountId": "123456789012", "AWS::URLSuffix": "amazonaws.com", "AWS::Partition": "aws"}


def test_extract_config_reads_the_contract_config_from_user_data(default_synth: Synth) -> None:
    text = _user_data(default_synth, PSEUDO)
    config = extract_config(text)
    assert config == {
        "schema_version": 1,
        "region": "us-east-1",
        "stack_name": "SpotTraining",
        "node_role": "single",
        "volume": {
            "tags": {"spot-training:stack": "SpotTraining", "spot-training:purpose": "data-volume",
                     "spot-training:deployment": "1f2e3d4c-0000-4000-8000-00000000abcd"},
            "device_name": "/dev/sdf",
            "mount_point": "/dltraining",
            "fs_type": "xfs",
            "keep_snapshots": 2,
            "snapshot_interval_s": 3600,
            "initialization_rate_mibps": 300,
        },
        "efs": None,
        "training": {
            "framework": "tensorflow",
            "python": "/usr/bin/python3",
            "command": ["{python}", "spot_training/training/examples/keras_resnet.py"],
            "user": "ubuntu",
            "dataset_dir": "/dltraining/datasets",
            "checkpoint_dir": "/dltraining/checkpoints",
            "log_dir": "/dltraining/logs",
            "code": {"type": "asset", "path": "/opt/spot-training/code"},
            # The Base AMI ships no framework: the agent builds it into a venv on the data volume, once.
            "venv": {"requirements": ["tensorflow[and-cuda]>=2.17,<2.18"], "root": "/dltraining/envs",
                     "inherit_site_packages": False},
        },
        "cleanup": {"cancel_fleet_on_success": True},
        "imds_endpoint": None,
        "monitoring": {"enabled": True, "log_group": "/spot-training/SpotTraining", "namespace": "SpotTraining/SpotTraining"},
        # The default job's dataset: the digits asset of the stack, synced and unpacked by the agent.
        "dataset": {"uri": f"s3://cdk-hnb659fds-assets-123456789012-us-east-1/"
                           f"{default_synth.stack.dataset_asset.asset.asset_hash}.zip", "unpack": True},
    }


def test_user_data_fetches_the_asset_and_starts_the_agent_under_systemd(default_synth: Synth) -> None:
    text = _user_data(default_synth, PSEUDO)
    asset = default_synth.stack.bootstrap_asset.asset
    assert f"s3://cdk-hnb659fds-assets-123456789012-us-east-1/{asset.asset_hash}.zip" in text
    # Paths and the agent's interpreter are the instance's unless local mode overrides them.
    assert 'ST_ROOT="${SPOT_TRAINING_ROOT:-}"' in text
    assert 'AGENT_PYTHON="${SPOT_TRAINING_AGENT_PYTHON:-/usr/bin/python3}"' in text
    assert 'CODE="$ST_ROOT/opt/spot-training/code"' in text
    assert '"$AGENT_PYTHON" -m zipfile -e "$ST_ROOT/opt/spot-training/bootstrap.zip" "$CODE"' in text
    assert "ExecStart=${AGENT_PYTHON} -m spot_training.agent run --config ${ST_ROOT}/etc/spot-training/config.json" in text
    assert "WorkingDirectory=${CODE}" in text
    assert "Restart=on-failure" in text and "RestartPreventExitStatus=78 74 69" in text
    assert "Environment=SPOT_TRAINING_ON_BOOT_FAILURE=${BOOT_FAILED}" in text
    # The agent waits up to 90 s for the trainer on stop; systemd must wait longer than that.
    assert "TimeoutStopSec=120" in text
    # No framework install on the boot path: the only mention of it is the config's venv section.
    before_config, after_config = text.split("# BEGIN spot-training config")[0], text.split("# END spot-training config")[1]
    assert "tensorflow" not in before_config + after_config
    assert "set -e" not in text  # a failing command is a reported step, never a silent end of the script
    # Every step before the agent is retried and reported; the boot-failure script is written first.
    for step in ("fetch-agent", "unpack-agent", "agent-boto3", "start-agent"):
        assert f"step {step} " in text
    assert text.index("SPOT_TRAINING_BOOT_FAILED") < text.index("step fetch-agent")
    assert "systemctl enable --now spot-training-agent.service" in text
    (lt,) = default_synth.resources("AWS::EC2::LaunchTemplate").values()
    # A failed boot shuts down; terminate (not stop) so that the fleet replaces the instance.
    assert lt["Properties"]["LaunchTemplateData"]["InstanceInitiatedShutdownBehavior"] == "terminate"
    assert text.index("# END spot-training config") < text.index("systemctl enable --now")
    assert len(text.encode()) < 16 * 1024  # EC2's user data limit, with room to spare
    assert text.startswith("#!/bin/bash\n")
    import subprocess

    subprocess.run(["bash", "-n", "-c", text], check=True)  # parses as bash


def test_user_data_runs_and_unpacks_a_real_asset_zip(default_synth: Synth, tmp_path: Path) -> None:
    """The asset CDK stages is a directory; zip it as the CDK CLI does and unpack it as the node does."""
    import subprocess
    import sys

    manifest = json.loads(next(default_synth.outdir.glob("*.assets.json")).read_text())
    source = default_synth.outdir / manifest["files"][default_synth.stack.bootstrap_asset.asset.asset_hash]["source"]["path"]
    archive = tmp_path / "bootstrap.zip"
    with zipfile.ZipFile(archive, "w") as zf:
        for p in sorted(source.rglob("*")):
            zf.write(p, p.relative_to(source).as_posix())
    out = tmp_path / "code"
    out.mkdir()
    subprocess.run([sys.executable, "-m", "zipfile", "-e", str(archive), str(out)], check=True)
    assert (out / "spot_training" / "agent" / "__init__.py").is_file() and (out / "spot_training" / "training" / "__init__.py").is_file()


def test_pinned_environment_config_and_capacity(pinned_synth: Synth) -> None:
    subnets = pinned_synth.resources("AWS::EC2::Subnet")
    assert sorted(s["Properties"]["AvailabilityZone"] for s in subnets.values()) == ["eu-west-1a", "eu-west-1b", "eu-west-1c"]
    (fleet,) = pinned_synth.resources("AWS::EC2::SpotFleet").values()
    data = fleet["Properties"]["SpotFleetRequestConfigData"]
    assert (data["AllocationStrategy"], data["TargetCapacity"], data["SpotPrice"]) == ("capacityOptimized", 2, "0.9")
    assert len(data["LaunchTemplateConfigs"][0]["Overrides"]) == 2 * 3
    (volume,) = pinned_synth.resources("AWS::EC2::Volume").values()
    assert volume["Properties"]["AvailabilityZone"] == "eu-west-1a"
    key_arn = "arn:aws:kms:eu-west-1:123456789012:key/1234abcd-12ab-34cd-56ef-1234567890ab"
    assert volume["Properties"]["KmsKeyId"] == key_arn
    kms_statements = [s for s in _policy_statements(pinned_synth, "NodeRole") if any(a.startswith("kms:") for a in _as_list(s["Action"]))]
    assert kms_statements and all(s["Resource"] == key_arn for s in kms_statements)
    (create_grant,) = [s for s in kms_statements if "kms:CreateGrant" in _as_list(s["Action"])]
    assert create_grant["Condition"] == {"Bool": {"kms:GrantIsForAWSResource": "true"}}
    pinned_synth.template.resource_count_is("AWS::EC2::FlowLog", 0)
    config = extract_config(_user_data(pinned_synth, {**PSEUDO, "AWS::Region": "eu-west-1"}))
    assert config["region"] == "eu-west-1"
    assert config["training"]["framework"] == "mxnet"
    assert config["training"]["python"] == "/usr/bin/python3"
    assert config["training"]["code"] == {"type": "git", "url": "https://github.com/example/train.git", "ref": "v1.2.0"}
    assert config["imds_endpoint"] == "http://127.0.0.1:18080"


# ---- EFS ------------------------------------------------------------------------------------------


def test_efs_is_encrypted_elastic_with_access_point_and_pinned_id(efs_synth: Synth) -> None:
    file_systems = efs_synth.resources("AWS::EFS::FileSystem")
    assert list(file_systems) == [PINNED_FILE_SYSTEM_ID]
    fs = file_systems[PINNED_FILE_SYSTEM_ID]
    assert fs["DeletionPolicy"] == "Retain"
    assert fs["Properties"]["Encrypted"] is True
    assert fs["Properties"]["ThroughputMode"] == "elastic"
    efs_synth.template.resource_count_is("AWS::EFS::AccessPoint", 1)
    efs_synth.template.resource_count_is("AWS::EFS::MountTarget", 2)


def test_nfs_is_open_only_to_the_fleet_security_group(efs_synth: Synth) -> None:
    ingress = list(efs_synth.resources("AWS::EC2::SecurityGroupIngress").values())
    assert len(ingress) == 1
    props = ingress[0]["Properties"]
    assert (props["FromPort"], props["ToPort"], props["IpProtocol"]) == (2049, 2049, "tcp")
    assert props["SourceSecurityGroupId"]["Fn::GetAtt"][0].startswith("FleetSecurityGroup")
    assert "CidrIp" not in props


def test_efs_ids_reach_the_node_config(efs_synth: Synth) -> None:
    (lt,) = efs_synth.resources("AWS::EC2::LaunchTemplate").values()
    user_data = json.dumps(lt["Properties"]["LaunchTemplateData"]["UserData"])
    assert PINNED_FILE_SYSTEM_ID in user_data
    assert "/mnt/efs" in user_data
    statements = _policy_statements(efs_synth, "NodeRole")
    assert any("elasticfilesystem:ClientWrite" in _as_list(s["Action"]) for s in statements)


def test_efs_file_system_policy_grants_mount_and_write_to_the_node_role_only_over_tls(efs_synth: Synth) -> None:
    (fs,) = efs_synth.resources("AWS::EFS::FileSystem").values()
    statements = fs["Properties"]["FileSystemPolicy"]["Statement"]
    (role_id,) = [k for k in efs_synth.resources("AWS::IAM::Role") if k.startswith("NodeRole")]
    (grant,) = [s for s in statements if s.get("Sid", "").startswith("MountAndWrite")]
    assert grant["Effect"] == "Allow" and grant["Principal"] == {"AWS": {"Fn::GetAtt": [role_id, "Arn"]}}
    assert sorted(_as_list(grant["Action"])) == ["elasticfilesystem:ClientMount", "elasticfilesystem:ClientWrite"]
    assert grant["Condition"] == {"Bool": {"elasticfilesystem:AccessedViaMountTarget": "true", "aws:SecureTransport": "true"}}
    (deny,) = [s for s in statements if s.get("Sid") == "DenyWithoutTls"]
    assert deny["Effect"] == "Deny" and deny["Condition"] == {"Bool": {"aws:SecureTransport": "false"}}
    # No statement lets an anonymous client mount: ClientMount only ever names the node role.
    for s in statements:
        if s["Effect"] == "Allow" and "elasticfilesystem:ClientMount" in _as_list(s["Action"]):
            assert s["Principal"] != {"AWS": "*"}


def test_efs_utils_is_installed_before_the_agent_starts_only_when_efs_is_on(default_synth: Synth, efs_synth: Synth) -> None:
    efs_text = _user_data(efs_synth, PSEUDO)
    assert "spot_training_install_efs_utils" in efs_text and "./build-deb.sh" in efs_text
    assert efs_text.index("spot_training_install_efs_utils") < efs_text.index("systemctl enable --now")
    assert "spot_training_install_efs_utils" not in _user_data(default_synth, PSEUDO)


def test_the_agents_config_loader_accepts_every_variant(default_synth: Synth, efs_synth: Synth, pinned_synth: Synth) -> None:
    """The other side of the contract: spot_training.agent.config parses what the stack writes."""
    from spot_training.agent.config import parse_config

    for synth, region in ((default_synth, "us-east-1"), (efs_synth, "us-east-1"), (pinned_synth, "eu-west-1")):
        config = extract_config(_user_data(synth, {**PSEUDO, "AWS::Region": region}))
        agent_config = parse_config(config)
        assert agent_config.stack_name == "SpotTraining" and agent_config.region == region
    efs = parse_config(extract_config(_user_data(efs_synth, PSEUDO))).efs
    assert efs is not None


def test_existing_vpc_by_id_and_fixed_image(tmp_path: Path) -> None:
    """vpc_id uses Vpc.from_lookup (CDK's dummy VPC until the CLI fills the lookup cache); image_id skips SSM."""
    from infra_helpers import synth_stack

    from spot_training.infra.config import StackSettings

    synth = synth_stack(tmp_path, StackSettings.from_mapping({
        "vpc_id": "vpc-0123456789abcdef0", "account": "123456789012", "region": "us-east-1",
        "availability_zones": ["us-east-1a", "us-east-1b"], "image_id": "ami-0123456789abcdef0",
    }))
    assert synth.resources("AWS::EC2::VPC") == {} and synth.resources("AWS::EC2::Subnet") == {}
    assert synth.nag_errors == []
    # The lookup is recorded for the CLI to resolve (with credentials) before the real synth.
    missing = json.loads((tmp_path / "manifest.json").read_text()).get("missing", [])
    assert [m["provider"] for m in missing] == ["vpc-provider"]
    (lt,) = synth.resources("AWS::EC2::LaunchTemplate").values()
    assert lt["Properties"]["LaunchTemplateData"]["ImageId"] == "ami-0123456789abcdef0"
    assert not [p for p in synth.data.get("Parameters", {}).values() if "EC2::Image::Id" in p["Type"]]
    (fleet,) = synth.resources("AWS::EC2::SpotFleet").values()
    overrides = fleet["Properties"]["SpotFleetRequestConfigData"]["LaunchTemplateConfigs"][0]["Overrides"]
    assert len(overrides) == 3 * 2 and all(isinstance(o["SubnetId"], str) for o in overrides)


def test_move_settings_reach_the_node_config(default_synth: Synth) -> None:
    from spot_training.agent.config import parse_config

    config = extract_config(_user_data(default_synth, PSEUDO))
    assert (config["volume"]["snapshot_interval_s"], config["volume"]["initialization_rate_mibps"]) == (3600, 300)
    volume = parse_config(config).volume
    assert (volume.snapshot_interval_s, volume.initialization_rate_mibps) == (3600, 300)


def test_pin_to_volume_az_keeps_the_fleet_in_the_volume_az(tmp_path: Path) -> None:
    from infra_helpers import synth_stack

    from spot_training.infra.config import StackSettings

    synth = synth_stack(tmp_path, StackSettings.from_mapping({"pin_to_volume_az": True,
                                                               "availability_zones": ["us-east-1a", "us-east-1b"]}))
    (volume,) = synth.resources("AWS::EC2::Volume").values()
    subnets = synth.resources("AWS::EC2::Subnet")
    (fleet,) = synth.resources("AWS::EC2::SpotFleet").values()
    overrides = fleet["Properties"]["SpotFleetRequestConfigData"]["LaunchTemplateConfigs"][0]["Overrides"]
    zones = {subnets[o["SubnetId"]["Ref"]]["Properties"]["AvailabilityZone"] for o in overrides}
    assert zones == {volume["Properties"]["AvailabilityZone"]} == {"us-east-1a"}
    assert len(overrides) == 3  # every default type, one subnet


# ---- FIS drill (spot-train drill --aws) ----------------------------------------------------------


def test_fis_experiment_template_only_with_fis_drill(default_synth: Synth, tmp_path: Path) -> None:
    from infra_helpers import synth_stack

    from spot_training.infra.config import StackSettings

    default_synth.template.resource_count_is("AWS::FIS::ExperimentTemplate", 0)
    assert "FisExperimentTemplateId" not in default_synth.data["Outputs"]
    assert not [r for r in default_synth.resources("AWS::IAM::Role").values()
                if "fis.amazonaws.com" in json.dumps(r["Properties"]["AssumeRolePolicyDocument"])]

    synth = synth_stack(tmp_path, StackSettings.from_mapping({"fis_drill": True}))
    assert cfn_lint_errors(synth.template_file) == []
    assert synth.nag_errors == []
    (template_id, template), = synth.resources("AWS::FIS::ExperimentTemplate").items()
    props = template["Properties"]
    (action,) = props["Actions"].values()
    assert action["ActionId"] == "aws:ec2:send-spot-instance-interruptions"
    assert action["Parameters"] == {"durationBeforeInterruption": "PT2M"}
    target = props["Targets"][action["Targets"]["SpotInstances"]]
    assert target["ResourceType"] == "aws:ec2:spot-instance" and target["SelectionMode"] == "COUNT(1)"
    assert target["ResourceTags"] == {STACK_TAG_KEY: "SpotTraining"}
    assert target["Filters"] == [{"Path": "State.Name", "Values": ["running"]}]
    assert props["StopConditions"] == [{"Source": "none"}]
    role_id = props["RoleArn"]["Fn::GetAtt"][0]
    role = synth.data["Resources"][role_id]
    assert role["Properties"]["AssumeRolePolicyDocument"]["Statement"][0]["Principal"] == {"Service": "fis.amazonaws.com"}
    statements = [s for p in synth.resources("AWS::IAM::Policy").values()
                  if {"Ref": role_id} in p["Properties"]["Roles"] for s in p["Properties"]["PolicyDocument"]["Statement"]]
    (interrupt,) = [s for s in statements if s["Action"] == "ec2:SendSpotInstanceInterruptions"]
    assert interrupt["Condition"] == {"StringEquals": {f"aws:ResourceTag/{STACK_TAG_KEY}": "SpotTraining"}}
    assert synth.data["Outputs"]["FisExperimentTemplateId"]["Value"] == {"Ref": template_id}


# ---- least privilege ------------------------------------------------------------
def test_nodes_delete_only_the_agents_bookkeeping_tags(default_synth: Synth) -> None:
    """DeleteTags with no tag list strips every tag, the stack tag included: nodes may delete only the
    agent's bookkeeping tags, and only by naming them."""
    from spot_training.agent.config import FAILED_BOOTS_TAG
    from spot_training.agent.ebs import CREATED_BY_TAG, MOVE_STATE_TAG, SOURCE_SNAPSHOT_TAG, SOURCE_VOLUME_TAG
    from spot_training.agent.lease import LEASE_TAG

    delete = [s for s in _policy_statements(default_synth, "NodeRole") if "ec2:DeleteTags" in _as_list(s["Action"])]
    assert delete
    # The failed-boot count (docs/contracts.md, "Tags a failed boot writes") is cleared by the agent.
    bookkeeping = {LEASE_TAG, SOURCE_VOLUME_TAG, SOURCE_SNAPSHOT_TAG, MOVE_STATE_TAG, CREATED_BY_TAG, FAILED_BOOTS_TAG}
    for statement in delete:
        assert set(_as_list(statement["Condition"]["ForAllValues:StringEquals"]["aws:TagKeys"])) == bookkeeping
        assert statement["Condition"]["Null"] == {"aws:TagKeys": "false"}  # a DeleteTags naming no tag: denied


def test_node_uses_the_volume_key_only_through_ec2(pinned_synth: Synth) -> None:
    """The customer managed volume key is usable by the node only through EBS (kms:ViaService), and no
    statement grants an action under a condition that never applies to it."""
    kms_statements = [s for s in _policy_statements(pinned_synth, "NodeRole") if any(a.startswith("kms:") for a in _as_list(s["Action"]))]
    for statement in kms_statements:
        actions = set(_as_list(statement["Action"]))
        if actions == {"kms:CreateGrant"}:
            assert statement["Condition"]["Bool"] == {"kms:GrantIsForAWSResource": "true"}
        else:
            assert "kms:CreateGrant" not in actions
            assert json.dumps(statement["Condition"]["StringEquals"]["kms:ViaService"]) == json.dumps(
                {"Fn::Join": ["", ["ec2.", {"Ref": "AWS::Region"}, ".amazonaws.com"]]}), statement
    used = {a for s in kms_statements for a in _as_list(s["Action"])}
    assert {"kms:CreateGrant", "kms:Decrypt", "kms:DescribeKey", "kms:GenerateDataKeyWithoutPlaintext"} <= used
    assert not [a for a in used if a in ("kms:Encrypt", "kms:GenerateDataKey")]  # EBS needs neither
