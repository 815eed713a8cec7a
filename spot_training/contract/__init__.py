"""The contract between the layers: every name, default and limit that crosses a layer, defined once.

spot_training/infra/ (synth time), spot_training/agent/ (the node agent, at boot), spot_training/training/ (inside the trainer) and
spot_training/local/ import this module and nothing of each other's domain (docs/architecture.md, "Layers";
a test parses the imports). It owns only:

- the node config settings that more than one layer reads: their one default and their limits, and
  :func:`check`, the one validator the stacks run on a context value at ``cdk synth`` and the agent
  runs on the node config at boot, so a value valid for one is valid for the other;
- resource tag keys and values, environment variable names, file names, exit codes, ports, mount
  points (docs/contracts.md lists them for users);
- :func:`write_json_atomic`, the one way every layer writes a JSON file that another process reads;
- :func:`check_seconds`, the one check of a duration argument;
- :func:`pid_alive`, the one way every layer asks whether a process (or process group) it recorded
  still exists.

Standard library only; runs on Python 3.10 (the node's interpreter).
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import re
import reprlib
import uuid
from pathlib import Path
from types import MappingProxyType
from typing import Any, Mapping, Optional

# ---- resource tags (docs/contracts.md, "Resource tags") --------------------------------------------
#: Carried by every resource the stack or its agents create; value: the stack name.
STACK_TAG = "spot-training:stack"
#: First part of every stack's CloudWatch metrics namespace (:func:`metrics_namespace`).
METRICS_NAMESPACE_PREFIX = "SpotTraining"


def metrics_namespace(stack_name: str) -> str:
    """The CloudWatch namespace of stack ``stack_name``'s agent metrics: ``SpotTraining/<stack name>``.

    One namespace per stack, so that the node role's ``cloudwatch:namespace`` condition lets a stack's
    nodes write only their own metrics (a shared namespace let one stack's node fake another's
    progress and completion, and so its alarms). The stack's alarms and dashboard, the node config's
    ``monitoring.namespace`` and ``spot-train status|cost`` all use it. A CloudFormation stack name
    (1-128 of letters, digits, '-') keeps the result within CloudWatch's 255 characters.
    """
    return f"{METRICS_NAMESPACE_PREFIX}/{stack_name}"
#: One deployment of a stack: the CloudFormation stack id's UUID, the same through updates, new when a
#: stack of the same name is created again. On the data volume, its copies and the agents' snapshots;
#: agents and the cleanup handler act only on their own deployment's, so data retained from an earlier
#: deployment never becomes a later one's by accident (a volume that outlived its stack is no new stack's).
DEPLOYMENT_TAG = "spot-training:deployment"
#: What a volume or snapshot is for; values below.
PURPOSE_TAG = "spot-training:purpose"
#: ``spot-training:purpose`` of the data volume and of every moved copy of it.
DATA_VOLUME_PURPOSE = "data-volume"
#: ``spot-training:purpose`` of the snapshots the agent takes to move the volume to another AZ.
MIGRATION_SNAPSHOT_PURPOSE = "migration-snapshot"
#: ``spot-training:purpose`` of the snapshots the agent takes of the data volume while training.
PERIODIC_SNAPSHOT_PURPOSE = "periodic-snapshot"
#: Data-volume tag counting failed boots in a row (written by the user data's boot-failure script;
#: the agent removes it once the trainer's environment is ready).
FAILED_BOOTS_TAG = "spot-training:failed-boots"
#: Instance tag that carries a failed boot step and its message (docs/agent.md, "Boot failures").
BOOT_ERROR_TAG = "spot-training:boot-error"
#: The agent's bookkeeping tags on the data volume, its copies and snapshots: the only tags a node
#: may delete (spot_training.infra.roles scopes ec2:DeleteTags to them).
#: The instance that holds the data volume's lease (spot_training/agent/lease.py).
LEASE_TAG = "spot-training:lease"
#: On a moved copy and its snapshot: where it came from, how far the move got, which instance made it.
SOURCE_VOLUME_TAG = "spot-training:source-volume"
SOURCE_SNAPSHOT_TAG = "spot-training:source-snapshot"
MOVE_STATE_TAG = "spot-training:move-state"
CREATED_BY_TAG = "spot-training:created-by"
AGENT_BOOKKEEPING_TAG_KEYS: tuple = (
    LEASE_TAG, SOURCE_VOLUME_TAG, SOURCE_SNAPSHOT_TAG, MOVE_STATE_TAG, CREATED_BY_TAG, FAILED_BOOTS_TAG,
)
#: Tag on every cluster worker instance; removing it asks the worker to leave.
CLUSTER_MEMBER_TAG = "spot-training:cluster-member"
#: Its value (the agent tests only that the key is present).
CLUSTER_MEMBER_TAG_VALUE = "true"

# ---- environment variables (docs/contracts.md, "Trainer environment") ------------------------------
ENV_DATA_DIR = "SPOT_TRAINING_DATA_DIR"
ENV_CHECKPOINT_DIR = "SPOT_TRAINING_CHECKPOINT_DIR"
ENV_LOG_DIR = "SPOT_TRAINING_LOG_DIR"
ENV_CHECKPOINT_REQUEST_FILE = "SPOT_TRAINING_CHECKPOINT_REQUEST_FILE"
#: The checkpoint cadence the agent hands the trainer (from the node config's ``spot_training.training`` section).
ENV_CHECKPOINT_EVERY_STEPS = "SPOT_TRAINING_CHECKPOINT_EVERY_STEPS"
ENV_CHECKPOINT_EVERY_SECONDS = "SPOT_TRAINING_CHECKPOINT_EVERY_SECONDS"
#: Local mode only: the node's file-system root, prefixed to every path of the node config.
ENV_ROOT = "SPOT_TRAINING_ROOT"
#: Cluster processes (docs/cluster.md): the node's id (the instance id; names each trainer's step log)
#: and the plan's generation (MXNet/TensorFlow; the TorchElastic epoch is torchrun's own).
ENV_NODE_ID = "SPOT_TRAINING_NODE_ID"
ENV_GENERATION = "SPOT_TRAINING_GENERATION"
#: MXNet/TensorFlow cluster processes: the plan's number of workers and this worker's rank in it.
ENV_NUM_WORKERS = "SPOT_TRAINING_NUM_WORKERS"
ENV_WORKER_RANK = "SPOT_TRAINING_WORKER_RANK"
#: Set by the systemd unit for the agent: the boot-failure script (spot_training/infra/userdata.py
#: writes it; docs/agent.md, "Boot failures").
ENV_ON_BOOT_FAILURE = "SPOT_TRAINING_ON_BOOT_FAILURE"
#: Environment a PyTorch worker node's agent gives its ``torchrun`` (docs/training-pytorch.md,
#: "Elastic clusters"): without it torch 2.14 publishes MASTER_ADDR/MASTER_PORT only in a node's
#: first rendezvous round, so a node joining a running job waits for them until it times out.
TORCHRUN_ENV = MappingProxyType({"TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1"})

# ---- the dataset ------------------------------------------------------------------------------------
#: The forms of a dataset URI (the stack's ``dataset_uri``, the node config's ``dataset.uri``).
DATASET_URI_FORMS = "s3://bucket/prefix/ (every object under the prefix) or s3://bucket/key (one object)"
#: Bucket names per the S3 naming rules (3..63 characters); no wildcards or white space in the key.
_DATASET_URI = re.compile(r"^s3://(?P<bucket>[a-z0-9][a-z0-9.-]{1,61}[a-z0-9])/(?P<key>[^\s*?]*)$")


#: ``repr`` for values in error messages: strings up to 300 characters in full, containers 3 levels deep.
_VALUE_REPR = reprlib.Repr()
_VALUE_REPR.maxstring, _VALUE_REPR.maxlevel, _VALUE_REPR.maxother = 300, 3, 300


def split_dataset_uri(uri: str) -> tuple[str, str]:
    """Split a dataset URI into its bucket and key, the one check the stack and the agent share.

    Args:
        uri: ``s3://bucket/prefix/`` (every object under the prefix) or ``s3://bucket/key`` (one object).

    Returns:
        ``(bucket, key or prefix)``; the prefix keeps its trailing ``/``.

    Raises:
        ValueError: ``uri`` has another form, a ``..`` part, a wildcard or a key starting with ``/``
            (names the value and :data:`DATASET_URI_FORMS`).
    """
    match = _DATASET_URI.match(uri) if isinstance(uri, str) else None
    if match is None or ".." in match.group("key").split("/") or match.group("key").startswith("/"):
        # reprlib: a value from a hostile context (a list nested 5000 deep) must not exhaust the stack.
        raise ValueError(f"expected {DATASET_URI_FORMS}, got {_VALUE_REPR.repr(uri)}")
    return match.group("bucket"), match.group("key")


# ---- files and mount points ------------------------------------------------------------------------
#: Where the user data writes the node config on an instance.
CONFIG_PATH = "/etc/spot-training/config.json"
#: The data volume's mount point when the stack does not set ``mount_point``.
DEFAULT_MOUNT_POINT = "/dltraining"
#: Where nodes mount the stack's EFS file system.
EFS_MOUNT_POINT = "/mnt/efs"
#: Directories under the data root (the data volume's or EFS mount point).
DATASETS_DIR, CHECKPOINTS_DIR, LOGS_DIR = "datasets", "checkpoints", "logs"
#: In the checkpoint directory: the pointer to the newest checkpoint, the end-of-training marker and
#: the file whose appearance asks the trainer for an extra checkpoint.
LATEST_FILE = "LATEST"
COMPLETED_FILE = "COMPLETED"
CHECKPOINT_REQUEST_FILE = "CHECKPOINT_REQUEST"
#: In the log directory: the trainer's per-step log, its optional progress file, the agent's log.
TRAINING_LOG_FILE = "training_log.csv"
PROGRESS_FILE = "progress.json"
AGENT_LOG_FILE = "agent.jsonl"

# ---- exit codes (docs/contracts.md, "Agent exit codes" and "Trainer exit codes"; sysexits.h) -------
#: The node can no longer work and gave up (EX_UNAVAILABLE); systemd does not restart the agent.
EXIT_UNAVAILABLE = 69
#: The checkpoint storage is full or unusable (EX_IOERR): agent and trainer; not restarted.
EXIT_CHECKPOINT_STORAGE = 74
#: Try again later (EX_TEMPFAIL): systemd restarts the agent.
EXIT_TEMPFAIL = 75
#: Bad configuration, nothing touched (EX_CONFIG); also the trainer's "this checkpoint cannot serve
#: this job". Not restarted.
EXIT_CONFIG = 78
#: The trainer's exit status when its checkpoint belongs to another job.
EXIT_CHECKPOINT_MISMATCH = EXIT_CONFIG
#: A PyTorch worker under an elastic torchrun that stopped only because another rank got the stop
#: signal (its checkpoint is committed): non-zero so that its torchrun restarts the worker group
#: instead of ending the job (spot_training.training.core.stop_exit_code; docs/training-pytorch.md).
EXIT_PEER_STOPPED = EXIT_TEMPFAIL

# ---- the restart policy: trainer exit status -> what every agent does (docs/contracts.md) ----------
#: Exit 0: training ended. Completed when ``COMPLETED`` is in the checkpoint directory; otherwise the
#: trainer stopped for a notice the agent relayed (not a crash), or, with neither, a crash.
TRAINER_FINISHED = "finished"
#: Permanent: every restart would fail the same way. The agent does not restart the trainer and exits
#: with the trainer's status, which systemd does not restart either (``RestartPreventExitStatus``).
TRAINER_GIVE_UP = "give-up"
#: The trainer stopped cleanly with its checkpoint committed and asks to be run again (a torchrun
#: rank stopped by a peer's notice): restarted after the back-off, not counted as a crash.
TRAINER_RETRY = "retry"
#: A crash: restarted after a jittered exponential back-off, within the crash budget (``max_restarts``
#: crashes in a row; a cluster's framework process: its torchrun or generation restarts).
TRAINER_RESTART = "restart"
#: The one table from a trainer's exit status to the decision (SkyPilot's ``recover_on_exit_codes`` is
#: the model). A status that is not listed (a negative one: killed by a signal) means
#: :data:`TRAINER_RESTART`. Read through :func:`trainer_exit_decision`.
TRAINER_EXIT_POLICY: Mapping[int, str] = MappingProxyType({
    0: TRAINER_FINISHED,
    EXIT_CHECKPOINT_STORAGE: TRAINER_GIVE_UP,
    EXIT_CHECKPOINT_MISMATCH: TRAINER_GIVE_UP,
    EXIT_TEMPFAIL: TRAINER_RETRY,
})


def trainer_exit_decision(status: Optional[int]) -> str:
    """What an agent does when its trainer exited with ``status``.

    Args:
        status: the exit status as ``subprocess.Popen.returncode`` gives it (negative: killed by that
            signal); None (the status is unknown, e.g. the agent restarted) counts as a crash.

    Returns:
        One of :data:`TRAINER_FINISHED`, :data:`TRAINER_GIVE_UP`, :data:`TRAINER_RETRY` and
        :data:`TRAINER_RESTART` (from :data:`TRAINER_EXIT_POLICY`).
    """
    if status is None:
        return TRAINER_RESTART
    return TRAINER_EXIT_POLICY.get(status, TRAINER_RESTART)


#: The agent's exit statuses that systemd must not restart (the unit's ``RestartPreventExitStatus``):
#: bad config (78), the node gave up (69), and every trainer status the policy gives up on (the agent
#: exits with it).
AGENT_EXITS_NOT_RESTARTED: tuple = tuple(dict.fromkeys(
    [EXIT_CONFIG, *sorted((s for s, d in TRAINER_EXIT_POLICY.items() if d == TRAINER_GIVE_UP), reverse=True),
     EXIT_UNAVAILABLE]))

# ---- ports -----------------------------------------------------------------------------------------
#: Default TCP ports of the parameter-server cluster's roles (ps-lite / TensorFlow gRPC).
DEFAULT_SCHEDULER_PORT, DEFAULT_SERVER_PORT, DEFAULT_WORKER_PORT = 9000, 9001, 9002

# ---- cluster sizes and torchrun (context keys ``cluster_*``, node config ``cluster.*``) -------------
#: Fewest and most workers of a generation (``cluster_min_workers``/``cluster_max_workers``).
DEFAULT_MIN_WORKERS, DEFAULT_MAX_WORKERS = 1, 8
#: The limits the stack (props and context keys) and the agents (``cluster.*``) both enforce:
#: parameter-server nodes 1..MAX_SERVERS (0 for PyTorch, which has none), workers 1..MAX_WORKERS.
MAX_SERVERS = 64
MAX_WORKERS = 1024
#: A cluster's phase bounds (node config ``cluster.stop_timeout_s`` and ``cluster.kill_grace_s``,
#: seconds): the checkpoint and teardown phases each last at most the first, SIGTERM -> SIGKILL the second.
DEFAULT_CLUSTER_STOP_TIMEOUT_S = 120.0
DEFAULT_CLUSTER_KILL_GRACE_S = 5.0
#: systemd's ``TimeoutStopSec`` for a cluster agent: a stopped worker leaves first (a checkpoint phase
#: and a teardown phase, then the kill grace), plus a margin of 55 s for the agent's own exit.
CLUSTER_AGENT_STOP_TIMEOUT_S = int(2 * DEFAULT_CLUSTER_STOP_TIMEOUT_S + DEFAULT_CLUSTER_KILL_GRACE_S + 55)
#: torchrun defaults of a PyTorch cluster (context keys ``cluster_torch_*``, docs/contracts.md):
#: worker-group restarts before torchrun gives up (every join and leave costs one; the agent then
#: relaunches torchrun under a new rendezvous id), and the SIGTERM -> SIGKILL grace torchrun gives
#: its workers (``--shutdown-timeout``, seconds): long enough to agree on a step and write the
#: checkpoint, inside the 120 s of a spot interruption notice.
DEFAULT_TORCH_MAX_RESTARTS = 100
DEFAULT_TORCH_SHUTDOWN_TIMEOUT_S = 90
MAX_TORCH_SHUTDOWN_TIMEOUT_S = 115
#: torchrun's ``--max-restarts`` 0..MAX_TORCH_MAX_RESTARTS and ``--nproc-per-node``
#: 1..MAX_TORCH_NPROC_PER_NODE (processes, one per GPU), as the stack and the agents check them.
MAX_TORCH_MAX_RESTARTS = 10000
DEFAULT_TORCH_NPROC_PER_NODE = 1
MAX_TORCH_NPROC_PER_NODE = 64


# ---- settings: one default, one validator --------------------------------------------------------
def shown(value: Any, limit: int = 80) -> str:
    """``repr(value)`` for an error message, cut to ``limit`` characters; never raises.

    Python refuses to convert an integer of more than 4300 digits to text, and a 100 000-character string
    is no message; such values are named by their type instead.

    Args:
        value: any object to show.
        limit: the most characters returned (an ellipsis marks a cut); default 80.

    Returns:
        the (possibly shortened) ``repr``, or ``"a <type> too large to show"``.
    """
    try:
        text = repr(value)
    except (ValueError, RecursionError):
        return f"a {type(value).__name__} too large to show"
    return text if len(text) <= limit else f"{text[:limit - 3]}..."


class SettingError(ValueError):
    """A setting's value is outside the contract; the message names the setting, the value and what is allowed.

    ``name``, ``value`` and ``allowed`` are kept as attributes for callers that word it their own way.

    Args:
        name: the setting's key (context key / node config key), or a label such as ``job.max_steps``.
        value: the value that was given (shown with :func:`shown`).
        allowed: what would be accepted, in words (for example ``"an integer in 1..10000 steps"``).
    """

    def __init__(self, name: str, value: Any, allowed: str) -> None:
        super().__init__(f"{name}: got {shown(value)}; allowed: {allowed}")
        self.name, self.value, self.allowed = name, value, allowed


@dataclasses.dataclass(frozen=True)
class Setting:
    """One number in the node config that more than one layer reads.

    Attributes:
        name: the context key in ``cdk.json`` and the node config key (same name).
        kind: ``int`` or ``float`` (an integer is a valid float; ``true``/``false`` never are).
        default: used when the value is absent (None: the feature is off).
        minimum: the inclusive lower limit.
        maximum: the inclusive upper limit (None: unbounded).
        unit: for messages and docs (``s``, ``steps``, ``snapshots``, ``TCP port``, ``MiB/s``).
    """

    name: str
    kind: type
    default: Optional[float]
    minimum: float
    maximum: Optional[float]
    unit: str

    def allowed(self) -> str:
        """What :func:`check` accepts, in words."""
        seconds = self.kind is float and self.unit == "s"
        what = "a number of seconds" if seconds else "an integer" if self.kind is int else "a number"
        unit = "" if seconds else f" ({self.unit})"
        if self.maximum is None:
            return f"{what} >= {self.minimum:g}{unit}"
        return f"{what} from {self.minimum:g} to {self.maximum:g}{unit}"


SETTINGS: Mapping[str, Setting] = {s.name: s for s in (
    # AWS recommends polling instance metadata for a notice every 5 s (EC2 User Guide, "Spot Instance
    # interruption notices"); local mode polls every second for its tiny models.
    Setting("notice_poll_interval_s", float, 5.0, 0.5, 60.0, "s"),
    Setting("monitoring_interval_s", float, 10.0, 1.0, 300.0, "s"),
    Setting("keep_snapshots", int, 2, 1, 100, "snapshots"),
    # Steps between checkpoints; None for checkpoint_every_seconds: no time-based saves.
    Setting("checkpoint_every_steps", int, 50, 1, 1_000_000_000, "steps"),
    Setting("checkpoint_every_seconds", float, None, 1.0, 86400.0, "s"),
    # Unprivileged ports only: the trainer runs as an ordinary user.
    Setting("port", int, None, 1024, 65535, "TCP port"),
    # EBS's Provisioned Rate for Volume Initialization (CreateVolume VolumeInitializationRate).
    Setting("initialization_rate_mibps", int, 300, 100, 300, "MiB/s"),
)}


def default(name: str) -> Any:
    """The one default of setting ``name`` (KeyError for an unknown name)."""
    return SETTINGS[name].default


#: Decimal text :func:`check` accepts: ASCII digits, an optional sign, a point and exponent for floats,
#: at most 32 characters (no setting needs more; a 5000-digit string is refused, not parsed).
_INT_TEXT = re.compile(r"[+-]?[0-9]+")
_FLOAT_TEXT = re.compile(r"[+-]?(?:[0-9]+(?:\.[0-9]*)?|\.[0-9]+)(?:[eE][+-]?[0-9]{1,3})?")
_MAX_NUMBER_TEXT = 32


def check(name: str, value: Any, *, label: Optional[str] = None) -> Any:
    """Validate ``value`` for setting ``name`` and return it as the setting's kind.

    Accepts a JSON number (the node config) or its ASCII decimal text of at most 32 characters
    (``cdk synth -c key=7``, an environment variable); never ``true``/``false``, NaN, infinity,
    Unicode digits or anything else (a list, a dict): every such value is a SettingError, never
    another exception. Every setting has an upper bound.

    Args:
        name: a key of :data:`SETTINGS`.
        value: the value to check.
        label: how the message names it (default ``name``; e.g. ``context key 'keep_snapshots'``).

    Raises:
        SettingError: (a ValueError) naming ``label``, the value and the allowed range.
    """
    setting = SETTINGS[name]
    label = label or name
    number: Any = None
    if isinstance(value, bool):
        number = None
    elif isinstance(value, int) or (setting.kind is float and isinstance(value, float)):
        number = value
    elif isinstance(value, str):
        # ASCII decimal text only: Python's int()/float() also take full-width and other Unicode
        # digits ('７０００'), underscores, 'inf' and 'nan', which CloudFormation and EC2 do not.
        text = value.strip()
        pattern = _INT_TEXT if setting.kind is int else _FLOAT_TEXT
        if len(text) <= _MAX_NUMBER_TEXT and text.isascii() and pattern.fullmatch(text):
            number = int(text) if setting.kind is int else float(text)
    if number is None or (isinstance(number, float) and not math.isfinite(number)):
        raise SettingError(label, value, setting.allowed())
    if number < setting.minimum or (setting.maximum is not None and number > setting.maximum):
        raise SettingError(label, value, setting.allowed())
    return setting.kind(number)


def check_seconds(name: str, value: Any, *, zero: bool = False) -> float:
    """The one check of a duration argument (a timeout, an interval, a delay) in every layer.

    A bool, a non-number, NaN and infinity are refused as well as the out-of-range values: NaN compares
    false with everything, so a bare ``value <= 0`` lets it through, and a timeout of NaN or infinity
    never expires.

    Args:
        name: how the error names the argument, e.g. ``"timeout_s"``.
        value: the argument.
        zero: 0 is allowed (a delay or a margin that may be none); default false (> 0).

    Returns:
        ``value`` as a float.

    Raises:
        ValueError: ``"<name> must be > 0 seconds, got <value>"`` (``>= 0`` with ``zero``).
    """
    if (isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value)
            or value < 0 or (value == 0 and not zero)):
        raise ValueError(f"{name} must be {'>=' if zero else '>'} 0 seconds, got {value!r}")
    return float(value)


# ---- files other processes read ------------------------------------------------------------------
def write_json_atomic(path: "str | os.PathLike[str]", payload: Mapping[str, Any], *, tmp_prefix: str = ".tmp-",
                      tmp_suffix: Optional[str] = None) -> None:
    """Write ``payload`` as JSON to ``path`` so that a reader sees the old file or the new one, never half.

    A reader (another process, another node on EFS) sees the old file or the new one, and the new one
    survives a power cut: a temporary file ``<tmp_prefix><name>-<tmp_suffix>`` beside it, fsync,
    ``os.replace``, fsync of the directory (the rename is durable only then; man pages rename(2), fsync(2)).

    Args:
        path: the file to write; its directory must exist.
        payload: a JSON-serializable mapping (written with sorted keys, indent 1, trailing newline).
        tmp_prefix: prefix of the temporary file's name; default ``.tmp-``.
        tmp_suffix: suffix of the temporary file's name; default ``<pid>-<8 random hex digits>``.

    Raises:
        OSError: the file or the directory cannot be written or synced; the temporary file is removed
            and the error re-raised (so is any other exception, for example ``TypeError`` from a value JSON
            cannot encode).
    """
    path = Path(path)
    suffix = tmp_suffix if tmp_suffix is not None else f"{os.getpid()}-{uuid.uuid4().hex[:8]}"
    tmp = path.with_name(f"{tmp_prefix}{path.name}-{suffix}")
    try:
        with open(tmp, "w", encoding="utf-8") as handle:
            json.dump(payload, handle, indent=1, sort_keys=True)
            handle.write("\n")
            handle.flush()
            os.fsync(handle.fileno())
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    fd = os.open(path.parent, os.O_RDONLY | getattr(os, "O_DIRECTORY", 0))
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


# ---- processes other processes watch ------------------------------------------------------------
def pid_alive(pid: Any, *, group: bool = False) -> bool:
    """Whether the process ``pid`` (with ``group``: any process of the process group ``pid``) exists.

    ``kill(pid, 0)`` / ``killpg(pid, 0)``, which checks without sending a signal (man page kill(2)): no
    such process is false; one owned by another user (``EPERM``) exists and is true.

    Args:
        pid: the process id (or process group id) as recorded, read back from a file or a name; anything
            but a positive ``int`` (``None``, a string, a bool, 0 or a negative number, which ``kill`` would
            take for the caller's own group or every process) is false.
        group: ask about the process group ``pid``; default false (the process).

    Returns:
        True while it exists.
    """
    if isinstance(pid, bool) or not isinstance(pid, int) or pid <= 0:
        return False
    try:
        (os.killpg if group else os.kill)(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True  # it exists, under another user
    return True


# ---- parameter sweeps on AWS Batch (docs/sweeps.md) ------------------------------------------------
#: Where a sweep child's container mounts the stack's EFS access point (the seed's ``/storage``).
SWEEP_MOUNT_POINT = "/storage"
#: Per child, under ``<sweep mount>/<sweep id>/<index>/``: its parameters, its metric at the newest
#: committed checkpoint, its attempts (one entry per AWS Batch attempt) and checkpoints/, logs/.
SWEEP_PARAMS_FILE, SWEEP_METRICS_FILE, SWEEP_ATTEMPTS_FILE = "params.json", "metrics.json", "attempts.json"
#: The manifest: a JSON list of parameter sets, index i = array child i (S3 key ``sweeps/<id>/manifest.json``).
SWEEP_MANIFEST_FILE = "manifest.json"
#: The environment AWS Batch gives an array child (AWS Batch User Guide, "Array jobs"; "Job environment variables").
ENV_BATCH_ARRAY_INDEX = "AWS_BATCH_JOB_ARRAY_INDEX"
ENV_BATCH_JOB_ATTEMPT = "AWS_BATCH_JOB_ATTEMPT"
ENV_BATCH_JOB_ID = "AWS_BATCH_JOB_ID"
#: What ``spot-train sweep submit`` passes the array job: the manifest's S3 URI and the sweep id.
ENV_SWEEP_MANIFEST_URI = "SPOT_TRAINING_SWEEP_MANIFEST_URI"
ENV_SWEEP_ID = "SPOT_TRAINING_SWEEP_ID"
#: A child whose trainer stopped for a spot notice and whose host was not taken by the notice's
#: deadline exits with this status (EX_TEMPFAIL); the job definition retries it like a reclaim.
EXIT_SWEEP_RECLAIM_NOT_TAKEN = EXIT_TEMPFAIL
#: AWS Batch's limits: retry attempts 1..10, evaluateOnExit rules <= 5, array size 2..10000.
MAX_BATCH_ATTEMPTS, MAX_BATCH_RETRY_RULES, MAX_BATCH_ARRAY_SIZE = 10, 5, 10000
#: AWS Batch's status reason of a job whose host EC2 instance went away (a spot reclaim), matched by
#: the job definition's retry rule ``onStatusReason: "Host EC2*"`` (aws-cdk-lib Reason.SPOT_INSTANCE_RECLAIMED).
BATCH_HOST_TERMINATED_REASON = "Host EC2 (instance {instance_id}) terminated."
SWEEP_RECLAIM_STATUS_REASON_GLOB = "Host EC2*"
