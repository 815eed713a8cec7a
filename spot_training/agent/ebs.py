"""The data volume follows the instance: find it by the stack's tags, bring it to this AZ, mount it.

:func:`prepare_data_volume` is the agent's volume step. It returns the mounted, verified mount point,
or raises; the caller never starts training otherwise (the original script trained on the root disk
when the attach failed, and lost the checkpoints with the instance).

Steps (each one logged as a JSON line with an ``event`` field, each bounded by a deadline):

1. ``volumes_found``: DescribeVolumes filtered by BOTH stack tags (docs/contracts.md), never by Name.
   None: :class:`ConfigError` (exit 78), nothing touched. Several independent ones: ConfigError that
   lists them (the agent will not guess which holds your data).
2. Already attached to this instance: mount and return (one API call).
3. Same AZ, nobody moving it (no lease tag on any candidate): AttachVolume is
   the arbiter, no lease needed (a second AttachVolume gets ``VolumeInUse``) -> ``volume_attached``
   (boto3 ``volume_in_use`` waiter). The article's three calls. A volume still attached to another
   instance (the interrupted one, detaching) is waited for, bounded, then exit 75.
4. Anything else (a move, or leftovers of an interrupted one): ``lease_acquired`` first
   (spot_training/agent/lease.py; the loser waits or exits 75), then the same-AZ attach or:
5. Other AZ, a move that never leaves zero copies of the data:
   ``snapshot_created`` (tagged ``spot-training:purpose=migration-snapshot`` + stack tag + source
   volume) -> waiter ``snapshot_completed`` -> ``volume_created`` in this AZ with the source's type,
   size, IOPS, throughput, encryption, KMS key and tags, given at creation (TagSpecifications, so IAM
   ``aws:RequestTag`` conditions hold) plus ``spot-training:source-volume``,
   ``spot-training:move-state=copying`` and the lease -> waiter ``volume_available`` ->
   ``volume_attached`` -> ``device_verified`` (the device node of the new volume id appeared) ->
   lease re-checked on the source -> ``copy_verified`` (``move-state=verified``) -> only then
   ``old_volume_retired`` (DeleteVolume, once the source is ``available``) -> ``snapshots_pruned``
   (keep the newest ``volume.keep_snapshots`` migration snapshots).
6. ``volume_mounted``: device by volume id (spot_training/agent/blockdev.py), format only when it has no file
   system, mount, check the mount, chown the mount point to the training user.

Crash safety: progress lives in tags on the resources, so a rerun after a kill at any point converges.
A copy in ``copying`` state made by this instance in this AZ is continued; one made elsewhere was
never trained on (training starts only after ``copy_verified`` and the mount) and is deleted while its
source still exists; a ``verified`` copy whose source still exists means the source is retired next.
A migration snapshot this instance took is reused. CreateVolume carries a ClientToken derived from
source, snapshot and AZ, so a retried request cannot make a second copy.
"""

from __future__ import annotations

import logging
import os
import random
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

from botocore.exceptions import ClientError, WaiterError

from spot_training.agent.blockdev import BlockDeviceError, BlockDevices
from spot_training.agent.config import (
    MIGRATION_SNAPSHOT_PURPOSE,
    PURPOSE_TAG,
    STACK_TAG,
    DATA_VOLUME_PURPOSE,
    DEPLOYMENT_TAG,
    AgentConfig,
    deployment_tags,
)
from spot_training.agent.errors import ConfigError, TemporaryError
from spot_training.agent.lease import LEASE_TAG, Lease, VolumeLease, lease_of
from spot_training.agent.retry import Deadline, RetryPolicy, call_with_retry, error_code
from spot_training.contract import CREATED_BY_TAG, MOVE_STATE_TAG, SOURCE_SNAPSHOT_TAG, SOURCE_VOLUME_TAG  # tag keys: the contract's

COPYING = "copying"
VERIFIED = "verified"
ABANDONED = "abandoned"
#: Tags of ours that describe one copy's progress; never copied onto the next copy.
_PROGRESS_TAGS = frozenset({SOURCE_VOLUME_TAG, SOURCE_SNAPSHOT_TAG, MOVE_STATE_TAG, CREATED_BY_TAG, LEASE_TAG})
_GONE_STATES = frozenset({"deleting", "deleted", "error"})
_NO_LEASE = Lease(owner="", expires=0)


@dataclass(frozen=True)
class VolumeTimeouts:
    """Deadlines and delays of the volume step, in seconds.

    Attributes:
        lease_ttl_s: lease lifetime without renewal (default 900).
        lease_settle_s: between writing the lease and reading it back (default 1.0).
        lease_wait_s: how long a loser waits for the lease before exiting 75 (default 120).
        lease_poll_s: between lease reads while waiting (default 5).
        detach_wait_s: for a volume still attached to a terminated instance to detach (default 300).
        snapshot_s: for the migration snapshot to complete (default 3600).
        volume_s: for a new volume to become available (default 600).
        attach_s: for an attachment to reach ``in-use`` (default 300).
        device_s: for the device node to appear after the attach (default 120).
        waiter_delay_s: boto3 waiter polling interval (default 5; 15 for snapshots on AWS is fine too).
        device_poll_s: between device lookups (default 0.25).
    """

    lease_ttl_s: float = 900.0
    lease_settle_s: float = 1.0
    lease_wait_s: float = 120.0
    lease_poll_s: float = 5.0
    detach_wait_s: float = 300.0
    snapshot_s: float = 3600.0
    volume_s: float = 600.0
    attach_s: float = 300.0
    device_s: float = 120.0
    waiter_delay_s: float = 5.0
    device_poll_s: float = 0.25


def _tags(resource: dict[str, Any]) -> dict[str, str]:
    return {t["Key"]: t["Value"] for t in resource.get("Tags", [])}


def _attached_instance(volume: dict[str, Any]) -> str | None:
    for attachment in volume.get("Attachments", []):
        if attachment.get("State") in ("attaching", "attached"):
            return attachment["InstanceId"]
    return None


def _describe(volume: dict[str, Any]) -> str:
    holder = _attached_instance(volume)
    return (f"{volume['VolumeId']} ({volume['AvailabilityZone']}, {volume['State']}"
            f"{', attached to ' + holder if holder else ''}, created {volume.get('CreateTime')})")


@dataclass
class _Plan:
    """What the tags say: the volume holding the data, a pending copy, and leftovers."""

    current: dict[str, Any]
    pending: dict[str, Any] | None  # a 'copying' copy of current that this instance made in this AZ
    stale: list[dict[str, Any]]  # 'copying' copies never trained on whose source still exists
    retire: list[dict[str, Any]]  # sources of verified copies


def _plan(volumes: list[dict[str, Any]], *, instance_id: str, availability_zone: str, tags: dict[str, str],
          log: logging.Logger) -> _Plan:
    by_id = {v["VolumeId"]: v for v in volumes}
    # A verified copy supersedes its source; an unverified copy of a source that has a verified copy
    # (even once that source is gone) lost the race or was abandoned, and is no data volume either.
    superseded_sources = {_tags(v).get(SOURCE_VOLUME_TAG) for v in volumes
                          if _tags(v).get(MOVE_STATE_TAG) == VERIFIED} - {None}
    copies = [v for v in volumes if _tags(v).get(SOURCE_VOLUME_TAG) in by_id
              or (_tags(v).get(SOURCE_VOLUME_TAG) in superseded_sources and _tags(v).get(MOVE_STATE_TAG) != VERIFIED)]
    verified = [v for v in copies if _tags(v).get(MOVE_STATE_TAG) == VERIFIED]
    copying = [v for v in copies if _tags(v).get(MOVE_STATE_TAG) != VERIFIED]
    retire_ids = {_tags(v)[SOURCE_VOLUME_TAG] for v in verified}
    copying_ids = {v["VolumeId"] for v in copying}
    authoritative = [v for v in volumes if v["VolumeId"] not in retire_ids and v["VolumeId"] not in copying_ids]
    if not authoritative:
        raise ConfigError(f"the volumes tagged {tags} form a cycle of copies: {', '.join(map(_describe, volumes))}; "
                          "remove the spot-training:source-volume tag from the one that holds your data")
    if len(authoritative) > 1:
        sources = {_tags(v).get(SOURCE_VOLUME_TAG) for v in authoritative}
        if len(sources) != 1 or None in sources:
            raise ConfigError(
                f"{len(authoritative)} independent EBS volumes carry the data-volume tags {tags}: "
                f"{'; '.join(map(_describe, authoritative))}. The agent will not guess which one holds your data "
                f"and has changed none of them. Do not delete or untag any of them yet: `cdk destroy` deletes every "
                f"volume carrying these tags (unless retain_data=true) whatever its purpose tag, so an untagged "
                f"volume is not safe either. Snapshot each one first (aws ec2 create-snapshot --volume-id ...), "
                f"find the one with your data, then give the others another {STACK_TAG!r} value (the node role "
                f"cannot) or move their data; docs/agent-storage.md, 'Several data volumes'")
        # Duplicate verified copies of one source (a lease race): pick deterministically, keep the rest.
        authoritative.sort(key=lambda v: (_attached_instance(v) != instance_id, v["AvailabilityZone"] != availability_zone,
                                          str(v.get("CreateTime")), v["VolumeId"]))
        log.warning("several verified copies of one source volume; using the first, leaving the others untouched",
                    extra={"event": "duplicate_copies", "chosen": authoritative[0]["VolumeId"],
                           "others": [v["VolumeId"] for v in authoritative[1:]]})
    current = authoritative[0]
    pending = None
    stale = []
    for copy in copying:
        copy_tags = _tags(copy)
        mine = copy_tags.get(CREATED_BY_TAG) == instance_id and copy["AvailabilityZone"] == availability_zone
        if (pending is None and mine and copy_tags.get(SOURCE_VOLUME_TAG) == current["VolumeId"]
                and copy_tags.get(MOVE_STATE_TAG) == COPYING):
            pending = copy
        else:
            stale.append(copy)
    retire = [by_id[i] for i in sorted(retire_ids)]
    return _Plan(current=current, pending=pending, stale=stale, retire=retire)


class _VolumeStep:
    """One run of the volume step; see :func:`prepare_data_volume`."""

    def __init__(self, *, ec2: Any, config: AgentConfig, instance_id: str, availability_zone: str,
                 blockdev: BlockDevices, log: logging.Logger, timeouts: VolumeTimeouts,
                 clock: Callable[[], float], wall_clock: Callable[[], float], sleep: Callable[[float], None],
                 rng: Callable[[], float]) -> None:
        self.ec2 = ec2
        self.config = config
        self.volume_config = config.volume
        self.instance_id = instance_id
        self.az = availability_zone
        self.blockdev = blockdev
        self.log = log
        self.t = timeouts
        self.clock = clock
        self.sleep = sleep
        self.rng = rng
        self.tags = dict(config.volume.tags)
        self.filters = [{"Name": f"tag:{k}", "Values": [v]} for k, v in sorted(self.tags.items())]
        # Snapshots of this deployment only; the volume filters include the tag already.
        self.deployment_filters = [{"Name": f"tag:{k}", "Values": [v]} for k, v in deployment_tags(self.tags).items()]
        self.lease = VolumeLease(ec2=ec2, owner=instance_id, ttl_s=timeouts.lease_ttl_s, settle_s=timeouts.lease_settle_s,
                                 wait_s=timeouts.lease_wait_s, poll_s=timeouts.lease_poll_s, wall_clock=wall_clock,
                                 clock=clock, sleep=sleep, rng=rng, log=log)
        self.leased: set[str] = set()
        self.recovering = False
        self.pruned = False

    # -- helpers --------------------------------------------------------------------------------
    def event(self, name: str, message: str, **fields: Any) -> None:
        self.log.info(message, extra={"event": name, **fields})

    def retry(self, operation: Callable[[], Any], what: str, deadline: Deadline) -> Any:
        return call_with_retry(operation, what=what, deadline=deadline, sleep=self.sleep, rng=self.rng, log=self.log,
                               policy=RetryPolicy(max_attempts=1_000, base_delay=1.0, max_delay=min(20.0, self.t.waiter_delay_s * 4)))

    def read(self) -> list[dict[str, Any]]:
        volumes = []
        for page in self.ec2.get_paginator("describe_volumes").paginate(Filters=self.filters):
            volumes.extend(v for v in page["Volumes"] if v["State"] not in _GONE_STATES)
        return volumes

    def describe_volume(self, volume_id: str) -> dict[str, Any] | None:
        try:
            return self.ec2.describe_volumes(VolumeIds=[volume_id])["Volumes"][0]
        except ClientError as error:
            if error_code(error) == "InvalidVolume.NotFound":
                return None
            raise

    def wait(self, waiter_name: str, deadline: Deadline, **kwargs: Any) -> None:
        try:
            self.ec2.get_waiter(waiter_name).wait(WaiterConfig=deadline.waiter_config(self.t.waiter_delay_s), **kwargs)
        except WaiterError as error:
            raise TemporaryError(f"{waiter_name} for {kwargs} did not succeed within {deadline.seconds:g} s: {error}") from error

    # -- the step ---------------------------------------------------------------------------------
    def adopt(self) -> None:
        """Make ``volume.adopt_volume_id`` this deployment's: the user named it, so it
        is explicit. Only a volume carrying this stack's tag and the data-volume purpose is adopted, by
        setting its ``spot-training:deployment`` tag to ours (nothing else changes). Already ours: nothing
        to do. Gone: fine once this deployment has a volume (an adopted volume moved to another AZ is
        retired after its copy is verified), else ConfigError. Raises ConfigError (exit 78) naming the
        volume and its tags when it is not this stack's data volume."""
        volume_id = self.volume_config.adopt_volume_id
        if volume_id is None or DEPLOYMENT_TAG not in self.tags:
            return
        deadline = Deadline(self.t.volume_s, f"adopt {volume_id}", self.clock)
        try:
            found = self.retry(lambda: self.ec2.describe_volumes(VolumeIds=[volume_id])["Volumes"],
                               f"DescribeVolumes {volume_id}", deadline)
        except ClientError as error:
            if error_code(error) != "InvalidVolume.NotFound":
                raise
            found = []
        if not found:
            if self.read():
                self.event("adopt_skipped", "the adopted volume is gone; this deployment's volume is found by its tags",
                           volume_id=volume_id)
                return
            raise ConfigError(f"volume.adopt_volume_id {volume_id}: no such volume in region {self.config.region}")
        tags = _tags(found[0])
        ours = self.tags[DEPLOYMENT_TAG]
        if tags.get(STACK_TAG) != self.config.stack_name or tags.get(PURPOSE_TAG) != DATA_VOLUME_PURPOSE:
            raise ConfigError(
                f"volume.adopt_volume_id {volume_id} carries the tags {tags}; only a data volume of this stack "
                f"({STACK_TAG}={self.config.stack_name}, {PURPOSE_TAG}={DATA_VOLUME_PURPOSE}) can be adopted. Nothing was changed")
        if tags.get(DEPLOYMENT_TAG) == ours:
            return
        self.retry(lambda: self.ec2.create_tags(Resources=[volume_id], Tags=[{"Key": DEPLOYMENT_TAG, "Value": ours}]),
                   f"CreateTags {DEPLOYMENT_TAG} on {volume_id}", deadline)
        self.event("volume_adopted", "adopted the data volume an earlier deployment retained",
                   volume_id=volume_id, previous_deployment=tags.get(DEPLOYMENT_TAG), deployment=ours)

    def other_deployments(self) -> list[dict[str, Any]]:
        """Data volumes of this stack whose deployment tag is not ours (or missing); [] without a deployment tag."""
        if DEPLOYMENT_TAG not in self.tags:
            return []
        found = self.ec2.describe_volumes(Filters=[
            {"Name": f"tag:{STACK_TAG}", "Values": [self.config.stack_name]},
            {"Name": f"tag:{PURPOSE_TAG}", "Values": [DATA_VOLUME_PURPOSE]}])["Volumes"]
        return [v for v in found if _tags(v).get(DEPLOYMENT_TAG) != self.tags[DEPLOYMENT_TAG]]

    def run(self) -> Path:
        self.adopt()
        volumes = self.read()
        self.event("volumes_found", "found data volume candidates by tags",
                   volume_ids=[v["VolumeId"] for v in volumes], tags=self.tags)
        if not volumes:
            others = self.other_deployments()
            raise ConfigError(
                f"no EBS volume in region {self.config.region} carries the tags {self.tags} (volume.tags); "
                "deploy the stack that creates the data volume, or fix volume.tags in the node config"
                + (f". Data volumes of this stack from other deployments (or from before deployments were tagged) "
                   f"exist and were left alone: {'; '.join(map(_describe, others))}. To train on one, adopt it "
                   "explicitly: cdk deploy -c adopt_volume_id=<its id> (docs/agent-storage.md, 'Adopting retained data')"
                   if others else ""))
        plan = _plan(volumes, instance_id=self.instance_id, availability_zone=self.az, tags=self.tags, log=self.log)
        clean = (plan.pending is None and not plan.retire and not plan.stale
                 and all(lease_of(v) is None for v in volumes))
        if clean and _attached_instance(plan.current) == self.instance_id:
            self.event("already_attached", "data volume already attached to this instance", volume_id=plan.current["VolumeId"])
            return self.mount(plan.current["VolumeId"])
        if clean and plan.current["AvailabilityZone"] == self.az:
            # Same AZ, nobody moving it: AttachVolume itself is the arbiter (a second attach gets
            # VolumeInUse), so no lease is needed; a mover re-checks the source before retiring it.
            # A volume the interrupted instance still holds is waited for (bounded) first.
            volume_id = self.attach_same_az(plan.current)
            self.back_off_if_moved(volume_id)
            return self.mount(volume_id)

        # Leases of ours left by an earlier run of this instance that was killed mid-way.
        earlier = {v["VolumeId"] for v in volumes if (lease_of(v) or _NO_LEASE).owner == self.instance_id}
        self.recovering = bool(earlier)
        volumes = self.lease.acquire(plan.current["VolumeId"], self.read, volumes=volumes)
        self.leased.add(plan.current["VolumeId"])
        try:
            # A copy made by that earlier run carries an older value of our lease: bring every lease of
            # ours to the current value so that release() removes them all.
            earlier &= {v["VolumeId"] for v in volumes}
            if earlier - self.leased:
                self.leased |= earlier
                self.lease.renew(sorted(self.leased))
            plan = _plan(volumes, instance_id=self.instance_id, availability_zone=self.az, tags=self.tags, log=self.log)
            volume_id = self.converge(plan)
            if self.recovering and not self.pruned:
                self.prune_snapshots()
        finally:
            self.release()
        return self.mount(volume_id)

    def release(self) -> None:
        ids = sorted(self.leased)
        if not ids:
            return
        try:
            self.lease.release(ids)
        except ClientError as error:  # the lease expires on its own; do not hide the step's outcome
            self.log.warning("could not release the lease", extra={"event": "lease_release_failed", "volume_ids": ids,
                                                                   "error": str(error)})

    def converge(self, plan: _Plan) -> str:
        for source in plan.retire:
            self.retire(source, reason="source of a verified copy")
        for copy in plan.stale:
            self.discard_stale_copy(copy)
        current = plan.current
        if plan.pending is not None:
            self.event("move_resumed", "continuing an unfinished move", volume_id=plan.pending["VolumeId"],
                       source_volume_id=current["VolumeId"])
            return self.finish_move(current, plan.pending)
        if current["AvailabilityZone"] == self.az:
            return self.attach_same_az(current)
        return self.move(current)

    def wait_until_detached(self, volume: dict[str, Any]) -> dict[str, Any]:
        """Wait (bounded) until a volume attached to another instance is ``available``."""
        holder = _attached_instance(volume)
        if holder is None or holder == self.instance_id:
            return volume
        self.event("waiting_for_detach", "volume still attached to another instance; waiting for it to detach",
                   volume_id=volume["VolumeId"], holder=holder)
        deadline = Deadline(self.t.detach_wait_s, "wait for detach", self.clock)
        self.wait("volume_available", deadline, VolumeIds=[volume["VolumeId"]])
        refreshed = self.describe_volume(volume["VolumeId"])
        if refreshed is None:
            raise TemporaryError(f"volume {volume['VolumeId']} disappeared while waiting for it to detach")
        return refreshed

    def attach(self, volume_id: str) -> None:
        """AttachVolume (the final arbiter between agents), then wait until it is in use by us."""
        deadline = Deadline(self.t.attach_s, f"attach {volume_id}", self.clock)
        device = self.volume_config.device_name

        def attach_once() -> None:
            try:
                self.ec2.attach_volume(VolumeId=volume_id, InstanceId=self.instance_id, Device=device)
            except ClientError as error:
                if error_code(error) != "VolumeInUse":
                    raise
                volume = self.describe_volume(volume_id)
                if volume is not None and _attached_instance(volume) == self.instance_id:
                    return  # an earlier attempt of ours went through
                if volume is not None and _attached_instance(volume) is not None:
                    # Another instance has it: wait (bounded) for it to detach, then try again.
                    self.wait_until_detached(volume)
                raise

        self.retry(attach_once, f"AttachVolume {volume_id} to {self.instance_id}", deadline)
        self.wait("volume_in_use", deadline, VolumeIds=[volume_id],
                  Filters=[{"Name": "attachment.instance-id", "Values": [self.instance_id]}])
        self.event("volume_attached", "volume attached to this instance", volume_id=volume_id, device_name=device)

    def attach_same_az(self, volume: dict[str, Any]) -> str:
        volume = self.wait_until_detached(volume)
        if _attached_instance(volume) != self.instance_id:
            self.attach(volume["VolumeId"])
        self.verify_device(volume["VolumeId"])
        return volume["VolumeId"]

    def move(self, source: dict[str, Any]) -> str:
        source = self.wait_until_detached(source)
        snapshot_id, state = self.snapshot(source)
        if state != "completed":
            # A snapshot can take longer than the lease's TTL: extend the lease over the wait.
            self.lease.renew(sorted(self.leased), ttl_s=self.t.snapshot_s + self.t.lease_ttl_s)
            deadline = Deadline(self.t.snapshot_s, f"snapshot {snapshot_id}", self.clock)
            self.wait("snapshot_completed", deadline, SnapshotIds=[snapshot_id])
        self.event("snapshot_completed", "migration snapshot completed", snapshot_id=snapshot_id)
        copy = self.create_copy(source, snapshot_id)
        return self.finish_move(source, copy)

    def snapshot(self, source: dict[str, Any]) -> tuple[str, str]:
        """``(snapshot id, state)`` of the migration snapshot: reused from a killed earlier run of this
        instance when there is one, else created."""
        if self.recovering:
            reused = self.reusable_snapshot(source)
            if reused is not None:
                return reused
        return self.new_snapshot(source)

    def reusable_snapshot(self, source: dict[str, Any]) -> tuple[str, str] | None:
        existing = self.ec2.describe_snapshots(OwnerIds=["self"], Filters=[
            {"Name": f"tag:{STACK_TAG}", "Values": [self.config.stack_name]},
            {"Name": f"tag:{PURPOSE_TAG}", "Values": [MIGRATION_SNAPSHOT_PURPOSE]},
            *self.deployment_filters,

            {"Name": f"tag:{CREATED_BY_TAG}", "Values": [self.instance_id]},
        ])["Snapshots"]
        usable = sorted((s for s in existing if s["State"] in ("pending", "completed")),
                        key=lambda s: (str(s.get("StartTime")), s["SnapshotId"]))
        if not usable:
            return None
        snapshot = usable[-1]
        self.event("snapshot_reused", "reusing the migration snapshot this instance took before a restart",
                   snapshot_id=snapshot["SnapshotId"], source_volume_id=source["VolumeId"])
        return snapshot["SnapshotId"], snapshot["State"]

    def new_snapshot(self, source: dict[str, Any]) -> tuple[str, str]:
        tags = [{"Key": STACK_TAG, "Value": self.config.stack_name},
                {"Key": PURPOSE_TAG, "Value": MIGRATION_SNAPSHOT_PURPOSE},
                *({"Key": k, "Value": v} for k, v in deployment_tags(self.tags).items()),
                {"Key": SOURCE_VOLUME_TAG, "Value": source["VolumeId"]},
                {"Key": CREATED_BY_TAG, "Value": self.instance_id}]
        deadline = Deadline(self.t.snapshot_s, f"create snapshot of {source['VolumeId']}", self.clock)
        response = self.retry(lambda: self.ec2.create_snapshot(
            VolumeId=source["VolumeId"],
            Description=f"spot-training: move {source['VolumeId']} from {source['AvailabilityZone']} to {self.az}",
            TagSpecifications=[{"ResourceType": "snapshot", "Tags": tags}]),
            f"CreateSnapshot of {source['VolumeId']}", deadline)
        self.event("snapshot_created", "migration snapshot created", snapshot_id=response["SnapshotId"],
                   source_volume_id=source["VolumeId"])
        return response["SnapshotId"], response.get("State", "pending")

    def create_copy(self, source: dict[str, Any], snapshot_id: str) -> dict[str, Any]:
        inherited = {k: v for k, v in _tags(source).items() if k not in _PROGRESS_TAGS and not k.startswith("aws:")}
        inherited.update(self.tags)
        tags = [{"Key": k, "Value": v} for k, v in sorted(inherited.items())] + [
            {"Key": SOURCE_VOLUME_TAG, "Value": source["VolumeId"]},
            {"Key": SOURCE_SNAPSHOT_TAG, "Value": snapshot_id},
            {"Key": MOVE_STATE_TAG, "Value": COPYING},
            {"Key": CREATED_BY_TAG, "Value": self.instance_id},
            self.lease.tag(),
        ]
        request: dict[str, Any] = {
            "AvailabilityZone": self.az, "SnapshotId": snapshot_id, "Size": source["Size"],
            "VolumeType": source["VolumeType"], "Encrypted": bool(source.get("Encrypted")),
            "TagSpecifications": [{"ResourceType": "volume", "Tags": tags}],
            # Idempotency: a retried or repeated request returns the same volume instead of a second copy.
            "ClientToken": f"{source['VolumeId']}-{snapshot_id}-{self.az}"[:64],
        }
        if source["VolumeType"] in ("io1", "io2", "gp3") and source.get("Iops"):
            request["Iops"] = source["Iops"]
        if source["VolumeType"] == "gp3" and source.get("Throughput"):
            request["Throughput"] = source["Throughput"]
        if source.get("Encrypted") and source.get("KmsKeyId"):
            request["KmsKeyId"] = source["KmsKeyId"]
        if self.volume_config.initialization_rate_mibps:
            # A volume created from a snapshot loads its blocks from S3 lazily; a provisioned rate
            # (100..300 MiB/s) makes that predictable (EBS user guide, "Initialize Amazon EBS volumes").
            request["VolumeInitializationRate"] = self.volume_config.initialization_rate_mibps
        deadline = Deadline(self.t.volume_s, f"create volume from {snapshot_id}", self.clock)
        volume_id = self.retry(lambda: self.ec2.create_volume(**request)["VolumeId"],
                               f"CreateVolume from {snapshot_id} in {self.az}", deadline)
        self.leased.add(volume_id)
        self.event("volume_created", "new volume created from the migration snapshot in this AZ", volume_id=volume_id,
                   snapshot_id=snapshot_id, source_volume_id=source["VolumeId"], availability_zone=self.az)
        self.wait("volume_available", deadline, VolumeIds=[volume_id])
        self.event("volume_available", "new volume available", volume_id=volume_id)
        # What CreateVolume asked for is what the copy is; only its state moved on (to available).
        return {"VolumeId": volume_id, "AvailabilityZone": self.az, "State": "available", "Attachments": [],
                "Tags": tags}

    def finish_move(self, source: dict[str, Any], copy: dict[str, Any]) -> str:
        copy_id = copy["VolumeId"]
        self.leased.add(copy_id)
        if copy["State"] == "creating":
            self.wait("volume_available", Deadline(self.t.volume_s, f"create {copy_id}", self.clock), VolumeIds=[copy_id])
            copy = self.describe_volume(copy_id) or copy
        if _attached_instance(copy) != self.instance_id:
            self.attach(copy_id)
        self.verify_device(copy_id)
        # The source must still be ours and untouched before the copy becomes the data volume.
        fresh = self.describe_volume(source["VolumeId"])
        if fresh is not None:
            problem = None
            if not self.lease.holds(fresh):
                problem = f"lost the data-volume lease on {source['VolumeId']} during the move"
            elif _attached_instance(fresh) is not None:
                problem = (f"source volume {source['VolumeId']} was attached to {_attached_instance(fresh)} during the "
                           "move, so it may hold data newer than the snapshot")
            if problem is not None:
                # The copy may be stale: mark it so that no later run continues it; the source keeps the data.
                self.ec2.create_tags(Resources=[copy_id], Tags=[{"Key": MOVE_STATE_TAG, "Value": ABANDONED}])
                self.event("copy_abandoned", f"{problem}; abandoning the copy", volume_id=copy_id,
                           source_volume_id=source["VolumeId"])
                raise TemporaryError(f"{problem}; the copy {copy_id} is abandoned and the source keeps the data")
        self.ec2.create_tags(Resources=[copy_id], Tags=[{"Key": MOVE_STATE_TAG, "Value": VERIFIED}])
        self.event("copy_verified", "new volume attached and its device present; it now holds the data",
                   volume_id=copy_id, source_volume_id=source["VolumeId"])
        if fresh is not None:
            self.retire_moved_source(fresh, copy_id)
        self.prune_snapshots()
        return copy_id

    def retire_moved_source(self, source: dict[str, Any], copy_id: str) -> None:
        """Delete the source of a move whose copy was just marked verified. An agent in the source's AZ
        attaches without the lease, so it can attach the source between the re-check and this delete.
        DeleteVolume is the arbiter: ``VolumeInUse`` means that agent may be training
        on the source, so the copy is marked ``abandoned`` (never left ``verified``, which would make the
        next boot retire the source that was trained on) and the step exits 75; a later run deletes the
        copy and moves the source afresh."""
        source_id = source["VolumeId"]
        deadline = Deadline(self.t.detach_wait_s, f"delete {source_id}", self.clock)

        def delete_once() -> bool:
            try:
                self.ec2.delete_volume(VolumeId=source_id)
            except ClientError as error:
                if error_code(error) == "VolumeInUse":
                    return False  # not retried: someone attached it; waiting would only delay the abandon
                if error_code(error) != "InvalidVolume.NotFound":
                    raise
            return True

        if self.retry(delete_once, f"DeleteVolume {source_id}", deadline):
            self.leased.discard(source_id)
            self.event("old_volume_retired", "old volume deleted", volume_id=source_id, reason="moved to this AZ")
            return
        holder = _attached_instance(self.describe_volume(source_id) or {})
        self.ec2.create_tags(Resources=[copy_id], Tags=[{"Key": MOVE_STATE_TAG, "Value": ABANDONED}])
        problem = (f"source volume {source_id} was attached to {holder or 'another instance'} after the final re-check "
                   "of the move, so it may hold data newer than the copy")
        self.event("copy_abandoned", f"{problem}; abandoning the copy", volume_id=copy_id, source_volume_id=source_id)
        raise TemporaryError(f"{problem}; the copy {copy_id} is abandoned and the source keeps the data")

    def back_off_if_moved(self, volume_id: str) -> None:
        """After a lease-free attach in the volume's AZ: re-read the move state, and if a mover elsewhere
        committed a copy of this volume meanwhile (``move-state=verified``: the next boot retires this
        volume), detach it again and exit 75 before anything is written to it. A copy
        still ``copying`` is no reason: its mover's re-check sees this attachment and abandons it."""
        committed = [v["VolumeId"] for v in self.read()
                     if _tags(v).get(SOURCE_VOLUME_TAG) == volume_id and _tags(v).get(MOVE_STATE_TAG) == VERIFIED]
        if not committed:
            return
        self.event("attach_backed_off", "a move of this volume committed while it was being attached; letting it go",
                   volume_id=volume_id, verified_copies=committed)
        deadline = Deadline(self.t.attach_s, f"detach {volume_id}", self.clock)
        self.ec2.detach_volume(VolumeId=volume_id, InstanceId=self.instance_id)
        self.wait("volume_available", deadline, VolumeIds=[volume_id])
        raise TemporaryError(f"volume {volume_id} has a verified copy {', '.join(committed)} made by a move that finished "
                             "while this instance attached it; detached it again without writing to it (try again)")

    def retire(self, volume: dict[str, Any], *, reason: str) -> None:
        volume_id = volume["VolumeId"]
        if _attached_instance(volume) is not None:
            self.log.warning("not retiring a volume that is attached", extra={
                "event": "retire_skipped", "volume_id": volume_id, "holder": _attached_instance(volume)})
            return
        try:
            deadline = Deadline(self.t.detach_wait_s, f"delete {volume_id}", self.clock)
            self.retry(lambda: self.ec2.delete_volume(VolumeId=volume_id), f"DeleteVolume {volume_id}", deadline)
        except ClientError as error:
            if error_code(error) != "InvalidVolume.NotFound":
                raise
        self.leased.discard(volume_id)
        self.event("old_volume_retired", "old volume deleted", volume_id=volume_id, reason=reason)

    def discard_stale_copy(self, copy: dict[str, Any]) -> None:
        """Delete an unverified copy that will not be continued (made elsewhere, or abandoned): it was
        never trained on, and its source (or a verified copy of it) holds the data."""
        holder = _attached_instance(copy)
        if holder == self.instance_id:
            deadline = Deadline(self.t.attach_s, f"detach {copy['VolumeId']}", self.clock)
            self.ec2.detach_volume(VolumeId=copy["VolumeId"], InstanceId=self.instance_id)
            self.wait("volume_available", deadline, VolumeIds=[copy["VolumeId"]])
        elif holder is not None:
            self.log.warning("leaving an unfinished copy that is attached to another instance", extra={
                "event": "stale_copy_kept", "volume_id": copy["VolumeId"], "holder": holder})
            return
        try:
            self.ec2.delete_volume(VolumeId=copy["VolumeId"])
        except ClientError as error:
            if error_code(error) != "InvalidVolume.NotFound":
                raise
        self.event("stale_copy_deleted", "deleted an unfinished copy from an earlier attempt", volume_id=copy["VolumeId"],
                   source_volume_id=_tags(copy).get(SOURCE_VOLUME_TAG))

    def prune_snapshots(self) -> None:
        keep = self.volume_config.keep_snapshots
        snapshots = self.ec2.describe_snapshots(OwnerIds=["self"], Filters=[
            {"Name": f"tag:{STACK_TAG}", "Values": [self.config.stack_name]},
            {"Name": f"tag:{PURPOSE_TAG}", "Values": [MIGRATION_SNAPSHOT_PURPOSE]},
            *self.deployment_filters,
        ])["Snapshots"]
        completed = sorted((s for s in snapshots if s["State"] == "completed"),
                           key=lambda s: (str(s.get("StartTime")), s["SnapshotId"]), reverse=True)
        deleted = []
        for snapshot in completed[keep:]:
            try:
                self.ec2.delete_snapshot(SnapshotId=snapshot["SnapshotId"])
            except ClientError as error:
                if error_code(error) not in ("InvalidSnapshot.NotFound", "InvalidSnapshot.InUse"):
                    raise
                continue
            deleted.append(snapshot["SnapshotId"])
        self.pruned = True
        self.event("snapshots_pruned", "kept the newest migration snapshots", kept=[s["SnapshotId"] for s in completed[:keep]],
                   deleted=deleted)

    def verify_device(self, volume_id: str) -> str:
        deadline = Deadline(self.t.device_s, f"device of {volume_id}", self.clock)
        while True:
            device = self.blockdev.resolve(volume_id, self.volume_config.device_name)
            if device is not None:
                self.event("device_verified", "device of the attached volume found by its volume id",
                           volume_id=volume_id, device=device)
                return device
            if deadline.expired():
                raise TemporaryError(f"volume {volume_id} is attached but no device with its id appeared within "
                                     f"{self.t.device_s:g} s; not starting training on the root disk")
            self.sleep(self.t.device_poll_s)

    def mount(self, volume_id: str) -> Path:
        device = self.verify_device(volume_id)
        mount_point = str(self.volume_config.mount_point)
        real_device = os.path.realpath(device)
        try:
            source = self.blockdev.mounted_source(mount_point)
            if source is not None and os.path.realpath(source) != real_device:
                raise TemporaryError(f"{mount_point} already has {source} mounted, not the data volume {volume_id} "
                                     f"({device}); unmount it first")
            if source is None:
                fs_type = self.blockdev.has_filesystem(device)
                if fs_type is None:
                    fs_type = self.volume_config.fs_type
                    self.blockdev.format(device, fs_type)
                    self.event("formatted", "new volume had no file system; formatted it", volume_id=volume_id,
                               device=device, fs_type=fs_type)
                elif fs_type != self.volume_config.fs_type:
                    self.log.warning("volume has a different file system than configured; mounting it as it is",
                                     extra={"event": "fs_type_differs", "found": fs_type,
                                            "configured": self.volume_config.fs_type})
                self.blockdev.mount(device, mount_point, fs_type)
            mounted = self.blockdev.mounted_source(mount_point)
            if mounted is None or os.path.realpath(mounted) != real_device:
                raise TemporaryError(f"mounting {device} at {mount_point} did not take effect (found {mounted!r}); "
                                     "not starting training on the root disk")
            self.blockdev.chown(mount_point, self.config.training.user)
        except BlockDeviceError as error:
            raise TemporaryError(f"data volume {volume_id}: {error}") from error
        self.event("volume_mounted", "data volume mounted", volume_id=volume_id, device=device, mount_point=mount_point)
        return Path(mount_point)


def prepare_data_volume(
    *,
    ec2: Any,
    config: AgentConfig,
    instance_id: str,
    availability_zone: str,
    blockdev: BlockDevices,
    log: logging.Logger | None = None,
    timeouts: VolumeTimeouts = VolumeTimeouts(),
    clock: Callable[[], float] = time.monotonic,
    wall_clock: Callable[[], float] = time.time,
    sleep: Callable[[float], None] = time.sleep,
    rng: Callable[[], float] = random.random,
) -> Path:
    """Find, bring over, attach and mount the stack's data volume; return the mount point.

    Args:
        ec2: boto3 EC2 client for ``config.region`` (use ``spot_training.agent.retry.client_config()``).
        config: the validated node config (uses ``stack_name``, ``region``, ``volume.*``, ``training.user``).
        instance_id: this instance (from IMDS ``instance-id``); also the lease owner.
        availability_zone: this instance's AZ (IMDS ``placement/availability-zone``).
        blockdev: :class:`~spot_training.agent.blockdev.LinuxBlockDevices` on an instance,
            :class:`~spot_training.agent.blockdev.DirectoryBlockDevices` in local mode.
        log: logger for the JSON-line events (default ``logging.getLogger("spot_training.agent.ebs")``).
        timeouts: deadlines in seconds (:class:`VolumeTimeouts`).
        clock, wall_clock, sleep, rng: injectable time, sleep and jitter.

    Returns:
        ``config.volume.mount_point``, with the data volume mounted there and owned by the training user.

    Raises:
        ConfigError: no volume carries the tags, or several independent ones do (nothing was changed).
        TemporaryError: the lease is held elsewhere, a volume is still attached elsewhere, a step ran
            past its deadline, the device did not appear, or the mount failed (exit 75; rerun converges).
        botocore.exceptions.ClientError: any other AWS error, unchanged.
    """
    step = _VolumeStep(ec2=ec2, config=config, instance_id=instance_id, availability_zone=availability_zone,
                       blockdev=blockdev, log=log or logging.getLogger(__name__), timeouts=timeouts, clock=clock,
                       wall_clock=wall_clock, sleep=sleep, rng=rng)
    return step.run()


def verify_mounted(blockdev: BlockDevices, volume_id: str, mount_point: str | os.PathLike[str]) -> None:
    """Raise :class:`TemporaryError` unless the device of ``volume_id`` is mounted at ``mount_point``.

    For the supervisor to call right before it starts the trainer.
    """
    device = blockdev.resolve(volume_id)
    mounted = blockdev.mounted_source(str(mount_point))
    if device is None or mounted is None or os.path.realpath(mounted) != os.path.realpath(device):
        raise TemporaryError(f"data volume {volume_id} is not mounted at {mount_point} (found {mounted!r}); "
                             "refusing to start training on the root disk")
