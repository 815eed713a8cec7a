"""The DistributedTraining stack and ParameterServerCluster: gates, capacity, network, EFS, node configs."""

from __future__ import annotations

import json
import re
import subprocess
from typing import Any

import aws_cdk as cdk
import pytest
from aws_cdk import assertions
from aws_cdk import aws_ec2 as ec2
from infra_helpers import (Synth, as_list, assert_docs_list_context_keys, assert_resource_star_only_where_no_resource_level_permissions,
                           cfn_lint_errors, launch_templates_by_role, render_intrinsics)

from spot_training.infra.cluster import AGENT_STOP_TIMEOUT_S, ClusterPorts, Framework, ParameterServerCluster
from spot_training.infra.cluster_config import CLUSTER_CONTEXT_KEYS, ClusterSettings
from spot_training.infra.tags import CLUSTER_MEMBER_TAG_KEY, STACK_TAG_KEY
from spot_training.infra.userdata import extract_config

Match = assertions.Match
#: Logical ids of the stateful resources: a change here replaces the file system and loses its data.
PINNED_CLUSTER_FILE_SYSTEM_ID = "ClusterSharedFileSystem7521FA77"
PINNED_CLUSTER_ACCESS_POINT_ID = "ClusterSharedFileSystemAccessPoint1ED85886"
PSEUDO = {"AWS::Region": "us-east-1", "AWS::AccountId": "123456789012", "AWS::URLSuffix": "amazonaws.com", "AWS::Partition": "aws"}


_as_list = as_list


def _render(value: Any, pseudo: dict[str, str]) -> str:
    """Render the intrinsics our user data uses (pseudo parameters; the pinned EFS ids stand for physical ids)."""
    efs = {PINNED_CLUSTER_ACCESS_POINT_ID: "fsap-0123456789abcdef0", PINNED_CLUSTER_FILE_SYSTEM_ID: "fs-0123456789abcdef0"}
    return render_intrinsics(value, pseudo, efs.get)


def _launch_templates(synth: Synth) -> dict[str, dict[str, Any]]:
    """role -> launch template resource (scheduler, server, worker)."""
    out = launch_templates_by_role(synth)
    assert sorted(out) == ["scheduler", "server", "worker"], list(synth.resources("AWS::EC2::LaunchTemplate"))
    return out


def _user_data(lt: dict[str, Any], pseudo: dict[str, str] = PSEUDO) -> str:
    return _render(lt["Properties"]["LaunchTemplateData"]["UserData"]["Fn::Base64"], pseudo)


def _group(synth: Synth, prefix: str) -> dict[str, Any]:
    (group,) = [g for k, g in synth.resources("AWS::AutoScaling::AutoScalingGroup").items() if k.startswith(prefix)]
    return group


# ---- gates -------------------------------------------------------------------------------------


def test_cfn_lint_reports_no_errors(cluster_synth: Synth, cluster_tf_synth: Synth) -> None:
    for synth in (cluster_synth, cluster_tf_synth):
        assert cfn_lint_errors(synth.template_file) == [], synth.template_file


def test_cdk_nag_reports_no_unacknowledged_findings(cluster_synth: Synth, cluster_tf_synth: Synth) -> None:
    for synth in (cluster_synth, cluster_tf_synth):
        assert synth.nag_errors == []


def test_the_file_system_logical_ids_are_pinned(cluster_synth: Synth) -> None:
    assert list(cluster_synth.resources("AWS::EFS::FileSystem")) == [PINNED_CLUSTER_FILE_SYSTEM_ID]
    assert list(cluster_synth.resources("AWS::EFS::AccessPoint")) == [PINNED_CLUSTER_ACCESS_POINT_ID]


# ---- capacity ------------------------------------------------------------------------------------


def test_scheduler_and_servers_are_fixed_size_on_demand_groups_with_launch_templates(cluster_synth: Synth, cluster_tf_synth: Synth) -> None:
    for synth, servers in ((cluster_synth, "2"), (cluster_tf_synth, "3")):
        synth.template.resource_count_is("AWS::AutoScaling::AutoScalingGroup", 2)
        synth.template.resource_count_is("AWS::AutoScaling::LaunchConfiguration", 0)
        scheduler, server = _group(synth, "ClusterSchedulerGroup"), _group(synth, "ClusterServerGroup")
        assert (scheduler["Properties"]["MinSize"], scheduler["Properties"]["MaxSize"]) == ("1", "1")
        assert (server["Properties"]["MinSize"], server["Properties"]["MaxSize"]) == (servers, servers)
        templates = _launch_templates(synth)
        for group, role in ((scheduler, "scheduler"), (server, "server")):
            props = group["Properties"]
            assert "DesiredCapacity" not in props  # min = max fixes the size; no reset on every deploy
            assert props["LaunchTemplate"]["LaunchTemplateId"]["Ref"] in synth.resources("AWS::EC2::LaunchTemplate")
            assert synth.data["Resources"][props["LaunchTemplate"]["LaunchTemplateId"]["Ref"]] is templates[role]
            # No spot options: on-demand capacity.
            assert "InstanceMarketOptions" not in templates[role]["Properties"]["LaunchTemplateData"]
            assert "MixedInstancesPolicy" not in props
            # A new launch template version replaces nodes old-first, one at a time (never two coordinators).
            rolling = group["UpdatePolicy"]["AutoScalingRollingUpdate"]
            assert (rolling["MaxBatchSize"], rolling["MinInstancesInService"]) == (1, 0)
    types = {role: lt["Properties"]["LaunchTemplateData"].get("InstanceType") for role, lt in _launch_templates(cluster_synth).items()}
    assert types == {"scheduler": "m5.large", "server": "m5.xlarge", "worker": None}
    types = {role: lt["Properties"]["LaunchTemplateData"].get("InstanceType") for role, lt in _launch_templates(cluster_tf_synth).items()}
    assert types == {"scheduler": "m5.2xlarge", "server": "c5.2xlarge", "worker": None}


def test_workers_are_a_spot_fleet_with_the_desired_target(cluster_synth: Synth, cluster_tf_synth: Synth) -> None:
    for synth, target, types, subnets in ((cluster_synth, 2, {"g6.xlarge", "g5.xlarge", "g4dn.xlarge"}, 2),
                                         (cluster_tf_synth, 3, {"g5.xlarge", "g4dn.xlarge"}, 3)):
        (fleet,) = synth.resources("AWS::EC2::SpotFleet").values()
        data = fleet["Properties"]["SpotFleetRequestConfigData"]
        assert (data["Type"], data["TargetCapacity"]) == ("maintain", target)
        (config,) = data["LaunchTemplateConfigs"]
        worker_lt = next(k for k in synth.resources("AWS::EC2::LaunchTemplate") if k.startswith("ClusterWorkerFleetLaunchTemplate"))
        assert config["LaunchTemplateSpecification"]["LaunchTemplateId"] == {"Ref": worker_lt}
        assert {o["InstanceType"] for o in config["Overrides"]} == types
        assert len(config["Overrides"]) == len(types) * subnets
    (fleet,) = cluster_tf_synth.resources("AWS::EC2::SpotFleet").values()
    assert fleet["Properties"]["SpotFleetRequestConfigData"]["SpotPrice"] == "0.9"


def test_every_launch_template_requires_imdsv2_encrypts_root_and_has_no_key(cluster_synth: Synth) -> None:
    groups = cluster_synth.resources("AWS::EC2::SecurityGroup")
    (member_sg,) = [k for k in groups if k.startswith("ClusterSecurityGroup")]
    for role, lt in _launch_templates(cluster_synth).items():
        data = lt["Properties"]["LaunchTemplateData"]
        assert data["MetadataOptions"] == {"HttpEndpoint": "enabled", "HttpPutResponseHopLimit": 2, "HttpTokens": "required",
                                           "InstanceMetadataTags": "enabled"}, role
        assert data["BlockDeviceMappings"] == [{"DeviceName": "/dev/sda1", "Ebs": {"DeleteOnTermination": True, "Encrypted": True,
                                                                                  "VolumeSize": 150, "VolumeType": "gp3"}}], role
        assert "KeyName" not in data, role
        assert data["SecurityGroupIds"] == [{"Fn::GetAtt": [member_sg, "GroupId"]}], role
        assert "IamInstanceProfile" in data, role


def test_only_workers_carry_the_member_tag(cluster_synth: Synth) -> None:
    for role, lt in _launch_templates(cluster_synth).items():
        specs = {s["ResourceType"]: s["Tags"] for s in lt["Properties"]["LaunchTemplateData"]["TagSpecifications"]}
        assert {"Key": STACK_TAG_KEY, "Value": "DistributedTraining"} in specs["instance"], role
        assert all(t["Key"] != STACK_TAG_KEY for t in specs.get("volume", [])), role  # root volumes carry no stack tag
        has_member_tag = {"Key": CLUSTER_MEMBER_TAG_KEY, "Value": "true"} in specs["instance"]
        assert has_member_tag == (role == "worker"), role
        # Instance tags in metadata allow no '/' or space in keys (EC2 rejects the launch otherwise).
        assert all(not re.search(r"[/ ]", t["Key"]) for t in specs["instance"]), role


# ---- network -----------------------------------------------------------------------------------


def _ingress_rules(synth: Synth) -> list[dict[str, Any]]:
    rules = [r["Properties"] for r in synth.resources("AWS::EC2::SecurityGroupIngress").values()]
    for sg in synth.resources("AWS::EC2::SecurityGroup").values():
        rules += sg["Properties"].get("SecurityGroupIngress", [])
    return rules


def test_members_reach_each_other_only_on_the_framework_ports_and_nfs_only_from_members(cluster_synth: Synth, cluster_tf_synth: Synth) -> None:
    for synth, expected_member_ports in ((cluster_synth, [(9000, 9002)]), (cluster_tf_synth, [(7000, 7000), (7100, 7101)])):
        groups = synth.resources("AWS::EC2::SecurityGroup")
        (member_sg,) = [k for k in groups if k.startswith("ClusterSecurityGroup")]
        (efs_sg,) = [k for k in groups if k.startswith("ClusterSharedFileSystemEfsSecurityGroup")]
        assert len(groups) == 2
        member_ref = {"Fn::GetAtt": [member_sg, "GroupId"]}
        rules = _ingress_rules(synth)
        for rule in rules:
            assert "CidrIp" not in rule and "CidrIpv6" not in rule and "SourcePrefixListId" not in rule, rule
            assert rule["SourceSecurityGroupId"] == member_ref, rule
            assert rule["IpProtocol"] == "tcp", rule
        member_rules = sorted((r["FromPort"], r["ToPort"]) for r in rules if r["GroupId"] == member_ref)
        nfs_rules = [(r["FromPort"], r["ToPort"]) for r in rules if r["GroupId"] == {"Fn::GetAtt": [efs_sg, "GroupId"]}]
        assert member_rules == expected_member_ports
        assert nfs_rules == [(2049, 2049)]
        assert len(rules) == len(member_rules) + 1


def test_no_ingress_from_anywhere_in_the_whole_template(cluster_synth: Synth) -> None:
    text = json.dumps(cluster_synth.data["Resources"])
    for sg in cluster_synth.resources("AWS::EC2::SecurityGroup").values():
        for rule in sg["Properties"].get("SecurityGroupIngress", []):
            assert rule.get("CidrIp") != "0.0.0.0/0" and rule.get("CidrIpv6") != "::/0"
    assert '"FromPort": 22' not in text


# ---- EFS -----------------------------------------------------------------------------------------


def test_efs_is_encrypted_deleted_by_default_with_an_access_point_and_mount_targets(cluster_synth: Synth) -> None:
    fs = cluster_synth.data["Resources"][PINNED_CLUSTER_FILE_SYSTEM_ID]
    # retain_data defaults to false: cdk destroy removes the file system, as the single-node stack's volume.
    assert fs["DeletionPolicy"] == "Delete" and fs["UpdateReplacePolicy"] == "Delete"
    assert fs["Properties"]["Encrypted"] is True
    cluster_synth.template.resource_count_is("AWS::EFS::MountTarget", 2)
    # Nodes boot only after the mount targets exist.
    mount_targets = set(cluster_synth.resources("AWS::EFS::MountTarget"))
    for group in cluster_synth.resources("AWS::AutoScaling::AutoScalingGroup").values():
        assert mount_targets <= set(group["DependsOn"])
    (fleet,) = cluster_synth.resources("AWS::EC2::SpotFleet").values()
    assert mount_targets <= set(fleet["DependsOn"])


def test_retain_data_keeps_the_file_system_on_destroy(tmp_path: Any) -> None:
    from infra_helpers import synth_cluster

    synth = synth_cluster(tmp_path, ClusterSettings.from_mapping({"retain_data": "true"}))
    fs = synth.data["Resources"][PINNED_CLUSTER_FILE_SYSTEM_ID]
    assert fs["DeletionPolicy"] == "Retain" and fs["UpdateReplacePolicy"] == "Retain"
    assert synth.nag_errors == []


def test_the_construct_retains_its_file_system_unless_told(stack: cdk.Stack) -> None:
    _cluster(stack)
    assertions.Template.from_stack(stack).has_resource("AWS::EFS::FileSystem", {"DeletionPolicy": "Retain"})


# ---- IAM -----------------------------------------------------------------------------------------


def _statements(synth: Synth, prefix: str) -> list[dict[str, Any]]:
    statements = []
    for logical_id, policy in synth.resources("AWS::IAM::Policy").items():
        if logical_id.startswith(prefix):
            statements += policy["Properties"]["PolicyDocument"]["Statement"]
    assert statements, prefix
    return statements


def test_cluster_nodes_get_efs_but_no_data_volume_permissions(cluster_synth: Synth) -> None:
    for prefix in ("ClusterNodeRole", "ClusterWorkerRole"):
        statements = _statements(cluster_synth, prefix)
        actions = {a for s in statements for a in _as_list(s["Action"])}
        assert {"elasticfilesystem:ClientMount", "elasticfilesystem:ClientWrite"} <= actions, prefix
        assert not actions & {"ec2:AttachVolume", "ec2:DetachVolume", "ec2:CreateVolume", "ec2:DeleteVolume",
                              "ec2:CreateSnapshot", "ec2:DeleteSnapshot"}, prefix
        # Tags only for boot failures: the error on the instance, the count on the fleet (workers).
        for st in statements:
            if {"ec2:CreateTags", "ec2:DeleteTags"} & set(_as_list(st["Action"])):
                keys = st["Condition"]["ForAllValues:StringEquals"]["aws:TagKeys"]
                assert keys in (["spot-training:boot-error"], ["spot-training:failed-boots"]), st
        assert_resource_star_only_where_no_resource_level_permissions(statements)
    scheduler_ec2 = {a for s in _statements(cluster_synth, "ClusterNodeRole") for a in _as_list(s["Action"]) if a.startswith("ec2:")}
    # Beyond Describe: the boot-error tag on its own instance and, at the failed-boot bound, cancelling
    # the stack's worker fleet (test_failed_boots_of_cluster_nodes_are_counted_and_bounded_within_the_stack).
    assert {a for a in scheduler_ec2 if not a.split(":")[1].startswith("Describe")} == {
        "ec2:CreateTags", "ec2:CancelSpotFleetRequests"}, scheduler_ec2
    roles = cluster_synth.resources("AWS::IAM::Role")
    principals = [json.dumps(r["Properties"]["AssumeRolePolicyDocument"]) for r in roles.values()]
    assert sum("ec2.amazonaws.com" in p for p in principals) == 2  # scheduler/servers, workers
    assert sum("spotfleet.amazonaws.com" in p for p in principals) == 1
    # No EBS data volume and no cleanup resource: the cluster keeps its data on EFS.
    cluster_synth.template.resource_count_is("AWS::EC2::Volume", 0)
    cluster_synth.template.resource_count_is("Custom::SpotTrainingDataCleanup", 0)


def test_only_workers_may_leave_their_fleet_and_only_within_the_stack(cluster_synth: Synth) -> None:
    """spot_training.agent.fleet_actions.leave_fleet: ModifySpotFleetRequest + TerminateInstances, tag- and profile-scoped."""
    mutating = [s for s in _statements(cluster_synth, "ClusterWorkerRole")
                if any(a in ("ec2:ModifySpotFleetRequest", "ec2:TerminateInstances") for a in _as_list(s["Action"]))]
    by_action = {a: s for s in mutating for a in _as_list(s["Action"])}
    assert set(by_action) == {"ec2:ModifySpotFleetRequest", "ec2:TerminateInstances"}
    for action, st in by_action.items():
        equals = dict(st["Condition"]["StringEquals"])
        if action == "ec2:TerminateInstances":
            # ... and only the caller's own instance (spot_training.infra.roles.TrainingNodeRole.allow_leaving_fleet)
            source = equals.pop("ec2:SourceInstanceARN")
            assert source["Fn::Join"][1][-1].endswith(":instance/${ec2:InstanceID}"), source
        assert equals == {f"aws:ResourceTag/{STACK_TAG_KEY}": "DistributedTraining"}, action
        assert "*" not in _as_list(st["Resource"])
    assert "spot-fleet-request/*" in json.dumps(by_action["ec2:ModifySpotFleetRequest"]["Resource"])
    terminate = by_action["ec2:TerminateInstances"]
    assert "instance/*" in json.dumps(terminate["Resource"])
    (worker_profile,) = [k for k in cluster_synth.resources("AWS::IAM::InstanceProfile") if k.startswith("ClusterWorkerRole")]
    assert terminate["Condition"]["ArnEquals"] == {"ec2:InstanceProfile": {"Fn::GetAtt": [worker_profile, "Arn"]}}
    # The workers' launch template runs with that profile; the scheduler's and servers' do not.
    templates = _launch_templates(cluster_synth)
    assert templates["worker"]["Properties"]["LaunchTemplateData"]["IamInstanceProfile"]["Arn"] == {"Fn::GetAtt": [worker_profile, "Arn"]}
    for role in ("scheduler", "server"):
        assert templates[role]["Properties"]["LaunchTemplateData"]["IamInstanceProfile"]["Arn"] != {"Fn::GetAtt": [worker_profile, "Arn"]}
    actions = {a for s in _statements(cluster_synth, "ClusterNodeRole") for a in _as_list(s["Action"])}
    assert not actions & {"ec2:ModifySpotFleetRequest", "ec2:TerminateInstances"}


def test_failed_boots_of_cluster_nodes_are_counted_and_bounded_within_the_stack(cluster_synth: Synth) -> None:
    """spot_training/infra/userdata.py boot_failed_script on cluster nodes: workers count on their fleet
    request, the scheduler and servers on their Auto Scaling group; at the bound the group's launches are
    suspended and the stack's fleets cancelled. Every write is scoped to the stack's resources and keys."""
    tagged = {f"aws:ResourceTag/{STACK_TAG_KEY}": "DistributedTraining"}
    count_key = {"ForAllValues:StringEquals": {"aws:TagKeys": ["spot-training:failed-boots"]}, "Null": {"aws:TagKeys": "false"}}
    worker = {st.get("Sid"): st for st in _statements(cluster_synth, "ClusterWorkerRole")}
    assert sorted(_as_list(worker["CountFailedBootsOnOwnFleet"]["Action"])) == ["ec2:CreateTags", "ec2:DeleteTags"]
    assert worker["CountFailedBootsOnOwnFleet"]["Condition"] == {"StringEquals": tagged, **count_key}
    assert "spot-fleet-request/*" in json.dumps(worker["CountFailedBootsOnOwnFleet"]["Resource"])
    assert worker["TagOwnInstanceBootError"]["Condition"]["ForAllValues:StringEquals"] == {
        "aws:TagKeys": ["spot-training:boot-error"]}
    node = {st.get("Sid"): st for st in _statements(cluster_synth, "ClusterNodeRole")}
    assert sorted(_as_list(node["CountFailedBootsOnOwnGroup"]["Action"])) == [
        "autoscaling:CreateOrUpdateTags", "autoscaling:DeleteTags"]
    assert node["CountFailedBootsOnOwnGroup"]["Condition"] == {"StringEquals": tagged, **count_key}
    assert node["SuspendLaunchesOfOwnGroup"]["Action"] == "autoscaling:SuspendProcesses"
    assert node["SuspendLaunchesOfOwnGroup"]["Condition"] == {"StringEquals": tagged}
    for sid in ("CountFailedBootsOnOwnGroup", "SuspendLaunchesOfOwnGroup"):
        assert "autoScalingGroup:*:autoScalingGroupName/*" in json.dumps(node[sid]["Resource"]), sid
    assert node["CancelOwnSpotFleet"]["Condition"] == {"StringEquals": tagged}
    autoscaling = {a for st in node.values() for a in _as_list(st["Action"]) if a.startswith("autoscaling:")}
    assert autoscaling == {"autoscaling:DescribeTags", "autoscaling:CreateOrUpdateTags", "autoscaling:DeleteTags",
                           "autoscaling:SuspendProcesses"}
    # The groups carry the stack tag the conditions test.
    for group in cluster_synth.resources("AWS::AutoScaling::AutoScalingGroup").values():
        assert {"Key": STACK_TAG_KEY, "Value": "DistributedTraining", "PropagateAtLaunch": True} in group["Properties"]["Tags"]


def test_only_workers_may_cancel_the_fleet_on_completion_and_only_the_stacks(cluster_synth: Synth) -> None:
    """spot_training.agent.fleet_actions.finish_node: a worker cancels its fleet when training completed."""
    (cancel,) = [s for s in _statements(cluster_synth, "ClusterWorkerRole") if "ec2:CancelSpotFleetRequests" in _as_list(s["Action"])]
    assert cancel["Condition"]["StringEquals"] == {f"aws:ResourceTag/{STACK_TAG_KEY}": "DistributedTraining"}
    assert "spot-fleet-request/*" in json.dumps(cancel["Resource"])
    configs = {role: extract_config(_user_data(lt)) for role, lt in _launch_templates(cluster_synth).items()}
    assert {role: c["cleanup"]["cancel_fleet_on_success"] for role, c in configs.items()} == {
        "scheduler": False, "server": False, "worker": True}


# ---- node configs ----------------------------------------------------------------------------------


def test_each_role_gets_its_node_config_with_the_cluster_section(cluster_synth: Synth) -> None:
    for role, lt in _launch_templates(cluster_synth).items():
        config = extract_config(_user_data(lt))
        assert config["node_role"] == role
        assert config["stack_name"] == "DistributedTraining"
        assert config["efs"] == {"file_system_id": "fs-0123456789abcdef0", "access_point_id": "fsap-0123456789abcdef0",
                                 "mount_point": "/mnt/efs"}
        assert config["cluster"] == {"state_dir": "/mnt/efs/cluster", "num_servers": 2, "min_workers": 1,
                                     "scheduler_port": 9000, "server_port": 9001, "worker_port": 9002,
                                     "member_tag": CLUSTER_MEMBER_TAG_KEY}
        training = config["training"]
        assert (training["dataset_dir"], training["checkpoint_dir"], training["log_dir"]) == (
            "/mnt/efs/datasets", "/mnt/efs/checkpoints", "/mnt/efs/logs")
        assert training["framework"] == "mxnet"
        assert training["command"] == ["{python}", "-m", "spot_training.training.distributed.mxnet_dist"]
        assert training["python"] == "/usr/bin/python3"


def test_the_agents_accept_every_role_config(cluster_synth: Synth, cluster_tf_synth: Synth) -> None:
    """The other side of the contract: spot_training.agent.config and spot_training.agent.cluster_state parse what the stack writes."""
    from spot_training.agent.cluster_state import settings_from_config
    from spot_training.agent.config import parse_config

    for synth, region, servers, min_workers, ports in ((cluster_synth, "us-east-1", 2, 1, (9000, 9001, 9002)),
                                                       (cluster_tf_synth, "eu-west-1", 3, 2, (7000, 7100, 7101))):
        for role, lt in _launch_templates(synth).items():
            agent = parse_config(extract_config(_user_data(lt, {**PSEUDO, "AWS::Region": region})))
            assert (agent.node_role, agent.region) == (role, region)
            cluster = settings_from_config(agent.extensions["cluster"])
            assert (cluster.num_servers, cluster.min_workers) == (servers, min_workers)
            assert (cluster.port_for("scheduler"), cluster.port_for("server"), cluster.port_for("worker")) == ports
            assert str(cluster.state_dir).startswith(str(agent.efs.mount_point))
            assert str(agent.training.checkpoint_dir).startswith(str(agent.efs.mount_point))
            # systemd must outwait a leaving worker: checkpoint and teardown phases, then the kill grace.
            assert AGENT_STOP_TIMEOUT_S > 2 * cluster.stop_timeout_s + cluster.kill_grace_s


def test_tensorflow_cluster_runs_the_pss_chief_with_its_own_python(cluster_tf_synth: Synth) -> None:
    for role, lt in _launch_templates(cluster_tf_synth).items():
        text = _user_data(lt, {**PSEUDO, "AWS::Region": "eu-west-1"})
        config = extract_config(text)
        assert config["training"]["framework"] == "tensorflow"
        assert config["training"]["command"] == ["{python}", "-m", "spot_training.training.distributed.tf_pss"]
        assert config["training"]["python"] == "/opt/tensorflow/bin/python"
        assert config["stack_name"] == "TfCluster"
        # An interpreter of the user's own: nothing is pip-installed into it.
        assert "/opt/tensorflow/bin/python -m pip" not in text and "tensorflow[and-cuda]" not in text


def test_user_data_asks_the_agent_for_the_framework_and_bounds_the_agents_stop(cluster_synth: Synth) -> None:
    for role, lt in _launch_templates(cluster_synth).items():
        text = _user_data(lt)
        # GPU build on the spot workers, CPU build on the on-demand m5 scheduler and servers: each a venv
        # the agents build once on EFS (a key per requirement set), not a pip install at every boot.
        build = "mxnet-cu112==1.9.1" if role == "worker" else "mxnet==1.9.1"
        venv = extract_config(text)["training"]["venv"]
        assert venv == {"requirements": [build, "numpy<1.24"], "root": "/mnt/efs/envs", "inherit_site_packages": False}, role
        assert "pip install --quiet 'mxnet" not in text, role
        # A stopped worker first leaves (checkpoint + teardown, each up to cluster.stop_timeout_s = 120 s).
        assert "TimeoutStopSec=300" in text
        assert len(text.encode()) < 16 * 1024
        subprocess.run(["bash", "-n", "-c", text], check=True)


def test_outputs(cluster_synth: Synth) -> None:
    outputs = cluster_synth.data["Outputs"]
    assert outputs["FileSystemId"]["Value"] == {"Ref": PINNED_CLUSTER_FILE_SYSTEM_ID}
    assert outputs["WorkerFleetRequestId"]["Value"] == {"Ref": next(iter(cluster_synth.resources("AWS::EC2::SpotFleet")))}
    assert outputs["SchedulerGroupName"]["Value"]["Ref"].startswith("ClusterSchedulerGroup")
    assert outputs["ServerGroupName"]["Value"]["Ref"].startswith("ClusterServerGroup")
    assert "/mnt/efs/cluster/plan.json" in outputs["Logs"]["Value"]


def test_pinned_environment(cluster_tf_synth: Synth) -> None:
    subnets = cluster_tf_synth.resources("AWS::EC2::Subnet")
    assert sorted(s["Properties"]["AvailabilityZone"] for s in subnets.values()) == ["eu-west-1a", "eu-west-1b", "eu-west-1c"]
    cluster_tf_synth.template.resource_count_is("AWS::EC2::FlowLog", 0)
    cluster_tf_synth.template.resource_count_is("AWS::EFS::MountTarget", 3)


# ---- the construct on its own --------------------------------------------------------------------


def _vpc(stack: cdk.Stack) -> ec2.Vpc:
    return ec2.Vpc(stack, "Vpc", nat_gateways=0,
                   subnet_configuration=[ec2.SubnetConfiguration(name="Public", subnet_type=ec2.SubnetType.PUBLIC)])


def _cluster(stack: cdk.Stack, **props: Any) -> ParameterServerCluster:
    return ParameterServerCluster(stack, "Cluster", vpc=_vpc(stack),
                                  machine_image=ec2.MachineImage.from_ssm_parameter("/aws/service/example/ami-id"), **props)


@pytest.mark.parametrize(
    ("props", "message"),
    [
        ({"num_servers": 0}, r"num_servers must be an integer from 1 to 64 \(parameter-server nodes\), got 0"),
        ({"num_servers": True}, r"num_servers must be an integer .* got True"),
        ({"desired_workers": 9}, r"min_workers <= desired_workers <= max_workers, got min_workers=1, desired_workers=9, max_workers=8"),
        ({"min_workers": 3, "desired_workers": 2}, r"got min_workers=3, desired_workers=2, max_workers=8"),
        ({"max_workers": 2000}, r"max_workers must be an integer from 1 to 1024 \(instances\), got 2000"),
        ({"scheduler_instance_type": "m5"}, r"scheduler_instance_type: 'm5' is not an EC2 instance type"),
        ({"server_instance_type": "big.box"}, r"server_instance_type: 'big.box' is not an EC2 instance type"),
        ({"worker_instance_types": []}, r"instance_types must be a non-empty list"),
        ({"ports": ClusterPorts(scheduler=80)}, r"ports.scheduler: got 80; allowed: an integer from 1024 to 65535 \(TCP port\)"),
        ({"ports": ClusterPorts(server=9002)}, r"ports must be three different TCP ports, got scheduler=9000, server=9002, worker=9002"),
        ({"ports": {"scheduler": 9000}}, r"ports must be a ClusterPorts"),
        ({"framework": "mxnet"}, r"framework must be a Framework \(MXNET, TENSORFLOW, PYTORCH\), got 'mxnet'"),
        ({"training_command": []}, r"training_command must be a non-empty list of strings"),
        ({"training_python": "python3"}, r"training_python must be an absolute path .* got 'python3'"),
        ({"training_requirements": ["ok==1", "bad'quote"]}, r"'training_requirements': got .*; allowed: a list of pip requirement"),
        ({"root_volume_size_gib": 4}, r"root_volume_size_gib must be an integer from 8 to 16384 \(GiB\), got 4"),
    ],
)
def test_fails_when_cluster_props_are_bad(stack: cdk.Stack, props: dict[str, Any], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        _cluster(stack, **props)


def test_ports_collapse_into_contiguous_ranges() -> None:
    assert ClusterPorts().ranges() == [(9000, 9002)]
    assert ClusterPorts(scheduler=7000, server=7100, worker=7101).ranges() == [(7000, 7000), (7100, 7101)]
    assert ClusterPorts(scheduler=9002, server=9000, worker=9004).ranges() == [(9000, 9000), (9002, 9002), (9004, 9004)]


def test_construct_with_an_existing_file_system_and_tensorflow(stack: cdk.Stack) -> None:
    from spot_training.infra.filesystem import SharedFileSystem

    vpc = _vpc(stack)
    shared = SharedFileSystem(stack, "Shared", vpc=vpc)
    cluster = ParameterServerCluster(stack, "Cluster", vpc=vpc, machine_image=ec2.MachineImage.from_ssm_parameter("/x"),
                                     framework=Framework.TENSORFLOW, file_system=shared, num_servers=1,
                                     desired_workers=1, max_workers=1, training_requirements=[])
    assert cluster.file_system is shared
    template = assertions.Template.from_stack(stack)
    template.resource_count_is("AWS::EFS::FileSystem", 1)
    template.has_resource_properties("AWS::EC2::SpotFleet", {"SpotFleetRequestConfigData": Match.object_like({"TargetCapacity": 1})})
    assert cluster.node_configs["scheduler"]["training"]["command"] == ["{python}", "-m", "spot_training.training.distributed.tf_pss"]
    assert cluster.node_configs["worker"]["cluster"]["num_servers"] == 1
    text = json.dumps(template.to_json())
    # training_requirements=[]: only the agent's own boto3 fallback install remains.
    assert "tensorflow[and-cuda]" not in text and "mxnet-cu112" not in text


# ---- context keys ----------------------------------------------------------------------------------


def cluster_settings(**context: object) -> ClusterSettings:
    """Read settings the way app.py does: from a real CDK app's context."""
    app = cdk.App(context=context)
    return ClusterSettings.from_context(app.node.try_get_context)


def test_cluster_defaults() -> None:
    s = cluster_settings()
    assert (s.stack_name, s.framework, s.num_servers, s.workers, s.min_workers, s.max_workers) == (
        "DistributedTraining", Framework.MXNET, 2, 2, 1, 8)
    assert (s.scheduler_instance_type, s.server_instance_type) == ("m5.large", "m5.xlarge")
    assert s.ports == ClusterPorts(9000, 9001, 9002)
    assert s.training_command == ("{python}", "-m", "spot_training.training.distributed.mxnet_dist")
    assert s.training_requirements is None  # the framework's builds per role
    tf = cluster_settings(cluster_framework="tensorflow")
    assert tf.training_command == ("{python}", "-m", "spot_training.training.distributed.tf_pss")
    assert cluster_settings(cluster_training_python="/opt/x/bin/python").training_requirements == ()
    assert cluster_settings(cluster_training_requirements='["mxnet==1.9.1"]').training_requirements == ("mxnet==1.9.1",)
    assert cluster_settings(cluster_training_requirements="[]").training_requirements == ()


@pytest.mark.parametrize(
    ("context", "message"),
    [
        ({"cluster_framework": "torch"}, r"'cluster_framework': got 'torch'; allowed: one of mxnet, tensorflow, pytorch"),
        ({"cluster_num_servers": "0"}, r"'cluster_num_servers': got '0'; allowed: an integer \(nodes\) from 1 to 64"),
        ({"cluster_num_servers": 65}, r"'cluster_num_servers': got 65; allowed: an integer \(nodes\) from 1 to 64"),
        ({"cluster_workers": "two"}, r"'cluster_workers': got 'two'; allowed: an integer \(instances\) from 1 to 1024"),
        ({"cluster_workers": 9}, r"'cluster_workers': got 9; allowed: from cluster_min_workers=1 to cluster_max_workers=8"),
        ({"cluster_min_workers": 3}, r"'cluster_workers': got 2; allowed: from cluster_min_workers=3 to cluster_max_workers=8"),
        ({"cluster_min_workers": 5, "cluster_max_workers": 4, "cluster_workers": 4},
         r"'cluster_min_workers': got 5; allowed: at most cluster_max_workers=4"),
        ({"cluster_max_workers": 0}, r"'cluster_max_workers': got 0; allowed: an integer \(instances\) from 1 to 1024"),
        ({"cluster_scheduler_instance_type": "large"}, r"context key 'cluster_scheduler_instance_type': 'large' is not an EC2 instance type"),
        ({"cluster_server_instance_type": "m5 .xlarge"}, r"context key 'cluster_server_instance_type': 'm5 \.xlarge' is not an EC2 instance type"),
        ({"cluster_worker_instance_types": ""}, r"'cluster_worker_instance_types': got ''; allowed: a non-empty list"),
        ({"cluster_worker_instance_types": "g5.xlarge,g5.xlarge"}, r"'cluster_worker_instance_types': got .*; allowed: distinct instance types"),
        ({"cluster_scheduler_port": "80"}, r"'cluster_scheduler_port': got '80'; allowed: an integer from 1024 to 65535 \(TCP port\)"),
        ({"cluster_server_port": 70000}, r"'cluster_server_port': got 70000; allowed: an integer from 1024 to 65535 \(TCP port\)"),
        ({"cluster_worker_port": 9001}, r"'cluster_worker_port': got 9001; allowed: a port different from the other two roles' ports"),
        ({"cluster_training_command": []}, r"'cluster_training_command': got \[\]; allowed: a non-empty list of strings"),
        ({"cluster_training_python": "python3"}, r"'cluster_training_python': got 'python3'; allowed: an absolute path"),
        ({"cluster_training_requirements": ["mxnet; rm -rf /"]}, r"'cluster_training_requirements': got .*; allowed: a list of pip requirement"),
        ({"cluster_stack_name": "9lives"}, r"'cluster_stack_name': got '9lives'; allowed: a CloudFormation stack name"),
        ({"root_volume_size_gib": 2}, r"'root_volume_size_gib': got 2; allowed: an integer \(GiB\) from 8 to 16384"),
    ],
)
def test_fails_when_a_cluster_context_key_is_bad(context: dict[str, object], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        cluster_settings(**context)


def test_fails_on_unknown_cluster_setting() -> None:
    with pytest.raises(ValueError, match=r"unknown cluster setting\(s\) \['cluster_servers'\]"):
        ClusterSettings.from_mapping({"cluster_servers": 2})


def test_docs_list_every_cluster_context_key_with_its_default() -> None:
    assert_docs_list_context_keys(CLUSTER_CONTEXT_KEYS, "infra.md")


def test_docs_cluster_example_synthesizes_clean(tmp_path: Any) -> None:
    """The "In your own CDK app" example of docs/infra.md runs as written: cdk-nag and cfn-lint clean."""
    from pathlib import Path

    text = (Path(__file__).resolve().parents[2] / "docs" / "infra.md").read_text()
    blocks = re.findall(r"```python\n(.*?)```", text, flags=re.S)
    (example,) = [b for b in blocks if "ParameterServerCluster(" in b and "app.synth()" in b]
    # The jsii runtime already runs (it read CDK_OUTDIR at its start), so pass the outdir to the App.
    assert example.count("app = cdk.App()") == 1
    example = example.replace("app = cdk.App()", f"app = cdk.App(outdir={str(tmp_path)!r})")
    namespace: dict[str, Any] = {}
    exec(compile(example, "docs/infra.md", "exec"), namespace)  # noqa: S102 - our own documentation
    stack = namespace["stack"]
    errors = assertions.Annotations.from_stack(stack).find_error("*", Match.any_value())
    assert [f"{m.id}: {m.entry.data}" for m in errors] == []
    template_file = tmp_path / "MyCluster.template.json"
    assert cfn_lint_errors(template_file) == []
    data = json.loads(template_file.read_text())
    (fleet,) = [r for r in data["Resources"].values() if r["Type"] == "AWS::EC2::SpotFleet"]
    assert fleet["Properties"]["SpotFleetRequestConfigData"]["TargetCapacity"] == 4
    assert namespace["cluster"].node_configs["scheduler"]["training"]["command"][-1] == "--scale-lr"


def test_every_role_builds_efs_utils_before_its_agent_and_may_mount_over_tls_with_iam(cluster_synth: Synth) -> None:
    for role, lt in _launch_templates(cluster_synth).items():
        text = _user_data(lt)
        assert "./build-deb.sh" in text, role
        assert text.index("spot_training_install_efs_utils") < text.index("systemctl enable --now spot-training-agent.service")
    (fs,) = cluster_synth.resources("AWS::EFS::FileSystem").values()
    statements = fs["Properties"]["FileSystemPolicy"]["Statement"]
    grants = [s for s in statements if s.get("Sid", "").startswith("MountAndWrite")]
    roles = {k for k in cluster_synth.resources("AWS::IAM::Role") if k.startswith(("ClusterNodeRole", "ClusterWorkerRole"))}
    assert {g["Principal"]["AWS"]["Fn::GetAtt"][0] for g in grants} == roles and len(roles) == 2
    for grant in grants:
        assert grant["Condition"]["Bool"]["aws:SecureTransport"] == "true"
    assert [s["Sid"] for s in statements if s["Effect"] == "Deny"] == ["DenyWithoutTls"]
