"""Block devices: find an attached EBS volume by its id, format it only if empty, mount it.

One small protocol, :class:`BlockDevices`, with two implementations:

- :class:`LinuxBlockDevices` on an instance. On Nitro instances the device requested as ``/dev/sdf``
  appears as ``/dev/nvme1n1`` (any index), so the device is found by the volume id, which EBS puts in
  the NVMe controller's serial number: ``/dev/disk/by-id/nvme-Amazon_Elastic_Block_Store_vol0123…``
  (udev rule of Amazon Linux and Ubuntu), else ``/sys/class/nvme/nvme*/serial``
  (``vol0123…``, what amazon-ec2-utils' ``ebsnvme-id`` reads). Only on Xen instances (no NVMe
  controller at all) is the requested name used, as ``/dev/xvdX`` or ``/dev/sdX``. File systems are
  detected with ``blkid``, created with ``mkfs.<type>`` and mounted with ``mount``.
- :class:`DirectoryBlockDevices` in local mode and tests: a volume is the directory
  ``<root>/<vol-id>/`` that spot_training.local.moto_compat's EBS data plane keeps for it; "formatting" writes a
  marker file into it and "mounting" makes the mount point a symlink to it.
"""

from __future__ import annotations

import logging
import os
import pwd
import subprocess
from pathlib import Path
from typing import Callable, Protocol, Sequence

#: How EBS names an NVMe device in /dev/disk/by-id (volume id without the dash).
EBS_BY_ID_PREFIX = "nvme-Amazon_Elastic_Block_Store_"

Runner = Callable[[Sequence[str]], "subprocess.CompletedProcess[str]"]


class BlockDeviceError(RuntimeError):
    """A block-device operation failed (the message names the device, mount point and command)."""


class BlockDevices(Protocol):
    """What the EBS step needs from the machine's block devices (paths are strings)."""

    def resolve(self, volume_id: str, requested_name: str | None = None) -> str | None:
        """The device path of attached volume ``volume_id``, or ``None`` if it is not (yet) there.

        Args:
            volume_id: the EBS volume id (``vol-…``).
            requested_name: the device name given to AttachVolume (``/dev/sdf``); only Xen instances use it.

        Returns:
            the device path, or None.
        """

    def has_filesystem(self, device: str) -> str | None:
        """The file system type on ``device`` (``"xfs"``), or ``None`` when it has none."""

    def format(self, device: str, fs_type: str) -> None:
        """Create a ``fs_type`` file system on ``device``.

        Args:
            device: the device path from :meth:`resolve`.
            fs_type: the file system type (``"xfs"``).

        Raises:
            BlockDeviceError: ``device`` has a file system already, or creating one failed.
        """

    def mount(self, device: str, mount_point: str, fs_type: str) -> None:
        """Mount ``device`` at ``mount_point`` (created if missing).

        Args:
            device: the device path.
            mount_point: the directory to mount it at.
            fs_type: the file system type on the device.

        Raises:
            BlockDeviceError: the mount failed.
        """

    def mounted_source(self, mount_point: str) -> str | None:
        """The device mounted at ``mount_point``, or ``None`` when nothing is mounted there."""

    def unmount(self, mount_point: str) -> None:
        """Unmount ``mount_point`` (nothing if nothing is mounted)."""

    def chown(self, path: str, user: str) -> None:
        """Give ``path`` (not recursively) to ``user`` and its primary group.

        Args:
            path: the file or directory.
            user: the user name.

        Raises:
            BlockDeviceError: ``user`` does not exist.
        """


def is_mounted(devices: BlockDevices, mount_point: str) -> bool:
    """True when something is mounted at ``mount_point``.

    Args:
        devices: the machine's block devices.
        mount_point: the directory to check.

    Raises:
        BlockDeviceError: the mount table cannot be read.
    """
    return devices.mounted_source(mount_point) is not None


def _run(argv: Sequence[str]) -> "subprocess.CompletedProcess[str]":
    return subprocess.run(list(argv), check=False, capture_output=True, text=True, timeout=300)


def _chown(path: str, user: str) -> None:
    try:
        entry = pwd.getpwnam(user)
    except KeyError:
        raise BlockDeviceError(f"training user {user!r} does not exist on this machine; create it or set "
                               "training.user to an existing user") from None
    os.chown(path, entry.pw_uid, entry.pw_gid)


class LinuxBlockDevices:
    """Real block devices (root needed for format, mount and chown).

    Args:
        dev_root: where ``/dev`` is (default ``"/dev"``; tests pass a fake tree).
        sys_root: where ``/sys`` is (default ``"/sys"``).
        proc_mounts: the mount table to read (default ``"/proc/self/mounts"``).
        run: command runner returning a CompletedProcess (default: ``subprocess.run`` with captured
            text output, 300 s timeout, no exception on a non-zero exit).
        log: default ``logging.getLogger(__name__)``.
    """

    def __init__(self, dev_root: str = "/dev", *, sys_root: str = "/sys", proc_mounts: str = "/proc/self/mounts",
                 run: Runner = _run, log: logging.Logger | None = None) -> None:
        self.dev_root = Path(dev_root)
        self.sys_root = Path(sys_root)
        self.proc_mounts = Path(proc_mounts)
        self._run = run
        self._log = log or logging.getLogger(__name__)

    def resolve(self, volume_id: str, requested_name: str | None = None) -> str | None:
        """Device of ``volume_id``: by-id link, else NVMe serial, else (Xen only) the requested name.

        Args:
            volume_id: the EBS volume id (``vol-…``).
            requested_name: the device name given to AttachVolume (``/dev/sdf``); Xen instances only.

        Returns:
            the real path (``/dev/nvme1n1``), or ``None`` while the device has not appeared.
        """
        serial = volume_id.replace("-", "")
        by_id = self.dev_root / "disk" / "by-id" / f"{EBS_BY_ID_PREFIX}{serial}"
        if by_id.exists():
            return os.path.realpath(by_id)
        nvme_controllers = sorted((self.sys_root / "class" / "nvme").glob("nvme*"))
        for controller in nvme_controllers:
            try:
                found = (controller / "serial").read_text().strip()
            except OSError:
                continue
            if found.replace("-", "") == serial:
                namespaces = sorted(p.name for p in controller.glob(f"{controller.name}n*") if "p" not in p.name[len(controller.name):])
                name = namespaces[0] if namespaces else f"{controller.name}n1"
                device = self.dev_root / name
                return str(device) if device.exists() else None
        if nvme_controllers or not requested_name:
            return None  # a Nitro instance: only the serial identifies the volume
        # Xen: the kernel names /dev/sdf as /dev/xvdf (or keeps sdf on old kernels).
        short = Path(requested_name).name
        for candidate in (short.replace("sd", "xvd", 1) if short.startswith("sd") else short, short):
            device = self.dev_root / candidate
            if device.exists():
                return str(device)
        return None

    def has_filesystem(self, device: str) -> str | None:
        """``blkid -o value -s TYPE DEVICE``: exit 2 means no file system."""
        result = self._run(["blkid", "-o", "value", "-s", "TYPE", device])
        if result.returncode == 2:
            return None
        if result.returncode != 0:
            raise BlockDeviceError(f"blkid {device} failed with exit {result.returncode}: {result.stderr.strip()}")
        return result.stdout.strip() or None

    def format(self, device: str, fs_type: str) -> None:
        """``mkfs.<fs_type> DEVICE`` after re-checking with blkid that there is no file system.

        Args:
            device: the device path.
            fs_type: the file system type (``"xfs"``); ``mkfs.<fs_type>`` must exist.

        Raises:
            BlockDeviceError: ``device`` has a file system already, or ``blkid``/``mkfs`` failed.
        """
        existing = self.has_filesystem(device)
        if existing is not None:
            raise BlockDeviceError(f"refusing to format {device}: it already has a {existing} file system")
        result = self._run([f"mkfs.{fs_type}", "-q", device])
        if result.returncode != 0:
            raise BlockDeviceError(f"mkfs.{fs_type} {device} failed with exit {result.returncode}: {result.stderr.strip()}")

    def mount(self, device: str, mount_point: str, fs_type: str) -> None:
        """``mount -t TYPE -o defaults,noatime DEVICE MOUNT_POINT``.

        Args:
            device: the device path.
            mount_point: the directory (created if missing).
            fs_type: the file system type on the device.

        Raises:
            BlockDeviceError: ``mount`` exited non-zero (its stderr in the message).
        """
        Path(mount_point).mkdir(parents=True, exist_ok=True)
        result = self._run(["mount", "-t", fs_type, "-o", "defaults,noatime", device, mount_point])
        if result.returncode != 0:
            raise BlockDeviceError(f"mount {device} at {mount_point} failed with exit {result.returncode}: "
                                   f"{result.stderr.strip()}")

    def mounted_source(self, mount_point: str) -> str | None:
        """The source of the last mount at ``mount_point`` in the mount table (octal escapes decoded)."""
        target = os.path.realpath(mount_point)
        source = None
        try:
            lines = self.proc_mounts.read_text().splitlines()
        except OSError as error:
            raise BlockDeviceError(f"cannot read the mount table {self.proc_mounts}: {error}") from error
        for line in lines:
            fields = line.split()
            if len(fields) >= 2 and _unescape(fields[1]) == target:
                source = _unescape(fields[0])
        return os.path.realpath(source) if source and source.startswith("/") else source

    def unmount(self, mount_point: str) -> None:
        """``umount MOUNT_POINT`` when something is mounted there."""
        if self.mounted_source(mount_point) is None:
            return
        result = self._run(["umount", mount_point])
        if result.returncode != 0:
            raise BlockDeviceError(f"umount {mount_point} failed with exit {result.returncode}: {result.stderr.strip()}")

    def chown(self, path: str, user: str) -> None:
        """Give ``path`` (not recursively) to ``user`` and its primary group.

        Args:
            path: the file or directory.
            user: the user name.

        Raises:
            BlockDeviceError: ``user`` does not exist on this machine.
        """
        _chown(path, user)


def _unescape(field: str) -> str:
    # /proc/mounts escapes space, tab, newline and backslash as \040, \011, \012, \134.
    return field.replace("\\040", " ").replace("\\011", "\t").replace("\\012", "\n").replace("\\134", "\\")


class DirectoryBlockDevices:
    """Volumes as directories: ``<root>/<vol-id>/`` (local mode and tests).

    Args:
        root: the directory holding one directory per volume (``MotoServer.volumes_dir``).
    """

    #: Marker file standing in for a file system's superblock; travels with snapshots.
    FS_MARKER = ".spot-training-fs"

    def __init__(self, root: str | os.PathLike[str]) -> None:
        self.root = Path(root)

    def resolve(self, volume_id: str, requested_name: str | None = None) -> str | None:
        """``<root>/<vol-id>`` if that directory exists (the data plane creates it with the volume).

        Args:
            volume_id: the volume id (``vol-…``).
            requested_name: ignored (directories have no device names).

        Returns:
            the directory's path, or None.
        """
        device = self.root / volume_id
        return str(device) if device.is_dir() else None

    def has_filesystem(self, device: str) -> str | None:
        """The file system type written in the directory's marker file, or ``None`` when it has none.

        Args:
            device: the volume's directory.
        """
        marker = Path(device) / self.FS_MARKER
        return marker.read_text().strip() if marker.exists() else None

    def format(self, device: str, fs_type: str) -> None:
        """Write the marker file that stands in for a file system (atomically).

        Args:
            device: the volume's directory.
            fs_type: the file system type recorded in the marker.

        Raises:
            BlockDeviceError: the directory has a marker already.
        """
        existing = self.has_filesystem(device)
        if existing is not None:
            raise BlockDeviceError(f"refusing to format {device}: it already has a {existing} file system")
        marker = Path(device) / self.FS_MARKER
        temporary = marker.with_suffix(".tmp")
        temporary.write_text(fs_type)
        os.replace(temporary, marker)

    def mount(self, device: str, mount_point: str, fs_type: str) -> None:
        """Make ``mount_point`` a symlink to ``device``; an empty directory there is replaced, a
        non-empty one is an error (like mounting over data, which would hide it).

        Args:
            device: the volume's directory.
            mount_point: the path to make the symlink.
            fs_type: ignored.

        Raises:
            BlockDeviceError: ``mount_point`` is a non-empty directory or a file.
        """
        point = Path(mount_point)
        point.parent.mkdir(parents=True, exist_ok=True)
        if point.is_symlink():
            point.unlink()
        elif point.is_dir():
            if any(point.iterdir()):
                raise BlockDeviceError(f"mount point {mount_point} is a non-empty directory; refusing to hide its files")
            point.rmdir()
        elif point.exists():
            raise BlockDeviceError(f"mount point {mount_point} exists and is not a directory")
        temporary = point.with_name(f".{point.name}.mounting")
        if temporary.is_symlink():
            temporary.unlink()
        temporary.symlink_to(Path(device).resolve(), target_is_directory=True)
        os.replace(temporary, point)

    def mounted_source(self, mount_point: str) -> str | None:
        """The directory ``mount_point`` links to, or ``None`` when it is no symlink to a directory.

        Args:
            mount_point: the path to check.
        """
        point = Path(mount_point)
        if not point.is_symlink():
            return None
        target = Path(os.path.realpath(point))
        return str(target) if target.is_dir() else None

    def unmount(self, mount_point: str) -> None:
        """Remove the symlink at ``mount_point`` (nothing if there is none).

        Args:
            mount_point: the path to unmount.
        """
        point = Path(mount_point)
        if point.is_symlink():
            point.unlink()

    def chown(self, path: str, user: str) -> None:
        """Give ``path`` to ``user``; when that user does not exist on this machine (local mode on a
        laptop), the directory stays with the current user, who runs the trainer there.

        Args:
            path: the file or directory.
            user: the user name.
        """
        try:
            pwd.getpwnam(user)
        except KeyError:
            return
        _chown(path, user)

