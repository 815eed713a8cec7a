"""Benchmark: the bytes a move across Availability Zones copies, with and without periodic snapshots (``make bench-move``).

A move (spot_training/agent/ebs.py) snapshots the data volume once the interrupted node let go of it and creates
the copy in the new node's Availability Zone from that migration snapshot. EBS snapshots are
incremental (the first snapshot of a volume holds every written block, each later one only the blocks
changed since the previous snapshot of the same volume: EBS user guide, "How Amazon EBS snapshots
work"), so with periodic snapshots (``-c snapshot_interval_s=...``, spot_training/agent/snapshots.py) the
migration snapshot holds only what the trainer wrote since the newest periodic one.

In local mode (docs/localmode.md) the moto server's EBS data plane records, per snapshot, the 512 KiB
blocks changed against the volume's lineage (spot_training/local/moto_compat.py, ``snapshot_blocks``). The real
agent code runs against it over HTTP:

1. a node in us-east-1a mounts the stack's data volume (``prepare_data_volume``); a dataset of
   ``--dataset-mib`` and a first checkpoint of ``--checkpoint-mib`` are written onto it;
2. **with**: one periodic snapshot is taken (``PeriodicSnapshots.take``); **without**: none;
3. training goes on: one more checkpoint of ``--checkpoint-mib`` and the training log;
4. the node goes (volume detached, instance terminated); a node in us-east-1b runs
   ``prepare_data_volume``, which moves the volume; the bytes its migration snapshot copied are read
   back, and the moved volume's files are checked against the source's (sha256).

Prints a table, then the figures as JSON on the last line. ``move_s`` is local-mode wall time (a
directory copy), not an AWS figure: on AWS the snapshot's time grows with the changed bytes.
"""

from __future__ import annotations

import argparse
import getpass
import hashlib
import json
import os
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

import boto3  # noqa: E402

from spot_training.agent.blockdev import DirectoryBlockDevices  # noqa: E402
from spot_training.agent.config import parse_config  # noqa: E402
from spot_training.agent.ebs import prepare_data_volume  # noqa: E402
from spot_training.agent.snapshots import PeriodicSnapshots  # noqa: E402
from spot_training.local.moto_compat import snapshot_blocks  # noqa: E402
from spot_training.local.moto_server import MotoServer  # noqa: E402

STACK = "BenchMove"
IMAGE_ID = "ami-12c6146b"  # one of moto's built-in AMIs
TAGS = {"spot-training:stack": STACK, "spot-training:purpose": "data-volume"}
MIB = 1024 * 1024


def _config(mount: Path) -> dict:
    return {
        "schema_version": 1, "region": "us-east-1", "stack_name": STACK, "node_role": "single",
        "volume": {"tags": dict(TAGS), "device_name": "/dev/sdf", "mount_point": str(mount), "fs_type": "xfs",
                   "keep_snapshots": 2, "snapshot_interval_s": 900},
        "efs": None,
        "training": {"framework": "tensorflow", "python": sys.executable, "command": ["{python}", "train.py"],
                     "user": getpass.getuser(), "dataset_dir": str(mount / "datasets"),
                     "checkpoint_dir": str(mount / "checkpoints"), "log_dir": str(mount / "logs"),
                     "code": {"type": "asset", "path": str(mount.parent / "code")}},
        "cleanup": {"cancel_fleet_on_success": False},
    }


def _write(path: Path, mib: int, seed: int) -> None:
    """``mib`` MiB of incompressible bytes (a stand-in for a dataset or a checkpoint shard)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "wb") as handle:
        for index in range(mib):
            handle.write(hashlib.sha256(f"{seed}:{index}".encode()).digest() * (MIB // 32))


def _digests(root: Path) -> dict[str, str]:
    return {p.relative_to(root).as_posix(): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(root.rglob("*")) if p.is_file() and not p.is_symlink()}


def one_move(server: MotoServer, work: Path, *, periodic: bool, dataset_mib: int, checkpoint_mib: int) -> dict:
    """Run one move and return its figures (see the module docstring).

    Args:
        server: the moto server (reset first).
        work: a scratch directory.
        periodic: take one periodic snapshot before the move (the migration snapshot is then incremental to it).
        dataset_mib: dataset size on the volume, MiB.
        checkpoint_mib: one checkpoint's size, MiB.

    Returns:
        the move's figures.
    """
    server.reset()
    ec2 = boto3.client("ec2", region_name="us-east-1", endpoint_url=server.endpoint_url,
                       aws_access_key_id="testing", aws_secret_access_key="testing")
    ec2.create_volume(AvailabilityZone="us-east-1a", Size=100, VolumeType="gp3", TagSpecifications=[
        {"ResourceType": "volume", "Tags": [{"Key": k, "Value": v} for k, v in TAGS.items()]}])
    blockdev = DirectoryBlockDevices(server.volumes_dir)

    def node(az: str, name: str):
        instance = ec2.run_instances(ImageId=IMAGE_ID, MinCount=1, MaxCount=1, InstanceType="g5.xlarge",
                                     Placement={"AvailabilityZone": az})["Instances"][0]["InstanceId"]
        mount = work / name / "dltraining"
        (work / name / "code").mkdir(parents=True, exist_ok=True)
        config = parse_config(_config(mount))
        mounted = prepare_data_volume(ec2=ec2, config=config, instance_id=instance, availability_zone=az,
                                      blockdev=blockdev)
        return instance, config, Path(mounted)

    first, config, mount = node("us-east-1a", "first")
    _write(mount / "datasets" / "train.bin", dataset_mib, seed=1)
    _write(mount / "checkpoints" / "ckpt-000000000050" / "model.bin", checkpoint_mib, seed=50)
    (mount / "checkpoints" / "LATEST").write_text(json.dumps({"step": 50}))
    if periodic:
        PeriodicSnapshots(ec2=ec2, stack_name=STACK, volume=config.volume, instance_id=first).take()
    _write(mount / "checkpoints" / "ckpt-000000000100" / "model.bin", checkpoint_mib, seed=100)
    (mount / "checkpoints" / "LATEST").write_text(json.dumps({"step": 100}))
    (mount / "logs").mkdir(parents=True, exist_ok=True)
    with open(mount / "logs" / "training_log.csv", "a") as log:
        log.writelines(f"{s},0,{1.0 / s:.4f},0.5,{time.time():.3f}\n" for s in range(1, 101))
    before = _digests(mount)
    [volume] = ec2.describe_volumes(Filters=[{"Name": f"tag:{k}", "Values": [v]} for k, v in TAGS.items()])["Volumes"]
    ec2.detach_volume(VolumeId=volume["VolumeId"])
    ec2.terminate_instances(InstanceIds=[first])

    start = time.perf_counter()
    _, _, moved_mount = node("us-east-1b", "second")
    move_s = time.perf_counter() - start
    after = _digests(moved_mount)
    if after != before:
        raise RuntimeError("the moved volume's files differ from the source's")
    migration = [s for s in ec2.describe_snapshots(OwnerIds=["self"])["Snapshots"]
                 if {"Key": "spot-training:purpose", "Value": "migration-snapshot"} in s.get("Tags", [])]
    if len(migration) != 1:
        raise RuntimeError(f"expected one migration snapshot, found {[s['SnapshotId'] for s in migration]}")
    blocks = snapshot_blocks(server.ebs_dir, migration[0]["SnapshotId"])
    if blocks is None:
        raise RuntimeError("the data plane recorded no blocks for the migration snapshot")
    return {"periodic_snapshots": periodic, "volume_mib": round(blocks["bytes_total"] / MIB, 2),
            "migration_copied_mib": round(blocks["bytes_changed"] / MIB, 2),
            "incremental_to": blocks["parent"], "move_s": round(move_s, 3)}


def main(argv: list[str] | None = None) -> int:
    """Run the volume-move benchmark; the last line printed is JSON.

    Args:
        argv: the arguments (default ``sys.argv[1:]``).

    Returns:
        0.

    Raises:
        SystemExit: 2 for a size below 1 MiB.
    """
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dataset-mib", type=int, default=256, help="dataset size on the volume (MiB, default 256)")
    parser.add_argument("--checkpoint-mib", type=int, default=8, help="one checkpoint's size (MiB, default 8)")
    args = parser.parse_args(argv)
    if args.dataset_mib < 1 or args.checkpoint_mib < 1:
        parser.error("--dataset-mib and --checkpoint-mib must be >= 1 (MiB)")
    with tempfile.TemporaryDirectory(prefix="bench-move-") as tmp, MotoServer(Path(tmp) / "moto") as server:
        rows = [one_move(server, Path(tmp) / f"run{i}", periodic=periodic, dataset_mib=args.dataset_mib,
                         checkpoint_mib=args.checkpoint_mib) for i, periodic in enumerate((False, True))]
    print(f"{'periodic snapshots':<20}{'volume MiB':>12}{'migration copied MiB':>22}{'move s (local)':>16}")
    for row in rows:
        print(f"{'yes' if row['periodic_snapshots'] else 'no':<20}{row['volume_mib']:>12}"
              f"{row['migration_copied_mib']:>22}{row['move_s']:>16}")
    without, with_ = rows
    ratio = with_["migration_copied_mib"] / without["migration_copied_mib"] if without["migration_copied_mib"] else None
    print(json.dumps({"bench": "move", "dataset_mib": args.dataset_mib, "checkpoint_mib": args.checkpoint_mib,
                      "without_periodic": without, "with_periodic": with_,
                      "copied_ratio_with_to_without": round(ratio, 4) if ratio is not None else None}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
