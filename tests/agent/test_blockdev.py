"""spot_training.agent.blockdev: device by volume id against a fake /dev and /sys tree, the Linux commands
built (runner injected), and the directory implementation used in local mode."""

from __future__ import annotations

import getpass
import subprocess

import pytest

from spot_training.agent.blockdev import BlockDeviceError, DirectoryBlockDevices, LinuxBlockDevices, is_mounted

VOLUME = "vol-0123456789abcdef0"


def _fake_dev(tmp_path):
    dev = tmp_path / "dev"
    (dev / "disk" / "by-id").mkdir(parents=True)
    for name in ("nvme0n1", "nvme1n1", "nvme2n1", "xvdf"):
        (dev / name).touch()
    return dev


def test_nitro_device_found_by_volume_id_not_by_requested_name(tmp_path):
    dev = _fake_dev(tmp_path)
    # As udev's EBS rule makes it: the link names the volume id (no dash), the target is nvme2n1.
    (dev / "disk" / "by-id" / "nvme-Amazon_Elastic_Block_Store_vol0123456789abcdef0").symlink_to("../../nvme2n1")
    (dev / "disk" / "by-id" / "nvme-Amazon_Elastic_Block_Store_vol0aaaaaaaaaaaaaaaa").symlink_to("../../nvme1n1")
    devices = LinuxBlockDevices(str(dev), sys_root=str(tmp_path / "sys"))
    assert devices.resolve(VOLUME, "/dev/sdf") == str((dev / "nvme2n1").resolve())
    assert devices.resolve("vol-0aaaaaaaaaaaaaaaa", "/dev/sdf") == str((dev / "nvme1n1").resolve())


def test_nvme_serial_in_sys_when_udev_links_are_missing(tmp_path):
    dev = _fake_dev(tmp_path)
    sys_nvme = tmp_path / "sys" / "class" / "nvme"
    for controller, serial in (("nvme0", "AWS1234567890ABCDEF"), ("nvme1", "vol0123456789abcdef0")):
        (sys_nvme / controller / f"{controller}n1").mkdir(parents=True)
        (sys_nvme / controller / "serial").write_text(serial + "  \n")
    devices = LinuxBlockDevices(str(dev), sys_root=str(tmp_path / "sys"))
    assert devices.resolve(VOLUME, "/dev/sdf") == str(dev / "nvme1n1")


def test_device_not_there_yet_is_none_on_nitro_even_if_the_requested_name_exists(tmp_path):
    dev = _fake_dev(tmp_path)
    (dev / "sdf").touch()
    sys_nvme = tmp_path / "sys" / "class" / "nvme" / "nvme0"
    sys_nvme.mkdir(parents=True)
    (sys_nvme / "serial").write_text("vol0fffffffffffffff0")
    devices = LinuxBlockDevices(str(dev), sys_root=str(tmp_path / "sys"))
    assert devices.resolve(VOLUME, "/dev/sdf") is None


def test_xen_instance_without_nvme_uses_the_xvd_name(tmp_path):
    dev = _fake_dev(tmp_path)
    devices = LinuxBlockDevices(str(dev), sys_root=str(tmp_path / "sys"))
    assert devices.resolve(VOLUME, "/dev/sdf") == str(dev / "xvdf")
    assert devices.resolve(VOLUME, "/dev/sdg") is None


class _Runner:
    """Records commands; answers blkid as configured."""

    def __init__(self, blkid_type=None):
        self.commands = []
        self.blkid_type = blkid_type

    def __call__(self, argv):
        self.commands.append(list(argv))
        if argv[0] == "blkid":
            if self.blkid_type is None:
                return subprocess.CompletedProcess(argv, 2, "", "")
            return subprocess.CompletedProcess(argv, 0, self.blkid_type + "\n", "")
        return subprocess.CompletedProcess(argv, 0, "", "")


def test_linux_format_mount_commands(tmp_path):
    runner = _Runner()
    devices = LinuxBlockDevices(str(tmp_path), sys_root=str(tmp_path), run=runner)
    assert devices.has_filesystem("/dev/nvme1n1") is None
    devices.format("/dev/nvme1n1", "xfs")
    devices.mount("/dev/nvme1n1", str(tmp_path / "dltraining"), "xfs")
    assert runner.commands == [
        ["blkid", "-o", "value", "-s", "TYPE", "/dev/nvme1n1"],
        ["blkid", "-o", "value", "-s", "TYPE", "/dev/nvme1n1"],
        ["mkfs.xfs", "-q", "/dev/nvme1n1"],
        ["mount", "-t", "xfs", "-o", "defaults,noatime", "/dev/nvme1n1", str(tmp_path / "dltraining")],
    ]


def test_linux_refuses_to_format_a_device_with_a_file_system(tmp_path):
    runner = _Runner(blkid_type="xfs")
    devices = LinuxBlockDevices(str(tmp_path), run=runner)
    with pytest.raises(BlockDeviceError, match="refusing to format /dev/nvme1n1: it already has a xfs"):
        devices.format("/dev/nvme1n1", "xfs")
    assert not any(c[0].startswith("mkfs") for c in runner.commands)


def test_linux_mount_table_parsing(tmp_path):
    mounts = tmp_path / "mounts"
    point = tmp_path / "dl training"
    point.mkdir()
    escaped = str(point).replace(" ", "\\040")
    mounts.write_text(f"/dev/root / ext4 rw 0 0\n/dev/nvme1n1 {escaped} xfs rw,noatime 0 0\n")
    devices = LinuxBlockDevices(str(tmp_path), proc_mounts=str(mounts))
    assert devices.mounted_source(str(point)) == "/dev/nvme1n1"
    assert devices.mounted_source(str(tmp_path / "elsewhere")) is None


def test_directory_devices_mount_is_a_link_and_idempotent(tmp_path):
    root = tmp_path / "volumes"
    (root / VOLUME).mkdir(parents=True)
    devices = DirectoryBlockDevices(root)
    device = devices.resolve(VOLUME)
    assert device == str(root / VOLUME)
    assert devices.resolve("vol-0ffffffffffffffff") is None
    assert devices.has_filesystem(device) is None
    devices.format(device, "xfs")
    assert devices.has_filesystem(device) == "xfs"
    with pytest.raises(BlockDeviceError, match="already has a xfs"):
        devices.format(device, "ext4")
    point = tmp_path / "dltraining"
    point.mkdir()  # an empty mount point directory, as on an instance
    devices.mount(device, str(point), "xfs")
    assert is_mounted(devices, str(point))
    (point / "file").write_text("on the volume")
    assert (root / VOLUME / "file").read_text() == "on the volume"
    devices.chown(str(point), getpass.getuser())
    devices.unmount(str(point))
    assert not is_mounted(devices, str(point))
    assert (root / VOLUME / "file").exists()


def test_directory_devices_never_hide_files_under_the_mount_point(tmp_path):
    root = tmp_path / "volumes"
    (root / VOLUME).mkdir(parents=True)
    point = tmp_path / "dltraining"
    point.mkdir()
    (point / "precious").write_text("x")
    with pytest.raises(BlockDeviceError, match="non-empty directory"):
        DirectoryBlockDevices(root).mount(str(root / VOLUME), str(point), "xfs")
    assert (point / "precious").read_text() == "x"
