"""Crash injection: SIGKILL the volume step (a real process) right after each step of a cross-AZ move,
then rerun it. At every moment at least one tagged data volume holds the data; at the end exactly one
does, in the instance's AZ, mounted, with no leftover snapshot, copy or lease."""

from __future__ import annotations

import signal
import time

import pytest
from storage_helpers import (
    agent_command,
    data_volumes,
    events,
    make_config,
    migration_snapshots,
    new_node,
    run_instance,
    run_until_event,
    seed_data_volume,
    start_agent,
)

from spot_training.agent.lease import LEASE_TAG
from spot_training.local.moto_compat import volume_dir

#: The move's steps in the order the agent logs them (spot_training/agent/ebs.py).
MOVE_STEPS = ["lease_acquired", "snapshot_created", "snapshot_completed", "volume_created", "volume_available",
              "volume_attached", "device_verified", "copy_verified", "old_volume_retired", "snapshots_pruned",
              "lease_released", "volume_mounted"]
PAYLOAD = b"checkpoint at step 1234"


def _seed(ec2, moto_server):
    return seed_data_volume(ec2, moto_server.ebs_dir, {"checkpoints/ckpt-1234": PAYLOAD})


def _copies_with_data(ec2, moto_server) -> list[str]:
    """Tagged data volumes whose bytes hold the payload."""
    found = []
    for volume in data_volumes(ec2):
        path = volume_dir(moto_server.ebs_dir, volume["VolumeId"]) / "checkpoints" / "ckpt-1234"
        if path.exists() and path.read_bytes() == PAYLOAD:
            found.append(volume["VolumeId"])
    return found


def _kill_at(argv, step):
    process, seen = run_until_event(argv, step)
    reached = bool(seen) and seen[-1].get("event") == step
    if reached:
        process.send_signal(signal.SIGKILL)
    process.wait(timeout=30)
    return reached, process.returncode


def _assert_converged(ec2, moto_server, config, instance_id):
    volumes = data_volumes(ec2)
    assert len(volumes) == 1, [v["VolumeId"] for v in volumes]
    [volume] = volumes
    assert volume["AvailabilityZone"] == "us-east-1b"
    assert [a["InstanceId"] for a in volume["Attachments"]] == [instance_id]
    assert LEASE_TAG not in {t["Key"] for t in volume.get("Tags", [])}
    assert (config.volume.mount_point / "checkpoints" / "ckpt-1234").read_bytes() == PAYLOAD
    assert len(migration_snapshots(ec2)) == 1  # the one move's snapshot (keep_snapshots=2), no orphans
    assert len(ec2.describe_volumes()["Volumes"]) == 2  # the data volume and the instance's root volume


@pytest.mark.slow
@pytest.mark.parametrize("step", MOVE_STEPS)
def test_kill_after_step_then_rerun_converges(ec2, moto_server, tmp_path, step):
    _seed(ec2, moto_server)
    instance_id, config, argv = new_node(ec2, tmp_path, "us-east-1b", moto_server.volumes_dir)

    reached, code = _kill_at(argv + ["--pause-after", step], step)
    assert reached, f"the agent never logged {step!r} (exit {code})"
    assert code == -signal.SIGKILL
    assert _copies_with_data(ec2, moto_server), f"no copy of the data after a kill at {step}"

    rerun = start_agent(argv)
    out, err = rerun.communicate(timeout=60)
    assert rerun.returncode == 0, err + out
    assert events(out)[-1]["event"] == "done"
    _assert_converged(ec2, moto_server, config, instance_id)


@pytest.mark.slow
def test_killed_after_every_step_in_turn_still_converges(ec2, moto_server, tmp_path):
    """One boot killed at the first step, its rerun killed at the next one, and so on."""
    _seed(ec2, moto_server)
    instance_id, config, argv = new_node(ec2, tmp_path, "us-east-1b", moto_server.volumes_dir)
    kills = 0
    for step in MOVE_STEPS:
        reached, code = _kill_at(argv + ["--pause-after", step], step)
        kills += reached
        assert code in (0, -signal.SIGKILL), f"exit {code} when pausing at {step}"
        assert _copies_with_data(ec2, moto_server), f"no copy of the data after a kill at {step}"
    final = start_agent(argv)
    out, err = final.communicate(timeout=60)
    assert final.returncode == 0, err + out
    assert kills >= 5  # the chain really crashed at many different points
    _assert_converged(ec2, moto_server, config, instance_id)


@pytest.mark.slow
@pytest.mark.parametrize("step", ["snapshot_created", "volume_created", "volume_attached", "copy_verified",
                                  "old_volume_retired"])
def test_mover_interrupted_and_replaced_in_a_third_az_converges(ec2, moto_server, tmp_path, step):
    """The instance moving the volume dies mid-move (killed, then terminated as spot does); its
    replacement boots in yet another AZ once the dead one's lease expired, and finishes the job."""
    config, config_path = make_config(tmp_path)
    _seed(ec2, moto_server)
    dying = run_instance(ec2, "us-east-1b")
    reached, _ = _kill_at(agent_command(config_path, dying, "us-east-1b", moto_server.volumes_dir)
                          + ["--pause-after", step], step)
    assert reached
    ec2.terminate_instances(InstanceIds=[dying])  # detaches whatever it had attached
    assert _copies_with_data(ec2, moto_server)
    # Time passes: the dead instance's lease (if it still held one) runs out. Rewritten rather than
    # waited for, so that a slow machine cannot make the dying agent lose its lease mid-move.
    for volume in data_volumes(ec2):
        for tag in volume.get("Tags", []):
            if tag["Key"] == LEASE_TAG:
                owner = tag["Value"].split()[0]
                ec2.create_tags(Resources=[volume["VolumeId"]],
                                Tags=[{"Key": LEASE_TAG, "Value": f"{owner} {int(time.time()) - 1}"}])

    replacement = run_instance(ec2, "us-east-1c")
    rerun = start_agent(agent_command(config_path, replacement, "us-east-1c", moto_server.volumes_dir))
    out, err = rerun.communicate(timeout=60)
    assert rerun.returncode == 0, err + out

    volumes = data_volumes(ec2)
    assert len(volumes) == 1, [(v["VolumeId"], v["AvailabilityZone"], v["Tags"]) for v in volumes]
    [volume] = volumes
    assert volume["AvailabilityZone"] == "us-east-1c"
    assert [a["InstanceId"] for a in volume["Attachments"]] == [replacement]
    assert (config.volume.mount_point / "checkpoints" / "ckpt-1234").read_bytes() == PAYLOAD
    assert len(migration_snapshots(ec2)) <= config.volume.keep_snapshots
    assert LEASE_TAG not in {t["Key"] for t in volume.get("Tags", [])}
