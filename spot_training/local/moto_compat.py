"""The one place where moto 5.2.5's gaps are bridged, applied inside our moto server process.

:func:`apply` patches moto's model classes (so the patches survive ``POST /moto-api/reset``, which
rebuilds the backend instances) in the process that runs moto's server; ``spot_training.local.moto_server``
calls it before starting ``moto.server.main``. The agents never import this module: they talk to the
server over HTTP with boto3 exactly as they talk to AWS, and run unchanged on AWS.

What each bridge fixes (docs/architecture.md, "Local mode"), and what real EC2 does instead:

1. **EBS data plane** (moto keeps no bytes). A volume's bytes are the directory
   ``<ebs_dir>/volumes/<vol-id>/``; CreateSnapshot copies it to ``<ebs_dir>/snapshots/<snap-id>/``
   (into a temporary name first, then ``os.replace``, so a snapshot directory is always complete);
   CreateVolume with a SnapshotId copies the snapshot's directory back; CopySnapshot copies;
   DeleteVolume / DeleteSnapshot remove the directory after moto has accepted the delete.
   Each snapshot also records what EBS would have copied for it (:func:`snapshot_blocks`): EBS
   snapshots are incremental, a snapshot stores only the blocks changed since the previous snapshot of
   the same volume, and the first snapshot of a volume created from a snapshot is incremental to that
   source snapshot (EBS user guide, "How Amazon EBS snapshots work"; "Write Amazon EBS snapshots with
   EBS direct APIs"). The model hashes each file in 512 KiB blocks (the EBS direct APIs' block size);
   file-system metadata is not counted.
   ``spot_training.agent.blockdev.DirectoryBlockDevices(<ebs_dir>/volumes)`` "mounts" these directories.
2. **AttachVolume is an arbiter** as on EC2: attaching a volume that is already attached raises
   ``VolumeInUse``, and a volume in another Availability Zone raises ``InvalidVolume.ZoneMismatch``
   (moto silently overwrote the attachment, so two instances could both "win").
3. **DetachVolume without InstanceId** detaches from whichever instance holds the volume (moto
   looked up instance ``None`` and failed).
4. **Spot fleet instances carry ``aws:ec2spot:fleet-request-id``** (and so do their spot requests),
   as EC2 tags them.
5. **CloudFormation ``AWS::EC2::Volume``** keeps VolumeType, Iops, Throughput, Encrypted, KmsKeyId,
   SnapshotId, MultiAttachEnabled and Tags (moto kept only Size and AvailabilityZone).
6. **CloudFormation ``AWS::EC2::SpotFleet``** reads ``LaunchTemplateConfigs``,
   ``InstanceInterruptionBehavior`` and ``TagSpecifications`` (moto read only
   ``LaunchSpecifications``, which CDK stacks never use because they carry no IMDSv2 setting).
7. **``Fn::GetAZs``** with an empty or ``Ref AWS::Region`` argument resolves to the stack's own
   region's zones (moto always used us-east-1).

Not bridged here: stack update and delete remain unreliable in moto; local mode deploys a fresh
stack and verifies resources with boto3 instead of trusting CloudFormation's status.
"""

from __future__ import annotations

import functools
import hashlib
import json
import os
import shutil
import threading
import uuid
from pathlib import Path
from typing import Any, Callable

FLEET_TAG = "aws:ec2spot:fleet-request-id"

_applied_lock = threading.Lock()
_state: dict[str, Any] = {"ebs_dir": None}


def volume_dir(ebs_dir: str | os.PathLike[str], volume_id: str) -> Path:
    """Directory holding the bytes of ``volume_id`` (``<ebs_dir>/volumes/<vol-id>``).

    Args:
        ebs_dir: the EBS data plane's root.
        volume_id: the volume (``vol-…``).

    Returns:
        the directory (not checked to exist).
    """
    return Path(ebs_dir) / "volumes" / volume_id


def snapshot_dir(ebs_dir: str | os.PathLike[str], snapshot_id: str) -> Path:
    """Directory holding the bytes of ``snapshot_id`` (``<ebs_dir>/snapshots/<snap-id>``).

    Args:
        ebs_dir: the EBS data plane's root.
        snapshot_id: the snapshot (``snap-…``).

    Returns:
        the directory (not checked to exist).
    """
    return Path(ebs_dir) / "snapshots" / snapshot_id


#: Block size of the EBS snapshot model (bytes): the EBS direct APIs' block size, 512 KiB.
SNAPSHOT_BLOCK_BYTES = 512 * 1024


def _blocks_path(ebs_dir: str | os.PathLike[str], kind: str, resource_id: str) -> Path:
    return Path(ebs_dir) / "blocks" / kind / f"{resource_id}.json"


def snapshot_blocks(ebs_dir: str | os.PathLike[str], snapshot_id: str) -> dict[str, Any] | None:
    """What EBS would have stored for ``snapshot_id`` in this data plane, or None if unknown.

    Args:
        ebs_dir: the EBS data plane's root.
        snapshot_id: the snapshot (``snap-…``).

    Returns:
        ``{"volume_id", "parent" (the snapshot it is incremental to, or None: a full snapshot),
        "bytes_total" (the volume's data), "bytes_changed" (the blocks this snapshot copied),
        "blocks_changed", "block_bytes"}``.
    """
    path = _blocks_path(ebs_dir, "snapshots", snapshot_id)
    try:
        record = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    record.pop("blocks", None)
    return record


def _block_hashes(root: Path) -> dict[str, str]:
    """``"<relative path>#<block index>" -> sha256`` of every file's 512 KiB blocks under ``root``."""
    hashes: dict[str, str] = {}
    if not root.is_dir():
        return hashes
    for path in sorted(root.rglob("*")):
        if path.is_symlink() or not path.is_file():
            continue
        relative = path.relative_to(root).as_posix()
        with open(path, "rb") as handle:
            index = 0
            while True:
                chunk = handle.read(SNAPSHOT_BLOCK_BYTES)
                if not chunk:
                    break
                hashes[f"{relative}#{index}"] = hashlib.sha256(chunk).hexdigest() + f":{len(chunk)}"
                index += 1
    return hashes


def _record_snapshot_blocks(ebs_dir: Path, volume_id: str, snapshot_id: str) -> None:
    """Store the snapshot's block hashes and the volume's lineage (its newest snapshot's blocks)."""
    blocks = _block_hashes(volume_dir(ebs_dir, volume_id))
    lineage_path = _blocks_path(ebs_dir, "lineage", volume_id)
    try:
        lineage = json.loads(lineage_path.read_text())
    except (OSError, ValueError):
        lineage = {"parent": None, "blocks": {}}
    previous = lineage.get("blocks", {})
    changed = [key for key, digest in blocks.items() if previous.get(key) != digest]
    record = {"volume_id": volume_id, "parent": lineage.get("parent"),
              "bytes_total": sum(int(d.rsplit(":", 1)[1]) for d in blocks.values()),
              "bytes_changed": sum(int(blocks[k].rsplit(":", 1)[1]) for k in changed),
              "blocks_changed": len(changed), "block_bytes": SNAPSHOT_BLOCK_BYTES, "blocks": blocks}
    _write_json(_blocks_path(ebs_dir, "snapshots", snapshot_id), record)
    _write_json(lineage_path, {"parent": snapshot_id, "blocks": blocks})


def _write_json(path: Path, payload: dict[str, Any]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    temporary = path.with_name(f".{path.name}.{uuid.uuid4().hex}.tmp")
    temporary.write_text(json.dumps(payload))
    os.replace(temporary, path)


def _copy_tree(source: Path, target: Path) -> None:
    """Copy ``source`` to ``target`` completely or not at all (temporary name, then ``os.replace``)."""
    temporary = target.with_name(f".{target.name}.{uuid.uuid4().hex}.tmp")
    target.parent.mkdir(parents=True, exist_ok=True)
    try:
        if source.is_dir():
            shutil.copytree(source, temporary, symlinks=True)
        else:
            temporary.mkdir()
        os.replace(temporary, target)
    finally:
        shutil.rmtree(temporary, ignore_errors=True)


def _remove_tree(path: Path) -> None:
    if path.is_symlink() or path.is_file():
        path.unlink()
    elif path.exists():
        shutil.rmtree(path)


def _wrap(cls: type, name: str, make: Callable[[Callable[..., Any]], Callable[..., Any]]) -> None:
    original = getattr(cls, name)
    if getattr(original, "_spot_training_compat", False):
        return  # already applied
    wrapped = functools.wraps(original)(make(original))
    wrapped._spot_training_compat = True  # type: ignore[attr-defined]
    setattr(cls, name, wrapped)


def apply(*, ebs_dir: str | os.PathLike[str]) -> None:
    """Apply every bridge in this process. Idempotent (a second call only changes ``ebs_dir``).

    Args:
        ebs_dir: root of the EBS data plane (``volumes/`` and ``snapshots/`` are created in it).
    """
    ebs_root = Path(ebs_dir)
    (ebs_root / "volumes").mkdir(parents=True, exist_ok=True)
    (ebs_root / "snapshots").mkdir(parents=True, exist_ok=True)
    with _applied_lock:
        _state["ebs_dir"] = ebs_root
        _patch_ebs()
        _patch_spot_fleet_tags()
        _patch_cloudformation()


# --- 1-3: EBS ---------------------------------------------------------------------------------
# The data plane's side of each EBS call (``ebs_dir``, moto's result, then the call's own arguments
# by the names moto gives them).
def _volume_created(ebs_dir: Path, volume: Any, *_: Any, **__: Any) -> None:
    target = volume_dir(ebs_dir, volume.id)
    if volume.snapshot_id:
        _copy_tree(snapshot_dir(ebs_dir, volume.snapshot_id), target)
        source = _blocks_path(ebs_dir, "snapshots", volume.snapshot_id)
        try:  # a volume made from a snapshot: its first snapshot is incremental to that one
            blocks = json.loads(source.read_text())["blocks"]
            _write_json(_blocks_path(ebs_dir, "lineage", volume.id), {"parent": volume.snapshot_id, "blocks": blocks})
        except (OSError, ValueError, KeyError):
            pass
    else:
        target.mkdir(parents=True, exist_ok=True)


def _volume_deleted(ebs_dir: Path, volume: Any, volume_id: str) -> None:
    _remove_tree(volume_dir(ebs_dir, volume_id))
    _blocks_path(ebs_dir, "lineage", volume_id).unlink(missing_ok=True)


def _snapshot_created(ebs_dir: Path, snapshot: Any, volume_id: str, *_: Any, **__: Any) -> None:
    _copy_tree(volume_dir(ebs_dir, volume_id), snapshot_dir(ebs_dir, snapshot.id))
    _record_snapshot_blocks(ebs_dir, volume_id, snapshot.id)


def _snapshot_copied(ebs_dir: Path, snapshot: Any, source_snapshot_id: str, *_: Any, **__: Any) -> None:
    _copy_tree(snapshot_dir(ebs_dir, source_snapshot_id), snapshot_dir(ebs_dir, snapshot.id))
    source = _blocks_path(ebs_dir, "snapshots", source_snapshot_id)
    if source.exists():  # a copy holds every block of its source (no parent in the copy's lineage)
        record = json.loads(source.read_text())
        record.update(parent=None, bytes_changed=record["bytes_total"], blocks_changed=len(record["blocks"]))
        _write_json(_blocks_path(ebs_dir, "snapshots", snapshot.id), record)


def _snapshot_deleted(ebs_dir: Path, snapshot: Any, snapshot_id: str) -> None:
    _remove_tree(snapshot_dir(ebs_dir, snapshot_id))
    _blocks_path(ebs_dir, "snapshots", snapshot_id).unlink(missing_ok=True)


def _patch_ebs() -> None:
    from moto.ec2.exceptions import EC2ClientError, VolumeInUseError
    from moto.ec2.models.elastic_block_store import EBSBackend

    def after(hook: Callable[..., None]):
        """A wrapper maker for the calls that change EBS data: moto's method, then
        ``hook(ebs_dir, <moto's result>, <the call's arguments>)`` (the data plane's side), then moto's result."""
        def make(original):
            def method(self, *args: Any, **kwargs: Any):
                result = original(self, *args, **kwargs)
                hook(_state["ebs_dir"], result, *args, **kwargs)
                return result
            return method
        return make

    def attach_volume(original):
        def attach_volume(self, volume_id: str, instance_id: str, device_path: str, *args: Any, **kwargs: Any):
            volume = self.get_volume(volume_id)
            instance = self.get_instance(instance_id)
            if volume.attachment is not None:
                # EC2: "vol-… is already attached to an instance" (also when it is this instance).
                raise VolumeInUseError(volume_id, volume.attachment.instance.id)
            instance_zone = instance.placement.zone
            if volume.zone is not None and instance_zone and volume.zone.name != instance_zone:
                raise EC2ClientError(
                    "InvalidVolume.ZoneMismatch",
                    f"The volume '{volume_id}' is not in the same availability zone as instance '{instance_id}'",
                )
            return original(self, volume_id, instance_id, device_path, *args, **kwargs)
        return attach_volume

    def detach_volume(original):
        def detach_volume(self, volume_id: str, instance_id: str | None, device_path: str | None, *args: Any, **kwargs: Any):
            if not instance_id:
                volume = self.get_volume(volume_id)
                if volume.attachment is not None:
                    instance_id = volume.attachment.instance.id
            return original(self, volume_id, instance_id, device_path, *args, **kwargs)
        return detach_volume

    for name, make in (
        ("create_volume", after(_volume_created)), ("delete_volume", after(_volume_deleted)),
        ("create_snapshot", after(_snapshot_created)), ("copy_snapshot", after(_snapshot_copied)),
        ("delete_snapshot", after(_snapshot_deleted)), ("attach_volume", attach_volume),
        ("detach_volume", detach_volume),
    ):
        _wrap(EBSBackend, name, make)


# --- 4: fleet tag -----------------------------------------------------------------------------
def _patch_spot_fleet_tags() -> None:
    from moto.ec2.models.spot_requests import SpotInstanceRequest

    def launch_instance(original):
        def launch_instance(self):
            instance = original(self)
            if self.spot_fleet_id:
                instance.add_tag(FLEET_TAG, self.spot_fleet_id)
                self.add_tag(FLEET_TAG, self.spot_fleet_id)
            return instance
        return launch_instance

    _wrap(SpotInstanceRequest, "launch_instance", launch_instance)


# --- 5-7: CloudFormation ----------------------------------------------------------------------
def _patch_cloudformation() -> None:
    from moto.cloudformation import parsing
    from moto.ec2.models.elastic_block_store import Volume
    from moto.ec2.models.spot_requests import SpotFleetRequest

    def volume_from_cfn(cls, resource_name: str, cloudformation_json: Any, account_id: str, region_name: str, **kwargs: Any):
        from moto.ec2.models import ec2_backends

        properties = cloudformation_json["Properties"]
        backend = ec2_backends[account_id][region_name]
        volume = backend.create_volume(
            size=_int_or_none(properties.get("Size")),
            zone_name=properties.get("AvailabilityZone"),
            snapshot_id=properties.get("SnapshotId"),
            encrypted=_bool(properties.get("Encrypted", False)),
            kms_key_id=properties.get("KmsKeyId"),
            volume_type=properties.get("VolumeType"),
            iops=_int_or_none(properties.get("Iops")),
            throughput=_int_or_none(properties.get("Throughput")),
            multi_attach_enabled=_bool(properties.get("MultiAttachEnabled", False)) or None,
        )
        for tag in properties.get("Tags", []):
            volume.add_tag(tag["Key"], tag["Value"])
        return volume

    def spot_fleet_from_cfn(cls, resource_name: str, cloudformation_json: Any, account_id: str, region_name: str, **kwargs: Any):
        from moto.ec2.models import ec2_backends

        config = cloudformation_json["Properties"]["SpotFleetRequestConfigData"]
        backend = ec2_backends[account_id][region_name]
        return backend.request_spot_fleet(
            spot_price=config.get("SpotPrice"),
            target_capacity=config["TargetCapacity"],
            iam_fleet_role=config["IamFleetRole"],
            allocation_strategy=config.get("AllocationStrategy", "lowestPrice"),
            launch_specs=config.get("LaunchSpecifications", []),
            launch_template_config=config.get("LaunchTemplateConfigs"),
            instance_interruption_behaviour=config.get("InstanceInterruptionBehavior"),
            tag_specifications=config.get("TagSpecifications"),
        )

    for cls, function in ((Volume, volume_from_cfn), (SpotFleetRequest, spot_fleet_from_cfn)):
        if not getattr(cls.create_from_cloudformation_json, "_spot_training_compat", False):
            function._spot_training_compat = True  # type: ignore[attr-defined]
            cls.create_from_cloudformation_json = classmethod(function)  # type: ignore[method-assign]

    original_clean_json = parsing.clean_json
    if not getattr(original_clean_json, "_spot_training_compat", False):
        def clean_json(resource_json: Any, resources_map: Any) -> Any:
            if isinstance(resource_json, dict) and "Fn::GetAZs" in resource_json:
                argument = resource_json["Fn::GetAZs"]
                if isinstance(argument, dict):
                    argument = original_clean_json(argument, resources_map)
                region = argument or getattr(resources_map, "_region_name", None)
                if region:
                    resource_json = {**resource_json, "Fn::GetAZs": region}
            return original_clean_json(resource_json, resources_map)

        clean_json._spot_training_compat = True  # type: ignore[attr-defined]
        parsing.clean_json = clean_json


def _int_or_none(value: Any) -> int | None:
    return None if value is None else int(value)


def _bool(value: Any) -> bool:
    return value is True or str(value).lower() == "true"
