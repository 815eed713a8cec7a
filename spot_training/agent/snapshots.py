"""Periodic snapshots of the data volume while training, so that a move across AZs copies little.

EBS snapshots are incremental: the first snapshot of a volume holds every written block, each later
one only the blocks changed since the previous one (EBS user guide, "How Amazon EBS snapshots work").
A move (spot_training/agent/ebs.py) snapshots the volume after the interrupted node let go of it; when a periodic
snapshot of the same volume exists, that migration snapshot holds only the blocks written since, and
completes in about the time those take instead of the time of the whole dataset (docs/agent-storage.md,
"Periodic snapshots").

:class:`PeriodicSnapshots` runs in a daemon thread next to the supervisor: every ``interval_s``
seconds it snapshots the data volume attached to this instance (found by the stack's tags and the
attachment, so it follows a moved volume), tagged ``spot-training:purpose=periodic-snapshot``, the stack
tag, the source volume and this instance, then prunes: it keeps the newest ``keep`` completed periodic
snapshots of the stack, never deletes a pending one, and so never the newest completed one either
(``keep`` >= 1). A snapshot is skipped while an earlier periodic snapshot is still pending. A failure
is logged and retried at the next interval; it never stops training. The snapshots are crash
consistent (taken while the trainer writes); the migration snapshot, taken once the volume is
detached, is the consistent one that a move restores. ``cdk destroy`` deletes them with the stack's
other tagged snapshots (the data cleanup).
"""

from __future__ import annotations

import logging
import threading
from typing import Any

from spot_training.agent.config import PERIODIC_SNAPSHOT_PURPOSE, PURPOSE_TAG, STACK_TAG, VolumeConfig, deployment_tags
from spot_training.contract import CREATED_BY_TAG, SOURCE_VOLUME_TAG  # tag keys: the contract's



class PeriodicSnapshots:
    """Snapshot the stack's data volume every ``interval_s`` seconds and keep the newest ``keep``.

    Args:
        ec2: boto3 EC2 client (standard retries).
        stack_name: the ``spot-training:stack`` tag value.
        volume: the node config's volume section (``tags``, ``snapshot_interval_s``, ``keep_snapshots``).
        instance_id: this instance (the attachment to look for; the ``created-by`` tag).
        log: logger (default ``spot_training.agent.snapshots``).
    """

    def __init__(self, *, ec2: Any, stack_name: str, volume: VolumeConfig, instance_id: str,
                 log: logging.Logger | None = None) -> None:
        self.ec2 = ec2
        self.stack_name = stack_name
        self.volume = volume
        self.interval_s = volume.snapshot_interval_s
        self.keep = volume.keep_snapshots
        self.instance_id = instance_id
        self.log = log or logging.getLogger(__name__)
        self._stop = threading.Event()
        #: Set to take the next snapshot now instead of at the end of the interval (take_soon, stop).
        self._soon = threading.Event()
        self._thread: threading.Thread | None = None

    # ---- one round --------------------------------------------------------------------------------
    def attached_volume_id(self) -> str | None:
        """The stack's data volume attached to this instance, or None."""
        filters = [{"Name": f"tag:{k}", "Values": [v]} for k, v in sorted(self.volume.tags.items())]
        filters.append({"Name": "attachment.instance-id", "Values": [self.instance_id]})
        volumes = self.ec2.describe_volumes(Filters=filters)["Volumes"]
        return volumes[0]["VolumeId"] if volumes else None

    def _ours(self) -> list[dict[str, Any]]:
        return self.ec2.describe_snapshots(OwnerIds=["self"], Filters=[
            {"Name": f"tag:{STACK_TAG}", "Values": [self.stack_name]},
            {"Name": f"tag:{PURPOSE_TAG}", "Values": [PERIODIC_SNAPSHOT_PURPOSE]},
            # this deployment's only: an earlier deployment's retained snapshots are never pruned
            *({"Name": f"tag:{k}", "Values": [v]} for k, v in deployment_tags(self.volume.tags).items()),
        ])["Snapshots"]

    def take(self) -> str | None:
        """Take one periodic snapshot (unless one is still pending or no volume is attached), then
        prune; return the new snapshot id or None."""
        volume_id = self.attached_volume_id()
        if volume_id is None:
            self.log.warning("periodic snapshot skipped: no data volume attached to this instance",
                             extra={"event": "periodic_snapshot_skipped", "reason": "no-volume"})
            return None
        pending = [s["SnapshotId"] for s in self._ours() if s["State"] == "pending"]
        if pending:
            self.log.info("periodic snapshot skipped: the previous one is still pending",
                          extra={"event": "periodic_snapshot_skipped", "reason": "pending", "pending": pending})
            return None
        tags = [{"Key": STACK_TAG, "Value": self.stack_name},
                {"Key": PURPOSE_TAG, "Value": PERIODIC_SNAPSHOT_PURPOSE},
                *({"Key": k, "Value": v} for k, v in deployment_tags(self.volume.tags).items()),
                {"Key": SOURCE_VOLUME_TAG, "Value": volume_id},
                {"Key": CREATED_BY_TAG, "Value": self.instance_id}]
        snapshot_id = self.ec2.create_snapshot(
            VolumeId=volume_id, Description=f"spot-training: periodic snapshot of {volume_id} while training",
            TagSpecifications=[{"ResourceType": "snapshot", "Tags": tags}])["SnapshotId"]
        self.log.info("periodic snapshot created", extra={"event": "periodic_snapshot_created",
                                                          "snapshot_id": snapshot_id, "volume_id": volume_id})
        self.prune()
        return snapshot_id

    def prune(self) -> list[str]:
        """Delete all but the newest ``keep`` completed periodic snapshots; pending ones stay.

        Returns:
            the deleted ids.
        """
        completed = sorted((s for s in self._ours() if s["State"] == "completed"),
                           key=lambda s: (str(s.get("StartTime")), s["SnapshotId"]), reverse=True)
        deleted = []
        for snapshot in completed[max(1, self.keep):]:
            try:
                self.ec2.delete_snapshot(SnapshotId=snapshot["SnapshotId"])
            except Exception as error:  # noqa: BLE001 - in use by a volume being created, already gone: next round
                self.log.warning("could not delete an old periodic snapshot", extra={
                    "event": "periodic_snapshot_prune_failed", "snapshot_id": snapshot["SnapshotId"], "error": str(error)})
                continue
            deleted.append(snapshot["SnapshotId"])
        if deleted:
            self.log.info("old periodic snapshots deleted", extra={"event": "periodic_snapshots_pruned", "deleted": deleted,
                                                                   "kept": [s["SnapshotId"] for s in completed[:self.keep]]})
        return deleted

    # ---- the thread -------------------------------------------------------------------------------
    def _run(self) -> None:
        while True:
            self._soon.wait(self.interval_s)
            if self._stop.is_set():
                return
            self._soon.clear()
            try:
                self.take()
            except Exception as error:  # noqa: BLE001 - a snapshot must never stop training
                self.log.warning("periodic snapshot failed; trying again at the next interval",
                                 extra={"event": "periodic_snapshot_failed", "error": str(error)})

    def start(self) -> PeriodicSnapshots:
        """Start the daemon thread (first snapshot after one interval, or at :meth:`take_soon`); no
        thread when ``interval_s`` is 0."""
        if self.interval_s > 0 and self._thread is None:
            self._thread = threading.Thread(target=self._run, name="periodic-snapshots", daemon=True)
            self._thread.start()
        return self

    def take_soon(self) -> None:
        """Take the next snapshot now, then every ``interval_s`` seconds from it. The agent calls
        this once the trainer's environment and the dataset are in place (and before the first
        training step), so the first, full snapshot holds them and a move later copies only the
        checkpoints written since. Nothing happens when snapshots are off (``interval_s`` 0)."""
        self._soon.set()

    def stop(self, timeout_s: float = 5.0) -> None:
        """Stop the thread (a CreateSnapshot in flight completes on AWS's side)."""
        self._stop.set()
        self._soon.set()
        if self._thread is not None:
            self._thread.join(timeout_s)
