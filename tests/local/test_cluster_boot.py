"""How the cluster drill boots its nodes, without a deployed stack: each node runs its own role's launch
template user data through spot_training.local.node_init (docs/localmode.md, "The boot script"), with the shared
EFS directory as its ``/mnt/efs``, and a boot step that fails reports and shuts the node down.

Launch templates and instances live in the session's moto server (tests/conftest.py); the nodes run on
loopback (``SPOT_TRAINING_TEST_LOOPBACK``), the fallback that needs the port offset. The whole drill,
in network namespaces, is tests/local/test_cluster_drill.py.
"""

from __future__ import annotations

import base64
import json
import time
from pathlib import Path

import pytest

from spot_training.infra.userdata import BOOT_ERROR_TAG, boot_script, config_block
from spot_training.local.cluster_drill import ClusterNodeRunner, DeployedCluster
from spot_training.local.deploy import FLEET_TAG, DeployedStack, clients
from spot_training.local.netns import Network
from spot_training.local.nodes import NodeError

ROLES = ("scheduler", "server", "worker")


def _config(role: str) -> dict:
    return {
        "schema_version": 1, "region": "us-east-1", "stack_name": "DistributedTraining", "node_role": role,
        "volume": {"mount_point": "/dltraining"},
        "efs": {"file_system_id": "fs-1", "access_point_id": "fsap-1", "mount_point": "/mnt/efs"},
        "training": {"python": "/usr/bin/python3", "command": ["{python}", "-m", "spot_training.training.distributed.mxnet_dist"],
                     "dataset_dir": "/mnt/efs/datasets", "checkpoint_dir": "/mnt/efs/checkpoints",
                     "log_dir": "/mnt/efs/logs", "code": {"type": "asset", "path": "/opt/spot-training/code"}},
        "cluster": {"state_dir": "/mnt/efs/cluster", "num_servers": 1, "scheduler_port": 9000, "server_port": 9001,
                    "worker_port": 9002},
        "imds_endpoint": None,
    }


def _probe_user_data(role: str) -> str:
    """User data that writes its config as the stack's does, then records what it saw: its role (from
    its own template), the local-mode environment, and what its /mnt/efs holds."""
    return "\n".join(["#!/bin/bash", *config_block(json.dumps(_config(role))),
                      f'{{ echo "role={role} netns=${{SPOT_TRAINING_NETNS:-}} offset=${{SPOT_TRAINING_PORT_OFFSET:-}}"'
                      ' ; ls "$SPOT_TRAINING_ROOT/mnt/efs"; } > "$SPOT_TRAINING_ROOT/booted"', ""])


def _runner(ec2, moto_server, tmp_path: Path, user_data: dict[str, str], image_id: str):
    templates, instances = {}, {}
    for role, text in user_data.items():
        template = ec2.create_launch_template(LaunchTemplateName=f"lt-{role}", LaunchTemplateData={
            "ImageId": image_id, "UserData": base64.b64encode(text.encode()).decode()})
        templates[role] = template["LaunchTemplate"]["LaunchTemplateId"]
        tags = [{"Key": FLEET_TAG, "Value": "sfr-00000000-0000-0000-0000-000000000000"}] if role == "worker" else []
        reservation = ec2.run_instances(
            LaunchTemplate={"LaunchTemplateId": templates[role]}, MinCount=1, MaxCount=1,
            **({"TagSpecifications": [{"ResourceType": "instance", "Tags": tags}]} if tags else {}))
        instances[role] = reservation["Instances"][0]["InstanceId"]
    stack = DeployedStack(name="DistributedTraining", fleet_request_id="sfr-00000000-0000-0000-0000-000000000000",
                          launch_template_id=templates.get("worker", ""), data_volume_id="", subnets={}, resources={})
    cluster = DeployedCluster(stack=stack, groups={}, launch_templates=templates, file_system_id="fs-1")
    efs_dir = tmp_path / "efs"
    efs_dir.mkdir()
    runner = ClusterNodeRunner(cluster=cluster, network=Network(), efs_dir=efs_dir, aws=clients(moto_server.endpoint_url),
                               endpoint_url=moto_server.endpoint_url, volumes_dir=moto_server.volumes_dir,
                               work_dir=tmp_path)
    return runner, instances, efs_dir


def _wait_ended(runner: ClusterNodeRunner, timeout_s: float) -> None:
    deadline = time.time() + timeout_s
    while any(node.alive for node in runner.nodes.values()):
        assert time.time() < deadline, {i: n.log_path.read_text() for i, n in runner.nodes.items()}
        time.sleep(0.2)


def test_every_cluster_node_runs_its_own_roles_user_data_with_the_shared_efs(ec2, moto_server, tmp_path, image_id,
                                                                             monkeypatch):
    monkeypatch.setenv("SPOT_TRAINING_TEST_LOOPBACK", "1")
    runner, instances, efs_dir = _runner(ec2, moto_server, tmp_path, {r: _probe_user_data(r) for r in ROLES}, image_id)
    (efs_dir / "datasets").mkdir()
    try:
        for role in ROLES:
            runner.start_node(instances[role], role)
        with pytest.raises(NodeError, match="role 'coordinator' has no launch template"):
            runner.start_node(instances["worker"], "coordinator")
        _wait_ended(runner, 60)
        offsets = set()
        for role in ROLES:
            node = runner.nodes[instances[role]]
            assert node.process.returncode == 0, node.log_path.read_text()
            log = node.log_path.read_text()
            assert "local-init: running the user data" in log and "local-init: user data exited with status 0" in log
            assert (node.node_dir / "user-data").read_text() == _probe_user_data(role)
            booted = (node.node_dir / "root" / "booted").read_text().split()
            # Its own template's user data, on loopback: no namespace, a port offset of its own.
            assert booted[:2] == [f"role={role}", "netns="] and booted[2].startswith("offset=")
            offsets.add(booted[2])
            assert booted[3:] == ["datasets"]  # /mnt/efs is the shared directory
            # The config is the one the user data wrote, under the node root; the runner wrote none.
            written = node.node_dir / "root" / "etc" / "spot-training" / "config.json"
            assert json.loads(written.read_text())["node_role"] == role
            assert not (node.node_dir / "config.json").exists()
            assert Path(node.config["efs"]["mount_point"]).resolve() == efs_dir.resolve()
            assert node.config["cluster"]["state_dir"] == str(node.node_dir / "root" / "mnt" / "efs" / "cluster")
        assert len(offsets) == len(ROLES)
    finally:
        runner.close()


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_a_cluster_worker_whose_boot_step_fails_reports_and_shuts_down(ec2, moto_server, tmp_path, image_id,
                                                                       monkeypatch):
    # The stack's real boot script, with an agent asset that is not there: fetch-agent fails every
    # attempt (backoff 5 + 10 + 15 s), the boot-failure script reports it as final and shuts the node down.
    monkeypatch.setenv("SPOT_TRAINING_TEST_LOOPBACK", "1")
    clients(moto_server.endpoint_url).s3.create_bucket(Bucket="assets")
    lines = boot_script(asset_url="s3://assets/missing.zip", region="us-east-1", stack_name="DistributedTraining",
                        volume_tags={"spot-training:stack": "DistributedTraining"},
                        config_json=json.dumps(_config("worker")), boto3_requirement="boto3", efs=True)
    runner, instances, _ = _runner(ec2, moto_server, tmp_path, {"worker": "\n".join(["#!/bin/bash", *lines, ""])},
                                   image_id)
    try:
        node = runner.start_node(instances["worker"], "worker")
        _wait_ended(runner, 200)
        log = node.log_path.read_text()
        assert "step fetch-agent failed (attempt 3 of 4)" in log and "step start-agent ok" not in log
        console = (node.node_dir / "console.log").read_text()
        assert "spot-training: boot failed at step 'fetch-agent'" in console and "shutting down" in console
        # The asset is not there (S3 answers 404): every replacement would fail alike, so the report is final.
        assert "retrying will not help" in console and "mode final" in console
        assert node.shutdown_requested
        tags = {t["Key"]: t["Value"] for t in ec2.describe_tags(
            Filters=[{"Name": "resource-id", "Values": [instances["worker"]]}])["Tags"]}
        assert tags[BOOT_ERROR_TAG].startswith("fetch-agent: failed 4 attempts")
        # In local mode the efs-utils step installs nothing (SPOT_TRAINING_BLOCKDEV_DIR: no git clone, no apt).
        assert "amazon-efs-utils" not in log
        assert runner.reap_shutdowns() == [instances["worker"]]
        state = ec2.describe_instances(InstanceIds=[instances["worker"]])["Reservations"][0]["Instances"][0]["State"]
        assert state["Name"] in ("shutting-down", "terminated")
    finally:
        runner.close()
