"""The node runner: each running fleet instance in the moto server becomes a local process.

A local node is what a spot instance of the stack would run, on this machine:

- its **boot** is the launch template's own user data, run with ``bash`` by
  :mod:`spot_training.local.node_init` under ``<work_dir>/nodes/<instance-id>/root`` (``SPOT_TRAINING_ROOT``), with
  the AWS CLI at the moto server, then the agent's unit the user data enabled (``systemctl`` and
  ``shutdown`` are stand-ins: docs/localmode.md, "The boot script"); the user data downloads the
  bootstrap asset ``cdk deploy`` uploaded to moto's S3, writes the config and starts the agent;
- its **config**, as the runner reads it (:attr:`LocalNode.config`), is the launch template's with the
  node root in front of its paths (:func:`rooted_node_config`, the agent's own rule);
- its **instance metadata** is an :class:`~spot_training.local.imds_emulator.ImdsEmulator` of its own, with the
  moto instance's identity (tokens enforced), named by ``AWS_EC2_METADATA_SERVICE_ENDPOINT``;
- its **agent** runs with ``SPOT_TRAINING_BLOCKDEV_DIR`` at the moto server's EBS data plane and pip
  pointed at a local wheel directory (docs/contracts.md, "Environment local mode gives the agent");
- its **EFS** (a config with an ``efs`` section, when the runner has an ``efs_dir``): the mount point
  under the node root is a symlink to that one directory, which every node shares (the runner stands in
  for ``mount.efs``, as the blockdev directories stand in for EBS).
  Cluster nodes (spot_training.local.cluster_drill) boot the same way, :meth:`NodeRunner.boot_node`, each from its
  role's launch template, in a network namespace of its own.

moto's Spot Fleet does not maintain capacity (moto 5.2.5 never replaces a terminated instance, and
launches only into the first override of a launch template config), so :meth:`NodeRunner.launch_for_fleet`
acts for the fleet: it launches a replacement from the fleet's launch template into the subnet of the
chosen Availability Zone, tagged as EC2 tags fleet instances (``aws:ec2spot:fleet-request-id``) and with
the launch template's own tags. When the fleet request is cancelled with its instances (the agent does
that when training completes), :meth:`NodeRunner.reconcile` terminates the instances it launched, as
EC2 would. Everything is stopped by PID; nothing is written outside ``work_dir``.
"""

from __future__ import annotations

import base64
import dataclasses
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from spot_training import contract
from spot_training.agent.cli import BLOCKDEV_DIR_ENV
from spot_training.local.deploy import FLEET_TAG, STACK_TAG_KEY, Clients, DeployedStack
from spot_training.local.imds_emulator import ImdsEmulator

#: Seconds an agent gets to stop its trainer after SIGTERM before its process group is killed.
DEFAULT_STOP_TIMEOUT_S = 60.0


class NodeError(RuntimeError):
    """A node could not be started (the message names the instance and the reason)."""


def launch_template_user_data(aws: Clients, launch_template_id: str) -> str:
    """The decoded user data of the launch template's latest version.

    Args:
        aws: the local AWS clients.
        launch_template_id: the launch template (``lt-…``).

    Returns:
        the user data's text.

    Raises:
        NodeError: the template has no user data.
    """
    versions = aws.ec2.describe_launch_template_versions(LaunchTemplateId=launch_template_id, Versions=["$Latest"])
    data = versions["LaunchTemplateVersions"][0]["LaunchTemplateData"]
    encoded = data.get("UserData")
    if not encoded:
        raise NodeError(f"launch template {launch_template_id} has no user data; expected the stack's node config")
    return base64.b64decode(encoded).decode("utf-8")


def rooted_node_config(deployed: dict[str, Any], *, root: Path) -> dict[str, Any]:
    """The node config as the agent of a local node whose file-system root is ``root`` reads it.

    Every file-system path is put under ``root`` (:func:`spot_training.agent.config.with_root`, the
    agent's own rule).

    Args:
        deployed: the node config the stack deployed (not changed).
        root: the node's file-system root.

    Returns:
        a copy with the paths under ``root``.
    """
    from spot_training.agent.config import with_root

    return with_root(deployed, root)


def node_environment(*, node_dir: Path, region: str, endpoint_url: str, imds_endpoint: str, volumes_dir: Path,
                     python: str, wheel_dir: Path | None) -> dict[str, str]:
    """The environment a local node's user data (and so its agent) runs with (docs/localmode.md, "The boot script").

    This process's environment minus ``AWS_*``/``SPOT_TRAINING_*``/``PIP_*``/``PYTHONPATH``, plus fake
    credentials, ``AWS_ENDPOINT_URL`` (the moto server, for boto3 and the AWS CLI),
    ``AWS_EC2_METADATA_SERVICE_ENDPOINT`` (the node's emulator), ``SPOT_TRAINING_ROOT`` =
    ``<node_dir>/root``, ``SPOT_TRAINING_AGENT_PYTHON`` = ``python``, ``SPOT_TRAINING_CONSOLE`` =
    ``<node_dir>/console.log``, ``SPOT_TRAINING_BLOCKDEV_DIR`` = ``volumes_dir``, a ``HOME`` in
    ``node_dir``, ``python``'s directory first on ``PATH`` (the ``aws`` CLI of the project's venv) and,
    with ``wheel_dir``, ``PIP_NO_INDEX=1`` and ``PIP_FIND_LINKS`` (the trainer's environment installs
    offline).

    Args:
        node_dir: the node's directory.
        region: the stack's region.
        endpoint_url: the moto server.
        imds_endpoint: the node's IMDS emulator.
        volumes_dir: the EBS data plane's volume directories.
        python: the interpreter that runs the agent.
        wheel_dir: a directory of wheels for offline installs, or None.

    Returns:
        the environment.
    """
    from spot_training.infra.userdata import AGENT_PYTHON_ENV, CONSOLE_ENV

    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("AWS_", "SPOT_TRAINING_", "PIP_")) and k != "PYTHONPATH"}
    env.update({
        "AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing", "AWS_SESSION_TOKEN": "testing",
        "AWS_REGION": region, "AWS_DEFAULT_REGION": region, "AWS_ENDPOINT_URL": endpoint_url,
        "AWS_EC2_METADATA_SERVICE_ENDPOINT": imds_endpoint,
        contract.ENV_ROOT: str(node_dir / "root"), AGENT_PYTHON_ENV: python,
        CONSOLE_ENV: str(node_dir / "console.log"),
        BLOCKDEV_DIR_ENV: str(volumes_dir),
        "PYTHONUNBUFFERED": "1", "PYTHONDONTWRITEBYTECODE": "1", "TF_CPP_MIN_LOG_LEVEL": "2",
        "HOME": str(node_dir / "home"),
        "PATH": f"{Path(python).parent}{os.pathsep}{os.environ.get('PATH', '')}",
    })
    if wheel_dir is not None:
        env.update({"PIP_NO_INDEX": "1", "PIP_FIND_LINKS": str(wheel_dir), "PIP_DISABLE_PIP_VERSION_CHECK": "1"})
    return env


def start_node_init(user_data: str, *, node_dir: Path, env: dict[str, str], python: str) -> subprocess.Popen[bytes]:
    """Write ``user_data`` to ``<node_dir>/user-data`` and start ``python -m spot_training.local.node_init`` on it.

    node_init runs the user data, then the units it enabled (spot_training/local/node_init.py), in a
    session of its own (stop it by PID), output to ``<node_dir>/agent.log``.

    Args:
        user_data: the launch template's user data.
        node_dir: the node's directory (created).
        env: the environment (:func:`node_environment`).
        python: the interpreter to run node_init with.

    Returns:
        the started process.

    Raises:
        OSError: the files cannot be written or the process cannot be started.
    """
    node_dir.mkdir(parents=True, exist_ok=True)
    (node_dir / "home").mkdir(exist_ok=True)
    (node_dir / "user-data").write_text(user_data)
    repo = Path(__file__).resolve().parents[2]
    with open(node_dir / "agent.log", "ab") as log:
        return subprocess.Popen(
            [python, "-m", "spot_training.local.node_init", "--user-data", str(node_dir / "user-data")],
            cwd=repo, env=env, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
            start_new_session=True,
        )


@dataclasses.dataclass
class LocalNode:
    """One fleet instance running as local processes.

    Attributes:
        instance_id: the moto instance's id.
        availability_zone: its AZ.
        node_dir: ``<work_dir>/nodes/<instance-id>``; ``agent.log`` there holds the stand-in init's,
            the user data's, the agent's and the trainer's output, ``user-data`` the script, ``root/`` the
            node's file-system root (the user data writes ``root/etc/spot-training/config.json``).
        config: the node config as the agent reads it (:func:`rooted_node_config`).
        imds: the node's emulator.
        process: the agent process (its own session; stopped by PID).
        launched_at: ``time.time()`` when the agent was started (seconds).
    """

    instance_id: str
    availability_zone: str
    node_dir: Path
    config: dict[str, Any]
    imds: ImdsEmulator
    process: subprocess.Popen[bytes]
    launched_at: float

    @property
    def mount_point(self) -> Path:
        """The node's mount point (a symlink to the attached volume's directory once mounted)."""
        return Path(self.config["volume"]["mount_point"])

    @property
    def checkpoint_dir(self) -> Path:
        """The trainer's checkpoint directory (under the node's root)."""
        return Path(self.config["training"]["checkpoint_dir"])

    @property
    def log_dir(self) -> Path:
        """The trainer's log directory (under the node's root)."""
        return Path(self.config["training"]["log_dir"])

    @property
    def log_path(self) -> Path:
        """``<node_dir>/agent.log``: the init's, user data's, agent's and trainer's output."""
        return self.node_dir / "agent.log"

    @property
    def alive(self) -> bool:
        """Whether the node's init process is still running."""
        return self.process.poll() is None

    @property
    def shutdown_requested(self) -> bool:
        """Whether the node ran ``shutdown`` (the boot-failure script does; spot_training/local/standins/shutdown)."""
        return (self.node_dir / "root" / "run" / "local-init" / "shutdown").exists()

    def trainer_pids(self) -> list[int]:
        """PIDs of the trainers this node's agent started (from its ``training started`` log lines)."""
        pids = []
        if self.log_path.exists():
            for line in self.log_path.read_text(errors="replace").splitlines():
                if '"training started"' in line:
                    try:
                        pids.append(int(json.loads(line)["pid"]))
                    except (ValueError, KeyError):
                        continue
        return pids

    def post_interruption_notice(self) -> dict[str, str]:
        """Post a spot interruption notice (terminate in two minutes) on the node's IMDS."""
        return self.imds.post_spot_interruption()

    def stop(self, timeout_s: float = DEFAULT_STOP_TIMEOUT_S) -> int | None:
        """Stop the node: SIGTERM the agent (it stops its trainer), then SIGKILL what is left, by PID. Idempotent.

        Args:
            timeout_s: seconds to wait after SIGTERM before SIGKILL (default :data:`DEFAULT_STOP_TIMEOUT_S`).

        Returns:
            the agent's exit status (None if it had to be killed).
        """
        status: int | None = self.process.poll()
        if status is None:
            signal_group(self.process.pid, signal.SIGTERM)
            try:
                status = self.process.wait(timeout=timeout_s)
            except subprocess.TimeoutExpired:
                signal_group(self.process.pid, signal.SIGKILL)
                self.process.wait(timeout=10)
                status = None
        for pid in self.trainer_pids():  # trainers run in sessions of their own
            if _mentions(pid, str(self.node_dir)):  # still our trainer, not a reused PID
                signal_group(pid, signal.SIGKILL)
        self.imds.stop()
        return status


def _mentions(pid: int, text: str) -> bool:
    """Whether live process ``pid``'s command line or environment (the trainer's SPOT_TRAINING_* paths)
    contains ``text``."""
    for name in ("cmdline", "environ"):
        try:
            if text in Path(f"/proc/{pid}/{name}").read_bytes().replace(b"\0", b" ").decode(errors="replace"):
                return True
        except OSError:
            continue
    return False


def signal_group(pid: int, sig: int) -> None:
    """``os.killpg`` that ignores a group already gone (or not ours).

    Args:
        pid: the group leader's pid (the group id).
        sig: the signal number.
    """
    try:
        os.killpg(pid, sig)
    except (ProcessLookupError, PermissionError):
        pass


class NodeRunner:
    """Turns the stack's running fleet instances into :class:`LocalNode` processes and acts for the fleet.

    Args:
        aws: boto3 clients for the moto server.
        endpoint_url: the moto server (given to the agents as ``AWS_ENDPOINT_URL``).
        volumes_dir: the moto server's EBS data plane (``MotoServer.volumes_dir``).
        stack: the deployed stack (fleet, launch template, subnets).
        work_dir: nodes live in ``<work_dir>/nodes/<instance-id>/``.
        python: the agents' interpreter (default: this one); the trainer's is the deployed config's
            ``training_python``, which the node's user data writes.
        on_event: called with a dict for each thing that happens (``{"event": "node-started", ...}``).
    """

    def __init__(self, *, aws: Clients, endpoint_url: str, volumes_dir: Path, stack: DeployedStack,
                 work_dir: Path, python: str = sys.executable,
                 on_event: Callable[[dict[str, Any]], None] | None = None) -> None:
        self.aws = aws
        self.endpoint_url = endpoint_url
        self.volumes_dir = Path(volumes_dir)
        self.stack = stack
        self.work_dir = Path(work_dir)
        self.python = python
        self.on_event = on_event or (lambda event: None)
        self.nodes: dict[str, LocalNode] = {}
        self.launched_for_fleet: list[str] = []
        self._reaped: set[str] = set()
        #: The directory every node's EFS mount point links to (None: no shared EFS; the cluster sets it).
        self.efs_dir: Path | None = None
        self._user_data_texts: dict[str, str] = {}
        #: Wheels the nodes' pip installs from, offline (spot_training/local/wheels.py).
        self.wheel_dir = self.work_dir / "wheels"
        from spot_training.local.wheels import write_probe_wheel

        write_probe_wheel(self.wheel_dir)

    # ---- what the launch template carries ------------------------------------------------------
    def user_data(self, launch_template_id: str | None = None) -> str:
        """Launch template ``launch_template_id``'s user data (default: the fleet's; ``$Latest``,
        decoded; cached per template).

        Raises:
            NodeError: the launch template has no user data.
        """
        template = launch_template_id or self.stack.launch_template_id
        if template not in self._user_data_texts:
            self._user_data_texts[template] = launch_template_user_data(self.aws, template)
        return self._user_data_texts[template]

    def deployed_config(self, launch_template_id: str | None = None) -> dict[str, Any]:
        """The node config launch template ``launch_template_id`` carries (default: the fleet's), read
        from its user data as the user data writes it (a copy)."""
        from spot_training.infra.userdata import extract_config

        return extract_config(self.user_data(launch_template_id))

    # ---- nodes ---------------------------------------------------------------------------------
    def fleet_instances(self) -> list[dict[str, Any]]:
        """Running instances of the stack's fleet (tagged with its fleet request id), oldest first."""
        reservations = self.aws.ec2.describe_instances(Filters=[
            {"Name": f"tag:{FLEET_TAG}", "Values": [self.stack.fleet_request_id]},
            {"Name": "instance-state-name", "Values": ["pending", "running"]},
        ])["Reservations"]
        instances = [i for r in reservations for i in r["Instances"]]
        return sorted(instances, key=lambda i: i["LaunchTime"])

    def sync(self) -> list[LocalNode]:
        """Start a node for each running fleet instance that has none; returns the new nodes."""
        started = []
        for instance in self.fleet_instances():
            if instance["InstanceId"] not in self.nodes:
                started.append(self.start_node(instance["InstanceId"]))
        return started

    def start_node(self, instance_id: str) -> LocalNode:
        """Boot moto instance ``instance_id`` from the fleet's launch template (:meth:`boot_node`)."""
        node = self.boot_node(instance_id, self.stack.launch_template_id)
        self.on_event({"event": "node-started", "instance_id": instance_id,
                       "availability_zone": node.availability_zone, "pid": node.process.pid})
        return node

    def boot_node(self, instance_id: str, launch_template_id: str, *, local_ipv4: str | None = None,
                  extra_env: dict[str, str] | None = None) -> LocalNode:
        """Boot moto instance ``instance_id`` as a local node; it is added to :attr:`nodes`.

        Starts its IMDS emulator (with ``local_ipv4`` as its private address when given), links its EFS
        mount point to :attr:`efs_dir` (when set and the config has EFS), then runs launch template
        ``launch_template_id``'s own user data (which downloads the bootstrap asset from moto's S3, writes
        the config and enables the agent's unit) and the unit, through :mod:`spot_training.local.node_init`,
        with :func:`node_environment` plus ``extra_env``.

        Args:
            instance_id: the moto instance.
            launch_template_id: the launch template whose user data boots it.
            local_ipv4: the node's private address (default: moto's).
            extra_env: more environment (e.g. ``SPOT_TRAINING_NETNS``), or None.

        Returns:
            the started node.

        Raises:
            NodeError: the launch template has no user data.
            ValueError: its config block is malformed.
        """
        node_dir = self.work_dir / "nodes" / instance_id
        deployed = self.deployed_config(launch_template_id)
        imds = ImdsEmulator.from_moto(self.aws.ec2, instance_id, local_ipv4=local_ipv4).start()
        root = node_dir / "root"
        config = rooted_node_config(deployed, root=root)
        if self.efs_dir is not None and isinstance(deployed.get("efs"), dict):
            mount_point = Path(config["efs"]["mount_point"])
            mount_point.parent.mkdir(parents=True, exist_ok=True)
            if not mount_point.is_symlink():
                mount_point.symlink_to(self.efs_dir.resolve(), target_is_directory=True)
        env = node_environment(node_dir=node_dir, region=deployed["region"], endpoint_url=self.endpoint_url,
                               imds_endpoint=imds.endpoint, volumes_dir=self.volumes_dir, python=self.python,
                               wheel_dir=self.wheel_dir)
        env.update(extra_env or {})
        process = start_node_init(self.user_data(launch_template_id), node_dir=node_dir, env=env, python=self.python)
        node = LocalNode(instance_id=instance_id, availability_zone=imds.availability_zone, node_dir=node_dir,
                         config=config, imds=imds, process=process, launched_at=time.time())
        self.nodes[instance_id] = node
        return node

    # ---- acting for the fleet ------------------------------------------------------------------
    def terminate_instance(self, instance_id: str) -> None:
        """Terminate ``instance_id`` in moto (its node must already be stopped) and wait until it is."""
        self.aws.ec2.terminate_instances(InstanceIds=[instance_id])
        self.aws.ec2.get_waiter("instance_terminated").wait(InstanceIds=[instance_id],
                                                            WaiterConfig={"Delay": 1, "MaxAttempts": 60})

    def launch_for_fleet(self, availability_zone: str, *, instance_type: str) -> str:
        """Launch a replacement instance as the ``maintain`` fleet would; returns its id.

        Args:
            availability_zone: the AZ to launch in.
            instance_type: the instance type.

        Returns:
            the instance id.

        Raises:
            ValueError: the stack has no subnet in ``availability_zone`` (names the ones it has).
        """
        subnet = self.stack.subnets.get(availability_zone)
        if subnet is None:
            raise ValueError(f"availability_zone {availability_zone!r} has no subnet in the stack; "
                             f"expected one of {sorted(self.stack.subnets)}")
        tags = [{"Key": FLEET_TAG, "Value": self.stack.fleet_request_id},
                {"Key": STACK_TAG_KEY, "Value": self.stack.name}]
        reservation = self.aws.ec2.run_instances(
            LaunchTemplate={"LaunchTemplateId": self.stack.launch_template_id, "Version": "$Latest"},
            SubnetId=subnet, InstanceType=instance_type, MinCount=1, MaxCount=1,
            InstanceMarketOptions={"MarketType": "spot", "SpotOptions": {"SpotInstanceType": "one-time"}},
            TagSpecifications=[{"ResourceType": "instance", "Tags": tags}],
        )
        instance_id = reservation["Instances"][0]["InstanceId"]
        self.launched_for_fleet.append(instance_id)
        self.on_event({"event": "instance-launched", "instance_id": instance_id,
                       "availability_zone": availability_zone, "by": "fleet (local mode acting for moto)"})
        return instance_id

    def reap_shutdowns(self) -> list[str]:
        """Terminate (in moto) the instances whose node has ended after running ``shutdown``, as EC2 does
        with the launch template's ``InstanceInitiatedShutdownBehavior=terminate``; returns their ids."""
        terminated = []
        for node in list(self.nodes.values()):
            if node.alive or not node.shutdown_requested or node.instance_id in self._reaped:
                continue
            node.stop()
            state = self.aws.ec2.describe_instances(InstanceIds=[node.instance_id])["Reservations"][0]["Instances"][0]["State"]["Name"]
            if state not in ("terminated", "shutting-down"):
                self.aws.ec2.terminate_instances(InstanceIds=[node.instance_id])
            self._reaped.add(node.instance_id)
            terminated.append(node.instance_id)
            self.on_event({"event": "instance-terminated", "instance_id": node.instance_id,
                           "reason": "shut down from the instance (boot failure)"})
        return terminated

    def fleet_active(self) -> bool:
        """Whether the stack's fleet request still exists and is not cancelled."""
        configs = self.aws.ec2.describe_spot_fleet_requests()["SpotFleetRequestConfigs"]
        for config in configs:
            if config["SpotFleetRequestId"] == self.stack.fleet_request_id:
                return not config["SpotFleetRequestState"].startswith("cancelled")
        return False

    def reconcile(self) -> list[str]:
        """If the fleet was cancelled, terminate the instances launched for it (as EC2 does with
        ``TerminateInstances=True``) once their nodes are done; returns the ids terminated."""
        if self.fleet_active():
            return []
        terminated = []
        for instance in self.fleet_instances():
            node = self.nodes.get(instance["InstanceId"])
            if node is not None and node.alive:
                continue
            self.aws.ec2.terminate_instances(InstanceIds=[instance["InstanceId"]])
            terminated.append(instance["InstanceId"])
            self.on_event({"event": "instance-terminated", "instance_id": instance["InstanceId"],
                           "reason": "fleet request cancelled"})
        return terminated

    def close(self) -> None:
        """Stop every node by PID and terminate the instances launched for the fleet that still run."""
        for node in self.nodes.values():
            node.stop()
        for instance_id in self.launched_for_fleet:
            try:
                state = self.aws.ec2.describe_instances(InstanceIds=[instance_id])["Reservations"][0]["Instances"][0]["State"]["Name"]
            except Exception:  # noqa: BLE001 - the server may be gone already; nothing to terminate then
                continue
            if state not in ("terminated", "shutting-down"):
                self.aws.ec2.terminate_instances(InstanceIds=[instance_id])
