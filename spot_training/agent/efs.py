"""Mount the stack's EFS file system with IAM and TLS through amazon-efs-utils; idempotent.

The only mount this agent makes is ``mount -t efs -o tls,iam[,accesspoint=fsap-…] fs-…:/ MOUNT_POINT``
(amazon-efs-utils' mount helper ``mount.efs``): encryption in transit, the instance role authorized
by the file system policy (``elasticfilesystem:ClientMount``/``ClientWrite``, which the stacks grant
to the node roles), and the access point enforcing the POSIX identity and root directory.

There is no plain-NFS fallback. The stacks' file system policy denies anonymous access
(``@aws-cdk/aws-efs:denyAnonymousAccess``), so an NFS mount without ``iam`` cannot be authorized and
cannot select the access point either; falling back to it only hides the real problem. When
``mount.efs`` is missing the agent raises :class:`ConfigError` (exit 78: systemd does not restart it)
naming the package and how the user data installs it (``spot_training.infra.userdata.efs_utils_install_commands``).

Already mounted (the mount table shows this file system at the mount point): nothing is run. Something
else mounted there: :class:`TemporaryError`, nothing is run. A failed mount (DNS of a new mount target
can take a minute to resolve) is retried with bounded, jittered backoff, then TemporaryError (exit 75).
Local mode (``SPOT_TRAINING_BLOCKDEV_DIR`` set by the local node runner, ``spot_training.agent.cli``) never
calls this module: its "EFS" is a shared directory.
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

from spot_training.agent.errors import ConfigError, TemporaryError
from spot_training.agent.retry import Deadline, RetryPolicy, call_with_retry

#: The mount helper amazon-efs-utils installs; without it the agent does not mount (exit 78).
MOUNT_HELPER = "mount.efs"

Runner = Callable[[Sequence[str]], "subprocess.CompletedProcess[str]"]


class _MountFailed(Exception):
    """A mount command exited non-zero (retryable)."""


def _run(argv: Sequence[str]) -> "subprocess.CompletedProcess[str]":
    return subprocess.run(list(argv), check=False, capture_output=True, text=True, timeout=120)


def efs_dns_name(file_system_id: str, region: str) -> str:
    """The file system's DNS name: ``fs-….efs.REGION.amazonaws.com`` (``.amazonaws.com.cn`` in the China regions).

    Source: Amazon EFS User Guide, "Implementation summary" and "Mounting on Amazon EC2 with a DNS name".

    Args:
        file_system_id: the EFS file system id (``fs-…``).
        region: the AWS region (``us-east-1``).

    Returns:
        the DNS name.
    """
    suffix = "amazonaws.com.cn" if region.startswith("cn-") else "amazonaws.com"
    return f"{file_system_id}.efs.{region}.{suffix}"


def mount_command(efs: Any) -> list[str]:
    """The efs-utils mount command for ``efs`` (an ``EfsConfig``: ``file_system_id``,
    ``access_point_id`` or None, ``mount_point``): always ``tls`` and ``iam``, plus the access point."""
    options = ["tls", "iam"]
    if efs.access_point_id:
        options.append(f"accesspoint={efs.access_point_id}")
    return ["mount", "-t", "efs", "-o", ",".join(options), f"{efs.file_system_id}:/", str(efs.mount_point)]


def require_mount_helper(efs: Any, *, which: Callable[[str], str | None] = shutil.which) -> None:
    """Raise :class:`ConfigError` (exit 78) unless ``mount.efs`` (amazon-efs-utils) is on the PATH.

    ``spot_training.agent.cli`` calls it before touching any resource, so a node without efs-utils stops
    before it attaches the data volume.

    Args:
        efs: the config's ``EfsConfig`` (its ids and mount point are named in the message).
        which: looks a program up on the PATH (default ``shutil.which``; tests pass their own).

    Raises:
        ConfigError: ``mount.efs`` is not installed (exit 78).
    """
    if which(MOUNT_HELPER) is None:
        raise ConfigError(
            f"efs: cannot mount {efs.file_system_id} at {efs.mount_point}: {MOUNT_HELPER} (amazon-efs-utils) is not installed. "
            "The file system policy allows only IAM-authorized clients over TLS, so there is no anonymous NFS fallback. "
            "The stack's user data builds amazon-efs-utils from source before the agent starts (spot_training.infra.userdata."
            "efs_utils_install_commands); check its log in /var/log/cloud-init-output.log, or use an AMI that ships "
            "amazon-efs-utils (image_id)")


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
        region: the AWS region (for recognising an existing mount by its DNS name).
        log: logger (default ``spot_training.agent.efs``); run: command runner (returns a CompletedProcess);
        which: finds ``mount.efs`` (amazon-efs-utils); proc_mounts: the mount table to read.
        deadline_s: seconds to keep retrying a failing mount (default 180).
        sleep: sleeps the given seconds (default ``time.sleep``; tests pass their own).
        rng: jitter source, uniform in [0, 1) (default ``random.random``).

    Raises:
        ConfigError: ``mount.efs`` is not installed (exit 78; nothing was mounted).
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
    require_mount_helper(efs, which=which)
    command = mount_command(efs)
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
                                   "mount_point": str(mount_point), "tls": True, "iam": True})
    return mount_point
