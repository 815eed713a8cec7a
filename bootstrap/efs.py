"""Mount the stack's EFS file system: TLS through efs-utils when present, else NFS 4.1; idempotent.

- With amazon-efs-utils (``mount.efs`` on the PATH): ``mount -t efs -o tls[,iam,accesspoint=fsap-…]
  fs-…:/ MOUNT_POINT`` (encryption in transit, the access point enforces the POSIX identity and root
  directory). ``iam`` is added with an access point so the file system policy can authorize the
  instance role.
- Without it: ``mount -t nfs4 -o nfsvers=4.1,rsize=1048576,wsize=1048576,hard,timeo=600,retrans=2,noresvport
  fs-….efs.REGION.amazonaws.com:/ MOUNT_POINT``, the options of AWS's EFS guide and of the AWS Batch
  article (1 MiB reads and writes, hard mounts that retry for ever rather than corrupt, 60 s timeout,
  2 retransmissions, a new source port on reconnect). Plain NFS can neither encrypt in transit nor
  select an access point; both are logged as warnings.

Already mounted (the mount table shows this file system at the mount point): nothing is run. Something
else mounted there: :class:`TemporaryError`, nothing is run. A failed mount (DNS of a new mount target
can take a minute to resolve) is retried with bounded, jittered backoff, then TemporaryError (exit 75).
"""

from __future__ import annotations

import logging
import os
import random
import shutil
import subprocess
import time
from pathlib import Path
from typing import Any, Callable, Sequence

from bootstrap.errors import TemporaryError
from bootstrap.retry import Deadline, RetryPolicy, call_with_retry

#: NFS options from the EFS user guide ("Mounting on Amazon EC2 with a DNS name") and the article.
NFS_OPTIONS = "nfsvers=4.1,rsize=1048576,wsize=1048576,hard,timeo=600,retrans=2,noresvport"

Runner = Callable[[Sequence[str]], "subprocess.CompletedProcess[str]"]


class _MountFailed(Exception):
    """A mount command exited non-zero (retryable)."""


def _run(argv: Sequence[str]) -> "subprocess.CompletedProcess[str]":
    return subprocess.run(list(argv), check=False, capture_output=True, text=True, timeout=120)


def efs_dns_name(file_system_id: str, region: str) -> str:
    """``fs-….efs.REGION.amazonaws.com`` (``.amazonaws.com.cn`` in the China regions)."""
    suffix = "amazonaws.com.cn" if region.startswith("cn-") else "amazonaws.com"
    return f"{file_system_id}.efs.{region}.{suffix}"


def mount_command(efs: Any, *, region: str, efs_utils: bool) -> list[str]:
    """The mount command for ``efs`` (an ``EfsConfig``: ``file_system_id``, ``access_point_id``,
    ``mount_point``): efs-utils with TLS when ``efs_utils``, else NFS 4.1 with :data:`NFS_OPTIONS`."""
    if efs_utils:
        options = ["tls"]
        if efs.access_point_id:
            options += ["iam", f"accesspoint={efs.access_point_id}"]
        return ["mount", "-t", "efs", "-o", ",".join(options), f"{efs.file_system_id}:/", str(efs.mount_point)]
    return ["mount", "-t", "nfs4", "-o", NFS_OPTIONS, f"{efs_dns_name(efs.file_system_id, region)}:/", str(efs.mount_point)]


def _mounted(proc_mounts: Path, mount_point: Path) -> tuple[str, str] | None:
    """``(source, fstype)`` of the last mount at ``mount_point``, or None."""
    target = os.path.realpath(mount_point)
    found = None
    for line in proc_mounts.read_text().splitlines():
        fields = line.split()
        if len(fields) >= 3 and fields[1].replace("\\040", " ") == target:
            found = (fields[0], fields[2])
    return found


def mount_efs(
    efs: Any,
    *,
    region: str,
    log: logging.Logger | None = None,
    run: Runner = _run,
    which: Callable[[str], str | None] = shutil.which,
    proc_mounts: str | os.PathLike[str] = "/proc/self/mounts",
    deadline_s: float = 180.0,
    sleep: Callable[[float], None] = time.sleep,
    rng: Callable[[], float] = random.random,
) -> Path:
    """Mount ``efs`` at ``efs.mount_point`` unless it is already mounted there; return the mount point.

    Args:
        efs: the config's ``EfsConfig`` (``file_system_id``, ``access_point_id`` or None, ``mount_point``).
        region: the AWS region (for the NFS DNS name).
        log: logger (default ``bootstrap.efs``); run: command runner (returns a CompletedProcess);
        which: finds ``mount.efs`` (efs-utils); proc_mounts: the mount table to read.
        deadline_s: seconds to keep retrying a failing mount (default 180).
        sleep, rng: injectable for tests.

    Raises:
        TemporaryError: something else is mounted at the mount point, or the mount kept failing.
    """
    log = log or logging.getLogger(__name__)
    mount_point = Path(efs.mount_point)
    table = Path(proc_mounts)
    dns = efs_dns_name(efs.file_system_id, region)
    current = _mounted(table, mount_point)
    if current is not None:
        source, fstype = current
        if efs.file_system_id in source or source.startswith(dns) or (fstype in ("nfs4", "efs") and source.startswith("127.0.0.1:")):
            log.info("EFS already mounted", extra={"event": "efs_already_mounted", "mount_point": str(mount_point),
                                                   "source": source})
            return mount_point
        raise TemporaryError(f"{mount_point} already has {source} ({fstype}) mounted, not EFS {efs.file_system_id}; "
                             "unmount it or choose another efs.mount_point")
    efs_utils = which("mount.efs") is not None
    if not efs_utils:
        log.warning("amazon-efs-utils not installed: mounting with NFS 4.1, without TLS"
                    + (f" and without access point {efs.access_point_id}" if efs.access_point_id else ""),
                    extra={"event": "efs_without_tls", "file_system_id": efs.file_system_id})
    command = mount_command(efs, region=region, efs_utils=efs_utils)
    mount_point.mkdir(parents=True, exist_ok=True)

    def attempt() -> None:
        result = run(command)
        if result.returncode != 0:
            raise _MountFailed(f"{' '.join(command)} exited {result.returncode}: {result.stderr.strip()}")

    call_with_retry(attempt, what=f"mount EFS {efs.file_system_id} at {mount_point}",
                    policy=RetryPolicy(max_attempts=10, base_delay=2.0, max_delay=30.0),
                    deadline=Deadline(deadline_s, "mount EFS"), retryable=lambda e: isinstance(e, _MountFailed),
                    sleep=sleep, rng=rng, log=log)
    log.info("EFS mounted", extra={"event": "efs_mounted", "file_system_id": efs.file_system_id,
                                   "mount_point": str(mount_point), "tls": efs_utils})
    return mount_point
