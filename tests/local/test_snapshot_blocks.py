"""The local EBS data plane's incremental-snapshot model (spot_training/local/moto_compat.py, ``snapshot_blocks``)
over HTTP, and the move benchmark built on it (bench/bench_move.py)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import boto3
import pytest

from spot_training.local.moto_compat import SNAPSHOT_BLOCK_BYTES, snapshot_blocks

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture()
def ec2(moto_server):
    moto_server.reset()
    return boto3.client("ec2", region_name="us-east-1", endpoint_url=moto_server.endpoint_url,
                        aws_access_key_id="testing", aws_secret_access_key="testing")


def test_first_snapshot_is_full_later_ones_hold_only_changed_blocks_and_a_copy_volume_continues_the_lineage(ec2, moto_server):
    volume = ec2.create_volume(AvailabilityZone="us-east-1a", Size=10)["VolumeId"]
    data = moto_server.volumes_dir / volume
    (data / "d").mkdir()
    (data / "d" / "big.bin").write_bytes(b"a" * SNAPSHOT_BLOCK_BYTES * 3)  # 3 blocks
    (data / "small.txt").write_text("x" * 100)  # 1 partial block
    first = ec2.create_snapshot(VolumeId=volume)["SnapshotId"]
    full = snapshot_blocks(moto_server.ebs_dir, first)
    assert full["parent"] is None and full["blocks_changed"] == 4
    assert full["bytes_changed"] == full["bytes_total"] == 3 * SNAPSHOT_BLOCK_BYTES + 100

    with open(data / "d" / "big.bin", "r+b") as handle:  # one block rewritten in place
        handle.seek(SNAPSHOT_BLOCK_BYTES)
        handle.write(b"b")
    second = ec2.create_snapshot(VolumeId=volume)["SnapshotId"]
    delta = snapshot_blocks(moto_server.ebs_dir, second)
    assert delta["parent"] == first and delta["blocks_changed"] == 1 and delta["bytes_changed"] == SNAPSHOT_BLOCK_BYTES

    ec2.delete_snapshot(SnapshotId=first)  # EBS keeps what later snapshots reference: the lineage holds
    assert snapshot_blocks(moto_server.ebs_dir, first) is None
    copy = ec2.create_volume(AvailabilityZone="us-east-1b", Size=10, SnapshotId=second)["VolumeId"]
    untouched = snapshot_blocks(moto_server.ebs_dir, ec2.create_snapshot(VolumeId=copy)["SnapshotId"])
    assert untouched["parent"] == second and untouched["bytes_changed"] == 0
    assert untouched["bytes_total"] == delta["bytes_total"]


@pytest.mark.slow
def test_bench_move_copies_less_with_a_periodic_snapshot(capfd):
    sys.path.insert(0, str(REPO / "bench"))
    try:
        import bench_move
    finally:
        sys.path.remove(str(REPO / "bench"))
    assert bench_move.main(["--dataset-mib", "16", "--checkpoint-mib", "2"]) == 0
    figures = json.loads(capfd.readouterr().out.strip().splitlines()[-1])
    without, with_ = figures["without_periodic"], figures["with_periodic"]
    assert without["incremental_to"] is None and without["migration_copied_mib"] == pytest.approx(20, abs=0.1)
    assert with_["incremental_to"] is not None and with_["migration_copied_mib"] == pytest.approx(2, abs=0.1)
