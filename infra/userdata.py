"""The node's user data: fetch the bootstrap asset, write the node config, start the agent under systemd.

The node config JSON (schema: docs/contracts.md, "Node config JSON") sits in the user data between
the lines ``# BEGIN spot-training config`` and ``# END spot-training config``, inside a quoted
heredoc, so the user data carries the JSON text verbatim. :func:`extract_config` reads it back
(local mode uses it on a deployed launch template's user data); it is pure Python and imports no CDK.
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping, Sequence
from typing import Any

CONFIG_BEGIN = "# BEGIN spot-training config"
CONFIG_END = "# END spot-training config"
CONFIG_PATH = "/etc/spot-training/config.json"
CODE_DIR = "/opt/spot-training/code"
SERVICE_NAME = "spot-training-agent"
#: systemd must not restart the agent after this exit status (78: bad config; docs/contracts.md).
EXIT_BAD_CONFIG = 78
#: ... nor after this one (74: the trainer's checkpoint storage is full or unusable; docs/contracts.md).
EXIT_CHECKPOINT_STORAGE = 74
#: ... nor after this one (69: the node could no longer work and was powered off; docs/agent.md).
EXIT_NODE_UNUSABLE = 69
_HEREDOC_TAG = "SPOT_TRAINING_CONFIG_JSON"
_HEREDOC_START = re.compile(r"<<\s*'(?P<tag>[A-Za-z_][A-Za-z0-9_]*)'\s*$")

#: Seconds systemd waits for the single-node agent to stop before SIGKILL. The agent gives the
#: trainer up to 90 s to checkpoint and exit on stop; systemd's default of 90 s would kill the agent
#: at that very edge. (Cluster nodes pass a longer bound, infra.cluster.AGENT_STOP_TIMEOUT_S.)
STOP_TIMEOUT_S = 120


def systemd_unit(stop_timeout_s: int = STOP_TIMEOUT_S) -> str:
    """The systemd unit that runs the agent. ``Restart=on-failure`` retries exit 75 (try again later)
    and crashes; ``RestartPreventExitStatus=78 74 69`` stops the loop on a bad config, on unusable
    checkpoint storage, and after the agent powered off a node that can no longer work; ``TimeoutStopSec``
    is ``stop_timeout_s`` seconds (default :data:`STOP_TIMEOUT_S`)."""
    return f"""[Unit]
Description=spot-training node agent (volume, trainer, interruption notices, cleanup)
Wants=network-online.target
After=network-online.target

[Service]
Type=simple
WorkingDirectory={CODE_DIR}
ExecStart=/usr/bin/python3 -m bootstrap run --config {CONFIG_PATH}
Restart=on-failure
RestartSec=15
RestartPreventExitStatus={EXIT_BAD_CONFIG} {EXIT_CHECKPOINT_STORAGE} {EXIT_NODE_UNUSABLE}
TimeoutStopSec={stop_timeout_s}
Environment=PYTHONUNBUFFERED=1

[Install]
WantedBy=multi-user.target
"""


def node_config(
    *,
    region: str,
    stack_name: str,
    volume_tags: Mapping[str, str],
    framework: str,
    python: str,
    command: Sequence[str],
    user: str = "ubuntu",
    mount_point: str = "/dltraining",
    device_name: str = "/dev/sdf",
    fs_type: str = "xfs",
    keep_snapshots: int = 2,
    snapshot_interval_s: int | None = None,
    initialization_rate_mibps: int | None = None,
    code: Mapping[str, str] | None = None,
    efs: Mapping[str, str] | None = None,
    cancel_fleet_on_success: bool = True,
    imds_endpoint: str | None = None,
    node_role: str = "single",
    data_root: str | None = None,
    cluster: Mapping[str, Any] | None = None,
    monitoring: Mapping[str, Any] | None = None,
) -> dict[str, Any]:
    """The node config dict (schema version 1, docs/contracts.md).

    ``region`` and the ``efs`` ids may be CDK tokens (string-encoded; ``json.dumps`` keeps them for CDK to resolve).
    ``code`` defaults to the unpacked bootstrap asset ``{"type": "asset", "path": CODE_DIR}``.
    Dataset, checkpoint and log directories are ``datasets/``, ``checkpoints/``, ``logs/`` under
    ``data_root`` (default: ``mount_point``, the data volume; cluster nodes pass the EFS mount point).
    ``snapshot_interval_s`` (seconds, periodic snapshots while training) and ``initialization_rate_mibps``
    (a moved volume's provisioned initialization rate) go in the ``volume`` section only when set.
    ``node_role``: ``single`` (default) or a cluster role ``scheduler``/``server``/``worker``, which
    come with a ``cluster`` section (docs/contracts.md, "Parameter-server cluster"); the key is left
    out when ``cluster`` is None. ``monitoring``: the CloudWatch publishing section
    (``TrainingMonitoring.node_config()``); left out when None. Raises nothing; the stack validated the values.
    """
    root = data_root or mount_point
    config: dict[str, Any] = {
        "schema_version": 1,
        "region": region,
        "stack_name": stack_name,
        "node_role": node_role,
        "volume": {
            "tags": dict(volume_tags),
            "device_name": device_name,
            "mount_point": mount_point,
            "fs_type": fs_type,
            "keep_snapshots": keep_snapshots,
        },
        "efs": dict(efs) if efs is not None else None,
        "training": {
            "framework": framework,
            "python": python,
            "command": list(command),
            "user": user,
            "dataset_dir": f"{root}/datasets",
            "checkpoint_dir": f"{root}/checkpoints",
            "log_dir": f"{root}/logs",
            "code": dict(code) if code is not None else {"type": "asset", "path": CODE_DIR},
        },
        "cleanup": {"cancel_fleet_on_success": cancel_fleet_on_success},
        "imds_endpoint": imds_endpoint,
    }
    # Left out unless set, so configs of stacks that do not use them stay as they were.
    if snapshot_interval_s:
        config["volume"]["snapshot_interval_s"] = snapshot_interval_s
    if initialization_rate_mibps is not None:
        config["volume"]["initialization_rate_mibps"] = initialization_rate_mibps
    if cluster is not None:
        config["cluster"] = dict(cluster)
    if monitoring is not None:
        config["monitoring"] = dict(monitoring)
    return config


def config_block(config_json: str) -> list[str]:
    """User-data lines that write ``config_json`` (text, may hold tokens) to :data:`CONFIG_PATH`."""
    return [
        CONFIG_BEGIN,
        f"install -d -m 0755 {CONFIG_PATH.rsplit('/', 1)[0]}",
        f"cat > {CONFIG_PATH} <<'{_HEREDOC_TAG}'",
        config_json,
        _HEREDOC_TAG,
        CONFIG_END,
    ]


def _pip_install(python: str, requirements: Sequence[str]) -> str:
    quoted = " ".join(f"'{r}'" for r in requirements)
    # Ubuntu 23.04+ marks the system Python externally managed (PEP 668); 22.04 does not know the flag.
    return (f"{python} -m pip install --quiet {quoted} "
            f"|| {python} -m pip install --quiet --break-system-packages {quoted}")


def agent_commands(
    *,
    archive_path: str,
    boto3_requirement: str,
    training_python: str | None = None,
    training_requirements: Sequence[str] = (),
    stop_timeout_s: int = STOP_TIMEOUT_S,
) -> list[str]:
    """User-data lines that unpack the bootstrap asset and start the agent as a systemd service.

    Args:
        archive_path: where the asset's zip file was downloaded on the node.
        boto3_requirement: pip requirement installed when the system Python lacks boto3 (the agent
            needs only the standard library and boto3), e.g. ``boto3>=1.34,<2``.
        training_python: the trainer's interpreter; needed only with ``training_requirements``.
        training_requirements: pip requirements installed into ``training_python`` before the agent
            starts (the framework, when the AMI ships none); default: none.
        stop_timeout_s: the unit's ``TimeoutStopSec``; default :data:`STOP_TIMEOUT_S` (120).

    Raises:
        ValueError: a requirement holds a quote or whitespace-only text, or requirements come without
            ``training_python``.
    """
    for requirement in training_requirements:
        if not isinstance(requirement, str) or not requirement.strip() or "'" in requirement or "\n" in requirement:
            raise ValueError(f"training_requirements: {requirement!r} is not a pip requirement such as 'tensorflow[and-cuda]>=2.17,<2.18'")
    if training_requirements and not training_python:
        raise ValueError("training_requirements need training_python (the interpreter to install them into)")
    install = [_pip_install(training_python, training_requirements)] if training_requirements else []
    return [
        f"rm -rf {CODE_DIR} && install -d -m 0755 {CODE_DIR}",
        # The standard library unzips; the AMI need not have `unzip`.
        f"python3 -m zipfile -e '{archive_path}' {CODE_DIR}",
        f"python3 -c 'import boto3' 2>/dev/null || python3 -m pip install --quiet '{boto3_requirement}' "
        f"|| python3 -m pip install --quiet --break-system-packages '{boto3_requirement}'",
        *install,
        f"cat > /etc/systemd/system/{SERVICE_NAME}.service <<'SPOT_TRAINING_UNIT'",
        systemd_unit(stop_timeout_s).rstrip("\n"),
        "SPOT_TRAINING_UNIT",
        "systemctl daemon-reload",
        f"systemctl enable --now {SERVICE_NAME}.service",
    ]


def extract_config(user_data_text: str) -> dict[str, Any]:
    """Read the node config back from user data text (already base64-decoded).

    Args:
        user_data_text: the launch template's user data as text.

    Returns:
        The config dict (the JSON between the markers' heredoc lines).

    Raises:
        ValueError: the markers are missing, repeated or out of order, the block holds no quoted
            heredoc, or its body is not a JSON object (the message says which).
    """
    if not isinstance(user_data_text, str):
        raise ValueError(f"user_data_text must be str (decoded user data), got {type(user_data_text).__name__}")
    lines = user_data_text.splitlines()
    begins = [i for i, line in enumerate(lines) if line.strip() == CONFIG_BEGIN]
    ends = [i for i, line in enumerate(lines) if line.strip() == CONFIG_END]
    if len(begins) != 1 or len(ends) != 1 or ends[0] < begins[0]:
        raise ValueError(
            f"user data must contain exactly one {CONFIG_BEGIN!r} line followed by one {CONFIG_END!r} line; "
            f"found {len(begins)} BEGIN and {len(ends)} END"
        )
    block = lines[begins[0] + 1 : ends[0]]
    for i, line in enumerate(block):
        match = _HEREDOC_START.search(line)
        if match:
            tag = match.group("tag")
            try:
                stop = block.index(tag, i + 1)
            except ValueError:
                raise ValueError(f"the config heredoc <<'{tag}' is not closed by a {tag!r} line before {CONFIG_END!r}") from None
            body = "\n".join(block[i + 1 : stop])
            try:
                config = json.loads(body)
            except json.JSONDecodeError as exc:
                raise ValueError(f"the config block is not valid JSON: {exc}") from exc
            if not isinstance(config, dict):
                raise ValueError(f"the config block must hold a JSON object, got {type(config).__name__}")
            return config
    raise ValueError(f"no quoted heredoc (<<'TAG') between {CONFIG_BEGIN!r} and {CONFIG_END!r}")


# ---- amazon-efs-utils: EFS mounts with TLS and IAM (only in user data of nodes that mount EFS) -------
#
# Kept apart from the agent's own boot steps above on purpose: it is one self-contained, retried step.
# amazon-efs-utils is not packaged for Ubuntu; its README ("On other Linux distributions", "To build
# and install a Debian package") builds a .deb from the source: apt-get install git binutils,
# git clone https://github.com/aws/efs-utils, ./build-deb.sh, apt-get install ./build/amazon-efs-utils*deb.
# Chosen over SSM Distributor's AmazonEFSUtils package because that one is installed by a State Manager
# association or Run Command from outside the instance, asynchronously, so the boot could not wait for it.
# The tag is pinned: 1.x is the pure-Python mount helper with stunnel; 2.x adds efs-proxy, written in
# Rust, which would need a Rust toolchain built at every boot.

#: Source of amazon-efs-utils and the release tag built at boot (docs/infra.md, "EFS mounts").
EFS_UTILS_REPO = "https://github.com/aws/efs-utils"
EFS_UTILS_REF = "v1.35.0"
#: Attempts of the whole install (apt, clone, build, install) before the user data moves on; the
#: agent then exits 78 naming the missing mount helper (bootstrap.efs).
EFS_UTILS_ATTEMPTS = 3


def efs_utils_install_commands(*, ref: str = EFS_UTILS_REF, attempts: int = EFS_UTILS_ATTEMPTS,
                               retry_delay_s: int = 15) -> list[str]:
    """User-data lines that build and install amazon-efs-utils unless ``mount.efs`` is already there.

    Skipped in local mode (``SPOT_TRAINING_BLOCKDEV_DIR`` set, the switch the agent reads too). Retried ``attempts`` times, ``retry_delay_s`` x attempt seconds apart; every line returns 0 under
    ``set -euo pipefail`` whatever happens, so a failed install does not end the user data: the agent
    then stops with exit 78 and a message naming ``mount.efs`` (there is no anonymous NFS fallback).

    Raises:
        ValueError: ``ref`` is not a plain git tag or branch name, or ``attempts`` < 1.
    """
    if not re.fullmatch(r"[A-Za-z0-9][A-Za-z0-9._/-]*", ref):
        raise ValueError(f"ref: {ref!r} is not a git tag or branch name such as v1.35.0")
    if isinstance(attempts, bool) or not isinstance(attempts, int) or attempts < 1:
        raise ValueError(f"attempts must be an integer >= 1, got {attempts!r}")
    work = "/tmp/spot-training-efs-utils"
    return [
        "spot_training_install_efs_utils() {",
        "  command -v mount.efs >/dev/null 2>&1 && return 0",
        # Local mode's explicit switch (the agent's too): its EFS is a directory, nothing to install.
        "  [ -n \"${SPOT_TRAINING_BLOCKDEV_DIR:-}\" ] && return 0",
        f"  rm -rf {work}",
        "  DEBIAN_FRONTEND=noninteractive apt-get update -q"
        " && DEBIAN_FRONTEND=noninteractive apt-get -y -q install git binutils"
        f" && git clone --quiet --depth 1 --branch {ref} {EFS_UTILS_REPO} {work}"
        f" && (cd {work} && ./build-deb.sh)"
        f" && DEBIAN_FRONTEND=noninteractive apt-get -y -q install {work}/build/amazon-efs-utils*deb",
        "}",
        f"for attempt in $(seq 1 {attempts}); do",
        "  if spot_training_install_efs_utils; then break; fi",
        f"  echo \"spot-training: amazon-efs-utils install attempt $attempt of {attempts} failed\" >&2",
        f"  if [ \"$attempt\" -lt {attempts} ]; then sleep $((attempt * {retry_delay_s})); fi",
        "done",
        "if [ -z \"${SPOT_TRAINING_BLOCKDEV_DIR:-}\" ] && ! command -v mount.efs >/dev/null 2>&1; then"
        " echo 'spot-training: amazon-efs-utils (mount.efs) is not installed; the agent will exit 78' >&2; fi",
    ]
