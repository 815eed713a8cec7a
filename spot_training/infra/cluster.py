"""``ParameterServerCluster``: a parameter-server training cluster with elastic spot workers.

One coordinator/scheduler node and ``num_servers`` parameter-server nodes run on on-demand capacity,
each role in a fixed-size Auto Scaling group (min = max), so a lost node is replaced; the workers run
on a :class:`~spot_training.infra.fleet.SpotTrainingFleet`. Every node runs the same bootstrap agent with a node
config whose ``node_role`` is ``scheduler``, ``server`` or ``worker`` and whose ``cluster`` section
(docs/contracts.md, "Parameter-server cluster") tells it where the membership state lives on EFS,
how many servers a generation has, the fewest workers to train with, and each role's fixed port.
The agents do the rest (spot_training/agent/cluster.py, docs/cluster.md): registrations and the plan on EFS,
generations when workers join or leave, MXNet ``DMLC_*`` / TensorFlow ``TF_CONFIG``.

Networking: one security group for every member. Members reach each other only on the framework
ports (ps-lite's scheduler port and ``PORT`` for MXNet, the gRPC ports of chief, ps and workers for
TensorFlow: the same three fixed ports), nothing reaches them from outside, and NFS to the EFS
mount targets is open only to that group.
"""

from __future__ import annotations

import dataclasses
import enum
from collections.abc import Mapping, Sequence
from typing import Any

import aws_cdk as cdk
import constructs
from aws_cdk import aws_autoscaling as autoscaling
from aws_cdk import aws_ec2 as ec2

from . import acknowledgements
from .asset import BootstrapAsset
from .config import DEFAULT_TRAINING_PYTHON, FRAMEWORK_CPU_REQUIREMENTS, FRAMEWORK_REQUIREMENTS, FRAMEWORKS, prop_int
from .config import training_requirements as checked_requirements
from .filesystem import SharedFileSystem
from .fleet import (DEFAULT_INSTANCE_TYPES, AllocationStrategy, SpotTrainingFleet, node_launch_template, root_volume_gib,
                    validate_instance_type)
from .roles import TrainingNodeRole
from .tags import CLUSTER_MEMBER_TAG_KEY, CLUSTER_MEMBER_TAG_VALUE, PURPOSE_DATA_VOLUME, PURPOSE_TAG_KEY, STACK_TAG_KEY
from .userdata import node_config
# Where cluster nodes mount the shared file system (datasets/, checkpoints/, logs/ and cluster/ live
# there), the roles' default ports, cluster sizes and torchrun defaults: the contract's.
from spot_training.contract import (CLUSTER_AGENT_STOP_TIMEOUT_S, DEFAULT_MAX_WORKERS, DEFAULT_MIN_WORKERS, DEFAULT_SCHEDULER_PORT, DEFAULT_SERVER_PORT,
                           DEFAULT_TORCH_MAX_RESTARTS, DEFAULT_TORCH_NPROC_PER_NODE, DEFAULT_TORCH_SHUTDOWN_TIMEOUT_S,
                           DEFAULT_WORKER_PORT, EFS_MOUNT_POINT, MAX_SERVERS, MAX_TORCH_MAX_RESTARTS,
                           MAX_TORCH_NPROC_PER_NODE, MAX_TORCH_SHUTDOWN_TIMEOUT_S, MAX_WORKERS, SETTINGS, SettingError,
                           check)

#: The membership state directory on EFS (``cluster.state_dir``).
STATE_DIR = f"{EFS_MOUNT_POINT}/cluster"
#: systemd's ``TimeoutStopSec`` for cluster agents (the contract derives it from the phase bounds).
AGENT_STOP_TIMEOUT_S = CLUSTER_AGENT_STOP_TIMEOUT_S
DEFAULT_SCHEDULER_INSTANCE_TYPE = "m5.large"
DEFAULT_SERVER_INSTANCE_TYPE = "m5.xlarge"


def _checked(name: str, value: Any) -> Any:
    """``value`` checked by the contract's validator (None passes: the agent's or trainer's default).

    Raises:
        ValueError: naming the prop, the value and the allowed range.
    """
    return None if value is None else check(name, value)


class Framework(enum.Enum):
    """The parameter-server engine the cluster runs."""

    #: MXNet ``dist_sync`` kvstore over ps-lite (scheduler, servers, workers).
    MXNET = "mxnet"
    #: TensorFlow ``ParameterServerStrategy`` (chief on the scheduler node, ps, workers).
    TENSORFLOW = "tensorflow"
    #: PyTorch DDP on TorchElastic: ``torchrun`` on every spot worker, the c10d rendezvous store on
    #: the on-demand coordinator node, no parameter servers (all-reduce: gloo on CPU, NCCL on GPU).
    PYTORCH = "pytorch"


#: Ports gloo and NCCL listen on between PyTorch workers: neither can be given a fixed port or range
#: (each pair connects on ports the kernel picks), so the members' group opens the Linux default
#: ephemeral range (``net.ipv4.ip_local_port_range``) between members only.
TORCH_COLLECTIVE_PORTS = (32768, 60999)


#: The trainer each framework runs (on MXNet workers, on the TensorFlow chief); ``{python}`` is
#: replaced by the training interpreter on the node. From the per-framework table, spot_training.infra.config.FRAMEWORKS.
DEFAULT_TRAINING_COMMANDS: dict[Framework, tuple[str, ...]] = {
    f: FRAMEWORKS[f.value].cluster_training_command for f in Framework  # type: ignore[misc]
}


@dataclasses.dataclass(frozen=True)
class ClusterPorts:
    """The fixed TCP port of each role (``cluster.scheduler_port`` / ``server_port`` / ``worker_port``).

    MXNet: ``scheduler`` is ps-lite's ``DMLC_PS_ROOT_PORT``; ``server`` and ``worker`` are the ``PORT``
    each server and worker binds. TensorFlow: the gRPC ports of the chief, the ps tasks and the worker
    tasks. Defaults 9000, 9001, 9002 (the agents' defaults). Each must be 1024..65535 (the trainer
    runs as an unprivileged user) and the three must differ.
    """

    scheduler: int = DEFAULT_SCHEDULER_PORT
    server: int = DEFAULT_SERVER_PORT
    worker: int = DEFAULT_WORKER_PORT

    def validate(self) -> ClusterPorts:
        """Check every port.

        Returns:
            self.

        Raises:
            ValueError: naming the bad port, its value and the allowed range.
        """
        for name in ("scheduler", "server", "worker"):
            value = getattr(self, name)
            if isinstance(value, str):
                raise SettingError(f"ports.{name}", value, SETTINGS["port"].allowed())
            check("port", value, label=f"ports.{name}")  # the contract's range, the agents' too
        if len({self.scheduler, self.server, self.worker}) != 3:
            raise ValueError(f"ports must be three different TCP ports, got scheduler={self.scheduler}, "
                             f"server={self.server}, worker={self.worker}")
        return self

    def ranges(self) -> list[tuple[int, int]]:
        """The ports as the fewest contiguous ``(from, to)`` ranges (9000-9002 -> one range)."""
        out: list[tuple[int, int]] = []
        for port in sorted((self.scheduler, self.server, self.worker)):
            if out and port == out[-1][1] + 1:
                out[-1] = (out[-1][0], port)
            else:
                out.append((port, port))
        return out


def _training_command(framework: Framework, training_command: Sequence[str] | None) -> tuple[str, ...]:
    """The trainer argv: ``training_command`` checked, or the framework's default (ValueError naming it)."""
    command = tuple(training_command) if training_command is not None else DEFAULT_TRAINING_COMMANDS[framework]
    if isinstance(training_command, str) or not command or not all(isinstance(p, str) and p for p in command):
        raise ValueError(f"training_command must be a non-empty list of strings such as {list(DEFAULT_TRAINING_COMMANDS[framework])}, got {training_command!r}")
    return command


def _requirements(framework: Framework, roles: Sequence[str], training_requirements: Sequence[str] | None,
                  training_python: str | None) -> dict[str, Any]:
    """Role -> pip requirements: the framework's GPU build on workers and CPU build elsewhere when neither
    is given, else the given ones (checked) on every role."""
    if training_requirements is None and training_python is None:
        return {role: FRAMEWORK_REQUIREMENTS[framework.value] if role == "worker"
                else FRAMEWORK_CPU_REQUIREMENTS[framework.value] for role in roles}
    given = checked_requirements(list(training_requirements) if training_requirements is not None else None,
                                 framework=framework.value, python_given=True, key="training_requirements")
    return dict.fromkeys(roles, given)


class ParameterServerCluster(constructs.Construct):
    """A parameter-server cluster: on-demand scheduler and servers, spot workers, EFS, one security group.

    Resources: a :class:`SharedFileSystem` (unless ``file_system`` is given) for the dataset,
    checkpoints and cluster state; a :class:`TrainingNodeRole` without data-volume permissions (the
    cluster keeps its data on EFS) that may mount and write the file system; the
    :class:`BootstrapAsset` (unless given); a second :class:`TrainingNodeRole` for the workers, which
    may also lower their fleet's target and terminate themselves when asked to leave; one security group; a launch template and a fixed-size
    Auto Scaling group for the scheduler (1 node) and for the servers (``num_servers`` nodes); a
    :class:`SpotTrainingFleet` for the workers (target ``desired_workers``) whose instances carry the
    member tag ``spot-training:cluster-member=true`` and expose their tags in instance metadata.
    All launch templates require IMDSv2 (hop limit 2), encrypt the gp3 root volume and have no key pair.

    Attributes:
        framework, ports, num_servers, desired_workers, min_workers, max_workers: the validated props.
        security_group / connections: the members' group (``connections.allow_internally`` on the ports).
        file_system: the :class:`SharedFileSystem`.
        node_role: the scheduler's and servers' :class:`TrainingNodeRole`.
        worker_role: the workers' :class:`TrainingNodeRole` (with :meth:`TrainingNodeRole.allow_leaving_fleet`).
        bootstrap_asset: the :class:`BootstrapAsset`.
        scheduler_group / server_group: the ``autoscaling.AutoScalingGroup`` of each on-demand role.
        scheduler_launch_template / server_launch_template: their ``ec2.LaunchTemplate``.
        worker_fleet: the :class:`SpotTrainingFleet` of the workers.
        node_configs: role -> node config dict (docs/contracts.md; may hold tokens).
    """

    def __init__(
        self,
        scope: constructs.Construct,
        construct_id: str,
        *,
        vpc: ec2.IVpc,
        machine_image: ec2.IMachineImage,
        framework: Framework = Framework.MXNET,
        num_servers: int = 2,
        desired_workers: int = 2,
        min_workers: int = DEFAULT_MIN_WORKERS,
        max_workers: int = DEFAULT_MAX_WORKERS,
        scheduler_instance_type: str = DEFAULT_SCHEDULER_INSTANCE_TYPE,
        server_instance_type: str = DEFAULT_SERVER_INSTANCE_TYPE,
        worker_instance_types: Sequence[str] = DEFAULT_INSTANCE_TYPES,
        ports: ClusterPorts | None = None,
        training_command: Sequence[str] | None = None,
        training_python: str | None = None,
        training_requirements: Sequence[str] | None = None,
        training_user: str = "ubuntu",
        training_inherit_site_packages: bool = False,
        code: Mapping[str, str] | None = None,
        allocation_strategy: AllocationStrategy = AllocationStrategy.PRICE_CAPACITY_OPTIMIZED,
        max_price: str | None = None,
        root_volume_size_gib: int = 150,
        vpc_subnets: ec2.SubnetSelection | None = None,
        file_system: SharedFileSystem | None = None,
        bootstrap_asset: BootstrapAsset | None = None,
        imds_endpoint: str | None = None,
        stack_tag_value: str | None = None,
        file_system_removal_policy: cdk.RemovalPolicy = cdk.RemovalPolicy.RETAIN,
        monitoring: Mapping[str, Any] | None = None,
        notice_poll_interval_s: float | None = None,
        checkpoint_every_steps: int | None = None,
        checkpoint_every_seconds: float | None = None,
        torch_max_restarts: int = DEFAULT_TORCH_MAX_RESTARTS,
        torch_shutdown_timeout_s: int = DEFAULT_TORCH_SHUTDOWN_TIMEOUT_S,
        torch_nproc_per_node: int = DEFAULT_TORCH_NPROC_PER_NODE,
    ) -> None:
        """Define the cluster.

        Args:
            scope: the parent construct.
            construct_id: the construct's id, unique within ``scope``.
            vpc: the VPC of the nodes.
            machine_image: the AMI of every node (e.g. the Deep Learning Base AMI from its public SSM parameter).
            framework: :class:`Framework`; default ``MXNET``.
            num_servers: parameter-server nodes, 1..64; default 2.
            desired_workers: the workers' Spot Fleet target capacity (instances); default 2.
            min_workers: fewest workers a generation trains with (``cluster.min_workers``); default 1.
            max_workers: upper bound for ``desired_workers`` (and for raising the fleet's target later),
                up to 1024; default 8. Must satisfy 1 <= min_workers <= desired_workers <= max_workers.
            scheduler_instance_type: on-demand type of the coordinator/scheduler node; default ``m5.large``.
            server_instance_type: on-demand type of each parameter server; default ``m5.xlarge``.
            worker_instance_types: spot types the worker fleet may launch; default
                ``g6.xlarge``, ``g5.xlarge``, ``g4dn.xlarge`` (:data:`spot_training.infra.fleet.DEFAULT_INSTANCE_TYPES`).
            ports: :class:`ClusterPorts`; default 9000 (scheduler), 9001 (server), 9002 (worker).
            training_command: the trainer argv (``{python}`` placeholder allowed); default: the
                framework's trainer in :data:`DEFAULT_TRAINING_COMMANDS`.
            training_python: absolute path of the trainer's interpreter; default ``/usr/bin/python3``
                (the Deep Learning Base AMI's Python).
            training_requirements: pip requirements installed into ``training_python`` at boot on
                every node; default, when ``training_python`` is left out: the framework's GPU build
                on workers (``spot_training.infra.config.FRAMEWORK_REQUIREMENTS``) and its CPU build on the
                scheduler and servers (``FRAMEWORK_CPU_REQUIREMENTS``); else none.
            training_user: OS user of the trainer; default ``ubuntu``.
            training_inherit_site_packages: the trainer's virtual environment also sees
                ``training_python``'s own packages; default False.
            code: ``{"type": "git", "url": ..., "ref": ...}``; default: the bootstrap asset.
            allocation_strategy: the worker fleet's; default ``PRICE_CAPACITY_OPTIMIZED``.
            max_price: highest spot price per worker instance-hour (USD, decimal string); default:
                the On-Demand price.
            root_volume_size_gib: encrypted gp3 root volume of every node, 8..16384 GiB; default 150.
            vpc_subnets: where nodes and mount targets go; default: the VPC's public subnets.
            file_system: an existing :class:`SharedFileSystem`; default: a new one (id ``SharedFileSystem``).
            bootstrap_asset: an existing :class:`BootstrapAsset`; default: a new one.
            imds_endpoint: the agents' instance metadata endpoint; default: none (169.254.169.254).
            stack_tag_value: the ``spot-training:stack`` tag value; default: the stack's name.
            file_system_removal_policy: what ``cdk destroy`` does with the new file system (and its
                checkpoints); default ``RETAIN`` (stateful resources keep their data unless asked).
                Ignored when ``file_system`` is given (the owner of that one decides).
            monitoring: the node config's ``monitoring`` section for every node
                (``TrainingMonitoring.node_config()``, docs/contracts.md); default: none (nothing is
                published). Grant the roles with ``TrainingMonitoring.grant_publish``.
            notice_poll_interval_s: how often every node's agent polls instance metadata for a spot
                interruption notice (seconds, the contract's range); default: the agent's (5 s).
            checkpoint_every_steps: the trainer's checkpoint cadence in steps, exported by the agents;
                default: the trainer's (spot_training.contract).
            checkpoint_every_seconds: the cadence in seconds, exported by the agents; default: the
                trainer's.
            torch_max_restarts: PyTorch only: torchrun's ``--max-restarts``, 0..10000; default 100.
            torch_shutdown_timeout_s: PyTorch only: torchrun's ``--shutdown-timeout`` (seconds its
                workers get after SIGTERM to agree on a step and checkpoint), 5..115; default 90.
            torch_nproc_per_node: PyTorch only: processes (GPUs) per worker node, 1..64; default 1.

        PyTorch (``framework=PYTORCH``): ``num_servers`` is ignored (no parameter servers; the
        ``server_group``/``server_launch_template`` attributes are None); the coordinator node serves
        the c10d rendezvous on ``ports.scheduler``; the members' group opens that port and
        :data:`TORCH_COLLECTIVE_PORTS` between members only.

        Raises:
            ValueError: a count out of range or out of order (names the props and values), a
                malformed instance type, a bad port, a ``framework`` that is not a :class:`Framework`,
                an empty ``training_command``, a relative ``training_python``, a malformed pip
                requirement, or a root volume size outside 8..16384 GiB.
        """
        super().__init__(scope, construct_id)
        acknowledgements.attach(self)  # its nag/checkov acknowledgements, on its own resources
        self._check_props(framework, num_servers, min_workers, desired_workers, max_workers, torch_max_restarts,
                          torch_shutdown_timeout_s, torch_nproc_per_node, ports)
        root_volume_size_gib = root_volume_gib(root_volume_size_gib, prop="root_volume_size_gib")
        validate_instance_type(scheduler_instance_type, prop="scheduler_instance_type")
        validate_instance_type(server_instance_type, prop="server_instance_type")
        command = _training_command(framework, training_command)
        python = training_python if training_python is not None else DEFAULT_TRAINING_PYTHON
        if not isinstance(python, str) or not python.startswith("/"):
            raise ValueError(f"training_python must be an absolute path to a Python interpreter such as /usr/bin/python3, got {training_python!r}")
        requirements = _requirements(framework, self.roles, training_requirements, training_python)

        stack = cdk.Stack.of(self)
        tag_value = stack_tag_value or stack.stack_name
        self._vpc = vpc
        subnets = vpc_subnets or ec2.SubnetSelection(subnet_type=ec2.SubnetType.PUBLIC)
        self.security_group = self._members_security_group(vpc)
        self.connections = ec2.Connections(security_groups=[self.security_group])
        self.file_system = file_system or SharedFileSystem(
            self, "SharedFileSystem", vpc=vpc, vpc_subnets=subnets, removal_policy=file_system_removal_policy
        )
        self.file_system.allow_from(self.connections)
        self.bootstrap_asset = bootstrap_asset or BootstrapAsset(self, "BootstrapAsset")
        self.node_role, self.worker_role = self._roles(tag_value)

        common = {
            "region": stack.region, "stack_name": tag_value,
            # The schema requires a volume section; cluster nodes attach no data volume and ignore it.
            "volume_tags": {STACK_TAG_KEY: tag_value, PURPOSE_TAG_KEY: PURPOSE_DATA_VOLUME},
            "framework": framework.value, "python": python, "command": command, "user": training_user, "code": code,
            "efs": {"file_system_id": self.file_system.file_system_id, "access_point_id": self.file_system.access_point_id,
                    "mount_point": EFS_MOUNT_POINT},
            "imds_endpoint": imds_endpoint, "data_root": EFS_MOUNT_POINT, "cluster": self._cluster_section(),
            "monitoring": monitoring, "inherit_site_packages": training_inherit_site_packages,
            "notice_poll_interval_s": _checked("notice_poll_interval_s", notice_poll_interval_s),
            "checkpoint_every_steps": _checked("checkpoint_every_steps", checkpoint_every_steps),
            "checkpoint_every_seconds": _checked("checkpoint_every_seconds", checkpoint_every_seconds),
        }
        self.node_configs: dict[str, dict[str, Any]] = {}
        user_data: dict[str, ec2.UserData] = {}
        for role in self.roles:
            # Completion ends every agent (plan state ``completed``); workers then cancel their spot fleet
            # (spot_training.agent.fleet_actions.finish_node). Scheduler and servers are in Auto Scaling groups.
            self.node_configs[role] = node_config(**common, node_role=role, requirements=requirements[role],
                                                  cancel_fleet_on_success=role == "worker")
            user_data[role] = self.bootstrap_asset.user_data(self.node_configs[role], region=stack.region,
                                                             stop_timeout_s=AGENT_STOP_TIMEOUT_S)

        self.scheduler_launch_template, self.scheduler_group = self._on_demand_group(
            "Scheduler", scheduler_instance_type, 1, machine_image, user_data["scheduler"], subnets, root_volume_size_gib
        )
        self.server_launch_template: ec2.LaunchTemplate | None = None
        self.server_group: autoscaling.AutoScalingGroup | None = None
        if "server" in self.roles:
            self.server_launch_template, self.server_group = self._on_demand_group(
                "Server", server_instance_type, self.num_servers, machine_image, user_data["server"], subnets,
                root_volume_size_gib
            )
        self.worker_fleet = SpotTrainingFleet(
            self, "WorkerFleet", vpc=vpc, vpc_subnets=subnets, machine_image=machine_image,
            instance_profile=self.worker_role.instance_profile, user_data=user_data["worker"],
            instance_types=worker_instance_types, target_capacity=self.desired_workers,
            allocation_strategy=allocation_strategy, max_price=max_price, security_group=self.security_group,
            root_volume_size_gib=root_volume_size_gib, stack_tag_value=tag_value, instance_metadata_tags=True,
        )
        cdk.Tags.of(self.worker_fleet.launch_template).add(CLUSTER_MEMBER_TAG_KEY, CLUSTER_MEMBER_TAG_VALUE)

        # Nodes must find their permissions and the EFS mount targets in place when they boot.
        for dependent in (g for g in (self.scheduler_group, self.server_group) if g is not None):
            dependent.node.add_dependency(self.node_role, self.file_system)
        self.worker_fleet.resource.node.add_dependency(self.worker_role, self.file_system)

    def _check_props(self, framework: Framework, num_servers: int, min_workers: int, desired_workers: int,
                     max_workers: int, torch_max_restarts: int, torch_shutdown_timeout_s: int, torch_nproc_per_node: int,
                     ports: ClusterPorts | None) -> None:
        """Validate and keep the framework, the counts, the torchrun settings and the ports (ValueError naming the prop)."""
        if not isinstance(framework, Framework):
            raise ValueError(f"framework must be a Framework ({', '.join(f.name for f in Framework)}), got {framework!r}")
        self.framework = framework
        self.roles: tuple[str, ...] = (("scheduler", "worker") if framework is Framework.PYTORCH
                                       else ("scheduler", "server", "worker"))
        self.num_servers = prop_int("num_servers", num_servers, 1, MAX_SERVERS, "parameter-server nodes")
        self.torch_max_restarts = prop_int("torch_max_restarts", torch_max_restarts, 0, MAX_TORCH_MAX_RESTARTS, "restarts")
        self.torch_shutdown_timeout_s = prop_int("torch_shutdown_timeout_s", torch_shutdown_timeout_s, 5,
                                               MAX_TORCH_SHUTDOWN_TIMEOUT_S, "seconds")
        self.torch_nproc_per_node = prop_int("torch_nproc_per_node", torch_nproc_per_node, 1, MAX_TORCH_NPROC_PER_NODE, "processes")
        self.min_workers = prop_int("min_workers", min_workers, 1, MAX_WORKERS, "instances")
        self.max_workers = prop_int("max_workers", max_workers, 1, MAX_WORKERS, "instances")
        self.desired_workers = prop_int("desired_workers", desired_workers, 1, MAX_WORKERS, "instances")
        if not self.min_workers <= self.desired_workers <= self.max_workers:
            raise ValueError(
                "worker counts must satisfy min_workers <= desired_workers <= max_workers, got "
                f"min_workers={min_workers}, desired_workers={desired_workers}, max_workers={max_workers}"
            )
        self.ports = (ports if ports is not None else ClusterPorts())
        if not isinstance(self.ports, ClusterPorts):
            raise ValueError(f"ports must be a ClusterPorts(scheduler=..., server=..., worker=...), got {ports!r}")
        self.ports.validate()

    def _members_security_group(self, vpc: ec2.IVpc) -> ec2.SecurityGroup:
        """The members' one group: ingress from itself on the framework's ports only, all outbound."""
        is_torch = self.framework is Framework.PYTORCH
        group = ec2.SecurityGroup(
            self, "SecurityGroup", vpc=vpc, allow_all_outbound=True,
            description=("pytorch TorchElastic cluster: members reach each other on the rendezvous and collective ports only"
                         if is_torch else
                         f"{self.framework.value} parameter-server cluster: members reach each other on the framework ports only"),
        )
        if is_torch:
            ingress = [((self.ports.scheduler, self.ports.scheduler), "torchrun c10d rendezvous on the coordinator"),
                       (TORCH_COLLECTIVE_PORTS, "gloo/NCCL collectives and the worker group's store between workers")]
        else:
            ingress = [(r, f"{self.framework.value} cluster traffic between members (scheduler, servers, workers)")
                       for r in self.ports.ranges()]
        for (lo, hi), description in ingress:
            port = ec2.Port.tcp(lo) if lo == hi else ec2.Port.tcp_range(lo, hi)
            # Ingress only (Connections.allow_internally would also add an egress rule, which a group
            # that allows all outbound ignores with a warning).
            group.add_ingress_rule(group, port, description)
        return group

    def _roles(self, tag_value: str) -> tuple[TrainingNodeRole, TrainingNodeRole]:
        """The scheduler's/servers' role and the workers' own role (only workers may lower the fleet's target
        and terminate themselves when asked to leave: spot_training.agent.fleet_actions.leave_fleet)."""
        node_role, worker_role = (
            TrainingNodeRole(self, construct_id, stack_tag_value=tag_value, assets=[self.bootstrap_asset.asset],
                             description=f"{nodes} of stack {tag_value}", data_volume_access=False)
            for construct_id, nodes in (("NodeRole", "Scheduler and parameter-server nodes"),
                                        ("WorkerRole", "Spot worker nodes"))
        )
        worker_role.allow_leaving_fleet()
        # ... and may cancel the stack's worker fleet when training completed (docs/architecture.md, "The user's story", step 4).
        worker_role.grant_cancel_own_fleet()
        for role in (node_role, worker_role):
            self.file_system.grant_read_write(role)
        # Failed boots are counted where they outlive the instance, and bounded (spot_training/infra/userdata.py).
        node_role.allow_boot_failure_reporting(counted_on="auto-scaling-group")
        worker_role.allow_boot_failure_reporting(counted_on="fleet")
        return node_role, worker_role

    def _cluster_section(self) -> dict[str, Any]:
        """The node config's ``cluster`` section (docs/contracts.md, "Parameter-server cluster")."""
        section: dict[str, Any] = {
            "state_dir": STATE_DIR, "num_servers": self.num_servers, "min_workers": self.min_workers,
            "scheduler_port": self.ports.scheduler, "server_port": self.ports.server, "worker_port": self.ports.worker,
            "member_tag": CLUSTER_MEMBER_TAG_KEY,
        }
        if self.framework is Framework.PYTORCH:
            section.update({"num_servers": 0, "max_workers": self.max_workers,
                            "torch_max_restarts": self.torch_max_restarts,
                            "torch_shutdown_timeout_s": self.torch_shutdown_timeout_s,
                            "torch_nproc_per_node": self.torch_nproc_per_node})
        return section

    def _on_demand_group(
        self,
        role: str,
        instance_type: str,
        size: int,
        machine_image: ec2.IMachineImage,
        user_data: ec2.UserData,
        subnets: ec2.SubnetSelection,
        root_volume_size_gib: int,
    ) -> tuple[ec2.LaunchTemplate, autoscaling.AutoScalingGroup]:
        template = node_launch_template(
            self, f"{role}LaunchTemplate", machine_image=machine_image, instance_type=ec2.InstanceType(instance_type),
            user_data=user_data, instance_profile=self.node_role.instance_profile, security_group=self.security_group,
            root_volume_size_gib=root_volume_size_gib, instance_metadata_tags=True)
        # Fixed size (min = max): the group exists to replace a lost node, not to scale.
        # A changed launch template (a new node config: servers, ports, ...) replaces the nodes one
        # at a time, old one first: the coordinator reads its config only at boot, and two
        # coordinators must never run side by side (a replacing update would start the new group
        # before deleting the old one).
        group = autoscaling.AutoScalingGroup(
            self,
            f"{role}Group",
            vpc=self._vpc,
            vpc_subnets=subnets,
            launch_template=template,
            min_capacity=size,
            max_capacity=size,
            update_policy=autoscaling.UpdatePolicy.rolling_update(max_batch_size=1, min_instances_in_service=0),
        )
        return template, group
