"""Settings of the ``DistributedTraining`` stack, read from CDK context (``cdk.json`` or ``-c key=value``).

The cluster stack shares the environment, network, AMI and code keys of the single-node stack
(:data:`SHARED_KEYS`, validated by :class:`spot_training.infra.config.StackSettings`, so the messages are the same)
and adds its own keys, all prefixed ``cluster_`` (:data:`CLUSTER_CONTEXT_KEYS`) so that one
``cdk.json`` configures both stacks. Every bad value fails ``cdk synth`` with a :class:`ValueError`
naming the context key, the value received and what is allowed. docs/infra.md lists the keys; a
test keeps the two in step.
"""

from __future__ import annotations

import dataclasses
import json
import re
from collections.abc import Mapping
from typing import Any

from .cluster import (
    DEFAULT_SCHEDULER_INSTANCE_TYPE,
    DEFAULT_SERVER_INSTANCE_TYPE,
    DEFAULT_TORCH_MAX_RESTARTS,
    DEFAULT_TORCH_NPROC_PER_NODE,
    DEFAULT_TORCH_SHUTDOWN_TIMEOUT_S,
    DEFAULT_TRAINING_COMMANDS,
    MAX_SERVERS,
    MAX_TORCH_SHUTDOWN_TIMEOUT_S,
    TORCH_COLLECTIVE_PORTS,
    MAX_WORKERS,
    MAX_TORCH_MAX_RESTARTS,
    MAX_TORCH_NPROC_PER_NODE,
    ClusterPorts,
    Framework,
)
from .config import (
    DEFAULT_TRAINING_PYTHON,
    FRAMEWORK_CPU_REQUIREMENTS,
    FRAMEWORK_REQUIREMENTS,
    ContextKey,
    ContextSettings,
    StackSettings,
    context_int,
    context_command,
    context_value_error,
    contract_setting,
    instance_types,
    stack_name_setting,
    training_requirements,
)
from .fleet import DEFAULT_INSTANCE_TYPES, validate_instance_type
from spot_training.contract import DEFAULT_MAX_WORKERS, DEFAULT_MIN_WORKERS, DEFAULT_SCHEDULER_PORT, DEFAULT_SERVER_PORT, DEFAULT_WORKER_PORT, SETTINGS

#: The TCP port range of every role (the contract's; the agents check the same).
_PORTS = f"{SETTINGS['port'].minimum}..{SETTINGS['port'].maximum}"

#: Keys of the single-node stack that mean the same for the cluster stack.
SHARED_KEYS: tuple[str, ...] = (
    "account", "region", "availability_zones", "vpc_id", "vpc_flow_logs", "private_subnets", "allocation_strategy", "max_price",
    "root_volume_size_gib", "image_id", "ami_ssm_parameter", "training_user", "code_git_url", "code_git_ref",
    "imds_endpoint", "retain_data", "monitoring", "log_retention_days", "monitoring_interval_s",
    "alarm_no_progress_minutes", "alarm_no_capacity_minutes", "notification_email", "notice_poll_interval_s",
    "checkpoint_every_steps", "checkpoint_every_seconds",
)

#: The cluster stack's own keys, in the order docs/infra.md lists them.
CLUSTER_CONTEXT_KEYS: tuple[ContextKey, ...] = (
    ContextKey("cluster_stack_name", "DistributedTraining", "-", "CloudFormation stack name of the cluster; also its `spot-training:stack` tag value"),
    ContextKey("cluster_framework", "mxnet", "-", "one of " + ", ".join(f.value for f in Framework)),
    ContextKey("cluster_num_servers", 2, "nodes", f"parameter-server nodes (on-demand, fixed-size Auto Scaling group), 1..{MAX_SERVERS}; ignored by pytorch (no parameter servers)"),
    ContextKey("cluster_workers", 2, "instances", "desired workers: the worker Spot Fleet's target capacity"),
    ContextKey("cluster_min_workers", DEFAULT_MIN_WORKERS, "instances", "fewest workers a generation trains with (`cluster.min_workers`)"),
    ContextKey("cluster_max_workers", DEFAULT_MAX_WORKERS, "instances", f"upper bound of `cluster_workers`, up to {MAX_WORKERS}"),
    ContextKey("cluster_scheduler_instance_type", DEFAULT_SCHEDULER_INSTANCE_TYPE, "-", "on-demand type of the coordinator/scheduler node"),
    ContextKey("cluster_server_instance_type", DEFAULT_SERVER_INSTANCE_TYPE, "-", "on-demand type of each parameter server"),
    ContextKey("cluster_worker_instance_types", list(DEFAULT_INSTANCE_TYPES), "list", "spot types the worker fleet may launch"),
    ContextKey("cluster_scheduler_port", DEFAULT_SCHEDULER_PORT, "TCP port", "ps-lite scheduler port (MXNet) / chief gRPC port (TensorFlow) / torchrun c10d rendezvous port on the coordinator (PyTorch; its collectives use "
               f"{TORCH_COLLECTIVE_PORTS[0]}-{TORCH_COLLECTIVE_PORTS[1]} between members), {_PORTS}"),
    ContextKey("cluster_server_port", DEFAULT_SERVER_PORT, "TCP port", f"ps-lite server PORT (MXNet) / ps gRPC port (TensorFlow), {_PORTS}"),
    ContextKey("cluster_worker_port", DEFAULT_WORKER_PORT, "TCP port", f"ps-lite worker PORT (MXNet) / worker gRPC port (TensorFlow), {_PORTS}"),
    ContextKey("cluster_training_command", None, "list", "trainer command (a list, or a shell-style string split with `shlex`); default per framework: "
               + "; ".join(f"{f.value}: {' '.join(c)}" for f, c in DEFAULT_TRAINING_COMMANDS.items())),
    ContextKey("cluster_torch_max_restarts", DEFAULT_TORCH_MAX_RESTARTS, "restarts", f"pytorch: torchrun `--max-restarts` (each join or leave costs one), 0..{MAX_TORCH_MAX_RESTARTS}"),
    ContextKey("cluster_torch_shutdown_timeout_s", DEFAULT_TORCH_SHUTDOWN_TIMEOUT_S, "seconds", f"pytorch: torchrun `--shutdown-timeout`, the workers' SIGTERM -> SIGKILL grace to agree on a step and checkpoint, 5..{MAX_TORCH_SHUTDOWN_TIMEOUT_S} (a spot notice gives 120)"),
    ContextKey("cluster_torch_nproc_per_node", DEFAULT_TORCH_NPROC_PER_NODE, "processes", f"pytorch: torchrun `--nproc-per-node` (GPUs per worker), 1..{MAX_TORCH_NPROC_PER_NODE}"),
    ContextKey("cluster_training_python", None, "-", f"trainer's interpreter on every node; default: {DEFAULT_TRAINING_PYTHON}, with `cluster_training_requirements` in virtual environments built once on EFS"),
    ContextKey("cluster_training_requirements", None, "list", "pip requirements of the trainer's virtual environment on every node (built once per requirement set on EFS, reused); default when "
               "`cluster_training_python` is not set: the framework's GPU build on workers ("
               + "; ".join(f"{f.value}: {', '.join(FRAMEWORK_REQUIREMENTS[f.value])}" for f in Framework) + "), its CPU build on scheduler and servers ("
               + "; ".join(f"{f.value}: {', '.join(FRAMEWORK_CPU_REQUIREMENTS[f.value])}" for f in Framework) + "); else none; `[]`: none"),
)
_CLUSTER_KEY_NAMES = tuple(k.name for k in CLUSTER_CONTEXT_KEYS)
#: Cluster context keys whose limits are the contract's (spot_training.contract.SETTINGS): key -> setting.
CLUSTER_CONTRACT_SETTINGS: dict[str, str] = {f"cluster_{role}_port": "port" for role in ("scheduler", "server", "worker")}


@dataclasses.dataclass(frozen=True)
class ClusterSettings(ContextSettings):
    """Validated settings of :class:`spot_training.infra.cluster_stack.DistributedTrainingStack`.

    ``base`` holds the shared keys (:data:`SHARED_KEYS`) as a :class:`StackSettings`; the other
    fields are the ``cluster_*`` keys (units in :data:`CLUSTER_CONTEXT_KEYS`).
    """

    context_keys = SHARED_KEYS + _CLUSTER_KEY_NAMES  # the shared and the cluster_* keys (not a field)

    base: StackSettings = StackSettings()
    stack_name: str = "DistributedTraining"
    framework: Framework = Framework.MXNET
    num_servers: int = 2
    workers: int = 2
    min_workers: int = DEFAULT_MIN_WORKERS
    max_workers: int = DEFAULT_MAX_WORKERS
    scheduler_instance_type: str = DEFAULT_SCHEDULER_INSTANCE_TYPE
    server_instance_type: str = DEFAULT_SERVER_INSTANCE_TYPE
    worker_instance_types: tuple[str, ...] = DEFAULT_INSTANCE_TYPES
    ports: ClusterPorts = ClusterPorts()
    #: None: the framework's (:data:`spot_training.infra.cluster.DEFAULT_TRAINING_COMMANDS`).
    training_command: tuple[str, ...] = None  # type: ignore[assignment]
    training_python: str = DEFAULT_TRAINING_PYTHON
    torch_max_restarts: int = DEFAULT_TORCH_MAX_RESTARTS
    torch_shutdown_timeout_s: int = DEFAULT_TORCH_SHUTDOWN_TIMEOUT_S
    torch_nproc_per_node: int = DEFAULT_TORCH_NPROC_PER_NODE
    #: None: the framework's builds per role (GPU on workers, CPU on scheduler and servers).
    training_requirements: tuple[str, ...] | None = None

    @classmethod
    def from_mapping(cls, raw: Mapping[str, Any]) -> ClusterSettings:
        """Like :meth:`from_context` from a plain mapping (missing or ``None`` values take the default).

        Raises:
            ValueError: an unknown key, or a bad value (naming the key, the value and what is allowed).
        """
        unknown = sorted(set(raw) - set(SHARED_KEYS) - set(_CLUSTER_KEY_NAMES))
        if unknown:
            raise ValueError(f"unknown cluster setting(s) {unknown}; allowed: {', '.join(SHARED_KEYS + _CLUSTER_KEY_NAMES)}")
        base = StackSettings.from_mapping({k: raw.get(k) for k in SHARED_KEYS})
        return cls(base=base, **_check_cluster_settings(raw))

    def __post_init__(self) -> None:
        # The typed constructor validates exactly as the context path does (as StackSettings does):
        # every field goes back to its cluster_* context form and through the same checks.
        if not isinstance(self.base, StackSettings):
            raise ValueError(f"base must be a StackSettings (the shared keys), got {type(self.base).__name__}")
        if not isinstance(self.ports, ClusterPorts):
            raise ValueError(f"ports must be a ClusterPorts, got {type(self.ports).__name__}")
        raw: dict[str, Any] = {}
        for field in dataclasses.fields(self):
            value = getattr(self, field.name)
            if field.name in ("base", "ports"):
                continue
            if isinstance(value, tuple):
                value = list(value)
            elif isinstance(value, Framework):
                value = value.value
            raw[_FIELD_KEYS[field.name]] = value
        for role in ("scheduler", "server", "worker"):
            raw[f"cluster_{role}_port"] = getattr(self.ports, role)
        if raw["cluster_training_python"] == DEFAULT_TRAINING_PYTHON and self.training_requirements is None:
            raw["cluster_training_python"] = None  # not "given": the framework's builds per role apply
        checked = _check_cluster_settings(raw)
        for field in dataclasses.fields(self):
            if field.name != "base":
                object.__setattr__(self, field.name, checked.get(field.name, field.default))


    def describe(self) -> dict[str, Any]:
        """The ``cluster_*`` settings as plain JSON-able values."""
        return json.loads(json.dumps({
            "stack_name": self.stack_name, "framework": self.framework.value, "num_servers": self.num_servers,
            "workers": self.workers, "min_workers": self.min_workers, "max_workers": self.max_workers,
            "ports": dataclasses.asdict(self.ports), "training_command": list(self.training_command),
            "torch_max_restarts": self.torch_max_restarts, "torch_shutdown_timeout_s": self.torch_shutdown_timeout_s,
            "torch_nproc_per_node": self.torch_nproc_per_node,
        }))


#: Field of :class:`ClusterSettings` -> its context key.
_FIELD_KEYS = {f.name: "cluster_" + f.name for f in dataclasses.fields(ClusterSettings)}


def _check_cluster_settings(raw: Mapping[str, Any]) -> dict[str, Any]:
    """The checked and converted ``cluster_*`` values of ``raw`` as :class:`ClusterSettings` fields
    (context form; a missing or ``None`` value takes the default).

    Raises:
        ValueError: a bad value (naming the key, the value and what is allowed).
    """
    v = {k: raw.get(k) for k in _CLUSTER_KEY_NAMES}
    out: dict[str, Any] = {}

    out["stack_name"] = stack_name_setting("cluster_stack_name", v["cluster_stack_name"], "DistributedTraining")

    framework = v["cluster_framework"] if v["cluster_framework"] is not None else Framework.MXNET.value
    if not isinstance(framework, str) or framework not in [f.value for f in Framework]:
        raise context_value_error("cluster_framework", framework, "one of " + ", ".join(f.value for f in Framework))
    out["framework"] = Framework(framework)

    for key, field, lo, hi, unit in (
        ("cluster_num_servers", "num_servers", 1, MAX_SERVERS, "(nodes)"),
        ("cluster_workers", "workers", 1, MAX_WORKERS, "(instances)"),
        ("cluster_min_workers", "min_workers", 1, MAX_WORKERS, "(instances)"),
        ("cluster_max_workers", "max_workers", 1, MAX_WORKERS, "(instances)"),
        ("cluster_torch_max_restarts", "torch_max_restarts", 0, MAX_TORCH_MAX_RESTARTS, "(restarts)"),
        ("cluster_torch_shutdown_timeout_s", "torch_shutdown_timeout_s", 5, MAX_TORCH_SHUTDOWN_TIMEOUT_S, "(seconds)"),
        ("cluster_torch_nproc_per_node", "torch_nproc_per_node", 1, MAX_TORCH_NPROC_PER_NODE, "(processes)"),
    ):
        if v[key] is not None:
            out[field] = context_int(key, v[key], lo, hi, unit)
    lo_w, want, hi_w = (out.get(f, _CLUSTER_DEFAULTS[f]) for f in ("min_workers", "workers", "max_workers"))
    if lo_w > hi_w:
        raise context_value_error("cluster_min_workers", v["cluster_min_workers"], f"at most cluster_max_workers={hi_w}")
    if not lo_w <= want <= hi_w:
        raise context_value_error("cluster_workers", want, f"from cluster_min_workers={lo_w} to cluster_max_workers={hi_w}")

    for key, field in (("cluster_scheduler_instance_type", "scheduler_instance_type"),
                       ("cluster_server_instance_type", "server_instance_type")):
        if v[key] is not None:
            if not isinstance(v[key], str) or len(v[key]) > 40:
                raise context_value_error(key, v[key], "an EC2 instance type such as m5.large")
            out[field] = validate_instance_type(v[key], prop=f"context key {key!r}")
    if v["cluster_worker_instance_types"] is not None:
        out["worker_instance_types"] = instance_types("cluster_worker_instance_types", v["cluster_worker_instance_types"])

    ports = {}
    for role in ("scheduler", "server", "worker"):
        key = f"cluster_{role}_port"
        ports[role] = contract_setting(key, v[key], "port") if v[key] is not None else getattr(ClusterPorts(), role)
    if len(set(ports.values())) != 3:
        clash = next(r for r in ("worker", "server", "scheduler") if list(ports.values()).count(ports[r]) > 1)
        raise context_value_error(f"cluster_{clash}_port", ports[clash], "a port different from the other two roles' ports "
                   f"(scheduler={ports['scheduler']}, server={ports['server']}, worker={ports['worker']})")
    out["ports"] = ClusterPorts(**ports)

    if v["cluster_training_command"] is not None:
        out["training_command"] = context_command("cluster_training_command", v["cluster_training_command"])
    else:
        out["training_command"] = DEFAULT_TRAINING_COMMANDS[out["framework"]]
    python = v["cluster_training_python"]
    if python is not None:
        if not isinstance(python, str) or not re.fullmatch(r"(/[A-Za-z0-9._+-]+)+", python):
            raise context_value_error("cluster_training_python", python, "an absolute path to a Python interpreter such as /usr/bin/python3")
        out["training_python"] = python
    if v["cluster_training_requirements"] is not None or python is not None:
        out["training_requirements"] = training_requirements(
            v["cluster_training_requirements"], framework=framework, python_given=True,
            key="cluster_training_requirements",
        )
    return out


_CLUSTER_DEFAULTS = {f.name: f.default for f in dataclasses.fields(ClusterSettings)}
