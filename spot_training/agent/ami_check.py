"""What the agent needs from the AMI, checked at start: a missing piece is a boot error naming it and the fix.

Without this check a too-old botocore turns into ``TypeError``/``ParamValidationError`` at the first
move (an agent restart every 15 s for ever), and a missing ``mkfs.xfs`` or ``venv`` into a failure
deep inside a boot step. :func:`check_node` raises :class:`~spot_training.agent.errors.ConfigError`
(exit 78, boot step ``config``: reported once and final, since every replacement from the same AMI
would fail alike) listing every missing piece.

Checked (only what this node's config uses):

- botocore >= 1.38.10 when ``volume.initialization_rate_mibps`` is set: CreateVolume's
  ``VolumeInitializationRate`` first appears in botocore 1.38.10 (botocore CHANGELOG, 1.38.10,
  "api-change:ec2: ... Provisioned Rate for Volume Initialization");
- the AWS CLI (``aws``): the boot-failure script reports and counts failed boots with it;
- ``mkfs.<fs_type>`` on a single node (a new data volume is formatted by the agent);
- ``training.python -m venv`` with ``ensurepip`` when ``training.venv`` is set (Ubuntu ships them
  in the ``python3-venv`` package).

Local mode (volumes are directories) checks only the Python pieces.
"""

from __future__ import annotations

import re
import shutil
import subprocess
from typing import Any, Callable

from spot_training.agent.errors import ConfigError

#: botocore's first release with CreateVolume ``VolumeInitializationRate``.
MIN_BOTOCORE_FOR_INITIALIZATION_RATE = (1, 38, 10)


def _version(text: str) -> tuple[int, ...]:
    return tuple(int(part) for part in re.findall(r"\d+", text)[:3])


def venv_works(python: str) -> bool:
    """Whether ``python -c 'import venv, ensurepip'`` succeeds (what ``python -m venv`` needs)."""
    try:
        return subprocess.run([python, "-c", "import venv, ensurepip"], capture_output=True, timeout=60,
                              stdin=subprocess.DEVNULL).returncode == 0
    except (OSError, subprocess.TimeoutExpired):
        return False


def check_node(config: Any, *, local_mode: bool = False, botocore_version: str | None = None,
               which: Callable[[str], str | None] = shutil.which,
               venv_ok: Callable[[str], bool] = venv_works) -> None:
    """Check this node against what ``config`` needs (see the module docstring).

    Args:
        config: the validated AgentConfig.
        local_mode: volumes are directories: skip the AWS CLI and mkfs checks.
        botocore_version: the installed botocore's version (default: ``botocore.__version__``).
        which: looks a program up on the PATH (default ``shutil.which``).
        venv_ok: tells whether an interpreter can create a virtual environment with pip (default :func:`venv_works`).

    Raises:
        ConfigError: naming each missing piece and how to fix it.
    """
    missing = []
    if botocore_version is None:
        import botocore

        botocore_version = botocore.__version__
    rate = getattr(config.volume, "initialization_rate_mibps", None) if config.volume is not None else None
    if config.node_role == "single" and rate is not None \
            and _version(botocore_version) < MIN_BOTOCORE_FOR_INITIALIZATION_RATE:
        need = ".".join(map(str, MIN_BOTOCORE_FOR_INITIALIZATION_RATE))
        missing.append(f"botocore {botocore_version} is older than {need}, the first with CreateVolume's "
                       f"VolumeInitializationRate (volume.initialization_rate_mibps={rate}); fix: an AMI with "
                       f"boto3/botocore >= {need} (pip install 'botocore>={need}'), or deploy with "
                       "-c volume_initialization_rate_mibps=none")
    if not local_mode:
        if which("aws") is None:
            missing.append("the AWS CLI ('aws') is not on PATH; the boot-failure report needs it; fix: an AMI with "
                           "the AWS CLI v2 (the Deep Learning AMIs have it)")
        if config.node_role == "single" and config.volume is not None \
                and which(f"mkfs.{config.volume.fs_type}") is None:
            package = "xfsprogs" if config.volume.fs_type == "xfs" else "e2fsprogs"
            missing.append(f"mkfs.{config.volume.fs_type} is not on PATH; the agent formats a new data volume with "
                           f"it; fix: an AMI with {package} installed")
    if config.training is not None and config.training.venv is not None and not venv_ok(str(config.training.python)):
        missing.append(f"{config.training.python} -m venv does not work (no venv/ensurepip); the trainer's environment "
                       "is built with it; fix: an AMI with python3-venv installed (apt-get install python3-venv), or "
                       "-c training_python= an interpreter that has it")
    if missing:
        raise ConfigError("this AMI lacks what the agent needs: " + "; ".join(missing))
