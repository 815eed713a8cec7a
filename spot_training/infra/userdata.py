"""The node's user data: only what must run before the agent, each step retried, a failure reported.

:func:`boot_script` writes the boot-failure script (:func:`boot_failed_script`) and the node config,
then fetches and unpacks the bootstrap asset and starts the agent under systemd. The trainer's framework
is not installed here: the agent builds it into a virtual environment on the data volume (or EFS) once
(``training.venv`` in the config; spot_training/agent/trainer_env.py). docs/agent.md, "What a node does" and
"Boot failures".

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

from spot_training.contract import (
    BOOT_ERROR_TAG,
    CHECKPOINTS_DIR,
    CONFIG_PATH,
    DATASETS_DIR,
    DEFAULT_MOUNT_POINT,
    ENV_ROOT,
    AGENT_EXITS_NOT_RESTARTED,
    ENV_ON_BOOT_FAILURE,
    FAILED_BOOTS_TAG,
    LOGS_DIR,
    STACK_TAG,
    default,
)

CONFIG_BEGIN = "# BEGIN spot-training config"
CONFIG_END = "# END spot-training config"
CODE_DIR = "/opt/spot-training/code"
#: Where the node unpacks the user's training code asset (``code_dir``): root-owned, read-only to the
#: trainer, apart from the agent's own code in :data:`CODE_DIR` (nothing there can shadow an agent import).
USER_CODE_DIR = "/opt/spot-training/user-code"
SERVICE_NAME = "spot-training-agent"
_HEREDOC_TAG = "SPOT_TRAINING_CONFIG_JSON"
_HEREDOC_START = re.compile(r"<<\s*'(?P<tag>[A-Za-z_][A-Za-z0-9_]*)'\s*$")

#: Seconds systemd waits for the single-node agent to stop before SIGKILL. The agent gives the
#: trainer up to 90 s to checkpoint and exit on stop; systemd's default of 90 s would kill the agent
#: at that very edge. (Cluster nodes pass a longer bound, spot_training.infra.cluster.AGENT_STOP_TIMEOUT_S.)
STOP_TIMEOUT_S = 120


def systemd_unit(stop_timeout_s: int = STOP_TIMEOUT_S) -> str:
    """The systemd unit that runs the agent, as the boot script writes it through an unquoted heredoc
    (``${CODE}``, ``${AGENT_PYTHON}``, ``${ST_ROOT}`` and ``${BOOT_FAILED}`` are the script's variables).
    ``Restart=on-failure`` retries exit 75 (try again later) and crashes; ``RestartPreventExitStatus``
    is the contract's :data:`~spot_training.contract.AGENT_EXITS_NOT_RESTARTED` (78 bad config, 69 gave
    up, and every trainer status the restart policy gives up on: 74, 78); ``TimeoutStopSec``
    is ``stop_timeout_s`` seconds (default :data:`STOP_TIMEOUT_S`)."""
    return f"""[Unit]
Description=spot-training node agent (volume, trainer, interruption notices, cleanup)
Wants=network-online.target
After=network-online.target

[Service]
Type=simple
WorkingDirectory=${{CODE}}
ExecStart=${{AGENT_PYTHON}} -m spot_training.agent run --config ${{ST_ROOT}}{CONFIG_PATH}
Restart=on-failure
RestartSec=15
RestartPreventExitStatus={' '.join(str(status) for status in AGENT_EXITS_NOT_RESTARTED)}
TimeoutStopSec={stop_timeout_s}
Environment=PYTHONUNBUFFERED=1
Environment={ENV_ON_BOOT_FAILURE}=${{BOOT_FAILED}}

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
    mount_point: str = DEFAULT_MOUNT_POINT,
    device_name: str = "/dev/sdf",
    fs_type: str = "xfs",
    keep_snapshots: int = default("keep_snapshots"),
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
    requirements: Sequence[str] = (),
    inherit_site_packages: bool = False,
    notice_poll_interval_s: float | None = None,
    checkpoint_every_steps: int | None = None,
    checkpoint_every_seconds: float | None = None,
    dataset: Mapping[str, Any] | None = None,
) -> dict[str, Any]:
    """The node config dict (schema version 1, docs/contracts.md).

    ``region`` and the ``efs`` ids may be CDK tokens (string-encoded; ``json.dumps`` keeps them for CDK
    to resolve). Dataset, checkpoint and log directories are ``datasets/``, ``checkpoints/``, ``logs/``
    under ``data_root``. Optional sections and keys are left out unless set, so configs of stacks that
    do not use them stay as they were. Raises nothing; the stack validated the values.

    Args:
        region: the stack's region.
        stack_name: the stack's name.
        volume_tags: the tags that find the data volume (stack and deployment tags).
        framework: ``training.framework`` (``tensorflow``, ``mxnet``, ``pytorch``).
        python: the training interpreter.
        command: the training command (placeholders such as ``{python}`` kept for the agent).
        user: the training user (default ``ubuntu``).
        mount_point: the data volume's mount point (default :data:`DEFAULT_MOUNT_POINT`).
        device_name: the AttachVolume device name (default ``/dev/sdf``).
        fs_type: the data volume's file system (default ``xfs``).
        keep_snapshots: snapshots the agent keeps (default: the contract's).
        snapshot_interval_s: seconds between periodic snapshots while training (None or 0: off).
        initialization_rate_mibps: a moved volume's provisioned initialization rate, MiB/s (None: EBS's default).
        code: the ``training.code`` section (default: the unpacked bootstrap asset
            ``{"type": "asset", "path": CODE_DIR}``).
        efs: the ``efs`` section (``file_system_id``, ``access_point_id``, ``mount_point``), or None.
        cancel_fleet_on_success: the agent cancels its spot fleet after training completed (default True).
        imds_endpoint: the instance metadata endpoint (None: IMDS's default; local mode's emulator).
        node_role: ``single`` (default) or a cluster role ``scheduler``/``server``/``worker``, which
            come with a ``cluster`` section (docs/contracts.md, "Parameter-server cluster").
        data_root: where the data directories go (default: ``mount_point``, the data volume; cluster
            nodes pass the EFS mount point).
        cluster: the ``cluster`` section, or None (left out).
        monitoring: the CloudWatch publishing section (``TrainingMonitoring.node_config()``), or None.
        requirements: pip specifiers; when any, ``training.venv`` asks the agent for a virtual
            environment of ``python`` with them under ``<data root>/envs``, built once on the volume (or
            EFS) and reused; none (an AMI that ships the framework): ``training.venv`` is null and
            ``python`` runs as it is.
        inherit_site_packages: the virtual environment also sees ``python``'s packages (default False).
        notice_poll_interval_s: seconds between the agent's IMDS notice polls (None: the agent's default).
        checkpoint_every_steps: the trainer's checkpoint cadence in steps, exported by the agent as
            ``SPOT_TRAINING_CHECKPOINT_EVERY_STEPS`` (None: the trainer's default).
        checkpoint_every_seconds: the cadence in seconds, exported as
            ``SPOT_TRAINING_CHECKPOINT_EVERY_SECONDS`` (None: the trainer's default).
        dataset: the ``dataset`` section (``uri``, ``unpack``) the agent syncs into ``datasets/`` before
            the trainer starts (:mod:`spot_training.infra.dataset`), or None.

    Returns:
        the config dict (JSON-serializable once tokens are resolved).
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
            "dataset_dir": f"{root}/{DATASETS_DIR}",
            "checkpoint_dir": f"{root}/{CHECKPOINTS_DIR}",
            "log_dir": f"{root}/{LOGS_DIR}",
            "code": dict(code) if code is not None else {"type": "asset", "path": CODE_DIR},
            "venv": ({"requirements": list(requirements), "root": f"{root}/envs",
                      "inherit_site_packages": bool(inherit_site_packages)} if requirements else None),
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
    if notice_poll_interval_s is not None:  # else the agent's default (AWS's recommended 5 s)
        config["notice_poll_interval_s"] = notice_poll_interval_s
    if checkpoint_every_steps is not None:  # else the trainer's default (spot_training.contract)
        config["training"]["checkpoint_every_steps"] = checkpoint_every_steps
    if checkpoint_every_seconds is not None:
        config["training"]["checkpoint_every_seconds"] = checkpoint_every_seconds
    if dataset is not None:
        config["dataset"] = dict(dataset)
    return config


def config_block(config_json: str) -> list[str]:
    """User-data lines that write ``config_json`` (text, may hold tokens) to :data:`CONFIG_PATH`
    (under ``$SPOT_TRAINING_ROOT`` in local mode; empty on an instance)."""
    return [
        CONFIG_BEGIN,
        f'install -d -m 0755 "{_ROOT}{CONFIG_PATH.rsplit("/", 1)[0]}"',
        f'cat > "{_ROOT}{CONFIG_PATH}" <<\'{_HEREDOC_TAG}\'',
        config_json,
        _HEREDOC_TAG,
        CONFIG_END,
    ]


#: Local mode only (docs/localmode.md, "The boot script"): the node's file-system root, prefixed to every
#: path the boot script and the agent write (``/etc``, ``/opt``, the mount points). Unset on an instance.
ROOT_ENV = ENV_ROOT
#: Local mode only: the interpreter that runs the agent (default ``/usr/bin/python3``, the AMI's).
AGENT_PYTHON_ENV = "SPOT_TRAINING_AGENT_PYTHON"
#: Local mode only: where boot failures are written for the user to see (default ``/dev/console``,
#: which EC2 keeps as the instance's console output: ``aws ec2 get-console-output``).
CONSOLE_ENV = "SPOT_TRAINING_CONSOLE"
BOOT_FAILED_PATH = "/opt/spot-training/boot-failed"
# BOOT_ERROR_TAG (instance tag: a failed boot step and its message, docs/agent.md, "Boot failures") and
# FAILED_BOOTS_TAG (data-volume tag: consecutive failed boots) come from the contract.
#: Failed boots in a row after which a node cancels its spot fleet instead of being replaced again.
DEFAULT_MAX_FAILED_BOOTS = 3
#: Attempts of each boot step (``BOOT_STEP_BACKOFF_S * n`` seconds apart).
BOOT_STEP_ATTEMPTS = 4
BOOT_STEP_BACKOFF_S = 5
_ROOT = "${SPOT_TRAINING_ROOT:-}"



def _jq(text: str) -> str:
    """A JMESPath raw string literal (``'text'``) inside a double-quoted bash word."""
    if any(c in text for c in "'\"$`\\"):
        raise ValueError(f"{text!r} cannot be quoted for the boot script")
    return f"'{text}'"


def _q(text: str) -> str:
    """Single-quote ``text`` for bash (tokens stay inside the quotes)."""
    return "'" + text.replace("'", "'\\''") + "'"


def boot_failed_script(*, region: str, stack_name: str, volume_tags: Mapping[str, str],
                       max_failed_boots: int = DEFAULT_MAX_FAILED_BOOTS) -> str:
    """The bash script ``boot-failed STEP MESSAGE [final]`` that user data writes first, and that the
    user data's steps and the agent call when a boot step failed for good (docs/agent.md, "Boot failures").

    It (1) writes ``spot-training: boot failed at step STEP: MESSAGE`` to stderr and the console
    (``$SPOT_TRAINING_CONSOLE``, default ``/dev/console``); (2) tags the instance with
    :data:`BOOT_ERROR_TAG` = ``STEP: MESSAGE`` (shortened); (3) adds one to :data:`FAILED_BOOTS_TAG` on
    what outlives the instance: the data volume (found by ``volume_tags``; single node), else the
    instance's spot fleet request (cluster workers), else its Auto Scaling group (cluster scheduler and
    servers); (4) when that count reaches ``max_failed_boots``, or with ``final`` (a failure a
    replacement would repeat), gives up: a fleet instance cancels its spot fleet request with its
    instances (only a request tagged with this stack: IAM allows no other); an Auto Scaling group's
    instance suspends its group's ``Launch`` process (no more replacements; ``aws autoscaling
    resume-processes`` once the cause is fixed) and cancels the stack's spot fleets, whose workers
    cannot train without it; then (5) shuts the instance down; the launch template's shutdown behaviour
    is terminate, so below the bound the fleet or group replaces it. Every AWS call is best effort: a
    failure to report never keeps the instance running.

    Args:
        region: the stack's region (may be a token).
        stack_name: the stack's name (the only fleets the script may cancel).
        volume_tags: the tags that find the data volume.
        max_failed_boots: failed boots in a row before it gives up (default 3).

    Returns:
        the script's text.
    """
    filters = " ".join(_q(f"Name=tag:{k},Values={v}") for k, v in volume_tags.items())
    return f"""#!/bin/bash
# spot-training: report a failed boot step, count it, then stop paying for this instance.
# Usage: boot-failed STEP MESSAGE [final]   (docs/agent.md, "Boot failures")
set -u
STEP="${{1:-unknown}}"; MESSAGE="${{2:-}}"; MODE="${{3:-count}}"
MAX_FAILED_BOOTS={int(max_failed_boots)}
export AWS_DEFAULT_REGION={_q(region)} AWS_RETRY_MODE=standard AWS_MAX_ATTEMPTS=5
CONSOLE="${{{CONSOLE_ENV}:-/dev/console}}"
IMDS="${{AWS_EC2_METADATA_SERVICE_ENDPOINT:-http://169.254.169.254}}"; IMDS="${{IMDS%/}}"
say() {{
  local line="spot-training: boot failed at step '$STEP': $*"
  echo "$line" >&2
  {{ echo "$line" >> "$CONSOLE"; }} 2>/dev/null || true
}}
say "$MESSAGE"
TOKEN=$(curl -sf -m 5 -X PUT "$IMDS/latest/api/token" -H 'X-aws-ec2-metadata-token-ttl-seconds: 300') || TOKEN=
ID=$(curl -sf -m 5 -H "X-aws-ec2-metadata-token: $TOKEN" "$IMDS/latest/meta-data/instance-id") || ID=
# Tag values: at most 256 characters; keep to characters the CLI shorthand passes unchanged.
SHORT=$(printf '%s: %s' "$STEP" "$MESSAGE" | tr -c '[:alnum:] ._:/=+@-' ' ' | cut -c1-250)
if [ -n "$ID" ]; then
  aws ec2 create-tags --resources "$ID" --tags "Key={BOOT_ERROR_TAG},Value=$SHORT" >/dev/null \\
    || say "could not tag instance $ID with {BOOT_ERROR_TAG}"
fi
instance_tag() {{  # instance_tag KEY: this instance's tag KEY, or nothing
  [ -n "$ID" ] || return 0
  local value
  value=$(aws ec2 describe-tags --filters "Name=resource-id,Values=$ID" "Name=key,Values=$1" \\
    --query 'Tags[0].Value' --output text 2>/dev/null) || value=
  [ "$value" = None ] || printf '%s' "$value"
}}
counted() {{ case "$1" in ''|*[!0-9]*) echo 1 ;; *) echo $(($1 + 1)) ;; esac; }}
FLEET=$(instance_tag aws:ec2spot:fleet-request-id)
GROUP=$(instance_tag aws:autoscaling:groupName)
VOLUME=$(aws ec2 describe-volumes --filters {filters} --query 'Volumes[0].VolumeId' --output text 2>/dev/null) || VOLUME=
COUNT=0
if [ -n "$VOLUME" ] && [ "$VOLUME" != None ]; then  # a single node: the data volume outlives it
  COUNT=$(counted "$(aws ec2 describe-volumes --volume-ids "$VOLUME" \\
    --query "Volumes[0].Tags[?Key=='{FAILED_BOOTS_TAG}'].Value | [0]" --output text 2>/dev/null)")
  aws ec2 create-tags --resources "$VOLUME" --tags "Key={FAILED_BOOTS_TAG},Value=$COUNT" >/dev/null \\
    || say "could not count the failed boot on $VOLUME"
elif [ -n "$FLEET" ]; then  # a cluster worker: its spot fleet request
  COUNT=$(counted "$(aws ec2 describe-tags --filters "Name=resource-id,Values=$FLEET" "Name=key,Values={FAILED_BOOTS_TAG}" \\
    --query 'Tags[0].Value' --output text 2>/dev/null)")
  aws ec2 create-tags --resources "$FLEET" --tags "Key={FAILED_BOOTS_TAG},Value=$COUNT" >/dev/null \\
    || say "could not count the failed boot on $FLEET"
elif [ -n "$GROUP" ]; then  # a cluster scheduler or server: its Auto Scaling group
  COUNT=$(counted "$(aws autoscaling describe-tags --filters "Name=auto-scaling-group,Values=$GROUP" \\
    "Name=key,Values={FAILED_BOOTS_TAG}" --query 'Tags[0].Value' --output text 2>/dev/null)")
  aws autoscaling create-or-update-tags --tags \\
    "ResourceId=$GROUP,ResourceType=auto-scaling-group,Key={FAILED_BOOTS_TAG},Value=$COUNT,PropagateAtLaunch=false" >/dev/null \\
    || say "could not count the failed boot on Auto Scaling group $GROUP"
fi
stack_fleets() {{
  aws ec2 describe-spot-fleet-requests --output text --query \\
    "SpotFleetRequestConfigs[?Tags[?Key=='{STACK_TAG}' && Value=={_jq(stack_name)}]].SpotFleetRequestId" 2>/dev/null
}}
cancel_fleet() {{
  aws ec2 cancel-spot-fleet-requests --spot-fleet-request-ids "$1" --terminate-instances >/dev/null \\
    || say "could not cancel spot fleet request $1"
}}
if [ "$MODE" = final ] || [ "$COUNT" -ge "$MAX_FAILED_BOOTS" ]; then
  if [ -n "$GROUP" ] && [ -z "$FLEET" ]; then
    say "giving up (failed boots in a row: $COUNT of at most $MAX_FAILED_BOOTS; mode $MODE): suspending launches of Auto Scaling group $GROUP and cancelling this stack's spot fleets"
    aws autoscaling suspend-processes --auto-scaling-group-name "$GROUP" --scaling-processes Launch >/dev/null \\
      || say "could not suspend launches of Auto Scaling group $GROUP"
    for CANDIDATE in $(stack_fleets); do cancel_fleet "$CANDIDATE"; done
  else
    say "giving up (failed boots in a row: $COUNT of at most $MAX_FAILED_BOOTS; mode $MODE): cancelling this instance's spot fleet"
    if [ -z "$FLEET" ]; then  # no fleet tag: find the instance in this stack's fleets
      for CANDIDATE in $(stack_fleets); do
        aws ec2 describe-spot-fleet-instances --spot-fleet-request-id "$CANDIDATE" --output text \\
          --query 'ActiveInstances[].InstanceId' 2>/dev/null | tr -s '[:space:]' '\\n' | grep -qx "$ID" && FLEET=$CANDIDATE
      done
    fi
    if [ -n "$FLEET" ]; then cancel_fleet "$FLEET"; fi
  fi
fi
say "shutting down (the fleet replaces a terminated instance)"
shutdown -h now
exit 1
"""


#: Exit status a boot step's function returns for a failure no retry fixes (sysexits EX_CONFIG): the
#: step still uses its attempts (IAM changes reach every endpoint only after a while, so a fresh
#: stack's first AccessDenied may clear), then reports the boot failure as ``final``.
BOOT_STEP_PERMANENT = 78
#: What ``aws s3 cp`` prints for a URL or a permission that is wrong, not a network that is down
#: (AWS CLI: "An error occurred (403) when calling the HeadObject operation: Forbidden").
_S3_PERMANENT_PATTERNS = ("*AccessDenied*", "*Forbidden*", '*"(403)"*', '*"(404)"*', "*NoSuchBucket*", "*NoSuchKey*")


def _step_function() -> list[str]:
    return [
        "# Each step is retried (bounded); a step that fails every attempt reports and shuts down,",
        f"# as a final failure when its last attempt returned {BOOT_STEP_PERMANENT} (a wrong setting or permission).",
        "step() {",
        '  local name="$1"; shift',
        "  local attempt=1 status",
        "  while true; do",
        '    "$@"; status=$?',
        '    if [ "$status" -eq 0 ]; then echo "spot-training boot: step $name ok (attempt $attempt)"; return 0; fi',
        f'    if [ "$attempt" -ge {BOOT_STEP_ATTEMPTS} ]; then',
        f'      if [ "$status" -eq {BOOT_STEP_PERMANENT} ]; then',
        f'        "$BOOT_FAILED" "$name" "failed {BOOT_STEP_ATTEMPTS} attempts; retrying will not help (a wrong setting or permission)" final',
        "      else",
        f'        "$BOOT_FAILED" "$name" "failed {BOOT_STEP_ATTEMPTS} attempts"',
        "      fi",
        "      exit 1",
        "    fi",
        f'    echo "spot-training boot: step $name failed (attempt $attempt of {BOOT_STEP_ATTEMPTS}); retrying" >&2',
        f"    sleep $((attempt * {BOOT_STEP_BACKOFF_S})); attempt=$((attempt + 1))",
        "  done",
        "}",
    ]


def _code_asset_steps(code_asset_url: str | None) -> list[str]:
    """The boot steps that bring the user's code asset (a zip in the CDK assets bucket) to
    :data:`USER_CODE_DIR`, as the agent's own asset is brought; none without ``code_asset_url``."""
    if code_asset_url is None:
        return []
    archive = "$ST_ROOT/opt/spot-training/user-code.zip"
    return [
        f'USER_CODE="$ST_ROOT{USER_CODE_DIR}"',
        f"fetch_code() {{ aws s3 cp {_q(code_asset_url)} \"{archive}\" --only-show-errors; }}",
        f'unpack_code() {{ rm -rf "$USER_CODE" && install -d -m 0755 "$USER_CODE" && "$AGENT_PYTHON" -m zipfile -e "{archive}" "$USER_CODE"; }}',
        "step fetch-code fetch_code",
        "step unpack-code unpack_code",
    ]


def boot_script(
    *,
    asset_url: str,
    region: str,
    stack_name: str,
    volume_tags: Mapping[str, str],
    config_json: str,
    boto3_requirement: str,
    stop_timeout_s: int = STOP_TIMEOUT_S,
    max_failed_boots: int = DEFAULT_MAX_FAILED_BOOTS,
    efs: bool = False,
    code_asset_url: str | None = None,
) -> list[str]:
    """The user data's lines (after ``#!/bin/bash``): only what must run before the agent.

    1. write :func:`boot_failed_script` (nothing can fail before it exists);
    2. write the node config (:func:`config_block`);
    3. steps, each retried :data:`BOOT_STEP_ATTEMPTS` times and logged: ``fetch-agent`` (``aws s3 cp``
       of ``asset_url``; access denied or not found is reported ``final`` once the attempts are used), ``unpack-agent``, ``agent-boto3`` (only when the AMI's Python lacks boto3 or its botocore is older
       than 1.38.10), with ``code_asset_url`` (the user's code directory as a CDK asset) ``fetch-code``
       and ``unpack-code`` into :data:`USER_CODE_DIR`,
       ``start-agent`` (write the unit, ``systemctl enable --now``).

    The trainer's framework is not installed here: the agent builds its virtual environment on the
    data volume (or EFS) once and reuses it (:mod:`spot_training.agent.trainer_env`). No ``set -e``: a failing
    command is a failed step, reported, never a silent end of the script. The environment variables
    :data:`ROOT_ENV`, :data:`AGENT_PYTHON_ENV` and :data:`CONSOLE_ENV` exist for local mode and are unset
    on an instance. ``efs``: install amazon-efs-utils first (:func:`efs_utils_install_commands`; its
    failure after the retry budget is the boot step ``efs-utils``).
    ``asset_url``, ``region`` and the config may hold CDK tokens.

    Args:
        asset_url: the bootstrap asset's ``s3://`` URL (may be a token).
        region: the stack's region (may be a token).
        stack_name: the stack's name.
        volume_tags: the tags that find the data volume (for the boot-failure script).
        config_json: the node config as JSON text (may hold tokens).
        boto3_requirement: the pip specifier installed when the AMI's Python lacks a recent boto3.
        stop_timeout_s: systemd's ``TimeoutStopSec`` for the agent, seconds.
        max_failed_boots: failed boots in a row before a node gives up (default 3).
        efs: install amazon-efs-utils first (default False).

    Returns:
        the user data's lines.
    """
    archive = "$ST_ROOT/opt/spot-training/bootstrap.zip"
    return [
        "set -uo pipefail",
        "# Local mode only (docs/localmode.md); unset on an instance.",
        f'ST_ROOT="{_ROOT}"',
        f'AGENT_PYTHON="${{{AGENT_PYTHON_ENV}:-/usr/bin/python3}}"',
        f'BOOT_FAILED="$ST_ROOT{BOOT_FAILED_PATH}"',
        f'CODE="$ST_ROOT{CODE_DIR}"',
        f"export AWS_DEFAULT_REGION={_q(region)} AWS_RETRY_MODE=standard AWS_MAX_ATTEMPTS=5",
        'echo "spot-training boot: start"',
        'install -d -m 0755 "$ST_ROOT/opt/spot-training"',
        "cat > \"$BOOT_FAILED\" <<'SPOT_TRAINING_BOOT_FAILED'",
        boot_failed_script(region=region, stack_name=stack_name, volume_tags=volume_tags,
                           max_failed_boots=max_failed_boots).rstrip("\n"),
        "SPOT_TRAINING_BOOT_FAILED",
        'chmod 0755 "$BOOT_FAILED"',
        *config_block(config_json),
        # With EFS: amazon-efs-utils, retried with backoff for a bounded time, then a counted boot failure.
        *(efs_utils_install_commands() if efs else []),
        *_step_function(),
        "fetch_agent() {",
        f"  local out; out=$(aws s3 cp {_q(asset_url)} \"{archive}\" --only-show-errors 2>&1) && return 0",
        '  echo "$out" >&2',
        f"  case \"$out\" in {'|'.join(_S3_PERMANENT_PATTERNS)}) return {BOOT_STEP_PERMANENT} ;; esac",
        "  return 1",
        "}",
        # The standard library unzips; the AMI need not have `unzip`.
        f'unpack_agent() {{ rm -rf "$CODE" && install -d -m 0755 "$CODE" && "$AGENT_PYTHON" -m zipfile -e "{archive}" "$CODE"; }}',
        "agent_boto3() {",
        # boto3 present and its botocore new enough for the agent (spot_training.agent.ami_check): nothing to do.
        "  \"$AGENT_PYTHON\" -c 'import boto3, botocore, sys; sys.exit(tuple(int(p) for p in botocore.__version__.split(\".\")[:3]) < (1, 38, 10))' 2>/dev/null && return 0",
        "  # Ubuntu 23.04+ marks the system Python externally managed (PEP 668); 22.04 does not know the flag.",
        f'  "$AGENT_PYTHON" -m pip install --quiet {_q(boto3_requirement)} \\',
        f'    || "$AGENT_PYTHON" -m pip install --quiet --break-system-packages {_q(boto3_requirement)}',
        "}",
        "start_agent() {",
        f'  install -d -m 0755 "$ST_ROOT/etc/systemd/system" && cat > "$ST_ROOT/etc/systemd/system/{SERVICE_NAME}.service" <<SPOT_TRAINING_UNIT',
        systemd_unit(stop_timeout_s).rstrip("\n"),
        "SPOT_TRAINING_UNIT",
        f"  systemctl daemon-reload && systemctl enable --now {SERVICE_NAME}.service",
        "}",
        *_code_asset_steps(code_asset_url),
        "step fetch-agent fetch_agent",
        "step unpack-agent unpack_agent",
        "step agent-boto3 agent_boto3",
        "step start-agent start_agent",
        'echo "spot-training boot: agent started"',
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
#: Seconds of backoff the whole install (apt, clone, build, install) may spend retrying before the
#: boot fails at step ``efs-utils`` (counted: the node is replaced, up to the failed-boot bound),
#: waits doubling from 15 s up to 120 s between attempts.
EFS_UTILS_RETRY_BUDGET_S = 1200
EFS_UTILS_FIRST_DELAY_S = 15
EFS_UTILS_MAX_DELAY_S = 120
#: How long apt-get waits for the dpkg lock (unattended-upgrades holds it at an Ubuntu instance's
#: first boot) instead of failing at once: apt's ``DPkg::Lock::Timeout`` option, apt >= 1.9.11
#: (Ubuntu 20.04+; apt.conf(5)).
APT_LOCK_TIMEOUT_S = 600
_APT_GET = f"DEBIAN_FRONTEND=noninteractive apt-get -o DPkg::Lock::Timeout={APT_LOCK_TIMEOUT_S}"


def efs_utils_install_commands(*, ref: str = EFS_UTILS_REF, retry_budget_s: int = EFS_UTILS_RETRY_BUDGET_S,
                               first_delay_s: int = EFS_UTILS_FIRST_DELAY_S,
                               max_delay_s: int = EFS_UTILS_MAX_DELAY_S) -> list[str]:
    """User-data lines that build and install amazon-efs-utils unless ``mount.efs`` is already there.

    Skipped in local mode (``SPOT_TRAINING_BLOCKDEV_DIR`` set, the switch the agent reads too). Every
    ``apt-get`` waits up to :data:`APT_LOCK_TIMEOUT_S` seconds for the dpkg lock. A failed attempt is
    retried after ``first_delay_s`` seconds, doubling up to ``max_delay_s``, while the waits add up
    to at most ``retry_budget_s`` seconds (a mirror or GitHub outage clears with time); then the boot
    fails at step ``efs-utils`` through ``$BOOT_FAILED`` (counted: a replacement node tries again, up
    to the failed-boot bound), never as the agent's final ``config`` error. Every line returns 0
    under ``set -euo pipefail`` when ``$BOOT_FAILED`` is not set.

    Args:
        ref: the amazon-efs-utils git tag or branch to build (default :data:`EFS_UTILS_REF`).
        retry_budget_s: the most seconds of waits between attempts, >= 1.
        first_delay_s: seconds before the second attempt, >= 1.
        max_delay_s: the longest wait between attempts, seconds, >= 1.

    Returns:
        the user-data lines (a shell function, then the retry loop that calls it).

    Raises:
        ValueError: ``ref`` is not a plain git tag or branch name, or a delay or budget is < 1.
    """
    if not re.fullmatch(r"[A-Za-z0-9][A-Za-z0-9._/-]*", ref):
        raise ValueError(f"ref: {ref!r} is not a git tag or branch name such as v1.35.0")
    for name, value in (("retry_budget_s", retry_budget_s), ("first_delay_s", first_delay_s), ("max_delay_s", max_delay_s)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"{name} must be an integer >= 1 (seconds), got {value!r}")
    work = "/tmp/spot-training-efs-utils"
    return [
        "spot_training_install_efs_utils() {",
        "  command -v mount.efs >/dev/null 2>&1 && return 0",
        # Local mode's explicit switch (the agent's too): its EFS is a directory, nothing to install.
        "  [ -n \"${SPOT_TRAINING_BLOCKDEV_DIR:-}\" ] && return 0",
        f"  rm -rf {work}",
        f"  {_APT_GET} update -q"
        f" && {_APT_GET} -y -q install git binutils"
        f" && git clone --quiet --depth 1 --branch {ref} {EFS_UTILS_REPO} {work}"
        f" && (cd {work} && ./build-deb.sh)"
        f" && {_APT_GET} -y -q install {work}/build/amazon-efs-utils*deb",
        "}",
        f"st_efs_attempt=1; st_efs_waited=0; st_efs_delay={first_delay_s}",
        "while ! spot_training_install_efs_utils; do",
        f"  if [ $((st_efs_waited + st_efs_delay)) -gt {retry_budget_s} ]; then",
        "    echo \"spot-training: amazon-efs-utils install failed $st_efs_attempt attempts over $st_efs_waited s of retries\" >&2",
        "    if [ -n \"${BOOT_FAILED:-}\" ] && [ -x \"$BOOT_FAILED\" ]; then",
        "      \"$BOOT_FAILED\" efs-utils \"amazon-efs-utils install failed $st_efs_attempt attempts over $st_efs_waited s of retries\"",
        "      exit 1",
        "    fi",
        "    break",
        "  fi",
        "  echo \"spot-training: amazon-efs-utils install attempt $st_efs_attempt failed; retrying in $st_efs_delay s\" >&2",
        "  sleep \"$st_efs_delay\"",
        "  st_efs_waited=$((st_efs_waited + st_efs_delay)); st_efs_attempt=$((st_efs_attempt + 1))",
        f"  st_efs_delay=$((st_efs_delay * 2)); if [ \"$st_efs_delay\" -gt {max_delay_s} ]; then st_efs_delay={max_delay_s}; fi",
        "done",
    ]
