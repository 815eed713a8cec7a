"""Helpers for the storage tests (EBS volume step, lease, crash and race drills) against the moto server."""

from __future__ import annotations

import getpass
import json
import os
import queue
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

from spot_training.agent.config import AgentConfig, parse_config

STACK = "SpotTraining"
IMAGE_ID = "ami-0123456789abcdef0"  # moto does not validate AMI ids
DATA_TAGS = {"spot-training:stack": STACK, "spot-training:purpose": "data-volume"}
AGENT = Path(__file__).resolve().parent / "volume_agent.py"
REPO = Path(__file__).resolve().parents[2]
#: Fast timeouts for tests: the moto server answers at once, so only the lease settle matters.
FAST = {"lease_settle_s": 0.2, "lease_wait_s": 3.0, "lease_poll_s": 0.3, "detach_wait_s": 2.0,
        "waiter_delay_s": 1.0, "device_s": 2.0, "device_poll_s": 0.05}


def config_dict(tmp_path: Path, *, stack: str = STACK, keep_snapshots: int = 2) -> dict[str, Any]:
    """A node config (docs/contracts.md) whose mount point and training dirs live under ``tmp_path``."""
    mount = tmp_path / "dltraining"
    return {
        "schema_version": 1, "region": "us-east-1", "stack_name": stack, "node_role": "single",
        "volume": {"tags": {"spot-training:stack": stack, "spot-training:purpose": "data-volume"},
                   "device_name": "/dev/sdf", "mount_point": str(mount), "fs_type": "xfs",
                   "keep_snapshots": keep_snapshots},
        "efs": None,
        "training": {"framework": "tensorflow", "python": sys.executable, "command": ["{python}", "train.py"],
                     "user": getpass.getuser(), "dataset_dir": str(mount / "datasets"),
                     "checkpoint_dir": str(mount / "checkpoints"), "log_dir": str(mount / "logs"),
                     "code": {"type": "asset", "path": str(tmp_path / "code")}},
        "cleanup": {"cancel_fleet_on_success": True},
        "imds_endpoint": None,
    }


def make_config(tmp_path: Path, **kwargs: Any) -> tuple[AgentConfig, Path]:
    """The parsed config and the path of its JSON file."""
    data = config_dict(tmp_path, **kwargs)
    path = tmp_path / "config.json"
    path.write_text(json.dumps(data))
    return parse_config(data), path


def create_data_volume(ec2: Any, az: str = "us-east-1a", *, stack: str = STACK, extra_tags: dict[str, str] | None = None,
                       **kwargs: Any) -> str:
    """A data volume with both stack tags (gp3, 20 GiB unless overridden)."""
    tags = {"spot-training:stack": stack, "spot-training:purpose": "data-volume", **(extra_tags or {})}
    params = {"AvailabilityZone": az, "Size": 20, "VolumeType": "gp3", **kwargs}
    return ec2.create_volume(**params, TagSpecifications=[{
        "ResourceType": "volume", "Tags": [{"Key": k, "Value": v} for k, v in tags.items()]}])["VolumeId"]


def seed_data_volume(ec2: Any, ebs_dir: Path, files: dict[str, bytes], az: str = "us-east-1a") -> str:
    """A data volume (:func:`create_data_volume`) in ``az`` whose bytes in the moto server's EBS data
    plane ``ebs_dir`` hold an xfs file system and ``files`` (path under the volume root -> bytes);
    returns its id."""
    from spot_training.agent.blockdev import DirectoryBlockDevices
    from spot_training.local.moto_compat import volume_dir

    volume_id = create_data_volume(ec2, az)
    data = volume_dir(ebs_dir, volume_id)
    (data / DirectoryBlockDevices.FS_MARKER).write_text("xfs")
    for name, payload in files.items():
        (data / name).parent.mkdir(parents=True, exist_ok=True)
        (data / name).write_bytes(payload)
    return volume_id


def new_node(ec2: Any, node_dir: Path, az: str, blockdev_dir: Path) -> tuple[str, AgentConfig, list[str]]:
    """A running instance in ``az`` with its agent's config under ``node_dir`` (created): returns
    ``(instance id, config, the agent's command line)`` (:func:`agent_command`)."""
    node_dir.mkdir(exist_ok=True)
    config, config_path = make_config(node_dir)
    instance_id = run_instance(ec2, az)
    return instance_id, config, agent_command(config_path, instance_id, az, blockdev_dir)


def run_instance(ec2: Any, az: str) -> str:
    """A running instance in ``az``."""
    return ec2.run_instances(ImageId=IMAGE_ID, MinCount=1, MaxCount=1, InstanceType="t3.micro",
                             Placement={"AvailabilityZone": az})["Instances"][0]["InstanceId"]


def data_volumes(ec2: Any, stack: str = STACK) -> list[dict[str, Any]]:
    """Volumes carrying both data-volume tags."""
    return ec2.describe_volumes(Filters=[
        {"Name": "tag:spot-training:stack", "Values": [stack]},
        {"Name": "tag:spot-training:purpose", "Values": ["data-volume"]}])["Volumes"]


def migration_snapshots(ec2: Any, stack: str = STACK) -> list[dict[str, Any]]:
    """Snapshots tagged as the stack's migration snapshots."""
    return ec2.describe_snapshots(OwnerIds=["self"], Filters=[
        {"Name": "tag:spot-training:stack", "Values": [stack]},
        {"Name": "tag:spot-training:purpose", "Values": ["migration-snapshot"]}])["Snapshots"]


def aws_state(ec2: Any) -> dict[str, Any]:
    """Everything the volume step could create, change or delete, in comparable form."""
    volumes = sorted((v["VolumeId"], v["AvailabilityZone"], v["State"], v["VolumeType"], v["Size"],
                      tuple(sorted((t["Key"], t["Value"]) for t in v.get("Tags", []))),
                      tuple(sorted((a["InstanceId"], a["State"]) for a in v.get("Attachments", []))))
                     for v in ec2.describe_volumes()["Volumes"])
    snapshots = sorted((s["SnapshotId"], s["VolumeId"], tuple(sorted((t["Key"], t["Value"]) for t in s.get("Tags", []))))
                       for s in ec2.describe_snapshots(OwnerIds=["self"])["Snapshots"])
    return {"volumes": volumes, "snapshots": snapshots}


def agent_command(config_path: Path, instance_id: str, az: str, blockdev_dir: Path, *,
                  timeouts: dict[str, float] | None = None, pause_after: str | None = None) -> list[str]:
    """argv of the volume-step driver (tests/agent/volume_agent.py)."""
    argv = [sys.executable, str(AGENT), "--config", str(config_path), "--instance-id", instance_id, "--az", az,
            "--blockdev-dir", str(blockdev_dir), "--timeouts", json.dumps(timeouts if timeouts is not None else FAST)]
    if pause_after:
        argv += ["--pause-after", pause_after]
    return argv


def start_agent(argv: list[str]) -> subprocess.Popen[str]:
    """Start the driver with the test's environment (AWS_ENDPOINT_URL of the moto server)."""
    return subprocess.Popen(argv, cwd=REPO, env=dict(os.environ), stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True)


def events(output: str) -> list[dict[str, Any]]:
    """The agent's JSON log lines."""
    found = []
    for line in output.splitlines():
        line = line.strip()
        if line.startswith("{"):
            found.append(json.loads(line))
    return found


def run_until_event(argv: list[str], event: str, timeout: float = 60.0) -> tuple[subprocess.Popen[str], list[dict[str, Any]]]:
    """Start the driver and read its log until it logs ``event`` (or exits); returns the process and
    the events read so far. The caller kills or waits for the process."""
    process = start_agent(argv)
    lines: "queue.Queue[str | None]" = queue.Queue()

    def pump() -> None:
        assert process.stdout is not None
        for line in process.stdout:
            lines.put(line)
        lines.put(None)

    threading.Thread(target=pump, daemon=True).start()
    seen: list[dict[str, Any]] = []
    deadline = time.monotonic() + timeout
    while True:
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            process.kill()
            raise AssertionError(f"agent did not log {event!r} within {timeout} s; saw {[e.get('event') for e in seen]}")
        try:
            line = lines.get(timeout=remaining)
        except queue.Empty:
            continue
        if line is None:
            return process, seen
        seen.extend(events(line))
        if seen and seen[-1].get("event") == event:
            return process, seen
