"""Settings of the single-node stack, read from CDK context (``cdk.json`` or ``cdk synth -c key=value``).

:func:`StackSettings.from_context` reads every key listed in :data:`CONTEXT_KEYS`, converts the
strings that ``-c`` passes (``-c target_capacity=2``, ``-c instance_types=g5.xlarge,g4dn.xlarge``,
``-c retain_data=true``) and validates them before any construct is built, so a bad value fails
``cdk synth`` with a :class:`ValueError` that names the context key, the value received and what is
allowed. ``docs/infra.md`` lists the same keys for users; a test keeps the two in step.
"""

from __future__ import annotations

import dataclasses
import difflib
import json
import re
import reprlib
import shlex
from collections.abc import Callable, Iterable, Mapping
from typing import Any, ClassVar

from spot_training import contract
from spot_training.contract import DEFAULT_MOUNT_POINT, EFS_MOUNT_POINT

from .fleet import DEFAULT_INSTANCE_TYPES, AllocationStrategy, validate_instance_type

#: The trainer's interpreter by default: the system Python of the default AMI. The Deep Learning
#: Base AMI (Ubuntu 22.04) documents ``python_location: /usr/bin/python3.10`` in its release notes
#: and ships no framework, so the node installs :data:`FRAMEWORK_REQUIREMENTS` into it at boot.
DEFAULT_TRAINING_PYTHON = "/usr/bin/python3"


@dataclasses.dataclass(frozen=True)
class FrameworkDefaults:
    """What a framework brings by default: the one place the stacks derive these from.

    Attributes:
        training_command: the single-node trainer (context key ``training_command`` when not set);
            ``{python}`` is replaced by the training interpreter on the node.
        requirements: pip requirements of its GPU build, installed into the default interpreter at
            boot (``training_requirements`` / the cluster's workers when not set).
        cpu_requirements: its CPU build for nodes without a GPU (the cluster's on-demand scheduler
            and parameter servers), or None where the framework has no cluster mode.
        cluster_training_command: the cluster trainer (``cluster_training_command`` when not set),
            or None where the framework has no cluster mode.
    """

    training_command: tuple[str, ...]
    requirements: tuple[str, ...]
    cpu_requirements: tuple[str, ...] | None = None
    cluster_training_command: tuple[str, ...] | None = None


#: Every framework a node can run, with its defaults (GPU builds; TensorFlow 2.17 is what the
#: training library is tested with; MXNet 1.9.1 needs numpy<1.24; the CPU builds download no CUDA
#: libraries, ``tensorflow[and-cuda]`` pulls several GiB of them). PyTorch: the Linux x86_64 wheels
#: of ``torch`` on PyPI are its CUDA builds, declaring the CUDA libraries as ``nvidia-*`` wheel
#: dependencies (pytorch/pytorch#100974), so no extra index is needed; numpy is for the
#: examples' data (spot_training/training/datasets.py). PyTorch clusters run on TorchElastic (torchrun), not on
#: parameter servers (spot_training/infra/cluster.py). The
#: tables below are derived from this one; the stacks read no other per-framework default.
FRAMEWORKS: dict[str, FrameworkDefaults] = {
    "tensorflow": FrameworkDefaults(
        training_command=("{python}", "spot_training/training/examples/keras_resnet.py"),
        requirements=("tensorflow[and-cuda]>=2.17,<2.18",),
        cpu_requirements=("tensorflow-cpu>=2.17,<2.18",),
        cluster_training_command=("{python}", "-m", "spot_training.training.distributed.tf_pss"),
    ),
    "mxnet": FrameworkDefaults(
        training_command=("{python}", "spot_training/training/examples/gluon_resnet.py"),
        requirements=("mxnet-cu112==1.9.1", "numpy<1.24"),
        cpu_requirements=("mxnet==1.9.1", "numpy<1.24"),
        cluster_training_command=("{python}", "-m", "spot_training.training.distributed.mxnet_dist"),
    ),
    "pytorch": FrameworkDefaults(
        training_command=("{python}", "spot_training/training/examples/torch_resnet.py"),
        requirements=("torch>=2.5,<3", "numpy>=1.26"),
        # The coordinator only serves torchrun's c10d store (spot_training.training.distributed.torch_rendezvous);
        # PyPI has no CPU-only Linux torch wheel, so it installs the same build as the workers.
        cpu_requirements=("torch>=2.5,<3", "numpy>=1.26"),
        # Run by torchrun on every worker (spot_training/agent/torch_elastic.py wraps it with --no-python).
        cluster_training_command=("{python}", "-m", "spot_training.training.distributed.torch_ddp"),
    ),
}
#: The framework when context key ``framework`` is not set.
DEFAULT_FRAMEWORK = "tensorflow"
#: Pip requirements of each framework's GPU build (from :data:`FRAMEWORKS`). Not installed when
#: ``training_python`` names another interpreter.
FRAMEWORK_REQUIREMENTS: dict[str, tuple[str, ...]] = {name: f.requirements for name, f in FRAMEWORKS.items()}
#: CPU builds of the frameworks that have a cluster mode (from :data:`FRAMEWORKS`).
FRAMEWORK_CPU_REQUIREMENTS: dict[str, tuple[str, ...]] = {
    name: f.cpu_requirements for name, f in FRAMEWORKS.items() if f.cpu_requirements is not None
}
#: Kept for callers of the first version: frameworks and their default interpreter.
FRAMEWORK_PYTHON = {name: DEFAULT_TRAINING_PYTHON for name in FRAMEWORKS}
#: Kept for callers of the first version: the default framework's training command.
DEFAULT_TRAINING_COMMAND = FRAMEWORKS[DEFAULT_FRAMEWORK].training_command
#: Public SSM parameter of the AWS Deep Learning Base AMI (x86_64, NVIDIA driver, Ubuntu 22.04).
DEFAULT_AMI_SSM_PARAMETER = "/aws/service/deeplearning/ami/x86_64/base-oss-nvidia-driver-gpu-ubuntu-22.04/latest/ami-id"

_AZ_RE = re.compile(r"^[a-z]{2}(-[a-z]+)+-[0-9][a-z]$")
_REGION_RE = re.compile(r"^[a-z]{2}(-[a-z]+)+-[0-9]$")
_ACCOUNT_RE = re.compile(r"^[0-9]{12}$")
_VPC_ID_RE = re.compile(r"^vpc-[0-9a-f]{8,17}$")
_VOLUME_ID_RE = re.compile(r"^vol-[0-9a-f]{8,17}$")
_AMI_ID_RE = re.compile(r"^ami-[0-9a-f]{8,17}$")
_STACK_NAME_RE = re.compile(r"^[A-Za-z][A-Za-z0-9-]{0,127}$")
# ASCII digits only: ``\d`` also matches full-width ``７０００``, which CloudFormation's SpotPrice refuses
# only at deploy. At most 6 integer digits (USD per hour) keep float() exact enough and bounded.
_MAX_PRICE_RE = re.compile(r"^[0-9]{1,6}(\.[0-9]{1,10})?$")
_EMAIL_RE = re.compile(r"^[^@\s]+@[^@\s]+\.[^@\s]+$")
#: The largest target capacity of one Spot Fleet (Amazon EC2 User Guide, "Spot Fleet quotas":
#: 10,000 target capacity per fleet).
MAX_TARGET_CAPACITY = 10_000
#: Retention periods CloudWatch Logs accepts (PutRetentionPolicy), in days.
LOG_RETENTION_DAYS = (1, 3, 5, 7, 14, 30, 60, 90, 120, 150, 180, 365, 400, 545, 731, 1096, 1827, 2192, 2557, 2922, 3288, 3653)


def _range(name: str) -> str:
    """``lo..hi`` of a contract setting, for the context-key tables."""
    setting = contract.SETTINGS[name]
    return f"{setting.minimum:g}.." + (f"{setting.maximum:g}" if setting.maximum is not None else "")


def contract_setting(key: str, value: Any, name: str | None = None, *, or_none: bool = False) -> Any:
    """Context key ``key`` checked by the contract's validator (``contract.check`` of setting
    ``name``, default ``key``), the one the agent runs at boot, so synth and boot accept the same values.
    ``or_none``: the message adds that ``none`` is allowed too (the caller handles it).

    Args:
        key: the context key (named in the message).
        value: its value (a number, or its text from ``-c``).
        name: the contract setting's name (default ``key``).
        or_none: the message adds that ``none`` is allowed too (the caller handles it); default False.

    Returns:
        the value converted to the setting's kind (``int`` or ``float``).

    Raises:
        ValueError: naming the context key, the value and what is allowed.
    """
    if not isinstance(value, (str, int, float)):  # a list or dict (nested thousands deep) is no number
        raise context_value_error(key, value, f"a number, {_range(name or key)}" + (", or none" if or_none else ""))
    try:
        return contract.check(name or key, value, label=f"context key {key!r}")
    except contract.SettingError as exc:
        # Worded here so that the value is shortened (a 5000-digit string is named by its start).
        raise context_value_error(key, value, exc.allowed + (", or none" if or_none else "")) from None


@dataclasses.dataclass(frozen=True)
class ContextKey:
    """One context key: its name, default (as stored in ``cdk.json``), unit and meaning."""

    name: str
    default: Any
    unit: str
    help: str


#: Every context key the app reads, in the order docs/infra.md lists them.
CONTEXT_KEYS: tuple[ContextKey, ...] = (
    ContextKey("stack_name", "SpotTraining", "-", "CloudFormation stack name; also the value of the `spot-training:stack` tag"),
    ContextKey("account", None, "-", "12-digit AWS account id; default: none (environment-agnostic stack)"),
    ContextKey("region", None, "-", "AWS region such as us-east-1; default: none (environment-agnostic: the region you deploy to)"),
    ContextKey("availability_zones", None, "list", "pin the Availability Zones (no lookup); default: the stack's AZs (2 when environment-agnostic)"),
    ContextKey("vpc_id", None, "-", "use this existing VPC (Vpc.from_lookup; needs account and region) instead of a new one"),
    ContextKey("vpc_flow_logs", True, "bool", "VPC flow logs to CloudWatch Logs for a new VPC"),
    ContextKey("private_subnets", False, "bool", "nodes in private subnets without public IPs, reaching AWS through VPC endpoints (new VPC only; docs/infra.md, \"Private subnets\")"),
    ContextKey("instance_types", list(DEFAULT_INSTANCE_TYPES), "list", "EC2 instance types the fleet may launch"),
    ContextKey("target_capacity", 1, "instances", "Spot Fleet target capacity, 0..10000 (0 pauses the fleet)"),
    ContextKey("allocation_strategy", AllocationStrategy.PRICE_CAPACITY_OPTIMIZED.value, "-", "one of " + ", ".join(s.value for s in AllocationStrategy)),
    ContextKey("max_price", None, "USD/hour", "highest Spot price per instance-hour; default: the On-Demand price"),
    ContextKey("volume_size_gib", 100, "GiB", "data volume size, 1..16384"),
    ContextKey("volume_iops", 3000, "IOPS", "data volume provisioned IOPS (gp3: 3000..16000)"),
    ContextKey("volume_throughput_mibps", 125, "MiB/s", "data volume throughput (gp3: 125..1000)"),
    ContextKey("volume_kms_key_arn", None, "-", "customer managed KMS key for the data volume; default: the AWS managed EBS key"),
    ContextKey("adopt_volume_id", None, "-", "adopt this data volume that an earlier deployment of the same stack name retained (docs/agent-storage.md, \"Adopting retained data\"); the stack then creates no new one"),
    ContextKey("root_volume_size_gib", 150, "GiB", "encrypted gp3 root volume of each instance"),
    ContextKey("image_id", None, "-", "AMI id; default: the Deep Learning AMI from `ami_ssm_parameter`"),
    ContextKey("ami_ssm_parameter", DEFAULT_AMI_SSM_PARAMETER, "-", "public SSM parameter resolved to the AMI id at deploy time"),
    ContextKey("framework", DEFAULT_FRAMEWORK, "-", "one of " + ", ".join(FRAMEWORKS)
               + "; picks the default `training_command` and `training_requirements`"),
    ContextKey("training_python", None, "-", f"trainer's interpreter; default: {DEFAULT_TRAINING_PYTHON} (the Base AMI's Python), with `training_requirements` in a virtual environment the agent builds once on the data volume"),
    ContextKey("training_requirements", None, "list", "pip requirements of the trainer's virtual environment (built from `training_python` on the data volume once, reused by every replacement); default: the framework's ("
               + "; ".join(f"{k}: {', '.join(v)}" for k, v in FRAMEWORK_REQUIREMENTS.items()) + ") when `training_python` is not set, else none; `[]`: none"),
    ContextKey("training_inherit_site_packages", False, "bool", "the trainer's virtual environment also sees `training_python`'s own packages (an AMI that ships a framework, plus a few `training_requirements`; local mode)"),
    ContextKey("training_command", None, "list", "trainer command (a list, or a shell-style string split with `shlex`); `{python}` becomes `training_python`; default: the framework's ("
               + "; ".join(f"{k}: {' '.join(f.training_command)}" for k, f in FRAMEWORKS.items()) + ")"),
    ContextKey("training_user", "ubuntu", "-", "OS user that runs the trainer"),
    ContextKey("code_git_url", None, "-", "clone the training code from this git URL instead of using the bootstrap asset"),
    ContextKey("code_git_ref", None, "-", "commit or tag to check out (required with `code_git_url`)"),
    ContextKey("code_git_token_secret", None, "-", "a private `code_git_url` (https): the Secrets Manager secret (name or full ARN) holding the token (or JSON {\"username\", \"password\"}); the node role may read only that secret and the agent hands it to git through a credential helper in the environment, never on disk, in argv or in logs (docs/infra.md, \"Your own script\")"),
    ContextKey("code_dir", None, "-", "a local directory with your training code (relative: to the CDK app's directory), shipped as a CDK asset and unpacked on every node; `training_command` runs in it; not with `code_git_url`"),
    ContextKey("code_exclude", None, "list", "with `code_dir`: .gitignore-style patterns left out of the asset; default: .git, .venv, venv, __pycache__, *.pyc, node_modules, cdk.out"),
    ContextKey("dataset_uri", None, "-", "s3://bucket/prefix/ (or s3://bucket/key) whose objects the agent copies into datasets/ on the data volume before the trainer starts, once, verified (docs/infra.md, \"Your data\"); the nodes may read only that prefix; default: the examples' digits, a CDK asset of the stack; none: no dataset step"),
    ContextKey("mount_point", DEFAULT_MOUNT_POINT, "-", "where the data volume is mounted; datasets/, checkpoints/, logs/ live under it"),
    ContextKey("keep_snapshots", contract.default("keep_snapshots"), "snapshots",
               f"migration snapshots the agent keeps, {_range('keep_snapshots')} (and as many periodic ones)"),
    ContextKey("snapshot_interval_minutes", 60, "minutes", "periodic snapshots of the data volume while training, so a move across AZs copies only what changed since; 0: none; else 1..1440"),
    ContextKey("volume_initialization_rate_mibps", contract.default("initialization_rate_mibps"), "MiB/s", "EBS Provisioned Rate for Volume Initialization of a volume moved to another AZ "
               f"({_range('initialization_rate_mibps')}; billed); none: EBS's default (lazy) rate"),
    ContextKey("pin_to_volume_az", False, "bool", "launch the fleet only in the data volume's Availability Zone (no moves; fewer spot pools)"),
    ContextKey("cancel_fleet_on_success", True, "bool", "the agent cancels the fleet when training completes"),
    ContextKey("efs", False, "bool", f"add an encrypted EFS file system (with access point) mounted at {EFS_MOUNT_POINT}"),
    ContextKey("retain_data", False, "bool", "keep the data volume and snapshots on `cdk destroy`"),
    ContextKey("fis_drill", False, "bool", "add an AWS FIS experiment template (and its role) that sends a spot interruption notice to the stack's running instance, for `spot-train drill --aws`"),
    ContextKey("notice_poll_interval_s", None, "s", "how often the agents (single and cluster nodes) poll instance metadata for an interruption notice, "
               f"{_range('notice_poll_interval_s')}; default: the agent's ({contract.default('notice_poll_interval_s'):g} s, as AWS recommends; local mode: 1 s for its tiny models)"),
    ContextKey("checkpoint_every_steps", None, "steps", f"the trainer checkpoints every this many steps, {_range('checkpoint_every_steps')} "
               f"(`SPOT_TRAINING_CHECKPOINT_EVERY_STEPS`); default: the trainer's ({contract.default('checkpoint_every_steps')})"),
    ContextKey("checkpoint_every_seconds", None, "s", f"the trainer also checkpoints every this many seconds, {_range('checkpoint_every_seconds')} "
               "(`SPOT_TRAINING_CHECKPOINT_EVERY_SECONDS`); default: none (no time-based checkpoints)"),
    ContextKey("imds_endpoint", None, "URL", "instance metadata endpoint for the agent; default: http://169.254.169.254 (local mode sets its emulator)"),
    ContextKey("monitoring", True, "bool", "the agents publish logs and metrics to CloudWatch; the stack adds the log group, dashboard and alarms"),
    ContextKey("log_retention_days", 30, "days", "retention of the nodes' CloudWatch Logs group `/spot-training/<stack>`: one of " + ", ".join(map(str, LOG_RETENTION_DAYS))),
    ContextKey("monitoring_interval_s", None, "seconds", f"how often the agents publish, {_range('monitoring_interval_s')}; "
               f"default: the agent's ({contract.default('monitoring_interval_s'):g} s)"),
    ContextKey("alarm_no_progress_minutes", 30, "minutes", "no training step for this long, once the trainer has logged one to training_log.csv on that node's boot, raises the hang alarm, 1..1440"),
    ContextKey("alarm_no_capacity_minutes", 60, "minutes", "the fleet below its target capacity this long raises the capacity alarm, 5..1440 (5-minute steps)"),
    ContextKey("notification_email", None, "-", "e-mail address told (SNS, encrypted topic) when training completes, fails, hangs or waits for capacity; default: no topic"),
)
_KEY_NAMES = tuple(k.name for k in CONTEXT_KEYS)
#: Context keys whose default and limits are the contract's (contract.SETTINGS): key -> setting.
CONTRACT_SETTINGS: dict[str, str] = {
    "keep_snapshots": "keep_snapshots",
    "volume_initialization_rate_mibps": "initialization_rate_mibps",
    "notice_poll_interval_s": "notice_poll_interval_s",
    "checkpoint_every_steps": "checkpoint_every_steps",
    "checkpoint_every_seconds": "checkpoint_every_seconds",
    "monitoring_interval_s": "monitoring_interval_s",
}


#: A Secrets Manager secret name, or its complete ARN (name plus the 6-character suffix AWS adds).
_SECRET_RE = re.compile(r"^([A-Za-z0-9/_+=.@-]{1,512}|arn:aws[a-z-]*:secretsmanager:[a-z0-9-]+:\d{12}:secret:[A-Za-z0-9/_+=.@-]+-[A-Za-z0-9]{6})$")

#: Shortens the value quoted in an error: a 5000-digit string or a list nested 10000 deep is named
#: by its start (reprlib bounds depth and length, so repr() cannot recurse without end).
_VALUE_REPR = reprlib.Repr()
_VALUE_REPR.maxstring = 120
_VALUE_REPR.maxother = 120
_VALUE_REPR.maxlevel = 4
_VALUE_REPR.maxlist = _VALUE_REPR.maxtuple = _VALUE_REPR.maxdict = 12
#: The longest integer a context key may spell (well beyond every limit, far below Python's
#: int-from-string limit of 4300 digits, whose own error would not name the key).
_MAX_INT_DIGITS = 18
#: Longer than any EC2 instance type name (the longest are like ``u7in-32tb.224xlarge``).
_MAX_INSTANCE_TYPE_CHARS = 40


def context_value_error(key: str, value: Any, allowed: str) -> ValueError:
    """The error for a bad context value: names the key, the value (shortened) and what is ``allowed``.

    Args:
        key: the context key.
        value: the bad value.
        allowed: what would be accepted, in words.

    Returns:
        the error (the caller raises it).
    """
    return ValueError(f"context key {key!r}: got {_VALUE_REPR.repr(value)}; allowed: {allowed}")


def prop_int(prop: str, value: object, lo: int, hi: int, unit: str | None = None) -> int:
    """The one range check of a construct's integer prop (a bad prop fails synth).

    Args:
        prop: the prop's name, for the message.
        value: the value; ``bool`` is refused although it is an ``int`` subclass.
        lo, hi: the allowed range, both included.
        unit: what the number counts (``instances``, ``GiB``), shown in the message; default none.

    Returns:
        ``value``.

    Raises:
        ValueError: ``<prop> must be an integer from <lo> to <hi> (<unit>), got <value>``.
    """
    if isinstance(value, bool) or not isinstance(value, int) or not lo <= value <= hi:
        raise ValueError(f"{prop} must be an integer from {lo} to {hi}{f' ({unit})' if unit else ''}, got {value!r}")
    return value


def stack_name_setting(key: str, value: Any, default: str) -> str:
    """The one check of a stack name setting, so that every stack accepts the same names.

    Args:
        key: the context key, for the error (``stack_name``, ``cluster_stack_name``, ``sweep_stack_name``).
        value: the key's value; None for ``default``.
        default: the stack's default name.

    Returns:
        The name.

    Raises:
        ValueError: not a CloudFormation stack name (a letter, then up to 127 letters, digits or hyphens).
    """
    name = default if value is None else value
    if not isinstance(name, str) or not _STACK_NAME_RE.match(name):
        raise context_value_error(key, name, "a CloudFormation stack name: a letter, then up to 127 letters, digits or hyphens")
    return name


def split_uri(uri: str) -> tuple[str, str]:
    """``(bucket, key or prefix)`` of a ``dataset_uri``.

    Raises:
        ValueError: naming the context key, the value and the expected form.
    """
    try:
        return contract.split_dataset_uri(uri)
    except ValueError:
        raise context_value_error("dataset_uri", uri, f"{contract.DATASET_URI_FORMS} or none") from None


def check_context_keys(context: Mapping[str, Any], known: Iterable[str]) -> None:
    """Refuse a context key that looks like a setting (snake_case) but is none of ``known``.

    ``cdk synth -c max_workrs=3`` would otherwise be ignored silently. Keys CDK itself uses
    (feature flags ``@aws-cdk/...``, ``aws:cdk:...``, lookup results ``key:account=...``, and
    hyphenated or camelCase ones such as ``acknowledged-issue-numbers``) are not settings and pass.

    Args:
        context: every context key and value (``app.node.get_all_context()``, or cdk.json plus ``-c``).
        known: the settings' context keys (``StackSettings.context_keys + ClusterSettings.context_keys``).

    Raises:
        ValueError: naming each unknown key and the nearest known one (difflib), if any.
    """
    names = tuple(dict.fromkeys(known))
    problems = []
    for key in sorted(k for k in context if isinstance(k, str) and re.fullmatch(r"[a-z][a-z0-9_]*", k)):
        if key in names:
            continue
        near = difflib.get_close_matches(key, names, n=1, cutoff=0.6)
        if not near:  # a fragment of a longer key (max_workrs -> cluster_max_workers)
            near = difflib.get_close_matches(key, [n.split("_", 1)[-1] for n in names], n=1, cutoff=0.6)
            near = [n for n in names if n.split("_", 1)[-1] == near[0]][:1] if near else []
        problems.append(f"{key!r}" + (f" (did you mean {near[0]!r}?)" if near else ""))
    if problems:
        raise ValueError(f"unknown context key(s): {', '.join(problems)}; the settings are listed in docs/infra.md")


def context_command(key: str, value: Any) -> tuple[str, ...]:
    """A command line from context key ``key``: a list of strings (cdk.json, or a JSON list with
    ``-c``), or a shell-style string split with :func:`shlex.split` (``-c "training_command={python}
    my_train.py --epochs 3"`` is four arguments).

    Args:
        key: the context key.
        value: a list of strings, a JSON list as text, or a shell-style string.

    Returns:
        the command's arguments.

    Raises:
        ValueError: naming the key, the value and what is allowed.
    """
    allowed = 'a non-empty list of strings (the command line), or a shell-style string such as "{python} train.py --epochs 3"'
    if isinstance(value, (list, tuple)):
        value = list(value)
    elif isinstance(value, str) and value.strip().startswith("["):
        return tuple(context_list(key, value))
    elif isinstance(value, str):
        try:
            value = shlex.split(value)
        except ValueError as exc:  # "No closing quotation"
            raise context_value_error(key, value, f"{allowed} ({exc})") from None
    if not isinstance(value, list) or not value or not all(isinstance(v, str) and v for v in value):
        raise context_value_error(key, value, allowed)
    return tuple(value)


def context_int(key: str, value: Any, lo: int, hi: int | None, unit: str) -> int:
    """An integer ``lo``..``hi`` from JSON or a ``-c`` string.

    Args:
        key: the context key.
        value: an int, or its decimal text (at most 18 digits).
        lo: the smallest allowed value.
        hi: the largest allowed value (None: no upper bound).
        unit: names the unit in the message (``"(days)"``, ``"seconds"``...).

    Returns:
        the integer.

    Raises:
        ValueError: (:func:`context_value_error`) not an integer, a bool, or out of range.
    """
    allowed = f"an integer {unit} from {lo} to {hi}" if hi is not None else f"an integer {unit} >= {lo}"
    if isinstance(value, bool):
        raise context_value_error(key, value, allowed)
    if isinstance(value, str) and re.fullmatch(rf"[+-]?[0-9]{{1,{_MAX_INT_DIGITS}}}", value.strip()):
        number = int(value.strip())
    elif isinstance(value, int) and abs(value) < 10 ** _MAX_INT_DIGITS:
        number = value
    else:
        raise context_value_error(key, value, allowed)
    if number < lo or (hi is not None and number > hi):
        raise context_value_error(key, value, allowed)
    return number


def _as_bool(key: str, value: Any) -> bool:
    if isinstance(value, bool):
        return value
    if isinstance(value, str) and value.strip().lower() in ("true", "false"):
        return value.strip().lower() == "true"
    raise context_value_error(key, value, "true or false")


def context_list(key: str, value: Any) -> list[str]:
    """A list from JSON (cdk.json) or from a ``-c`` string: a JSON list or comma-separated items.

    Args:
        key: the context key.
        value: a list of strings, a JSON list as text, or ``"a,b,c"``.

    Returns:
        the non-empty list of non-empty strings.

    Raises:
        ValueError: (:func:`context_value_error`) anything else.
    """
    allowed = 'a non-empty list of strings (in cdk.json a JSON list; with -c a JSON list or "a,b,c")'
    if isinstance(value, str):
        text = value.strip()
        if text.startswith("["):
            try:
                value = json.loads(text)
            except (json.JSONDecodeError, RecursionError):  # RecursionError: nested thousands deep
                raise context_value_error(key, value, allowed) from None
        else:
            value = [item.strip() for item in text.split(",") if item.strip()]
    if not isinstance(value, list) or not value or not all(isinstance(v, str) and v for v in value):
        raise context_value_error(key, value, allowed)
    return value


def _as_optional_str(key: str, value: Any, pattern: re.Pattern[str] | None, allowed: str) -> str | None:
    if value is None or value == "":
        return None
    if not isinstance(value, str) or (pattern is not None and not pattern.match(value)):
        raise context_value_error(key, value, allowed)
    return value


def instance_types(key: str, value: Any) -> tuple[str, ...]:
    """Context key ``key``: a non-empty list of distinct EC2 instance types (JSON list or ``a,b``).

    Args:
        key: the context key.
        value: a list of instance types, a JSON list as text, or ``"a,b"``.

    Returns:
        the instance types, in the given order.

    Raises:
        ValueError: naming the key, the value and what is allowed.
    """
    if value in ([], ""):
        raise context_value_error(key, value, "a non-empty list of EC2 instance types such as g5.xlarge")
    types = context_list(key, value)
    for t in types:
        if len(t) > _MAX_INSTANCE_TYPE_CHARS:  # quoted in full by validate_instance_type's message
            raise context_value_error(key, value, "EC2 instance types such as g5.xlarge (FAMILY.SIZE)")
        validate_instance_type(t, prop=f"context key {key!r}")
    if len(set(types)) != len(types):
        raise context_value_error(key, value, "distinct instance types")
    return tuple(types)


_REQUIREMENT_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]*(\[[A-Za-z0-9,._-]+\])?\s*([<>=!~]=?[^\s',;]+(,\s*[<>=!~]=?[^\s',;]+)*)?$")


def training_requirements(value: Any, *, framework: str, python_given: bool, key: str = "training_requirements") -> tuple[str, ...]:
    """The pip requirements to install at boot (context key ``key``).

    ``None``: the framework's :data:`FRAMEWORK_REQUIREMENTS` when the interpreter is the default one
    (``python_given`` false), else none. ``[]``, ``"[]"`` or ``"none"``: none. Otherwise a list (or
    ``-c`` string) of requirement specifiers such as ``tensorflow[and-cuda]>=2.17,<2.18``.

    Args:
        value: the context value (None: not set).
        framework: the training framework (picks the default requirements).
        python_given: a training interpreter was set (then no default requirements).
        key: the context key named in messages (default ``training_requirements``).

    Returns:
        the requirement specifiers (may be empty).

    Raises:
        ValueError: naming ``key``, the value and the allowed form.
    """
    if value is None:
        return () if python_given else FRAMEWORK_REQUIREMENTS[framework]
    if value in ([], "[]", "none", ""):
        return ()
    allowed = "a list of pip requirement specifiers such as tensorflow[and-cuda]>=2.17,<2.18, or [] for none"
    if isinstance(value, str) and not value.strip().startswith("["):
        items = [value.strip()]  # one specifier may hold commas (>=2.17,<2.18)
    else:
        items = context_list(key, value)
    if not all(_REQUIREMENT_RE.match(item.strip()) for item in items):
        raise context_value_error(key, value, allowed)
    return tuple(item.strip() for item in items)


def monitoring_settings(v: Mapping[str, Any]) -> dict[str, Any]:
    """Validated ``log_retention_days``, ``monitoring_interval_s``, ``alarm_no_progress_minutes``,
    ``alarm_no_capacity_minutes`` and ``notification_email`` of ``v`` (keys whose value is None are
    left out, so the dataclass default applies). Both stacks read them.

    Raises:
        ValueError: naming the key, the value and what is allowed.
    """
    out: dict[str, Any] = {}
    if v.get("log_retention_days") is not None:
        days = context_int("log_retention_days", v["log_retention_days"], 1, 3653, "(days)")
        if days not in LOG_RETENTION_DAYS:
            raise context_value_error("log_retention_days", v["log_retention_days"], "one of " + ", ".join(map(str, LOG_RETENTION_DAYS)))
        out["log_retention_days"] = days
    if v.get("monitoring_interval_s") is not None:
        out["monitoring_interval_s"] = contract_setting("monitoring_interval_s", v["monitoring_interval_s"])
    if v.get("alarm_no_progress_minutes") is not None:
        out["alarm_no_progress_minutes"] = context_int("alarm_no_progress_minutes", v["alarm_no_progress_minutes"], 1, 1440, "(minutes)")
    if v.get("alarm_no_capacity_minutes") is not None:
        out["alarm_no_capacity_minutes"] = context_int("alarm_no_capacity_minutes", v["alarm_no_capacity_minutes"], 5, 1440, "(minutes)")
    out_email = _as_optional_str("notification_email", v.get("notification_email"), _EMAIL_RE, "an e-mail address such as ops@example.com")
    if out_email:
        out["notification_email"] = out_email
    return out


class ContextSettings:
    """What every settings class shares: :meth:`from_context` reads its ``context_keys`` and hands them
    to the class's own ``from_mapping`` (which validates them)."""

    #: The context keys the class reads (cdk.json "context").
    context_keys: ClassVar[tuple[str, ...]] = ()

    @classmethod
    def from_context(cls, get: Callable[[str], Any]) -> Any:
        """Read and validate the class's context keys (:attr:`context_keys`).

        Args:
            get: returns a context value or ``None`` (``app.node.try_get_context``).

        Raises:
            ValueError: a key holds a bad value; the message names the key, the value and what is allowed.
        """
        return cls.from_mapping({key: get(key) for key in cls.context_keys})  # type: ignore[attr-defined]


@dataclasses.dataclass(frozen=True)
class StackSettings(ContextSettings):
    """Validated settings of :class:`spot_training.infra.stack.SpotTrainingStack` (see :data:`CONTEXT_KEYS` for units).

    ``training_command`` and ``training_requirements`` left at ``None`` become the ``framework``'s
    (:data:`FRAMEWORKS`; requirements only for the default ``training_python``, else none), so
    ``StackSettings(framework="mxnet")`` runs the Gluon example as ``-c framework=mxnet`` does.

    Raises:
        ValueError: ``framework`` is not one of :data:`FRAMEWORKS` (naming the value and the allowed ones).
    """

    context_keys = _KEY_NAMES  # every context key (a class attribute, not a field: no annotation)

    stack_name: str = "SpotTraining"
    account: str | None = None
    region: str | None = None
    availability_zones: tuple[str, ...] | None = None
    vpc_id: str | None = None
    vpc_flow_logs: bool = True
    private_subnets: bool = False
    instance_types: tuple[str, ...] = DEFAULT_INSTANCE_TYPES
    target_capacity: int = 1
    allocation_strategy: AllocationStrategy = AllocationStrategy.PRICE_CAPACITY_OPTIMIZED
    max_price: str | None = None
    volume_size_gib: int = 100
    volume_iops: int = 3000
    volume_throughput_mibps: int = 125
    volume_kms_key_arn: str | None = None
    adopt_volume_id: str | None = None
    root_volume_size_gib: int = 150
    image_id: str | None = None
    ami_ssm_parameter: str = DEFAULT_AMI_SSM_PARAMETER
    framework: str = DEFAULT_FRAMEWORK
    training_python: str = DEFAULT_TRAINING_PYTHON
    #: None: the framework's (see the class docstring); set after construction.
    training_requirements: tuple[str, ...] = None  # type: ignore[assignment]
    training_inherit_site_packages: bool = False
    #: None: the framework's (see the class docstring); set after construction.
    training_command: tuple[str, ...] = None  # type: ignore[assignment]
    training_user: str = "ubuntu"
    code_git_url: str | None = None
    code_git_ref: str | None = None
    code_git_token_secret: str | None = None
    code_dir: str | None = None
    #: None: the default exclusions (spot_training.infra.asset.DEFAULT_CODE_EXCLUDE).
    code_exclude: tuple[str, ...] | None = None
    #: None: the default examples' digits asset; "none": no dataset step; else an s3:// URI.
    dataset_uri: str | None = None
    mount_point: str = DEFAULT_MOUNT_POINT
    keep_snapshots: int = contract.default("keep_snapshots")
    snapshot_interval_minutes: int = 60
    volume_initialization_rate_mibps: int | None = contract.default("initialization_rate_mibps")
    pin_to_volume_az: bool = False
    cancel_fleet_on_success: bool = True
    efs: bool = False
    retain_data: bool = False
    fis_drill: bool = False
    imds_endpoint: str | None = None
    monitoring: bool = True
    log_retention_days: int = 30
    monitoring_interval_s: float | None = None
    alarm_no_progress_minutes: int = 30
    alarm_no_capacity_minutes: int = 60
    notification_email: str | None = None
    notice_poll_interval_s: float | None = None
    #: None: not written to the node config; the trainer's default (the contract's) applies.
    checkpoint_every_steps: int | None = None
    checkpoint_every_seconds: float | None = None

    def __post_init__(self) -> None:
        # The typed constructor validates exactly as the context path does: every field goes back to
        # its context form and through the same checks, then takes the checked (converted) value.
        # A field left at None takes its default, as a context key that is not set does.
        raw: dict[str, Any] = {}
        for field in dataclasses.fields(self):
            value = getattr(self, field.name)
            if isinstance(value, tuple):
                value = list(value)
            elif isinstance(value, AllocationStrategy):
                value = value.value
            raw[field.name] = value
        if raw["volume_initialization_rate_mibps"] is None:
            raw["volume_initialization_rate_mibps"] = "none"  # None here means EBS's default rate
        if raw["training_python"] == DEFAULT_TRAINING_PYTHON:
            raw["training_python"] = None  # not "given": the framework's requirements apply
        checked = _check_stack_settings(raw)
        for field in dataclasses.fields(self):
            object.__setattr__(self, field.name, checked.get(field.name, field.default))
        if self.training_command is None:
            object.__setattr__(self, "training_command", FRAMEWORKS[self.framework].training_command)

    @classmethod
    def from_mapping(cls, raw: Mapping[str, Any]) -> StackSettings:
        """Like :meth:`from_context` from a plain mapping (missing or ``None`` values take the default).

        Raises:
            ValueError: an unknown key, or a bad value (the message names the key, the value and what is allowed).
        """
        unknown = sorted(set(raw) - set(_KEY_NAMES))
        if unknown:
            raise ValueError(f"unknown setting(s) {unknown}; allowed: {', '.join(_KEY_NAMES)}")
        return cls(**_check_stack_settings(raw))


    def describe_defaults(self) -> dict[str, Any]:
        """The settings as plain JSON-able values (for logs and the docs test)."""
        data = dataclasses.asdict(self)
        data["allocation_strategy"] = self.allocation_strategy.value
        return {k: list(val) if isinstance(val, tuple) else val for k, val in data.items()}


def _check_stack_settings(raw: Mapping[str, Any]) -> dict[str, Any]:
    """The checked and converted values of :class:`StackSettings`' keys in ``raw`` (context form;
    a missing or ``None`` value is left out so that the default applies).

    Raises:
        ValueError: a bad value (the message names the key, the value and what is allowed).
    """
    v = {k: raw.get(k) for k in _KEY_NAMES}
    out: dict[str, Any] = {}

    out["stack_name"] = stack_name_setting("stack_name", v["stack_name"], "SpotTraining")
    out["account"] = _as_optional_str(
        "account", v["account"], _ACCOUNT_RE, "a 12-digit AWS account id"
    )
    out["region"] = _as_optional_str(
        "region", v["region"], _REGION_RE, "an AWS region name such as us-east-1"
    )
    if v["availability_zones"] is not None:
        azs = context_list("availability_zones", v["availability_zones"])
        bad = [az for az in azs if not _AZ_RE.match(az)]
        if bad or len(set(azs)) != len(azs):
            raise context_value_error("availability_zones", v["availability_zones"], "distinct Availability Zone names such as us-east-1a")
        if out["region"] and any(not az.startswith(out["region"]) for az in azs):
            raise context_value_error("availability_zones", v["availability_zones"], f"Availability Zones of region {out['region']}")
        out["availability_zones"] = tuple(azs)
    out["vpc_id"] = _as_optional_str("vpc_id", v["vpc_id"], _VPC_ID_RE, "a VPC id such as vpc-0123456789abcdef0")
    if out["vpc_id"] and not (out["account"] and out["region"]):
        raise context_value_error("vpc_id", out["vpc_id"], "an existing VPC only together with an explicit account and region (Vpc.from_lookup needs them)")
    if v["vpc_flow_logs"] is not None:
        out["vpc_flow_logs"] = _as_bool("vpc_flow_logs", v["vpc_flow_logs"])
    if v["private_subnets"] is not None:
        out["private_subnets"] = _as_bool("private_subnets", v["private_subnets"])
        if out["private_subnets"] and out["vpc_id"]:
            raise context_value_error("private_subnets", v["private_subnets"],
                       "false with vpc_id (private subnets and their VPC endpoints are made only in a new VPC; "
                       "an existing VPC's nodes go in its public subnets)")

    if v["instance_types"] is not None:
        out["instance_types"] = instance_types("instance_types", v["instance_types"])
    if v["target_capacity"] is not None:
        out["target_capacity"] = context_int("target_capacity", v["target_capacity"], 0, MAX_TARGET_CAPACITY, "(instances)")
    if v["allocation_strategy"] is not None:
        names = [s.value for s in AllocationStrategy]
        if v["allocation_strategy"] not in names:
            raise context_value_error("allocation_strategy", v["allocation_strategy"], "one of " + ", ".join(names))
        out["allocation_strategy"] = AllocationStrategy(v["allocation_strategy"])
    if v["max_price"] is not None:
        price = str(v["max_price"]) if isinstance(v["max_price"], (int, float)) and not isinstance(v["max_price"], bool) else v["max_price"]
        if not isinstance(price, str) or not _MAX_PRICE_RE.match(price) or float(price) <= 0:
            raise context_value_error("max_price", v["max_price"], "a positive decimal price in USD per instance-hour, such as 0.75")
        out["max_price"] = price

    if v["volume_size_gib"] is not None:
        out["volume_size_gib"] = context_int("volume_size_gib", v["volume_size_gib"], 1, 16384, "(GiB)")
    if v["volume_iops"] is not None:
        out["volume_iops"] = context_int("volume_iops", v["volume_iops"], 3000, 16000, "(IOPS)")
    if v["volume_throughput_mibps"] is not None:
        out["volume_throughput_mibps"] = context_int("volume_throughput_mibps", v["volume_throughput_mibps"], 125, 1000, "(MiB/s)")
    size, iops, tput = (out.get(k, _FIELD_DEFAULTS[k]) for k in ("volume_size_gib", "volume_iops", "volume_throughput_mibps"))
    if iops > 3000 and iops > 500 * size:
        raise context_value_error("volume_iops", v["volume_iops"], f"at most 500 IOPS per GiB of volume_size_gib={size} (max {500 * size})")
    if tput > 125 and tput * 4 > iops:
        raise context_value_error("volume_throughput_mibps", v["volume_throughput_mibps"], f"at most volume_iops/4 = {iops // 4} MiB/s (gp3)")
    out["volume_kms_key_arn"] = _as_optional_str(
        "volume_kms_key_arn", v["volume_kms_key_arn"], re.compile(r"^arn:aws[a-z-]*:kms:"), "a KMS key ARN (arn:aws:kms:REGION:ACCOUNT:key/ID)"
    )
    out["adopt_volume_id"] = _as_optional_str(
        "adopt_volume_id", v["adopt_volume_id"], _VOLUME_ID_RE, "an EBS volume id such as vol-0123456789abcdef0"
    )
    if v["root_volume_size_gib"] is not None:
        out["root_volume_size_gib"] = context_int("root_volume_size_gib", v["root_volume_size_gib"], 8, 16384, "(GiB)")

    out["image_id"] = _as_optional_str("image_id", v["image_id"], _AMI_ID_RE, "an AMI id such as ami-0123456789abcdef0")
    if v["ami_ssm_parameter"] is not None:
        if not isinstance(v["ami_ssm_parameter"], str) or not v["ami_ssm_parameter"].startswith("/"):
            raise context_value_error("ami_ssm_parameter", v["ami_ssm_parameter"], "an SSM parameter name starting with /")
        out["ami_ssm_parameter"] = v["ami_ssm_parameter"]

    framework = v["framework"] if v["framework"] is not None else DEFAULT_FRAMEWORK
    if not isinstance(framework, str) or framework not in FRAMEWORKS:
        raise context_value_error("framework", framework, "one of " + ", ".join(FRAMEWORKS))
    out["framework"] = framework
    python = v["training_python"] if v["training_python"] is not None else DEFAULT_TRAINING_PYTHON
    if not isinstance(python, str) or not re.fullmatch(r"(/[A-Za-z0-9._+-]+)+", python):
        raise context_value_error("training_python", python, "an absolute path to a Python interpreter such as /usr/bin/python3")
    out["training_python"] = python
    out["training_requirements"] = training_requirements(
        v["training_requirements"], framework=framework, python_given=v["training_python"] is not None
    )
    if v["training_command"] is not None:
        out["training_command"] = context_command("training_command", v["training_command"])
    if v["training_user"] is not None:
        if not isinstance(v["training_user"], str) or not re.fullmatch(r"[a-z_][a-z0-9_-]{0,31}", v["training_user"]):
            raise context_value_error("training_user", v["training_user"], "a Linux user name such as ubuntu")
        out["training_user"] = v["training_user"]
    out["code_git_url"] = _as_optional_str(
        "code_git_url", v["code_git_url"], re.compile(r"^(https://|ssh://|git@)\S+$"), "a git URL (https://..., ssh://... or git@host:path)"
    )
    out["code_git_ref"] = _as_optional_str("code_git_ref", v["code_git_ref"], re.compile(r"^\S+$"), "a commit or tag")
    if out["code_git_url"] and not out["code_git_ref"]:
        raise context_value_error("code_git_ref", v["code_git_ref"], "a commit or tag to check out, required when code_git_url is set")
    if out["code_git_ref"] and not out["code_git_url"]:
        raise context_value_error("code_git_url", v["code_git_url"], "a git URL, required when code_git_ref is set")
    if out["code_git_url"] and re.match(r"^[a-z]+://[^/@]*:[^/@]*@", out["code_git_url"]):
        raise context_value_error("code_git_url", out["code_git_url"], "a URL without a password in it (it would "
                                  "be in the template, the node config and git's config); use code_git_token_secret")
    out["code_git_token_secret"] = _as_optional_str(
        "code_git_token_secret", v["code_git_token_secret"], _SECRET_RE,
        "a Secrets Manager secret name (letters, digits, /_+=.@-) or its full ARN (arn:aws:secretsmanager:REGION:ACCOUNT:secret:NAME-xxxxxx)")
    if out["code_git_token_secret"] and not (out["code_git_url"] or "").startswith(("https://", "http://")):
        raise context_value_error("code_git_token_secret", out["code_git_token_secret"],
                                  "set only with an https:// code_git_url (the token is an HTTPS credential)")
    out["code_dir"] = _as_optional_str("code_dir", v["code_dir"], re.compile(r"^\S(.*\S)?$"), "a directory path")
    if out["code_dir"] and out["code_git_url"]:
        raise context_value_error("code_dir", out["code_dir"], "unset when code_git_url is set (one source of training code)")
    if v["code_exclude"] is not None:
        if not out["code_dir"]:
            raise context_value_error("code_exclude", v["code_exclude"], "set only with code_dir")
        empty = v["code_exclude"] in ([], "[]")
        out["code_exclude"] = () if empty else tuple(context_list("code_exclude", v["code_exclude"]))
    if v["dataset_uri"] is not None:
        uri = v["dataset_uri"]
        none = isinstance(uri, str) and uri.strip().lower() == "none"
        if not none:
            split_uri(uri)
        out["dataset_uri"] = "none" if none else uri
    if v["mount_point"] is not None:
        mp = v["mount_point"]
        if not isinstance(mp, str) or not re.fullmatch(r"(/[A-Za-z0-9._-]+)+", mp):
            raise context_value_error("mount_point", mp, "an absolute directory path such as /dltraining")
        out["mount_point"] = mp
    if v["keep_snapshots"] is not None:
        out["keep_snapshots"] = contract_setting("keep_snapshots", v["keep_snapshots"])
    if v["snapshot_interval_minutes"] is not None:
        out["snapshot_interval_minutes"] = context_int("snapshot_interval_minutes", v["snapshot_interval_minutes"], 0, 1440, "(minutes; 0: none)")
    rate = v["volume_initialization_rate_mibps"]
    if rate is None:
        pass  # key absent: the default
    elif isinstance(rate, str) and rate.strip().lower() in ("none", "null", ""):
        out["volume_initialization_rate_mibps"] = None
    else:
        out["volume_initialization_rate_mibps"] = contract_setting("volume_initialization_rate_mibps", rate, "initialization_rate_mibps", or_none=True)
    for key in ("cancel_fleet_on_success", "efs", "retain_data", "pin_to_volume_az", "fis_drill", "monitoring",
                "training_inherit_site_packages"):
        if v[key] is not None:
            out[key] = _as_bool(key, v[key])
    for key in ("notice_poll_interval_s", "checkpoint_every_steps", "checkpoint_every_seconds"):
        if v[key] is not None:
            out[key] = contract_setting(key, v[key])
    out["imds_endpoint"] = _as_optional_str(
        "imds_endpoint", v["imds_endpoint"], re.compile(r"^https?://[^\s/]+/?$"), "an http(s)://host[:port] URL"
    )
    out.update(monitoring_settings(v))
    return out


_FIELD_DEFAULTS = {f.name: f.default for f in dataclasses.fields(StackSettings)}
