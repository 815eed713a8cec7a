"""Two agents (real processes, different instances) racing for one data volume: exactly one attaches
it (or moves it); the other waits and then exits 75, and nothing is lost or duplicated."""

from __future__ import annotations

import pytest
from storage_helpers import data_volumes, events, migration_snapshots, new_node, seed_data_volume, start_agent

from spot_training.agent.lease import LEASE_TAG

PAYLOAD = b"dataset shard 0"


def _race(ec2, moto_server, tmp_path, zones):
    seed_data_volume(ec2, moto_server.ebs_dir, {"shard-0": PAYLOAD})
    agents = [new_node(ec2, tmp_path / f"node{n}", az, moto_server.volumes_dir) for n, az in enumerate(zones)]
    processes = [start_agent(argv) for _, _, argv in agents]  # started together
    results = []
    for (instance_id, config, _), process in zip(agents, processes):
        out, err = process.communicate(timeout=60)
        results.append((instance_id, config, process.returncode, events(out), err))
    return results


@pytest.mark.slow
@pytest.mark.parametrize("zones", [("us-east-1a", "us-east-1a"), ("us-east-1b", "us-east-1c"), ("us-east-1a", "us-east-1b")],
                         ids=["both-in-the-volume-az", "both-elsewhere", "one-each"])
def test_exactly_one_agent_gets_the_volume(ec2, moto_server, tmp_path, zones):
    results = _race(ec2, moto_server, tmp_path, zones)

    codes = sorted(code for _, _, code, _, _ in results)
    assert codes == [0, 75], [(code, err[-500:]) for _, _, code, _, err in results]
    winner = next(r for r in results if r[2] == 0)
    loser = next(r for r in results if r[2] == 75)
    volumes = data_volumes(ec2)
    assert len(volumes) == 1, [v["VolumeId"] for v in volumes]
    [volume] = volumes
    assert [a["InstanceId"] for a in volume["Attachments"]] == [winner[0]]
    assert LEASE_TAG not in {t["Key"] for t in volume.get("Tags", [])}
    assert (winner[1].volume.mount_point / "shard-0").read_bytes() == PAYLOAD
    assert not loser[1].volume.mount_point.exists()  # the loser never mounted anything
    assert not any(e.get("event") in ("volume_attached", "snapshot_created") for e in loser[3])
    moved = volume["AvailabilityZone"] != "us-east-1a"
    assert len(migration_snapshots(ec2)) == (1 if moved else 0)  # one move at most, never two
    loser_events = {e.get("event") for e in loser[3]}
    assert loser_events & {"lease_wait", "waiting_for_detach"}, loser_events  # it saw the other and waited
    attached = [e for _, _, _, evs, _ in results for e in evs if e.get("event") == "volume_attached"]
    assert len(attached) == 1


@pytest.mark.slow
@pytest.mark.parametrize("new_az", ["us-east-1a", "us-east-1b"], ids=["new-fleet-in-the-volume-az", "new-fleet-elsewhere"])
def test_stack_update_new_fleet_node_waits_for_the_old_node_then_takes_the_volume(ec2, moto_server, tmp_path, new_az):
    """A user-data change makes a new launch template version; the fleet follows LatestVersionNumber, so
    CloudFormation replaces the fleet: the new fleet's node boots while the old node still trains on the
    volume, and the old fleet (and its node) goes only afterwards. The new node must neither attach,
    snapshot nor copy a volume another running instance holds: it exits 75 (systemd retries it), and
    takes the volume, intact and alone, once the old node is gone."""
    old_id = seed_data_volume(ec2, moto_server.ebs_dir, {"shard-0": PAYLOAD})
    nodes = [new_node(ec2, tmp_path / name, az, moto_server.volumes_dir)
             for name, az in (("old", "us-east-1a"), ("new", new_az))]
    (old_instance, old_config, old_argv), (new_instance, new_config, new_argv) = nodes

    old = start_agent(old_argv)
    out, err = old.communicate(timeout=60)
    assert old.returncode == 0, err[-500:]
    assert [a["InstanceId"] for a in data_volumes(ec2)[0]["Attachments"]] == [old_instance]

    # The new fleet's node boots while the old node still holds the volume.
    first = start_agent(new_argv)
    out, err = first.communicate(timeout=60)
    assert first.returncode == 75, err[-500:]
    first_events = {e.get("event") for e in events(out)}
    assert "waiting_for_detach" in first_events
    assert not first_events & {"volume_attached", "snapshot_created", "volume_created"}
    [volume] = data_volumes(ec2)
    assert (volume["VolumeId"], [a["InstanceId"] for a in volume["Attachments"]]) == (old_id, [old_instance])
    assert migration_snapshots(ec2) == [] and LEASE_TAG not in {t["Key"] for t in volume.get("Tags", [])}
    assert not new_config.volume.mount_point.exists()

    # CloudFormation deletes the old fleet: its node is terminated, the volume detaches.
    ec2.terminate_instances(InstanceIds=[old_instance])
    second = start_agent(new_argv)  # systemd's restart of the new node's agent
    out, err = second.communicate(timeout=60)
    assert second.returncode == 0, err[-500:]
    [volume] = data_volumes(ec2)
    assert [a["InstanceId"] for a in volume["Attachments"]] == [new_instance]
    assert volume["AvailabilityZone"] == new_az and (volume["VolumeId"] == old_id) == (new_az == "us-east-1a")
    assert (new_config.volume.mount_point / "shard-0").read_bytes() == PAYLOAD
    assert LEASE_TAG not in {t["Key"] for t in volume.get("Tags", [])}
