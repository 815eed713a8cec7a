"""Retained data of an earlier deployment of the same stack name is never a later deployment's: the
agent's volume step, periodic and migration snapshot pruning and the cleanup handler act
only on their own ``spot-training:deployment``; the agent's error advice is safe. moto server over HTTP."""

from __future__ import annotations

import dataclasses
import importlib.util
import logging
import time
from pathlib import Path

import pytest
from storage_helpers import FAST, STACK, config_dict, create_data_volume, data_volumes, run_instance

from spot_training.agent.blockdev import DirectoryBlockDevices
from spot_training.agent.config import DEPLOYMENT_TAG, MIGRATION_SNAPSHOT_PURPOSE, PERIODIC_SNAPSHOT_PURPOSE, parse_config
from spot_training.agent.ebs import VolumeTimeouts, prepare_data_volume
from spot_training.agent.errors import ConfigError
from spot_training.agent.snapshots import PeriodicSnapshots

LOG = logging.getLogger("test.deployment")
OLD, NEW = "11111111-aaaa-4bbb-8ccc-000000000001", "22222222-aaaa-4bbb-8ccc-000000000002"
HANDLER_PATH = Path(__file__).resolve().parents[2] / "spot_training" / "infra" / "handlers" / "data_cleanup" / "index.py"


def _config(tmp_path, deployment: str | None = NEW, keep: int = 1):
    data = config_dict(tmp_path, keep_snapshots=keep)
    if deployment is not None:
        data["volume"]["tags"][DEPLOYMENT_TAG] = deployment
    return parse_config(data)


def _snapshot(ec2, volume_id: str, purpose: str, deployment: str | None) -> str:
    tags = {"spot-training:stack": STACK, "spot-training:purpose": purpose}
    if deployment is not None:
        tags[DEPLOYMENT_TAG] = deployment
    snapshot_id = ec2.create_snapshot(VolumeId=volume_id, TagSpecifications=[{
        "ResourceType": "snapshot", "Tags": [{"Key": k, "Value": v} for k, v in tags.items()]}])["SnapshotId"]
    time.sleep(1.1)  # moto's StartTime resolution: keep the order unambiguous
    return snapshot_id


def _snapshot_ids(ec2) -> set[str]:
    return {s["SnapshotId"] for s in ec2.describe_snapshots(OwnerIds=["self"])["Snapshots"]}


def _tags(resource) -> dict[str, str]:
    return {t["Key"]: t["Value"] for t in resource.get("Tags", [])}


def test_the_agent_ignores_and_keeps_an_earlier_deployments_retained_volume_and_snapshots(ec2, moto_server, tmp_path):
    """The issue's story: destroy with retain_data, deploy the same stack name again. Before, the agent
    exited 78 on two volumes; whoever followed its advice lost the retained snapshot to pruning."""
    old_volume = create_data_volume(ec2, "us-east-1a", extra_tags={DEPLOYMENT_TAG: OLD})
    old_periodic = _snapshot(ec2, old_volume, PERIODIC_SNAPSHOT_PURPOSE, OLD)
    old_migration = _snapshot(ec2, old_volume, MIGRATION_SNAPSHOT_PURPOSE, OLD)
    legacy = _snapshot(ec2, old_volume, PERIODIC_SNAPSHOT_PURPOSE, None)  # from before deployments were tagged
    new_volume = create_data_volume(ec2, "us-east-1a", extra_tags={DEPLOYMENT_TAG: NEW})
    config = _config(tmp_path, keep=1)
    instance_id = run_instance(ec2, "us-east-1a")

    prepare_data_volume(ec2=ec2, config=config, instance_id=instance_id, availability_zone="us-east-1a",
                        blockdev=DirectoryBlockDevices(moto_server.volumes_dir), log=LOG, timeouts=VolumeTimeouts(**FAST))
    volumes = {v["VolumeId"]: v for v in data_volumes(ec2)}
    assert [a["InstanceId"] for a in volumes[new_volume]["Attachments"]] == [instance_id]
    assert volumes[old_volume]["Attachments"] == [] and _tags(volumes[old_volume])[DEPLOYMENT_TAG] == OLD

    # Periodic snapshots: keep 1, take 2 of ours; the earlier deployment's stay, ours carry our tag.
    volume = dataclasses.replace(config.volume, snapshot_interval_s=3600)
    periodic = PeriodicSnapshots(ec2=ec2, stack_name=STACK, volume=volume, instance_id=instance_id, log=LOG)
    first = periodic.take()
    time.sleep(1.1)
    second = periodic.take()
    left = _snapshot_ids(ec2)
    assert {old_periodic, old_migration, legacy} <= left, "an earlier deployment's snapshot was pruned"
    assert second in left and first not in left  # our own pruning still works
    [ours] = ec2.describe_snapshots(SnapshotIds=[second])["Snapshots"]
    assert _tags(ours)[DEPLOYMENT_TAG] == NEW


def test_a_move_tags_its_snapshot_and_copy_and_prunes_only_this_deployments(ec2, moto_server, tmp_path):
    old_volume = create_data_volume(ec2, "us-east-1a", extra_tags={DEPLOYMENT_TAG: OLD})
    old_migration = _snapshot(ec2, old_volume, MIGRATION_SNAPSHOT_PURPOSE, OLD)
    new_volume = create_data_volume(ec2, "us-east-1a", extra_tags={DEPLOYMENT_TAG: NEW})
    from spot_training.local.moto_compat import volume_dir
    (volume_dir(moto_server.ebs_dir, new_volume) / DirectoryBlockDevices.FS_MARKER).write_text("xfs")
    config = _config(tmp_path, keep=1)
    instance_id = run_instance(ec2, "us-east-1b")
    prepare_data_volume(ec2=ec2, config=config, instance_id=instance_id, availability_zone="us-east-1b",
                        blockdev=DirectoryBlockDevices(moto_server.volumes_dir), log=LOG, timeouts=VolumeTimeouts(**FAST))
    ours = [v for v in data_volumes(ec2) if _tags(v).get(DEPLOYMENT_TAG) == NEW]
    assert [v["AvailabilityZone"] for v in ours] == ["us-east-1b"]  # moved, the source retired
    assert old_volume in {v["VolumeId"] for v in data_volumes(ec2)}
    assert old_migration in _snapshot_ids(ec2)
    migrations = ec2.describe_snapshots(OwnerIds=["self"], Filters=[
        {"Name": "tag:spot-training:purpose", "Values": [MIGRATION_SNAPSHOT_PURPOSE]},
        {"Name": f"tag:{DEPLOYMENT_TAG}", "Values": [NEW]}])["Snapshots"]
    assert migrations, "the move's snapshot does not carry this deployment's tag"


def test_two_volumes_of_one_deployment_give_safe_advice(ec2, moto_server, tmp_path):
    """The advice must not send the user to untag or delete a volume (that led to data loss)."""
    first = create_data_volume(ec2, "us-east-1a", extra_tags={DEPLOYMENT_TAG: NEW})
    second = create_data_volume(ec2, "us-east-1a", extra_tags={DEPLOYMENT_TAG: NEW})
    config = _config(tmp_path)
    with pytest.raises(ConfigError) as caught:
        prepare_data_volume(ec2=ec2, config=config, instance_id=run_instance(ec2, "us-east-1a"),
                            availability_zone="us-east-1a", blockdev=DirectoryBlockDevices(moto_server.volumes_dir),
                            log=LOG, timeouts=VolumeTimeouts(**FAST))
    message = str(caught.value)
    assert first in message and second in message
    assert "remove the 'spot-training:purpose' tag" not in message and "or delete them" not in message
    assert "Snapshot each one first" in message and "Do not delete or untag" in message
    assert {v["VolumeId"] for v in data_volumes(ec2)} == {first, second}


def _load_handler():
    spec = importlib.util.spec_from_file_location("data_cleanup_index_deployment", HANDLER_PATH)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_cdk_destroy_deletes_only_this_deployments_data(ec2):
    old_volume = create_data_volume(ec2, "us-east-1a", extra_tags={DEPLOYMENT_TAG: OLD})
    old_snapshot = _snapshot(ec2, old_volume, PERIODIC_SNAPSHOT_PURPOSE, OLD)
    new_volume = create_data_volume(ec2, "us-east-1a", extra_tags={DEPLOYMENT_TAG: NEW})
    new_snapshot = _snapshot(ec2, new_volume, PERIODIC_SNAPSHOT_PURPOSE, NEW)
    handler = _load_handler()
    result = handler.handler({"RequestType": "Delete", "PhysicalResourceId": "data-cleanup-SpotTraining",
                              "ResourceProperties": {"StackName": STACK, "DeploymentTagValue": NEW}}, None)
    assert result["Data"]["DeletedVolumes"] == new_volume
    assert result["Data"]["DeletedSnapshots"] == new_snapshot
    assert {v["VolumeId"] for v in data_volumes(ec2)} == {old_volume}
    assert old_snapshot in _snapshot_ids(ec2)
    with pytest.raises(ValueError, match="DeploymentTagValue"):
        handler.handler({"RequestType": "Delete", "ResourceProperties": {"StackName": STACK, "DeploymentTagValue": ""}}, None)


def test_explicit_adoption_makes_a_retained_volume_this_deployments(ec2, moto_server, tmp_path):
    """-c adopt_volume_id=vol-...: the stack creates no new volume; the agent retags the named one."""
    old_volume = create_data_volume(ec2, "us-east-1a", extra_tags={DEPLOYMENT_TAG: OLD})
    other_stack = create_data_volume(ec2, "us-east-1a", stack="OtherStack", extra_tags={DEPLOYMENT_TAG: OLD})
    data = config_dict(tmp_path)
    data["volume"]["tags"][DEPLOYMENT_TAG] = NEW
    data["volume"]["adopt_volume_id"] = other_stack
    with pytest.raises(ConfigError, match=rf"adopt_volume_id {other_stack} carries the tags"):
        prepare_data_volume(ec2=ec2, config=parse_config(data), instance_id=run_instance(ec2, "us-east-1a"),
                            availability_zone="us-east-1a", blockdev=DirectoryBlockDevices(moto_server.volumes_dir),
                            log=LOG, timeouts=VolumeTimeouts(**FAST))
    [untouched] = ec2.describe_volumes(VolumeIds=[other_stack])["Volumes"]
    assert _tags(untouched)[DEPLOYMENT_TAG] == OLD

    data["volume"]["adopt_volume_id"] = old_volume
    config = parse_config(data)
    instance_id = run_instance(ec2, "us-east-1a")
    for _ in range(2):  # a second boot finds it by its tags; adopting again changes nothing
        prepare_data_volume(ec2=ec2, config=config, instance_id=instance_id, availability_zone="us-east-1a",
                            blockdev=DirectoryBlockDevices(moto_server.volumes_dir), log=LOG, timeouts=VolumeTimeouts(**FAST))
    [adopted] = ec2.describe_volumes(VolumeIds=[old_volume])["Volumes"]
    assert _tags(adopted)[DEPLOYMENT_TAG] == NEW
    assert [a["InstanceId"] for a in adopted["Attachments"]] == [instance_id]

    # Once moved away (source retired), the gone id is not an error: the copy is found by its tags.
    data["volume"]["adopt_volume_id"] = "vol-0000000000000dead"
    prepare_data_volume(ec2=ec2, config=parse_config(data), instance_id=instance_id, availability_zone="us-east-1a",
                        blockdev=DirectoryBlockDevices(moto_server.volumes_dir), log=LOG, timeouts=VolumeTimeouts(**FAST))


def test_adoption_needs_a_deployment_tag_and_a_volume_id(tmp_path):
    data = config_dict(tmp_path)
    data["volume"]["adopt_volume_id"] = "vol-0123456789abcdef0"
    with pytest.raises(ConfigError, match="adopt_volume_id"):
        parse_config(data)  # no deployment tag: nothing to adopt into
    data["volume"]["tags"][DEPLOYMENT_TAG] = NEW
    data["volume"]["adopt_volume_id"] = "--volume"
    with pytest.raises(ConfigError, match="adopt_volume_id"):
        parse_config(data)


def test_no_volume_of_this_deployment_names_the_others_and_how_to_adopt(ec2, moto_server, tmp_path):
    """An existing stack updated to deployment tags after its volume moved (the copy has no deployment
    tag), or a new deployment whose volume is missing: the agent names the candidates, touches nothing."""
    legacy = create_data_volume(ec2, "us-east-1a")  # no deployment tag
    with pytest.raises(ConfigError, match=rf"{legacy}.*adopt_volume_id"):
        prepare_data_volume(ec2=ec2, config=_config(tmp_path), instance_id=run_instance(ec2, "us-east-1a"),
                            availability_zone="us-east-1a", blockdev=DirectoryBlockDevices(moto_server.volumes_dir),
                            log=LOG, timeouts=VolumeTimeouts(**FAST))
    [volume] = ec2.describe_volumes(VolumeIds=[legacy])["Volumes"]
    assert DEPLOYMENT_TAG not in _tags(volume) and volume["Attachments"] == []
