"""Load and validate the node config JSON (docs/contracts.md, "Node config JSON").

``load_config(path)`` reads the file the stack's user data writes to ``/etc/spot-training/config.json``
and returns a frozen :class:`AgentConfig`. Every problem found is collected and reported together in
one :class:`~spot_training.agent.errors.ConfigError` (exit 78), each naming the key path (``training.command[0]``),
the bad value and what is allowed. Validation uses only the standard library and botocore's bundled
endpoint data (for regions); it never creates an AWS client or makes a network call.
"""

from __future__ import annotations

import functools
import json
import os
import re
from dataclasses import dataclass, field
from pathlib import Path, PurePosixPath
from types import MappingProxyType
from typing import Any, Mapping
from urllib.parse import urlparse

from spot_training import contract
from spot_training.agent.errors import ConfigError
# Tag keys and values are the contract's (docs/contracts.md, "Resource tags"); re-exported for the agent.
from spot_training.contract import (  # noqa: F401
    CHECKPOINTS_DIR,
    DATA_VOLUME_PURPOSE,
    DATASETS_DIR,
    DEFAULT_MOUNT_POINT,
    DEPLOYMENT_TAG,
    FAILED_BOOTS_TAG,
    LOGS_DIR,
    MIGRATION_SNAPSHOT_PURPOSE,
    PERIODIC_SNAPSHOT_PURPOSE,
    PURPOSE_TAG,
    STACK_TAG,
    SettingError,
)

#: The path user data writes the config to on an instance.
DEFAULT_CONFIG_PATH = Path(contract.CONFIG_PATH)

SCHEMA_VERSION = 1
_VOLUME_ID_RE = re.compile(r"^vol-[0-9a-f]{8,17}$")


def deployment_tags(volume_tags: Mapping[str, str]) -> dict[str, str]:
    """``{DEPLOYMENT_TAG: value}`` when ``volume_tags`` (the node config's) name a deployment, else ``{}``
    (configs of stacks synthesized before deployments were tagged). When it does, the agent finds,
    copies, snapshots and prunes only volumes and snapshots of this deployment. Raises nothing."""
    return {DEPLOYMENT_TAG: volume_tags[DEPLOYMENT_TAG]} if DEPLOYMENT_TAG in volume_tags else {}


#: Shortest interval between periodic snapshots, seconds.
MIN_SNAPSHOT_INTERVAL_S = 60
#: Longest periodic-snapshot interval (seconds, 7 days): a larger value is a typo, and 10**60 would
#: overflow the snapshot thread's timer.
MAX_SNAPSHOT_INTERVAL_S = 7 * 86400
#: Valid range of EBS's Provisioned Rate for Volume Initialization, MiB/s (CreateVolume reference).
INITIALIZATION_RATE_MIBPS = (contract.SETTINGS["initialization_rate_mibps"].minimum,
                             contract.SETTINGS["initialization_rate_mibps"].maximum)

NODE_ROLES = ("single", "scheduler", "server", "worker")
#: ``training.framework`` values; parameter-server cluster nodes (``node_role`` other than ``single``)
#: run only :data:`CLUSTER_FRAMEWORKS` (PyTorch clusters: TorchElastic, spot_training/agent/torch_elastic.py).
FRAMEWORKS = ("tensorflow", "mxnet", "pytorch")
CLUSTER_FRAMEWORKS = ("tensorflow", "mxnet", "pytorch")
FS_TYPES = ("xfs", "ext4")
CODE_TYPES = ("asset", "git")
#: Instance-metadata poll interval for notices, seconds (the contract's ``notice_poll_interval_s``:
#: AWS recommends 5 s, EC2 User Guide, "Spot Instance interruption notices").
DEFAULT_NOTICE_POLL_INTERVAL_S = contract.default("notice_poll_interval_s")
#: Deepest JSON nesting the agent reads (the contract's documents nest 4 levels; the cluster section
#: a few more). Deeper input is refused before ``json.loads``, which would raise RecursionError.
MAX_JSON_DEPTH = 32
#: Mount points that would hide or be the operating system (``mount_point`` may not be one of these),
#: and trees a mount point may not be inside of.
SYSTEM_DIRS = frozenset({"/", "/bin", "/boot", "/dev", "/etc", "/home", "/lib", "/lib32", "/lib64", "/media",
                         "/mnt", "/opt", "/proc", "/root", "/run", "/sbin", "/srv", "/sys", "/tmp", "/usr", "/var"})
SYSTEM_TREES = ("/bin", "/boot", "/dev", "/etc", "/lib", "/lib32", "/lib64", "/proc", "/run", "/sbin", "/sys", "/usr")

# CloudFormation stack names: a letter, then letters, digits and hyphens, at most 128 characters.
_STACK_NAME_RE = re.compile(r"^[A-Za-z][A-Za-z0-9-]{0,127}$")
# Block device names EC2 accepts for attached EBS data volumes on Linux.
_DEVICE_NAME_RE = re.compile(r"^/dev/(sd[b-z]|xvd[b-z]{1,2}|sd[b-z][1-9]?)$")
# POSIX portable user names (useradd's default rule).
_USER_RE = re.compile(r"^[a-z_][a-z0-9_-]{0,31}\$?$")
_FS_ID_RE = re.compile(r"^fs-[0-9a-f]{8,40}$")
_FSAP_ID_RE = re.compile(r"^fsap-[0-9a-f]{8,40}$")
#: ``monitoring.interval_s`` (seconds between the publisher's rounds; the contract's ``monitoring_interval_s``).
DEFAULT_MONITORING_INTERVAL_S = contract.default("monitoring_interval_s")
# CloudWatch Logs group names: 1-512 of letters, digits, '_-./#' (CreateLogGroup's pattern).
_LOG_GROUP_RE = re.compile(r"^[.\-_/#A-Za-z0-9]{1,512}$")
# CloudWatch namespaces: 1-255 of letters, digits, '.-_/#:' and space, not starting with ':' (PutMetricData).
_NAMESPACE_RE = re.compile(r"^[.\-_/#A-Za-z0-9][.\-_/#:A-Za-z0-9 ]{0,254}$")
# Keys outside the sections defined here that other layers may add (the cluster stack's plan
# settings); kept verbatim in AgentConfig.extensions instead of being rejected.
EXTENSION_KEYS = ("cluster",)


@dataclass(frozen=True)
class VolumeConfig:
    """The data volume: found by ``tags`` (both stack tags, never ``Name``), attached as ``device_name``,
    mounted at ``mount_point`` with file system ``fs_type`` (``xfs`` or ``ext4``); the agent keeps the
    newest ``keep_snapshots`` (>= 1) migration snapshots."""

    tags: Mapping[str, str]
    device_name: str
    mount_point: Path
    fs_type: str
    keep_snapshots: int
    #: Seconds between periodic snapshots of the data volume while training (0: none; >= 60 otherwise),
    #: so that a move across AZs copies only what changed since the last one (spot_training/agent/snapshots.py).
    snapshot_interval_s: int = 0
    #: EBS Provisioned Rate for Volume Initialization of a volume created from a migration snapshot,
    #: MiB/s (100..300), or None for EBS's default rate (CreateVolume ``VolumeInitializationRate``).
    initialization_rate_mibps: int | None = None
    #: A data volume of this stack that an earlier deployment retained, to be made this deployment's
    #: (its ``spot-training:deployment`` tag set to ours) before the volume step; None: adopt nothing.
    adopt_volume_id: str | None = None


@dataclass(frozen=True)
class EfsConfig:
    """An EFS file system shared by the nodes: ``file_system_id`` (``fs-…``), optional
    ``access_point_id`` (``fsap-…``), mounted at ``mount_point``."""

    file_system_id: str
    access_point_id: str | None
    mount_point: Path


@dataclass(frozen=True)
class CodeConfig:
    """Where the training code comes from: ``type="asset"`` with ``path`` (already unpacked on disk),
    or ``type="git"`` with ``url`` and a pinned ``ref`` (commit or tag), cloned into
    ``<volume.mount_point>/workspace``; ``token_secret``: the Secrets Manager secret (name or ARN)
    holding the token of a private HTTPS repository (spot_training.agent.workspace hands it to git)."""

    type: str
    path: Path | None = None
    url: str | None = None
    ref: str | None = None
    token_secret: str | None = None


@dataclass(frozen=True)
class DatasetConfig:
    """The job's dataset in S3 (spot_training.agent.dataset): ``uri`` is ``s3://bucket/prefix/`` (every
    object under the prefix) or ``s3://bucket/key`` (one object; a zip archive extracted into
    ``training.dataset_dir`` when ``unpack``). The agent brings it onto the volume once, verified."""

    uri: str
    unpack: bool = False


@dataclass(frozen=True)
class VenvConfig:
    """The trainer's virtual environment (``spot_training.agent.trainer_env``): ``requirements`` (pip specifiers)
    installed once into a venv of ``training.python`` under ``root`` (on the data volume or EFS) and
    reused by every later node; ``inherit_site_packages`` lets it see the base interpreter's packages."""

    requirements: tuple[str, ...]
    root: Path
    inherit_site_packages: bool = False


@dataclass(frozen=True)
class TrainingConfig:
    """The trainer: ``framework`` (``tensorflow``/``mxnet``/``pytorch``), its interpreter ``python`` (absolute path),
    ``command`` (argv; ``{python}`` is replaced by ``python``), the Unix ``user`` it runs as, and the
    dataset, checkpoint and log directories (absolute paths) handed over in the environment."""

    framework: str
    python: Path
    command: tuple[str, ...]
    user: str
    dataset_dir: Path
    checkpoint_dir: Path
    log_dir: Path
    code: CodeConfig
    #: None: run ``python`` as it is (an AMI that ships the framework); else build/reuse a venv.
    venv: VenvConfig | None = None
    #: Checkpoint cadence handed to the trainer as ``SPOT_TRAINING_CHECKPOINT_EVERY_STEPS`` /
    #: ``_EVERY_SECONDS`` (steps >= 1; seconds); None: not exported, the trainer's default applies
    #: (the contract's: every 50 steps, no time-based saves).
    checkpoint_every_steps: int | None = None
    checkpoint_every_seconds: float | None = None

    def argv(self, python: str | os.PathLike[str] | None = None) -> list[str]:
        """The command with every ``{python}`` placeholder replaced by ``python`` (default
        ``self.python``; the agent passes the venv's interpreter when ``venv`` is set)."""
        exe = str(python if python is not None else self.python)
        return [part.replace("{python}", exe) for part in self.command]


@dataclass(frozen=True)
class CleanupConfig:
    """What to do when training completes: ``cancel_fleet_on_success`` (default True) cancels this
    instance's spot fleet request with TerminateInstances=True."""

    cancel_fleet_on_success: bool = True


@dataclass(frozen=True)
class MonitoringConfig:
    """Publishing to CloudWatch (spot_training.agent.publish): the agent's and the trainer's log lines to the
    CloudWatch Logs group ``log_group`` (one stream per instance id) and metrics under the CloudWatch
    namespace ``namespace`` (dimension ``Stack``), every ``interval_s`` seconds (1..300, default 10).
    ``enabled`` false: nothing is published."""

    enabled: bool
    log_group: str
    namespace: str
    interval_s: float = DEFAULT_MONITORING_INTERVAL_S


@dataclass(frozen=True)
class AgentConfig:
    """The whole validated node config (docs/contracts.md). ``imds_endpoint`` is ``None`` on AWS
    (the agent then uses ``AWS_EC2_METADATA_SERVICE_ENDPOINT`` or ``http://169.254.169.254``)."""

    schema_version: int
    region: str
    stack_name: str
    node_role: str
    volume: VolumeConfig
    efs: EfsConfig | None
    training: TrainingConfig
    cleanup: CleanupConfig
    imds_endpoint: str | None
    #: Seconds between instance-metadata polls for a spot interruption notice or a rebalance
    #: recommendation. AWS recommends 5 s; local mode polls every second because its trainers run
    #: tiny models whose remaining steps can take less time than one 5 s round.
    notice_poll_interval_s: float = DEFAULT_NOTICE_POLL_INTERVAL_S
    #: CloudWatch publishing; None (the key absent or null): nothing is published.
    monitoring: MonitoringConfig | None = None
    #: The dataset the agent syncs into ``training.dataset_dir`` before the trainer starts; None: none.
    dataset: DatasetConfig | None = None
    extensions: Mapping[str, Any] = field(default_factory=lambda: MappingProxyType({}))


@functools.lru_cache(maxsize=1)
def known_regions() -> frozenset[str]:
    """Every EC2 region in botocore's bundled endpoint data, across all partitions (aws, aws-cn,
    aws-us-gov, ...). Reads local data only; no network call."""
    import botocore.session  # botocore ships with boto3, the agent's one dependency

    session = botocore.session.get_session()
    regions: set[str] = set()
    for partition in session.get_available_partitions():
        regions.update(session.get_available_regions("ec2", partition_name=partition))
    return frozenset(regions)


#: Local mode only (docs/localmode.md, "The boot script"): the node's file-system root. The boot script
#: writes under it, and the agent reads every file-system path of the config beneath it.
ROOT_ENV = contract.ENV_ROOT


def with_root(data: Any, root: str | os.PathLike[str] | None) -> Any:
    """The config document with ``root`` put in front of every file-system path the node uses.

    Those paths: the volume and EFS mount points, the dataset/checkpoint/log directories,
    ``training.code.path``, ``training.venv.root``, ``cluster.state_dir``, and each ``training.command``
    argument under a mount point. The interpreter (``training.python``) is left alone: it is a program,
    not node data. Anything malformed is left for :func:`parse_config` to report.

    Args:
        data: the parsed config document (not changed).
        root: the node's file-system root (local mode: ``$SPOT_TRAINING_ROOT``); None or empty: ``data``
            is returned unchanged.

    Returns:
        a copy with the paths prefixed (or ``data`` itself when ``root`` is empty or ``data`` no object).
    """
    if not root:
        return data
    data = json.loads(json.dumps(data))
    prefix = str(root).rstrip("/")

    def put(section: Any, key: str) -> None:
        if isinstance(section, dict) and isinstance(section.get(key), str) and section[key].startswith("/"):
            section[key] = prefix + section[key]

    if not isinstance(data, dict):
        return data
    mounts = [m for m in ((data.get("volume") or {}).get("mount_point") if isinstance(data.get("volume"), dict) else None,
                          (data.get("efs") or {}).get("mount_point") if isinstance(data.get("efs"), dict) else None)
              if isinstance(m, str) and m.startswith("/")]
    put(data.get("volume"), "mount_point")
    put(data.get("efs"), "mount_point")
    put(data.get("cluster"), "state_dir")
    training = data.get("training")
    if isinstance(training, dict):
        for key in ("dataset_dir", "checkpoint_dir", "log_dir"):
            put(training, key)
        put(training.get("code"), "path")
        put(training.get("venv"), "root")
        if isinstance(training.get("command"), list):
            training["command"] = [prefix + part if isinstance(part, str) and any(
                part == m or part.startswith(m.rstrip("/") + "/") for m in mounts) else part
                for part in training["command"]]
    return data


#: Local mode only (docs/contracts.md, "Environment local mode gives the agent"): an integer added to the
#: ``cluster`` section's ports, so that cluster nodes sharing 127.0.0.1 (no network namespaces) each
#: listen on ports of their own. Unset on an instance, and with namespaces (every node has its own address).
PORT_OFFSET_ENV = "SPOT_TRAINING_PORT_OFFSET"
_CLUSTER_PORTS = ("scheduler_port", "server_port", "worker_port")


def with_port_offset(data: Any, offset: str | int | None) -> Any:
    """The config document with ``offset`` added to each integer port of its ``cluster`` section
    (:data:`PORT_OFFSET_ENV`). ``offset`` None or empty: ``data`` unchanged. Returns a copy.

    Args:
        data: the parsed config document (not changed).
        offset: the port offset, an integer 0..10000 or its text; None or empty: no change.

    Returns:
        a copy with the cluster ports moved (or ``data`` itself when ``offset`` is empty).

    Raises:
        ConfigError: ``offset`` is not an integer 0..10000 (the message names the variable and value).
    """
    if offset is None or offset == "":
        return data
    try:
        value = int(offset)
    except (TypeError, ValueError):
        value = -1
    if isinstance(offset, bool) or not 0 <= value <= 10000:
        raise ConfigError(f"{PORT_OFFSET_ENV}={offset!r}: expected an integer 0..10000 (local mode's port offset "
                          "for cluster nodes on loopback), or leave it unset")
    data = json.loads(json.dumps(data))
    cluster = data.get("cluster") if isinstance(data, dict) else None
    if isinstance(cluster, dict):
        for key in _CLUSTER_PORTS:
            if isinstance(cluster.get(key), int) and not isinstance(cluster[key], bool):
                cluster[key] += value
    return data


def load_config(path: str | os.PathLike[str], *, root: str | os.PathLike[str] | None = None,
                port_offset: str | int | None = None) -> AgentConfig:
    """Read and validate the config file at ``path``.

    Args:
        path: the node config file (JSON).
        root: put in front of its file-system paths (:func:`with_root`; local mode: ``$SPOT_TRAINING_ROOT``).
        port_offset: added to its cluster ports (:func:`with_port_offset`; local mode:
            ``$SPOT_TRAINING_PORT_OFFSET``).

    Returns:
        the validated config.

    Raises:
        ConfigError: (exit 78) the file is missing or unreadable, is not JSON (with line and column), or
            fails validation (every problem listed).
    """
    path = Path(path)
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise ConfigError(f"config file {str(path)!r} does not exist; pass --config with the path of "
                          f"the node config JSON (on an instance: {DEFAULT_CONFIG_PATH})") from None
    except (OSError, UnicodeDecodeError) as exc:
        raise ConfigError(f"config file {str(path)!r} cannot be read: {exc}") from None
    depth = _json_depth(text)
    if depth > MAX_JSON_DEPTH:
        raise ConfigError(f"config file {str(path)!r} is not valid JSON: nested too deeply ({depth} levels of "
                          f"[ or {{); expected at most {MAX_JSON_DEPTH} (the node config nests 4)")
    try:
        data = json.loads(text)
    except json.JSONDecodeError as exc:
        raise ConfigError(f"config file {str(path)!r} is not valid JSON: {exc.msg} at line {exc.lineno} "
                          f"column {exc.colno}") from None
    except (ValueError, RecursionError) as exc:  # an integer longer than Python's digit limit, say
        raise ConfigError(f"config file {str(path)!r} is not valid JSON: {exc}; expected the node config "
                          "(integers of a few digits)") from None
    return parse_config(with_port_offset(with_root(data, root), port_offset))


def _json_depth(text: str) -> int:
    """The deepest nesting of ``[``/``{`` in JSON ``text``, skipping strings (linear, no recursion)."""
    depth = deepest = 0
    in_string = escaped = False
    for char in text:
        if in_string:
            if escaped:
                escaped = False
            elif char == "\\":
                escaped = True
            elif char == '"':
                in_string = False
        elif char == '"':
            in_string = True
        elif char in "[{":
            depth += 1
            deepest = max(deepest, depth)
        elif char in "]}":
            depth -= 1
    return deepest


def parse_config(data: Any) -> AgentConfig:
    """Validate an already-decoded config document and build the frozen AgentConfig.

    Raises:
        ConfigError: listing every problem: missing or unknown keys, wrong types (``true`` is not an
            integer), values outside the allowed set (region, framework, node_role, fs_type),
            relative paths, a volume tag filter that does not scope to this stack.
    """
    v = _Validator()
    root = v.object(data, "")
    if root is None:
        raise ConfigError(problems=v.problems)
    v.keys(root, "", required=("schema_version", "region", "stack_name", "node_role", "volume", "training"),
           optional=("efs", "cleanup", "imds_endpoint", "notice_poll_interval_s", "monitoring", "dataset")
           + EXTENSION_KEYS)

    schema_version = v.integer(root, "schema_version", "", minimum=1)
    if schema_version is not None and schema_version != SCHEMA_VERSION:
        v.problem("schema_version", schema_version, f"{SCHEMA_VERSION} (the only version this agent reads)")
    region = v.string(root, "region", "")
    if region is not None:
        regions = known_regions()
        if region not in regions:
            v.problem("region", region, "an AWS region known to botocore, e.g. 'us-east-1' "
                      f"({len(regions)} known)")
    stack_name = v.string(root, "stack_name", "", pattern=_STACK_NAME_RE,
                          allowed="a CloudFormation stack name (a letter, then letters, digits, '-')")
    node_role = v.choice(root, "node_role", "", NODE_ROLES)

    volume = _volume(v, root, stack_name)
    efs = _efs(v, root)
    training = _training(v, root)
    if training is not None and node_role not in (None, "single") and training.framework not in CLUSTER_FRAMEWORKS:
        v.problem("training.framework", training.framework,
                  f"one of {', '.join(repr(f) for f in CLUSTER_FRAMEWORKS)} on a cluster node (node_role {node_role!r})")
    if training is not None and volume is not None and node_role == "single":
        # Cluster nodes ignore the volume section; their checkpoints live where the cluster stack puts
        # them (EFS, docs/contracts.md "Parameter-server cluster").
        _checkpoints_not_on_root_disk(v, training, volume, efs)
    cleanup = _cleanup(v, root)
    monitoring = _monitoring(v, root)
    dataset = _dataset(v, root)
    imds_endpoint = None
    if root.get("imds_endpoint") is not None:
        imds_endpoint = v.string(root, "imds_endpoint", "")
        if imds_endpoint is not None:
            parsed = urlparse(imds_endpoint)
            if parsed.scheme not in ("http", "https") or not parsed.hostname or parsed.path not in ("", "/"):
                v.problem("imds_endpoint", imds_endpoint,
                          "null or an http(s) URL with host and optional port, e.g. 'http://127.0.0.1:1338'")
                imds_endpoint = None
            else:
                imds_endpoint = imds_endpoint.rstrip("/")

    poll = v.setting(root, "notice_poll_interval_s", "")
    if poll is None:
        poll = DEFAULT_NOTICE_POLL_INTERVAL_S
    if node_role in ("scheduler", "server", "worker") and training is not None:
        # The cluster section is validated here too, so that check-config and the boot refuse what
        # the cluster agent would (one validation: spot_training.agent.cluster_state.settings_from_config).
        from spot_training.agent.cluster_state import settings_from_config

        try:
            settings_from_config(root.get("cluster"), framework=training.framework)
        except ConfigError as exc:
            v.problems.extend(exc.problems)

    if v.problems:
        raise ConfigError(problems=v.problems)
    extensions = {k: root[k] for k in EXTENSION_KEYS if k in root}
    return AgentConfig(schema_version=schema_version, region=region, stack_name=stack_name,
                       node_role=node_role, volume=volume, efs=efs, training=training, cleanup=cleanup,
                       imds_endpoint=imds_endpoint, notice_poll_interval_s=float(poll), monitoring=monitoring,
                       dataset=dataset, extensions=MappingProxyType(extensions))


def _volume(v: "_Validator", root: Mapping[str, Any], stack_name: str | None) -> VolumeConfig | None:
    section = v.object(root.get("volume"), "volume") if "volume" in root else None
    if section is None:
        return None
    v.keys(section, "volume", required=("tags", "device_name", "mount_point"),
           optional=("fs_type", "keep_snapshots", "snapshot_interval_s", "initialization_rate_mibps", "adopt_volume_id"))
    tags = v.string_map(section, "tags", "volume")
    if tags is not None:
        if STACK_TAG not in tags:
            v.problem("volume.tags", tags, f"a map that includes {STACK_TAG!r} (the stack name)")
        elif stack_name is not None and tags[STACK_TAG] != stack_name:
            v.problem(f"volume.tags.{STACK_TAG}", tags[STACK_TAG],
                      f"the stack name {stack_name!r} (stack_name), so the agent never takes another stack's volume")
        if tags.get(PURPOSE_TAG) != DATA_VOLUME_PURPOSE:
            v.problem(f"volume.tags.{PURPOSE_TAG}", tags.get(PURPOSE_TAG), repr(DATA_VOLUME_PURPOSE))
    device_name = v.string(section, "device_name", "volume", pattern=_DEVICE_NAME_RE,
                           allowed="an EBS device name such as '/dev/sdf' or '/dev/xvdf'")
    mount_point = v.abs_path(section, "mount_point", "volume")
    fs_type = v.choice(section, "fs_type", "volume", FS_TYPES, default="xfs")
    if mount_point is not None and (str(mount_point) in SYSTEM_DIRS or any(
            mount_point.is_relative_to(tree) for tree in SYSTEM_TREES)):
        v.problem("volume.mount_point", str(mount_point),
                  "a directory of its own such as '/dltraining', not '/', a system directory "
                  f"({', '.join(sorted(SYSTEM_DIRS - {'/'}))}) or inside {', '.join(SYSTEM_TREES)}")
        mount_point = None
    keep = v.setting(section, "keep_snapshots", "volume")
    interval = v.integer(section, "snapshot_interval_s", "volume", minimum=0, maximum=MAX_SNAPSHOT_INTERVAL_S, default=0)
    if interval is not None and 0 < interval < MIN_SNAPSHOT_INTERVAL_S:
        v.problem("volume.snapshot_interval_s", interval, f"0 (no periodic snapshots) or an integer >= {MIN_SNAPSHOT_INTERVAL_S} (seconds)")
        interval = None
    rate = None
    if section.get("initialization_rate_mibps") is not None:  # null or absent: EBS's default rate
        rate = v.setting(section, "initialization_rate_mibps", "volume", allowed_prefix="null or ")
        if rate is None:
            return None
    adopt = None
    if section.get("adopt_volume_id") is not None:
        adopt = v.string(section, "adopt_volume_id", "volume", pattern=_VOLUME_ID_RE,
                         allowed="null or an EBS volume id such as 'vol-0123456789abcdef0'")
        if adopt is None:
            return None
        if tags is not None and DEPLOYMENT_TAG not in tags:
            v.problem("volume.adopt_volume_id", adopt, f"null unless volume.tags names a deployment ({DEPLOYMENT_TAG!r})")
            return None
    if None in (tags, device_name, mount_point, fs_type, keep, interval):
        return None
    return VolumeConfig(tags=MappingProxyType(dict(tags)), device_name=device_name, mount_point=mount_point,
                        fs_type=fs_type, keep_snapshots=keep, snapshot_interval_s=interval, initialization_rate_mibps=rate,
                        adopt_volume_id=adopt)


def _checkpoints_not_on_root_disk(v: "_Validator", training: TrainingConfig, volume: VolumeConfig,
                                  efs: EfsConfig | None) -> None:
    """``checkpoint_dir`` must be below the data volume's or the EFS mount point: anywhere else it is
    on the root disk, deleted with the instance at the next interruption (the original blog post's
    failure)."""
    homes = [volume.mount_point] + ([efs.mount_point] if efs is not None else [])
    ckpt = training.checkpoint_dir
    if not any(ckpt != home and ckpt.is_relative_to(home) for home in homes):
        where = f"the data volume's mount point {str(volume.mount_point)!r}"
        if efs is not None:
            where += f" or the EFS mount point {str(efs.mount_point)!r}"
        v.problem("training.checkpoint_dir", str(ckpt),
                  f"a directory under {where} (e.g. '{volume.mount_point}/checkpoints'); anywhere else the "
                  "checkpoints are on the root disk and lost with the instance")


def _efs(v: "_Validator", root: Mapping[str, Any]) -> EfsConfig | None:
    section = v.optional_object(root, "efs", "efs")
    if section is None:  # null, absent or not an object (reported)
        return None
    v.keys(section, "efs", required=("file_system_id", "mount_point"), optional=("access_point_id",))
    fs_id = v.string(section, "file_system_id", "efs", pattern=_FS_ID_RE, allowed="an EFS id like 'fs-0123abcd'")
    ap_id = None
    if section.get("access_point_id") is not None:
        ap_id = v.string(section, "access_point_id", "efs", pattern=_FSAP_ID_RE,
                         allowed="null or an access point id like 'fsap-0123abcd'")
    mount_point = v.abs_path(section, "mount_point", "efs")
    if fs_id is None or mount_point is None:
        return None
    return EfsConfig(file_system_id=fs_id, access_point_id=ap_id, mount_point=mount_point)


def _training(v: "_Validator", root: Mapping[str, Any]) -> TrainingConfig | None:
    section = v.object(root.get("training"), "training") if "training" in root else None
    if section is None:
        return None
    v.keys(section, "training",
           required=("framework", "python", "command", "user", "checkpoint_dir", "code"),
           optional=("dataset_dir", "log_dir", "venv", "checkpoint_every_steps", "checkpoint_every_seconds"))
    framework = v.choice(section, "framework", "training", FRAMEWORKS)
    python = v.abs_path(section, "python", "training")
    command = None
    if "command" in section:
        raw = section["command"]
        if not isinstance(raw, list) or not raw:
            v.problem("training.command", raw, "a non-empty list of strings, e.g. ['{python}', 'train.py']")
        elif not all(isinstance(p, str) and p for p in raw):
            for i, p in enumerate(raw):
                if not isinstance(p, str) or not p:
                    v.problem(f"training.command[{i}]", p, "a non-empty string")
        else:
            command = tuple(raw)
    user = v.string(section, "user", "training", pattern=_USER_RE, allowed="a Unix user name, e.g. 'ubuntu'")
    dataset_dir = v.abs_path(section, "dataset_dir", "training", default=f"{DEFAULT_MOUNT_POINT}/{DATASETS_DIR}")
    checkpoint_dir = v.abs_path(section, "checkpoint_dir", "training")
    log_dir = v.abs_path(section, "log_dir", "training", default=f"{DEFAULT_MOUNT_POINT}/{LOGS_DIR}")
    cadence = {key: v.setting(section, key, "training", default=None)
               for key in ("checkpoint_every_steps", "checkpoint_every_seconds") if section.get(key) is not None}
    code = _code(v, section)
    venv = _venv(v, section)
    values = (framework, python, command, user, dataset_dir, checkpoint_dir, log_dir, code)
    if any(x is None for x in values) or venv is False or None in cadence.values():
        return None
    return TrainingConfig(framework=framework, python=python, command=command, user=user,
                          dataset_dir=dataset_dir, checkpoint_dir=checkpoint_dir, log_dir=log_dir, code=code,
                          venv=venv or None, **cadence)


# A pip requirement specifier as the stack accepts it (spot_training/infra/config.py): a name, optional extras, optional
# version clauses; no options, URLs, quotes or whitespace inside (the agent passes each as one argv item).
_REQUIREMENT_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]*(\[[A-Za-z0-9,._-]+\])?\s*([<>=!~]=?[^\s',;]+(,\s*[<>=!~]=?[^\s',;]+)*)?$")


def _venv(v: "_Validator", training: Mapping[str, Any]) -> VenvConfig | None | bool:
    """None when absent or null; False when invalid (problems recorded)."""
    if training.get("venv") is None:
        return None
    section = v.object(training["venv"], "training.venv", allowed="null or an object")
    if section is None:
        return False
    v.keys(section, "training.venv", required=("requirements", "root"), optional=("inherit_site_packages",))
    ok = True
    requirements = section.get("requirements")
    if not isinstance(requirements, list) or not all(isinstance(r, str) and _REQUIREMENT_RE.match(r) for r in requirements):
        v.problem("training.venv.requirements", requirements,
                  "a list of pip requirement specifiers such as 'tensorflow[and-cuda]>=2.17,<2.18'")
        ok = False
    root = v.abs_path(section, "root", "training.venv")
    inherit = section.get("inherit_site_packages", False)
    if not isinstance(inherit, bool):
        v.problem("training.venv.inherit_site_packages", inherit, "true or false")
        ok = False
    if not ok or root is None:
        return False
    return VenvConfig(requirements=tuple(requirements), root=root, inherit_site_packages=inherit)


def _code(v: "_Validator", training: Mapping[str, Any]) -> CodeConfig | None:
    if "code" not in training:
        return None
    section = v.object(training["code"], "training.code")
    if section is None:
        return None
    kind = v.choice(section, "type", "training.code", CODE_TYPES)
    if kind == "asset":
        v.keys(section, "training.code", required=("type", "path"), optional=())
        path = v.abs_path(section, "path", "training.code")
        return CodeConfig(type="asset", path=path) if path is not None else None
    if kind == "git":
        v.keys(section, "training.code", required=("type", "url", "ref"), optional=("token_secret",))
        # Neither may start with '-': git would read it as an option (--upload-pack=<command>).
        url = v.string(section, "url", "training.code", pattern=re.compile(r"^[^-\s]\S*$"),
                       allowed="a git URL (https://..., ssh://..., git@host:path) not starting with '-'")
        ref = v.string(section, "ref", "training.code", pattern=re.compile(r"^[^-\s~^:?*\[\\][^\s~^:?*\[\\]*$"),
                       allowed="a pinned commit or tag (no spaces or git revision operators, not starting with '-')")
        secret = None
        if section.get("token_secret") is not None:
            secret = v.string(section, "token_secret", "training.code", pattern=re.compile(r"^[A-Za-z0-9/_+=.@:-]{1,2048}$"),
                              allowed="a Secrets Manager secret name or ARN")
        if url is None or ref is None:
            return None
        return CodeConfig(type="git", url=url, ref=ref, token_secret=secret)
    return None


def _dataset(v: "_Validator", root: Mapping[str, Any]) -> DatasetConfig | None:
    """None when absent or null (problems recorded when invalid)."""
    if root.get("dataset") is None:
        return None
    section = v.object(root["dataset"], "dataset", allowed="null or an object")
    if section is None:
        return None
    v.keys(section, "dataset", required=("uri",), optional=("unpack",))
    uri = v.string(section, "uri", "dataset")
    if uri is not None:
        try:
            contract.split_dataset_uri(uri)
        except ValueError:
            v.problem("dataset.uri", uri, contract.DATASET_URI_FORMS)
            uri = None
    unpack = section.get("unpack", False)
    if not isinstance(unpack, bool):
        v.problem("dataset.unpack", unpack, "true or false")
        return None
    if uri is not None and unpack and uri.endswith("/"):
        v.problem("dataset.unpack", unpack, "false with a prefix URI (unpack extracts one zip object)")
        return None
    return DatasetConfig(uri=uri, unpack=unpack) if uri is not None else None


def _monitoring(v: "_Validator", root: Mapping[str, Any]) -> MonitoringConfig | None:
    section = v.optional_object(root, "monitoring", "monitoring")
    if section is None:  # null, absent or not an object (reported)
        return None
    v.keys(section, "monitoring", required=("enabled", "log_group", "namespace"), optional=("interval_s",))
    enabled = section.get("enabled")
    if "enabled" in section and not isinstance(enabled, bool):
        v.problem("monitoring.enabled", enabled, "true or false")
        enabled = None
    log_group = v.string(section, "log_group", "monitoring", pattern=_LOG_GROUP_RE,
                         allowed="a CloudWatch Logs group name (1-512 of letters, digits, '_-./#'), e.g. '/spot-training/SpotTraining'")
    namespace = v.string(section, "namespace", "monitoring", pattern=_NAMESPACE_RE,
                         allowed="a CloudWatch namespace (1-255 of letters, digits, '.-_/#: '), e.g. 'SpotTraining'")
    if namespace is not None and namespace.startswith("AWS/"):
        v.problem("monitoring.namespace", namespace, "a namespace of our own; 'AWS/' is reserved for AWS services")
        namespace = None
    interval = v.setting(section, "interval_s", "monitoring", name="monitoring_interval_s")
    if enabled is None or log_group is None or namespace is None or interval is None:
        return None
    return MonitoringConfig(enabled=enabled, log_group=log_group, namespace=namespace, interval_s=float(interval))


def _cleanup(v: "_Validator", root: Mapping[str, Any]) -> CleanupConfig:
    section = v.optional_object(root, "cleanup", "cleanup")
    if section is None:
        return CleanupConfig()
    v.keys(section, "cleanup", required=(), optional=("cancel_fleet_on_success",))
    value = section.get("cancel_fleet_on_success", True)
    if not isinstance(value, bool):
        v.problem("cleanup.cancel_fleet_on_success", value, "true or false")
        value = True
    return CleanupConfig(cancel_fleet_on_success=value)


class _Validator:
    """Collects problems as '<path>: got <value>; expected <allowed>' lines."""

    _MISSING = object()

    def __init__(self) -> None:
        self.problems: list[str] = []

    def problem(self, path: str, value: Any, allowed: str) -> None:
        if value is self._MISSING:
            shown = "missing"
        else:
            try:
                text = json.dumps(value, default=str)
            except (ValueError, RecursionError):  # an integer over Python's 4300-digit limit, deep nesting
                text = f"a {type(value).__name__} too large to show"
            shown = f"got {text if len(text) <= 120 else text[:117] + '...'}"
        self.problems.append(f"{path or '<root>'}: {shown}; expected {allowed}")

    @staticmethod
    def _join(parent: str, key: str) -> str:
        return f"{parent}.{key}" if parent else key

    def object(self, value: Any, path: str, allowed: str = "an object") -> Mapping[str, Any] | None:
        if not isinstance(value, dict):
            self.problem(path, value, allowed)
            return None
        return value

    def optional_object(self, parent: Mapping[str, Any], key: str, path: str) -> Mapping[str, Any] | None:
        """``parent[key]`` when it is an object; None when absent or null, or when it is something
        else (then the problem is recorded)."""
        if parent.get(key) is None:
            return None
        return self.object(parent[key], path, allowed="null or an object")

    def keys(self, section: Mapping[str, Any], path: str, *, required: tuple[str, ...],
             optional: tuple[str, ...]) -> None:
        for key in required:
            if key not in section:
                self.problem(self._join(path, key), self._MISSING, "a value (required key)")
        known = set(required) | set(optional)
        for key in section:
            if key not in known:
                self.problem(self._join(path, key), section[key],
                             f"no such key; allowed keys here: {', '.join(sorted(known))}")

    def _get(self, section: Mapping[str, Any], key: str, default: Any) -> Any:
        return section.get(key, default)

    def string(self, section: Mapping[str, Any], key: str, parent: str, *, pattern: re.Pattern[str] | None = None,
               allowed: str = "a non-empty string") -> str | None:
        if key not in section:
            return None  # reported by keys()
        value = section[key]
        if not isinstance(value, str) or not value or (pattern is not None and not pattern.match(value)):
            self.problem(self._join(parent, key), value, allowed)
            return None
        return value

    def choice(self, section: Mapping[str, Any], key: str, parent: str, choices: tuple[str, ...],
               default: str | None = None) -> str | None:
        if key not in section:
            return default
        value = section[key]
        if value not in choices or not isinstance(value, str):
            self.problem(self._join(parent, key), value, "one of " + ", ".join(repr(c) for c in choices))
            return None
        return value

    def integer(self, section: Mapping[str, Any], key: str, parent: str, *, minimum: int,
                maximum: int | None = None, default: int | None = None) -> int | None:
        if key not in section:
            return default
        value = section[key]
        # bool is a subclass of int: reject true/false explicitly.
        if isinstance(value, bool) or not isinstance(value, int) or value < minimum or (
                maximum is not None and value > maximum):
            self.problem(self._join(parent, key), value,
                         f"an integer >= {minimum}" + ("" if maximum is None else f" and <= {maximum}"))
            return None
        return value

    def setting(self, section: Mapping[str, Any], key: str, parent: str, *, name: str | None = None,
                default: Any = _MISSING, allowed_prefix: str = "") -> Any:
        """A number the contract defines (:data:`contract.SETTINGS` ``name``, default ``key``),
        checked by the contract's one validator so that the stack and the agent accept the same values.
        A JSON number only (text is refused here, unlike in ``cdk.json``). Absent: ``default`` (default:
        the contract's). Bad: the problem is recorded and None returned."""
        name = name or key
        if key not in section:
            return contract.default(name) if default is self._MISSING else default
        value = section[key]
        try:
            if isinstance(value, str):
                raise SettingError(name, value, contract.SETTINGS[name].allowed())
            return contract.check(name, value)
        except SettingError as exc:
            self.problem(self._join(parent, key), value, allowed_prefix + exc.allowed)
            return None

    def abs_path(self, section: Mapping[str, Any], key: str, parent: str, default: str | None = None) -> Path | None:
        value = section.get(key, default)
        if value is None:
            return None  # missing required key: reported by keys()
        if not isinstance(value, str) or not value or not PurePosixPath(value).is_absolute() or "\0" in value:
            self.problem(self._join(parent, key), value, "an absolute path (starting with '/')")
            return None
        if ".." in PurePosixPath(value).parts:
            self.problem(self._join(parent, key), value, "an absolute path without '..' components")
            return None
        return Path(value)

    def string_map(self, section: Mapping[str, Any], key: str, parent: str) -> dict[str, str] | None:
        if key not in section:
            return None
        value = section[key]
        if not isinstance(value, dict) or not value or not all(
                isinstance(k, str) and k and isinstance(x, str) for k, x in value.items()):
            self.problem(self._join(parent, key), value, "a non-empty object of string tag keys to string values")
            return None
        return value
