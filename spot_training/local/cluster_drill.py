"""The cluster drill: the DistributedTraining stack's story on one machine, measured, with a report.

moto server up -> ``cdk bootstrap`` -> ``cdk deploy DistributedTraining`` (the real CLI; MXNet
``dist_sync``, one scheduler, ``num_servers`` parameter servers, 2 spot workers; or, with
``framework="pytorch"``, ``cluster_framework=pytorch``: the on-demand coordinator serving TorchElastic's
c10d rendezvous, no parameter servers, 2 spot workers each running ``torchrun``) -> the digits written
onto "EFS" (a directory under the work dir that every node shares) -> each instance of the scheduler
and server Auto Scaling groups and of the worker Spot Fleet becomes a local node that boots as
an instance does: its role's launch template's own user data runs (spot_training.local.node_init, as for a
single node) and starts the agent's unit, with its own IMDS emulator, its own network namespace and
the shared EFS directory as its ``/mnt/efs``) -> the 2 workers train -> the user raises the fleet's target capacity to 3
(``ModifySpotFleetRequest``, as a user would) and the runner acts for the fleet: a third worker joins
-> one worker gets a spot interruption notice, leaves through a checkpoint, its instance is terminated
and the fleet's replacement joins -> training completes at exactly the total step -> a worker's agent
cancels the fleet -> ``cdk destroy`` -> boto3 checks that nothing of the stack is left.

:func:`run_cluster_drill` returns the report (and writes ``report.json`` into ``work_dir``). Fields
(times in seconds): ``completed``, ``steps_total`` (the trainer's last step, from ``COMPLETED``),
``steps_executed`` (step rows rank 0 logged over every generation: each step of a ``dist_sync``
cluster runs once on every worker, and rank 0 logs it), ``distinct_steps``, ``lost_steps`` (executed
minus total: steps done twice), ``generations``, ``world_sizes`` (workers of each generation, in
order), ``joins``/``leaves`` (workers added to / dropped from
one running generation to the next, from the coordinator's ``events.jsonl``), ``max_workers_seen``,
``join_s`` (capacity raised -> the 3-worker generation's first step), ``leave_s`` (notice ->
training goes on without the worker), ``test_accuracy`` (held-out digits, from the trainer's
``result.json``), ``fleet_cancelled_on_completion``, ``orphans_after_destroy`` (a list), ``wall_s``,
``phases_s``, ``error`` and ``passed``; ``framework``; ``rendezvous_epoch`` (PyTorch: the epoch of
the coordinator's ``rendezvous.json`` at the end, 1 when neither the coordinator nor a torchrun gave
out; None for MXNet).

Membership per framework. MXNet: a generation is the coordinator's plan (``plan.json``,
``events.jsonl``). PyTorch has no generations (TorchElastic restarts the worker groups itself,
spot_training/agent/torch_elastic.py), so the drill numbers them from rank 0's step rows: a new one begins
where the ``num_workers`` column (the world size) changes (:func:`world_size_generations`).

moto's Spot Fleet does not maintain capacity, so :class:`ClusterNodeRunner` launches what the fleet
would (a third instance when the target goes up; a replacement after an interruption) through
:meth:`spot_training.local.nodes.NodeRunner.launch_for_fleet`. Everything started is stopped by PID; the
namespaces are removed; nothing is written outside ``work_dir``.
"""

from __future__ import annotations

import csv
import dataclasses
import json
import shutil
import signal
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from spot_training.local.deploy import ACCOUNT, AVAILABILITY_ZONES, LOCAL_IMAGE_ID, REGION, CdkCli, Clients, DeployedStack, \
    client, clients, destroy_and_check
from spot_training.local.drill import EventLog, add_read_back, bootstrap_and_deploy, check_stack_and_framework, framework_python, \
    check_on_demand_prices, fresh_work_dir, options_dict, table_on_demand_prices
from spot_training.local.moto_server import MotoServer
from spot_training.local.netns import Network
from spot_training.local.nodes import LocalNode, NodeError, NodeRunner, launch_template_user_data, signal_group

from spot_training.contract import COMPLETED_FILE, check_seconds  # noqa: E402
from spot_training.contract import STACK_TAG as STACK_TAG_KEY  # noqa: E402


@dataclasses.dataclass(frozen=True)
class ClusterFramework:
    """What differs between the cluster drill's frameworks (the trainer is the stack's own default,
    ``spot_training.infra.config.FRAMEWORKS[...].cluster_training_command``; its interpreter is the single-node
    drill's, :func:`spot_training.local.drill.framework_python`).

    Attributes:
        group_roles: node roles on on-demand Auto Scaling groups (the coordinator's ``scheduler``, and
            ``server`` where the framework has parameter servers).
        plan_generations: True: membership is the coordinator's plan (``plan.json``/``events.jsonl``);
            False: the world size in rank 0's step rows (TorchElastic keeps no plan).
        start_with_all_workers: deploy with ``cluster_min_workers`` = the starting workers. torchrun's
            c10d rendezvous starts a round once ``--nnodes`` MIN nodes are in and its last call
            (spot_training/agent/torch_elastic.py ``LAST_CALL_TIMEOUT_S``) has passed, so with the stack's
            default of 1 the first worker up would train alone until the second's torchrun joins; the
            MXNet coordinator's plan waits for registrations to settle instead (``debounce_s``).
    """

    group_roles: tuple[str, ...]
    plan_generations: bool
    start_with_all_workers: bool


#: The frameworks the cluster drill runs (default: mxnet).
CLUSTER_FRAMEWORKS: dict[str, ClusterFramework] = {
    "mxnet": ClusterFramework(group_roles=("scheduler", "server"), plan_generations=True, start_with_all_workers=False),
    "pytorch": ClusterFramework(group_roles=("scheduler",), plan_generations=False, start_with_all_workers=True),
}


@dataclasses.dataclass
class ClusterDrillOptions:
    """What the cluster drill does.

    Attributes:
        work_dir: everything goes here (default ``out/cluster-drill``); emptied first.
        stack: stack name (default ``DistributedTraining``).
        framework: ``mxnet`` (default) or ``pytorch`` (:data:`CLUSTER_FRAMEWORKS`): deployed with
            ``-c cluster_framework=...``; PyTorch's trainer and rendezvous store run on ``.venv-torch``.
        steps: total optimizer steps of the trainer (default 800).
        workers: workers at the start (the fleet's target capacity; default 2); one more joins.
        num_servers: parameter-server nodes (default 1: fewer processes on a small machine; PyTorch
            has none, the stack ignores it).
        join_after_steps: raise the fleet's target once training reached this step (default 60).
        interrupt_after_steps: steps the grown generation runs before the notice (default 40).
        save_every_steps: checkpoint cadence (default 20).
        min_step_seconds: the trainer's floor per step (default 0.05 s), so that membership changes
            happen well before the last step on any machine.
        seed: trainer seed (default 0).
        timeout_s: the longest the training phase may take (default 480 s).
        instance_types: the worker fleet's types (default g5.xlarge, g4dn.xlarge: types the local AWS
            has a spot price history for).
        on_demand_prices: the stated on-demand USD/hour of each type that runs, an input of the cost
            read-back (local mode cannot ask the AWS Price List API; default: local mode's dated price
            table, :func:`spot_training.local.drill.table_on_demand_prices`, for g5.xlarge, g4dn.xlarge, the
            on-demand scheduler's (PyTorch: the coordinator's) m5.large and the servers' m5.xlarge).
        ebs_gb_month_price: USD per GB-month of EBS (the cluster has no data volume; stated for the
            same cost report as the single-node drill).
        snapshot_gb_month_price: USD per GB-month of snapshots (the cluster has none; as above).
    """

    work_dir: Path = Path("out/cluster-drill")
    stack: str = "DistributedTraining"
    framework: str = "mxnet"
    steps: int = 800
    workers: int = 2
    num_servers: int = 1
    join_after_steps: int = 60
    interrupt_after_steps: int = 40
    save_every_steps: int = 20
    min_step_seconds: float = 0.05
    seed: int = 0
    timeout_s: float = 480.0
    instance_types: tuple[str, ...] = ("g5.xlarge", "g4dn.xlarge")
    on_demand_prices: dict[str, float] = dataclasses.field(
        default_factory=lambda: table_on_demand_prices(("g5.xlarge", "g4dn.xlarge", "m5.large", "m5.xlarge")))
    ebs_gb_month_price: float = 0.08
    snapshot_gb_month_price: float = 0.05

    def validate(self) -> None:
        """Raise ``ValueError`` naming the bad option, its value and what is allowed."""
        for name in ("steps", "workers", "num_servers", "join_after_steps", "interrupt_after_steps", "save_every_steps"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be an integer >= 1, got {value!r}")
        if self.workers > 7:
            raise ValueError(f"workers must be at most 7 (one more joins; the stack allows 8), got {self.workers}")
        if self.join_after_steps >= self.steps:
            raise ValueError(f"join_after_steps must be below steps={self.steps}, got {self.join_after_steps}")
        check_seconds("min_step_seconds", self.min_step_seconds, zero=True)
        check_seconds("timeout_s", self.timeout_s)
        check_on_demand_prices(self.instance_types, self.on_demand_prices)
        check_stack_and_framework(self.stack, self.framework, CLUSTER_FRAMEWORKS)

    @property
    def settings(self) -> ClusterFramework:
        """What the drill does differently for :attr:`framework`."""
        return CLUSTER_FRAMEWORKS[self.framework]

    def trainer_command(self) -> list[str]:
        """The trainer argv the stack is deployed with (``{python}`` is the node's interpreter): the
        framework's default cluster trainer (``spot_training.infra.config.FRAMEWORKS``) with the drill's options."""
        from spot_training.infra.config import FRAMEWORKS

        return [*FRAMEWORKS[self.framework].cluster_training_command, "--steps", str(self.steps), "--batch-size", "64",
                "--save-every-steps", str(self.save_every_steps), "--min-step-seconds", str(self.min_step_seconds),
                "--seed", str(self.seed)]

    def context(self) -> dict[str, str]:
        """CDK context (``-c key=value``) that deploys the cluster stack to the moto server."""
        return {
            "account": ACCOUNT, "region": REGION, "availability_zones": ",".join(AVAILABILITY_ZONES),
            "image_id": LOCAL_IMAGE_ID, "cluster_stack_name": self.stack, "cluster_framework": self.framework,
            "cluster_num_servers": str(self.num_servers), "cluster_workers": str(self.workers),
            "cluster_max_workers": str(max(8, self.workers + 1)),
            "cluster_worker_instance_types": ",".join(self.instance_types),
            # This machine's interpreter of the framework runs every node's framework process;
            # nothing is pip-installed.
            "cluster_training_python": framework_python(self.framework), "cluster_training_requirements": "[]",
            "cluster_training_command": json.dumps(self.trainer_command()),
            **({"cluster_min_workers": str(self.workers)} if self.settings.start_with_all_workers else {}),
        }


class DrillError(RuntimeError):
    """The drill could not run to its end (the message says where; the report is still written)."""


@dataclasses.dataclass(frozen=True)
class DeployedCluster:
    """What the drill needs from the deployed cluster stack, read with boto3.

    Attributes:
        stack: the worker fleet as a :class:`DeployedStack` (fleet, the workers' launch template, subnets).
        groups: ``{role: auto scaling group name}`` for ``scheduler`` and ``server``.
        launch_templates: ``{role: launch template id}``.
        file_system_id: the EFS.
    """

    stack: DeployedStack
    groups: dict[str, str]
    launch_templates: dict[str, str]
    file_system_id: str


def cluster_resources(aws: Clients, autoscaling: Any, stack: str, *,
                      group_roles: tuple[str, ...] = CLUSTER_FRAMEWORKS["mxnet"].group_roles) -> DeployedCluster:
    """Read the deployed cluster ``stack`` with boto3.

    Args:
        aws: the local AWS clients.
        autoscaling: a boto3 Auto Scaling client.
        stack: the cluster stack's name.
        group_roles: the roles that must have an Auto Scaling group (default: MXNet's scheduler and
            servers; PyTorch's coordinator only).

    Returns:
        the fleet, launch templates per role, groups per role and the file system.

    Raises:
        DrillError: the stack is not ``CREATE_COMPLETE`` or lacks a fleet, a role's launch template,
            a group of ``group_roles`` or the file system.
    """
    from spot_training.infra.userdata import extract_config

    status = aws.cloudformation.describe_stacks(StackName=stack)["Stacks"][0]["StackStatus"]
    if status not in ("CREATE_COMPLETE", "UPDATE_COMPLETE"):
        raise DrillError(f"stack {stack} is {status}, expected CREATE_COMPLETE")
    resources = {r["LogicalResourceId"]: (r["ResourceType"], r.get("PhysicalResourceId"))
                 for r in aws.cloudformation.describe_stack_resources(StackName=stack)["StackResources"]}

    def of(kind: str) -> list[str]:
        return [physical for k, physical in resources.values() if k == kind]

    templates: dict[str, str] = {}
    for template_id in of("AWS::EC2::LaunchTemplate"):
        role = extract_config(launch_template_user_data(aws, template_id))["node_role"]
        templates[role] = template_id
    groups: dict[str, str] = {}
    names = of("AWS::AutoScaling::AutoScalingGroup")
    described = autoscaling.describe_auto_scaling_groups(AutoScalingGroupNames=names)["AutoScalingGroups"] if names else []
    by_template = {template_id: role for role, template_id in templates.items()}
    for group in described:
        template_id = (group.get("LaunchTemplate") or {}).get("LaunchTemplateId")
        if template_id in by_template:
            groups[by_template[template_id]] = group["AutoScalingGroupName"]
    fleets, file_systems, vpcs = of("AWS::EC2::SpotFleet"), of("AWS::EFS::FileSystem"), of("AWS::EC2::VPC")
    missing = [what for what, ok in (("the worker Spot Fleet", len(fleets) == 1), ("the file system", len(file_systems) == 1),
                                     ("the VPC", len(vpcs) == 1), ("the worker launch template", "worker" in templates),
                                     *((f"the {role} group", role in groups) for role in group_roles))
               if not ok]
    if missing:
        raise DrillError(f"stack {stack} lacks {', '.join(missing)}; resources: {sorted(resources)}")
    subnets = {s["AvailabilityZone"]: s["SubnetId"]
               for s in aws.ec2.describe_subnets(Filters=[{"Name": "vpc-id", "Values": vpcs}])["Subnets"]}
    fleet = DeployedStack(name=stack, fleet_request_id=fleets[0], launch_template_id=templates["worker"],
                          data_volume_id="", subnets=dict(sorted(subnets.items())), resources=resources)
    return DeployedCluster(stack=fleet, groups=groups, launch_templates=templates, file_system_id=file_systems[0])


class ClusterNodeRunner(NodeRunner):
    """:class:`NodeRunner` for the cluster stack: a node boots from its role's launch template (its own
    user data, :meth:`NodeRunner.boot_node`); every node's EFS mount point is the one shared ``efs_dir``,
    and every node gets an address of its own from ``network`` (on loopback: a port offset,
    ``SPOT_TRAINING_PORT_OFFSET``).

    Args:
        cluster: the deployed cluster (:func:`cluster_resources`).
        network: hands out node addresses (network namespaces, or loopback with port offsets).
        efs_dir: the directory standing in for the EFS file system.
        **kwargs: :class:`NodeRunner`'s arguments.
    """

    def __init__(self, *, cluster: DeployedCluster, network: Network, efs_dir: Path, **kwargs: Any) -> None:
        super().__init__(stack=cluster.stack, **kwargs)
        self.cluster = cluster
        self.network = network
        self.efs_dir = efs_dir
        self.roles: dict[str, str] = {}

    def group_instances(self, autoscaling: Any) -> dict[str, str]:
        """``{instance id: role}`` of the scheduler and server groups' in-service instances."""
        found: dict[str, str] = {}
        groups = autoscaling.describe_auto_scaling_groups(AutoScalingGroupNames=list(self.cluster.groups.values()))
        role_of = {name: role for role, name in self.cluster.groups.items()}
        for group in groups["AutoScalingGroups"]:
            for instance in group.get("Instances", []):
                if instance.get("LifecycleState", "InService") in ("InService", "Pending"):
                    found[instance["InstanceId"]] = role_of[group["AutoScalingGroupName"]]
        return found

    def start_node(self, instance_id: str, role: str = "worker") -> LocalNode:  # type: ignore[override]
        """Boot ``instance_id`` as a cluster node of ``role`` from ``role``'s launch template, in a
        network namespace of its own (``SPOT_TRAINING_NETNS``; its address is the IMDS's local-ipv4),
        or on loopback with a port offset of its own.

        Args:
            instance_id: the instance the fleet or group launched.
            role: ``scheduler``, ``server`` or ``worker`` (default).

        Returns:
            the started node.

        Raises:
            NodeError: ``role`` has no launch template (names the roles the stack has).
        """
        template = self.cluster.launch_templates.get(role)
        if template is None:
            raise NodeError(f"role {role!r} has no launch template in the stack; expected one of "
                            f"{sorted(self.cluster.launch_templates)}")
        netns, address, offset = self.network.add(instance_id)
        from spot_training.agent.config import PORT_OFFSET_ENV
        from spot_training.agent.launch import NETNS_ENV

        extra = {NETNS_ENV: netns} if netns else {PORT_OFFSET_ENV: str(offset)}
        node = self.boot_node(instance_id, template, local_ipv4=address, extra_env=extra)
        self.roles[instance_id] = role
        self.on_event({"event": "node-started", "instance_id": instance_id, "role": role, "address": address,
                       "availability_zone": node.availability_zone, "pid": node.process.pid})
        return node

    def stop_node(self, node: LocalNode) -> int | None:
        """Stop ``node`` (:meth:`LocalNode.stop`) and SIGKILL its framework process if it outlived its
        agent (the PID from the node's heartbeat, only while that process names this instance)."""
        status = node.stop()
        beat = self.efs_dir / "cluster" / "heartbeats" / f"{node.instance_id}.json"
        try:
            pid = int(json.loads(beat.read_text()).get("pid") or 0)
        except (OSError, ValueError):
            pid = 0
        if pid and _environ_has(pid, f"SPOT_TRAINING_NODE_ID={node.instance_id}"):
            signal_group(pid, signal.SIGKILL)
        return status

    def close(self) -> None:
        """Stop every node by PID, terminate what was launched for the fleet, remove the namespaces."""
        for node in self.nodes.values():
            self.stop_node(node)
        try:
            super().close()
        finally:
            self.network.close()


def _environ_has(pid: int, text: str) -> bool:
    try:
        return text.encode() in Path(f"/proc/{pid}/environ").read_bytes()
    except OSError:
        return False


def _read_rows(log_dir: Path) -> list[dict[str, str]]:
    rows = []
    for path in sorted(log_dir.glob("steps-*.csv")):
        with open(path, newline="") as handle:
            for row in csv.DictReader(handle):
                row["node"] = path.stem[len("steps-"):]
                rows.append(row)
    return sorted(rows, key=lambda r: float(r["wall_time"]))


def _plan(efs_dir: Path) -> dict[str, Any] | None:
    try:
        return json.loads((efs_dir / "cluster" / "plan.json").read_text())
    except (OSError, ValueError):
        return None


def world_size_generations(rows: list[dict[str, str]]) -> list[dict[str, Any]]:
    """PyTorch's generations, numbered by the drill: rank 0's step rows split where ``num_workers`` changes.

    ``num_workers`` is the world size of the TorchElastic round that ran the step. A restart that keeps
    the world size (a round without a membership change) does not begin a new generation.

    Args:
        rows: the step rows, sorted by ``wall_time`` (other ranks' rows are left out).

    Returns:
        ``[{"generation": 1.., "num_workers": W, "rows": [...]}]``, each row's ``generation`` set to its number.
    """
    generations: list[dict[str, Any]] = []
    for row in rows:
        if row["rank"] != "0":
            continue
        workers = int(row["num_workers"])
        if not generations or generations[-1]["num_workers"] != workers:
            generations.append({"generation": len(generations) + 1, "num_workers": workers, "rows": []})
        generations[-1]["rows"].append({**row, "generation": str(generations[-1]["generation"])})
    return generations


def world_size_changes(generations: list[dict[str, Any]]) -> tuple[int, int, int]:
    """``(joins, leaves, generations)`` from :func:`world_size_generations`: workers added and dropped
    from one generation to the next (world-size differences), and the number of generations."""
    sizes = [g["num_workers"] for g in generations]
    joins = sum(max(0, b - a) for a, b in zip(sizes, sizes[1:]))
    leaves = sum(max(0, a - b) for a, b in zip(sizes, sizes[1:]))
    return joins, leaves, len(sizes)


def membership_changes(events: list[dict[str, Any]]) -> tuple[int, int, int]:
    """``(joins, leaves, generations)`` from the coordinator's ``events.jsonl`` lines: workers added to
    and dropped from one ``running`` generation to the next, and the number of running generations."""
    joins = leaves = 0
    previous: set[str] | None = None
    generations = set()
    for event in events:
        if event.get("state") != "running":
            continue
        workers = {w["node_id"] if isinstance(w, dict) else str(w) for w in event.get("workers", [])}
        generations.add(event.get("generation"))
        if previous is not None:
            joins += len(workers - previous)
            leaves += len(previous - workers)
        previous = workers
    return joins, leaves, len(generations)


def cluster_orphans(autoscaling: Any, efs: Any, stack: str, *, group_names: list[str],
                    file_system_id: str | None) -> list[str]:
    """What of a cluster stack :func:`spot_training.local.deploy.find_orphans` does not look at: Auto Scaling
    groups and the file system (:func:`spot_training.local.deploy.destroy_and_check` checks both).

    Callers leave the file system out when it is kept on purpose with ``retain_data``.

    Args:
        autoscaling: a boto3 Auto Scaling client.
        efs: a boto3 EFS client.
        stack: the stack name.
        group_names: the Auto Scaling groups the drill saw.
        file_system_id: the stack's file system, or None.

    Returns:
        ``"kind id (state)"`` strings; empty when nothing is left.
    """
    orphans: list[str] = []
    if group_names:
        for group in autoscaling.describe_auto_scaling_groups(AutoScalingGroupNames=group_names)["AutoScalingGroups"]:
            orphans.append(f"auto-scaling-group {group['AutoScalingGroupName']}")
    for fs in efs.describe_file_systems()["FileSystems"]:
        tags = {t["Key"]: t["Value"] for t in fs.get("Tags", [])}
        if fs["FileSystemId"] == file_system_id or tags.get(STACK_TAG_KEY) == stack:
            orphans.append(f"file-system {fs['FileSystemId']} ({fs.get('LifeCycleState')})")
    return orphans


def run_cluster_drill(options: ClusterDrillOptions, *,
                      on_event: Callable[[dict[str, Any]], None] | None = None) -> dict[str, Any]:
    """Run the cluster drill (see the module docstring); returns the report, also in ``report.json``.

    Args:
        options: the drill's options.
        on_event: called with every progress event (the live display), or None.

    Returns:
        the report.

    Raises:
        ValueError: bad options (nothing started). A failure later is recorded in the report's
            ``error`` (``passed`` false); everything started is stopped and the stack destroyed.
    """
    options.validate()
    started = time.time()
    work_dir = fresh_work_dir(options.work_dir)
    efs_dir = work_dir / "efs"
    record = EventLog(started, on_event)
    report: dict[str, Any] = {
        "stack": options.stack, "work_dir": str(work_dir), "framework": options.framework, "completed": False,
        "steps_total": 0, "steps_executed": 0, "distinct_steps": 0, "lost_steps": None, "generations": 0, "world_sizes": [],
        "joins": 0, "leaves": 0, "max_workers_seen": 0, "join_s": None, "leave_s": None, "test_accuracy": None,
        "fleet_cancelled_on_completion": False, "orphans_after_destroy": None, "wall_s": 0.0, "phases_s": {},
        "options": options_dict(options),
        "rendezvous_epoch": None, "error": None, "aws_status": None, "aws_interruptions": [], "cost": None, "savings_pct": None,
    }
    phases = report["phases_s"]
    server = MotoServer(work_dir / "moto")
    runner: ClusterNodeRunner | None = None
    cdk: CdkCli | None = None
    cluster: DeployedCluster | None = None
    network: Network | None = None
    try:
        record({"event": "phase", "phase": "moto", "message": "starting the moto server on 127.0.0.1"})
        server.start()
        aws = clients(server.endpoint_url)
        autoscaling, efs = client(server.endpoint_url, "autoscaling"), client(server.endpoint_url, "efs")
        cdk = CdkCli(server.endpoint_url, work_dir=work_dir)
        bootstrap_and_deploy(cdk, options.stack, options.context(), record=record, phases=phases)
        cluster = cluster_resources(aws, autoscaling, options.stack, group_roles=options.settings.group_roles)
        report["fleet_request_id"] = cluster.stack.fleet_request_id
        record({"event": "deployed", "fleet_request_id": cluster.stack.fleet_request_id, "groups": cluster.groups,
                "file_system_id": cluster.file_system_id})

        from spot_training.training.examples.prepare_data import prepare_digits

        prepare_digits(efs_dir / "datasets")
        record({"event": "phase", "phase": "data", "message": f"digits written onto the EFS ({cluster.file_system_id} -> {efs_dir})"})
        network = Network()
        runner = ClusterNodeRunner(cluster=cluster, network=network, efs_dir=efs_dir, aws=aws,
                                   endpoint_url=server.endpoint_url, volumes_dir=server.volumes_dir,
                                   work_dir=work_dir, on_event=record)
        t = time.time()
        record({"event": "phase", "phase": "training",
                "message": "Auto Scaling group and fleet instances -> local nodes" + (
                    "" if network.netns else f" (loopback: {network.reason})")})
        for instance_id, role in sorted(runner.group_instances(autoscaling).items(), key=lambda kv: kv[1] != "scheduler"):
            runner.start_node(instance_id, role)
        _act_for_fleet(runner, options.workers)
        if sum(role == "worker" for role in runner.roles.values()) != options.workers:
            raise DrillError(f"expected {options.workers} worker instances, started {runner.roles}")
        deadline = t + options.timeout_s
        watcher = (_Watcher if options.settings.plan_generations else _WorldSizeWatcher)(
            efs_dir, options, record, deadline, runner)

        watcher.until(lambda: watcher.max_step >= options.join_after_steps, f"step {options.join_after_steps}")
        raised_at = time.time()
        target = options.workers + 1
        aws.ec2.modify_spot_fleet_request(SpotFleetRequestId=cluster.stack.fleet_request_id, TargetCapacity=target)
        record({"event": "capacity-raised", "target_capacity": target, "step": watcher.max_step})
        _act_for_fleet(runner, target)
        grown = watcher.until(lambda: watcher.running_generation(workers=target), f"a running generation of {target} workers")
        watcher.until(lambda: watcher.first_step(grown) is not None, f"the first step of generation {grown}")
        report["join_s"] = round(watcher.first_step(grown)[1] - raised_at, 3)
        record({"event": "joined", "generation": grown, "workers": target, "join_s": report["join_s"]})
        watcher.until(lambda: watcher.steps_in(grown) >= options.interrupt_after_steps,
                      f"{options.interrupt_after_steps} steps in generation {grown}")

        victim = runner.nodes[_workers(runner)[0]]
        noticed_at = time.time()
        victim.post_interruption_notice()
        record({"event": "notice-posted", "instance_id": victim.instance_id, "step": watcher.max_step})
        without = watcher.until(lambda: watcher.running_generation(workers=target - 1, without=victim.instance_id),
                                f"a generation without {victim.instance_id}")
        watcher.until(lambda: watcher.first_step(without) is not None, f"the first step of generation {without}")
        report["leave_s"] = round(watcher.first_step(without)[1] - noticed_at, 3)
        watcher.until(lambda: not victim.alive, f"{victim.instance_id}'s agent to exit after leaving")
        if victim.process.returncode != 0:
            raise DrillError(f"the interrupted worker's agent exited {victim.process.returncode}; see {victim.log_path}")
        runner.stop_node(victim)
        runner.terminate_instance(victim.instance_id)
        record({"event": "instance-terminated", "instance_id": victim.instance_id, "reason": "spot interruption",
                "leave_s": report["leave_s"]})
        _act_for_fleet(runner, target)  # the maintain fleet replaces the interrupted instance

        watcher.until(lambda: all(not n.alive for n in runner.nodes.values()), "every agent to finish",
                      completion_expected=True)
        phases["training"] = round(time.time() - t, 3)
        failed = {i: n.process.returncode for i, n in runner.nodes.items() if n.process.returncode != 0}
        if failed:
            raise DrillError(f"agents exited non-zero: {failed}; see {work_dir / 'nodes'}")
        report["fleet_cancelled_on_completion"] = not runner.fleet_active()
        runner.reconcile()
        _collect(efs_dir, work_dir / "results", report, options.settings)
        record({"event": "completed", "step": report["steps_total"], "test_accuracy": report["test_accuracy"],
                "fleet_cancelled": report["fleet_cancelled_on_completion"]})
        # What `spot-train status` and `cost` read from the local AWS (the agents' published figures).
        add_read_back(report, server.endpoint_url, options, record)
    except Exception as error:  # noqa: BLE001 - recorded in the report; teardown below runs either way
        report["error"] = f"{type(error).__name__}: {error}"
        record({"event": "error", "message": report["error"]})
    finally:
        if runner is not None:
            runner.close()
        elif network is not None:
            network.close()
        if report["steps_total"] == 0 and efs_dir.exists():
            try:
                _collect(efs_dir, work_dir / "results", report, options.settings)
            except (OSError, ValueError) as error:
                report["error"] = report["error"] or f"collect: {error}"
        if cdk is not None and server.process is not None:
            # aws, autoscaling and efs exist: they are made before cdk.
            destroy_and_check(
                cdk, aws, options.stack, context=options.context(), report=report, record=record,
                fleet_request_ids=[cluster.stack.fleet_request_id] if cluster else [],
                more_orphans=lambda: cluster_orphans(
                    autoscaling, efs, options.stack, group_names=list(cluster.groups.values()) if cluster else [],
                    file_system_id=cluster.file_system_id if cluster else None))
            if report.get("destroy_error"):
                report["error"] = report["error"] or f"destroy: {report['destroy_error']}"
        server.stop()
        report["wall_s"] = round(time.time() - started, 3)
        report["passed"] = cluster_passed(report, options)
        record.write(work_dir / "events.jsonl")
        (work_dir / "report.json").write_text(json.dumps(report, indent=2))
    return report


def _workers(runner: ClusterNodeRunner) -> list[str]:
    """Ids of the live worker nodes, oldest first."""
    return [i for i, node in runner.nodes.items() if runner.roles.get(i) == "worker" and node.alive]


def _act_for_fleet(runner: ClusterNodeRunner, target: int) -> None:
    """Bring the fleet's running instances up to ``target`` as a ``maintain`` fleet would (moto's does
    not), spreading them over the AZs, and start a node for every fleet instance without one."""
    zones = sorted(runner.stack.subnets)
    running = runner.fleet_instances()
    types = [i["InstanceType"] for i in running] or ["g5.xlarge"]
    for index in range(len(running), target):
        runner.launch_for_fleet(zones[index % len(zones)], instance_type=types[0])
    for instance in runner.fleet_instances():
        if instance["InstanceId"] not in runner.nodes:
            runner.start_node(instance["InstanceId"], "worker")


class _Watcher:
    """Reads the cluster's state on the shared EFS directory while the drill waits."""

    def __init__(self, efs_dir: Path, options: ClusterDrillOptions, record: Callable[[dict[str, Any]], None],
                 deadline: float, runner: ClusterNodeRunner) -> None:
        self.efs_dir, self.options, self.record, self.deadline, self.runner = efs_dir, options, record, deadline, runner
        self.max_step = 0
        self._rows: list[dict[str, str]] = []

    def refresh(self) -> None:
        self._rows = self._label(_read_rows(self.efs_dir / "logs"))
        step = max((int(r["step"]) for r in self._rows), default=0)
        if step != self.max_step:
            self.max_step = step
            last = self._rows[-1]
            self.record({"event": "progress", "step": step, "total": self.options.steps, "loss": float(last["loss"]),
                         "workers": int(last["num_workers"]), "generation": int(last["generation"])})

    def until(self, predicate: Callable[[], Any], what: str, *, completion_expected: bool = False) -> Any:
        """Poll every 0.25 s until ``predicate()`` is truthy; returns its value.

        Raises:
            DrillError: training completed first (unless ``completion_expected``), an agent exited non-
                zero, or the deadline passed.
        """
        while True:
            self.refresh()
            value = predicate()
            if value:
                return value
            if self._completed() and not completion_expected:
                raise DrillError(f"training completed before {what}; use more --steps")
            dead = [i for i, n in self.runner.nodes.items() if not n.alive and n.process.returncode != 0]
            if dead:
                raise DrillError(f"agent(s) {dead} exited non-zero while waiting for {what}; see their agent.log")
            if time.time() > self.deadline:
                raise DrillError(f"timed out (timeout_s={self.options.timeout_s}) waiting for {what}")
            time.sleep(0.25)

    def _label(self, rows: list[dict[str, str]]) -> list[dict[str, str]]:
        """The step rows with their ``generation`` (MXNet: the trainer's own column, the plan's)."""
        return rows

    def _completed(self) -> bool:
        return (_plan(self.efs_dir) or {}).get("state") == "completed"

    def running_generation(self, *, workers: int, without: str | None = None) -> int:
        """The running generation of ``workers`` workers (none of them ``without``), else 0."""
        plan = _plan(self.efs_dir)
        if not plan or plan.get("state") != "running" or len(plan.get("workers", [])) != workers:
            return 0
        if without and any(w.get("node_id") == without for w in plan["workers"]):
            return 0
        return int(plan["generation"])

    def _in(self, generation: int) -> list[dict[str, str]]:
        return [r for r in self._rows if int(r["generation"]) == generation]

    def first_step(self, generation: int) -> tuple[int, float] | None:
        rows = self._in(generation)
        return (int(rows[0]["step"]), float(rows[0]["wall_time"])) if rows else None

    def steps_in(self, generation: int) -> int:
        steps = [int(r["step"]) for r in self._in(generation)]
        return max(steps) - min(steps) + 1 if steps else 0


class _WorldSizeWatcher(_Watcher):
    """:class:`_Watcher` for PyTorch: no plan; generations are numbered from rank 0's rows where the
    world size changes (:func:`world_size_generations`), completion is ``COMPLETED``."""

    def _label(self, rows: list[dict[str, str]]) -> list[dict[str, str]]:
        return [row for g in world_size_generations(rows) for row in g["rows"]]

    def _completed(self) -> bool:
        return (self.efs_dir / "checkpoints" / COMPLETED_FILE).exists()

    def running_generation(self, *, workers: int, without: str | None = None) -> int:
        """The newest generation when it has ``workers`` ranks (and ``without``'s agent has exited:
        the rows do not name nodes, and a node whose agent is gone runs no rank), else 0."""
        newest = self._rows[-1] if self._rows else None
        if newest is None or int(newest["num_workers"]) != workers:
            return 0
        if without and self.runner.nodes[without].alive:
            return 0
        return int(newest["generation"])


def _collect(efs_dir: Path, results: Path, report: dict[str, Any], framework: ClusterFramework) -> None:
    """Copy the step logs, ``result.json``, ``COMPLETED`` and the membership events (PyTorch: the
    rendezvous) off the EFS and fill the report's step, membership and accuracy fields."""
    from spot_training.agent.torch_elastic import RENDEZVOUS_FILE

    results.mkdir(parents=True, exist_ok=True)
    for path in list((efs_dir / "logs").glob("steps-*.csv")) + [efs_dir / "logs" / "result.json",
                                                              efs_dir / "checkpoints" / COMPLETED_FILE,
                                                              efs_dir / "cluster" / "events.jsonl",
                                                              efs_dir / "cluster" / RENDEZVOUS_FILE]:
        if path.exists():
            shutil.copy2(path, results / path.name)
    completed = results / COMPLETED_FILE
    report["completed"] = completed.exists()
    if report["completed"]:
        report["steps_total"] = int(json.loads(completed.read_text())["step"])
    rows = _read_rows(results)
    rank0 = [int(r["step"]) for r in rows if r["rank"] == "0"]
    report["steps_executed"] = len(rank0)
    report["distinct_steps"] = len(set(rank0))
    report["lost_steps"] = len(rank0) - report["steps_total"] if report["completed"] else None
    report["max_workers_seen"] = max((int(r["num_workers"]) for r in rows), default=0)
    if framework.plan_generations:
        lines = (results / "events.jsonl").read_text().splitlines() if (results / "events.jsonl").exists() else []
        plan = [json.loads(x) for x in lines if x.strip()]
        report["joins"], report["leaves"], report["generations"] = membership_changes(plan)
        report["world_sizes"] = [len(event.get("workers", [])) for event in plan if event.get("state") == "running"]
    else:
        generations = world_size_generations(rows)
        report["joins"], report["leaves"], report["generations"] = world_size_changes(generations)
        report["world_sizes"] = [g["num_workers"] for g in generations]
        if (results / RENDEZVOUS_FILE).exists():
            report["rendezvous_epoch"] = int(json.loads((results / RENDEZVOUS_FILE).read_text())["epoch"])
    result = results / "result.json"
    if result.exists():
        report["test_accuracy"] = json.loads(result.read_text()).get("test_accuracy")


def cluster_passed(report: dict[str, Any], options: ClusterDrillOptions) -> bool:
    """Whether the cluster drill passed.

    Passed: completed at exactly ``options.steps`` with every step run once, a worker joined and one
    left, the fleet cancelled by the agents, the figures read back from the local AWS (status and cost,
    with the notice among the agents' published logs), nothing orphaned, no error.

    Args:
        report: the drill's report.
        options: its options.

    Returns:
        True when every condition holds.
    """
    return bool(
        report.get("read_back_error") is None and report.get("cost") is not None
        and len(report.get("aws_interruptions") or []) >= 1 and
        report["completed"] and report["error"] is None and report["steps_total"] == options.steps
        and report["steps_executed"] == options.steps and report["distinct_steps"] == options.steps
        and report["lost_steps"] == 0 and report["joins"] >= 1 and report["leaves"] >= 1
        and report["max_workers_seen"] >= options.workers + 1 and report["fleet_cancelled_on_completion"]
        and report["orphans_after_destroy"] == []
    )


def format_cluster_report(report: dict[str, Any]) -> str:
    """The report as a two-column table for the terminal."""
    keys = ("passed", "framework", "completed", "steps_total", "steps_executed", "distinct_steps", "lost_steps", "generations",
            "world_sizes",
            "joins", "leaves", "max_workers_seen", "join_s", "leave_s", "test_accuracy",
            "fleet_cancelled_on_completion", "orphans_after_destroy", "savings_pct", "wall_s")
    keys += ("rendezvous_epoch",) if report.get("rendezvous_epoch") is not None else ()
    lines = ["", "Cluster drill report", "-" * 60]
    lines += [f"{key:<30}  {report.get(key)}" for key in keys]
    lines += [f"{'phase ' + name + ' (s)':<30}  {value}" for name, value in report.get("phases_s", {}).items()]
    if report.get("error"):
        lines.append(f"{'error':<30}  {report['error']}")
    return "\n".join(lines) + "\n"


__all__ = ["CLUSTER_FRAMEWORKS", "ClusterDrillOptions", "ClusterFramework", "ClusterNodeRunner", "DeployedCluster", "DrillError", "cluster_orphans",
           "cluster_passed", "cluster_resources", "format_cluster_report",
           "membership_changes", "run_cluster_drill", "world_size_changes", "world_size_generations"]
