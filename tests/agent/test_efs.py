"""spot_training.agent.efs: the one mount command (efs-utils, TLS + IAM + access point), no anonymous NFS fallback
(exit 78 without efs-utils, before any resource is touched), idempotence, failures."""

from __future__ import annotations

import subprocess

import pytest

from spot_training.agent.config import EfsConfig
from spot_training.agent.efs import efs_dns_name, mount_efs
from spot_training.agent.errors import ConfigError, ExitCode, TemporaryError

FS = "fs-0123456789abcdef0"
AP = "fsap-0123456789abcdef0"


class _Machine:
    """A runner that 'mounts' by appending to a fake mount table; fails the first ``failures`` times."""

    def __init__(self, mounts_path, failures=0):
        self.mounts = mounts_path
        self.mounts.write_text("/dev/root / ext4 rw 0 0\n")
        self.commands = []
        self.failures = failures

    def __call__(self, argv):
        self.commands.append(list(argv))
        if self.failures:
            self.failures -= 1
            return subprocess.CompletedProcess(argv, 32, "", "mount.nfs4: Failed to resolve server")
        source = "127.0.0.1:/" if argv[2] == "efs" else argv[-2]
        with self.mounts.open("a") as table:
            table.write(f"{source} {argv[-1]} nfs4 rw 0 0\n")
        return subprocess.CompletedProcess(argv, 0, "", "")


def _efs(tmp_path, access_point=AP):
    return EfsConfig(file_system_id=FS, access_point_id=access_point, mount_point=tmp_path / "efs")


def _mount(tmp_path, machine, efs, efs_utils=True):
    return mount_efs(efs, region="us-west-2", run=machine, which=lambda name: "/sbin/mount.efs" if efs_utils else None,
                     proc_mounts=machine.mounts, sleep=lambda s: None, rng=lambda: 0.0)


def test_efs_utils_mounts_with_tls_iam_and_the_access_point_once(tmp_path):
    machine = _Machine(tmp_path / "mounts")
    efs = _efs(tmp_path)
    assert _mount(tmp_path, machine, efs) == efs.mount_point
    assert machine.commands == [["mount", "-t", "efs", "-o", f"tls,iam,accesspoint={AP}", f"{FS}:/", str(efs.mount_point)]]
    assert efs.mount_point.is_dir()
    _mount(tmp_path, machine, efs)  # already mounted: nothing runs
    assert len(machine.commands) == 1


def test_without_access_point_still_tls_and_iam(tmp_path):
    machine = _Machine(tmp_path / "mounts")
    efs = _efs(tmp_path, access_point=None)
    _mount(tmp_path, machine, efs)
    assert machine.commands == [["mount", "-t", "efs", "-o", "tls,iam", f"{FS}:/", str(efs.mount_point)]]


def test_without_efs_utils_no_anonymous_nfs_fallback_but_exit_78(tmp_path):
    machine = _Machine(tmp_path / "mounts")
    efs = _efs(tmp_path)
    with pytest.raises(ConfigError, match=r"mount\.efs \(amazon-efs-utils\) is not installed.*no anonymous NFS fallback") as raised:
        _mount(tmp_path, machine, efs, efs_utils=False)
    assert raised.value.exit_code == ExitCode.CONFIG == 78
    assert machine.commands == [] and not efs.mount_point.exists()


def test_a_failing_mount_is_retried_then_succeeds(tmp_path):
    machine = _Machine(tmp_path / "mounts", failures=2)
    _mount(tmp_path, machine, _efs(tmp_path))
    assert len(machine.commands) == 3


def test_a_mount_that_keeps_failing_is_a_temporary_failure(tmp_path):
    machine = _Machine(tmp_path / "mounts", failures=100)
    with pytest.raises(TemporaryError, match="mount EFS fs-0123456789abcdef0 .*still failing after 10 attempts.*resolve"):
        _mount(tmp_path, machine, _efs(tmp_path))


def test_something_else_mounted_there_is_refused(tmp_path):
    machine = _Machine(tmp_path / "mounts")
    efs = _efs(tmp_path)
    efs.mount_point.mkdir()
    with machine.mounts.open("a") as table:
        table.write(f"/dev/nvme1n1 {efs.mount_point} xfs rw 0 0\n")
    with pytest.raises(TemporaryError, match=r"already has /dev/nvme1n1 \(xfs\) mounted, not EFS"):
        _mount(tmp_path, machine, efs, efs_utils=True)
    assert machine.commands == []


def test_dns_name_per_partition():
    assert efs_dns_name(FS, "eu-west-1") == f"{FS}.efs.eu-west-1.amazonaws.com"
    assert efs_dns_name(FS, "cn-north-1") == f"{FS}.efs.cn-north-1.amazonaws.com.cn"
