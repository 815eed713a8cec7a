"""Command line of the node agent: ``python3 -m spot_training.agent <command> --config PATH``.

Commands:

- ``run``: the whole boot sequence of a node: IMDS identity -> data volume (find, move, attach,
  mount) -> EFS if configured -> the dataset from S3 if configured (once, verified) -> supervise the trainer while watching for interruption notices ->
  cancel the fleet when training completed. This is what the systemd unit runs.
- ``check-config``: validate the config and print a summary; touches nothing.
- ``attach-volume``: only the data-volume step (prints the mount point).
- ``supervise``: only the trainer (the volume must already be mounted) with the notice watcher.
- ``cleanup``: only the fleet cancellation (our stack's fleet only).

``main()`` reads straight through: parse, load and validate the config, set up logging once, act. The
exit status is an :class:`~spot_training.agent.errors.ExitCode`: 0 done, 75 try again later, 78 bad config. A
bad config exits 78 before any AWS client is created or any request made.

Local mode: when ``SPOT_TRAINING_BLOCKDEV_DIR`` is set, volumes are directories under it
(``spot_training.agent.blockdev.DirectoryBlockDevices``) instead of Linux block devices, and a training user that
does not exist falls back to the current user; ``SPOT_TRAINING_ROOT`` is the node's file-system root,
put in front of the config's paths (``spot_training.agent.config.with_root``).
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import signal
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

from spot_training.agent.config import DEFAULT_CONFIG_PATH, PORT_OFFSET_ENV, ROOT_ENV, AgentConfig, load_config
from spot_training.agent.errors import AgentError, ConfigError, ExitCode, NodeUnusableError
from spot_training.agent.logs import add_file_handler, flush_logs, setup_logging
from spot_training.contract import ENV_ON_BOOT_FAILURE

log = logging.getLogger("spot_training.agent.cli")

#: Local mode: volumes are directories under this path (spot_training.agent.blockdev.DirectoryBlockDevices).
BLOCKDEV_DIR_ENV = "SPOT_TRAINING_BLOCKDEV_DIR"
#: The command that powers a node off when it can no longer work (shell words). Default on an
#: instance: ``systemctl poweroff`` (the launch template sets InstanceInitiatedShutdownBehavior=terminate,
#: so the spot fleet replaces the instance); in local mode nothing is powered off unless this is set.
POWEROFF_COMMAND_ENV = "SPOT_TRAINING_POWEROFF_COMMAND"
DEFAULT_POWEROFF_COMMAND = ("systemctl", "poweroff")
# AWS error codes that waiting will not fix: the instance role or the config is wrong.
_PERMANENT_AWS_ERRORS = frozenset({"UnauthorizedOperation", "AccessDenied", "AccessDeniedException",
                                   "AuthFailure", "InvalidClientTokenId", "OptInRequired"})


@dataclass(frozen=True)
class Identity:
    """Who this node is, from IMDS."""

    instance_id: str
    availability_zone: str
    region: str


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    """Parse the command line (argparse exits 2 on a usage error)."""
    parser = argparse.ArgumentParser(prog="python3 -m spot_training.agent", description="Spot training node agent.")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    helps = {
        "run": "find/move/attach/mount the data volume, supervise training, clean up when complete",
        "check-config": "validate the config and print a summary (touches nothing)",
        "attach-volume": "only bring the data volume to this instance and mount it",
        "supervise": "only run and supervise the trainer (volume already mounted)",
        "cleanup": "only cancel this instance's spot fleet (if it belongs to our stack)",
    }
    for name, text in helps.items():
        cmd = sub.add_parser(name, help=text, description=text)
        cmd.add_argument("--config", type=Path, default=DEFAULT_CONFIG_PATH,
                         help=f"node config JSON (default: {DEFAULT_CONFIG_PATH})")
        cmd.add_argument("--log-level", default="INFO", choices=["DEBUG", "INFO", "WARNING", "ERROR"])
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    """Entry point; returns the exit status (see the module docstring)."""
    args = parse_args(argv)
    setup_logging(level=args.log_level)
    booting = args.command == "run"
    try:
        config = load_config(args.config, root=os.environ.get(ROOT_ENV), port_offset=os.environ.get(PORT_OFFSET_ENV))
    except ConfigError as exc:
        return _fail(exc, ExitCode.CONFIG, boot_step="config" if booting else None)
    try:
        return int(COMMANDS[args.command](config))
    except NodeUnusableError as exc:
        return _hand_node_back(exc)
    except AgentError as exc:
        return _fail(exc, exc.exit_code, boot_step=_boot_step(exc) if booting else None)
    except Exception as exc:  # botocore errors: classified, not swallowed (logged with the traceback)
        code = _aws_exit_code(exc)
        if code is None:
            raise
        return _fail(exc, code, boot_step="config" if booting and code is ExitCode.CONFIG else None)
    finally:
        flush_logs()


def _boot_step(exc: AgentError) -> str | None:
    """The boot step an error of ``run`` ends the node at, or None when systemd should just retry.

    ``config`` (exit 78: a replacement would fail alike), ``environment`` (the trainer's venv could not
    be built: counted, the node is replaced up to the failed-boot bound), ``trainer`` (it crashed more
    than ``max_restarts`` times in a row).
    """
    from spot_training.agent.supervisor import TrainerFailedError
    from spot_training.agent.workspace import EnvironmentBuildFailed

    if isinstance(exc, EnvironmentBuildFailed):
        return "environment"
    if isinstance(exc, TrainerFailedError):
        return "trainer"
    if exc.exit_code is ExitCode.CONFIG:
        return "config"
    return None


#: Boot steps whose failure a replacement node would repeat: the fleet is cancelled at once.
_FINAL_BOOT_STEPS = frozenset({"config", "trainer"})


def report_boot_failure(step: str, message: str, *, environ: Any = None, timeout_s: float = 300.0) -> bool:
    """Run the unit's boot-failure script (``$SPOT_TRAINING_ON_BOOT_FAILURE STEP MESSAGE count|final``).

    The script reports where the user sees it (console output, the ``spot-training:boot-error``
    instance tag), counts the failed boot on the data volume, cancels the fleet when the bound is
    reached or the step is final, and shuts the instance down (docs/agent.md, "Boot failures").

    Args:
        step: the boot step that failed; ``config`` and ``trainer`` are final (a replacement would fail
            the same way), any other step is counted.
        message: the error, one line (whitespace collapsed, cut to 500 characters for the script).
        environ: where ``$SPOT_TRAINING_ON_BOOT_FAILURE`` is read (default ``os.environ``).
        timeout_s: seconds the script may run (default 300).

    Returns:
        True when the script ran (whatever its exit status: it shuts the instance down); False (and
        logs why) when no script is configured (the agent runs outside its unit) or it could not be run.
    """
    import subprocess

    env = os.environ if environ is None else environ
    script = env.get(ENV_ON_BOOT_FAILURE)
    mode = "final" if step in _FINAL_BOOT_STEPS else "count"
    if not script:
        log.warning("boot failure not reported: no boot-failure script (the agent runs outside its unit)",
                    extra={"boot_step": step, "variable": ENV_ON_BOOT_FAILURE})
        return False
    log.error("boot failed; reporting and shutting down", extra={"boot_step": step, "mode": mode, "script": script})
    flush_logs()
    try:
        done = subprocess.run([script, step, " ".join(message.split())[:500], mode], timeout=timeout_s,
                              stdin=subprocess.DEVNULL, capture_output=True, text=True)
    except (OSError, subprocess.SubprocessError) as exc:
        log.error("the boot-failure script could not run", extra={"script": script, "error": repr(exc)})
        return False
    log.info("boot-failure script done", extra={"exit_status": done.returncode, "output": done.stderr.strip()[-2000:]})
    return True


def _fail(exc: BaseException, code: ExitCode, *, boot_step: str | None = None) -> int:
    """Report ``exc`` (and, for a boot step of ``run``, run the boot-failure script); the exit status."""
    if boot_step is not None and report_boot_failure(boot_step, str(exc)):
        code = ExitCode.UNAVAILABLE
    log.error(str(exc), extra={"error": type(exc).__name__, "exit_code": int(code)})
    flush_logs()
    print(f"bootstrap: error: {exc}", file=sys.stderr)
    return int(code)


def _hand_node_back(exc: NodeUnusableError) -> int:
    """Log why this node stops working, then power it off (docs/agent.md, "A node that can no longer
    work"): exit 78 would leave an idle instance billing under systemd; powering off with the launch
    template's terminate behaviour lets the spot fleet launch a replacement. Returns 69."""
    log.error(str(exc), extra={"event": "node_unusable", "error": type(exc).__name__,
                               "exit_code": int(ExitCode.UNAVAILABLE)})
    raw = os.environ.get(POWEROFF_COMMAND_ENV)
    if raw is None and _local_mode():
        log.warning("local mode: not powering off this machine", extra={"event": "poweroff_skipped"})
        print("bootstrap: local mode: not powering off this machine", file=sys.stderr)
    else:
        import shlex
        import subprocess

        argv = shlex.split(raw) if raw is not None else list(DEFAULT_POWEROFF_COMMAND)
        log.warning("powering the node off so that the fleet replaces it", extra={"event": "poweroff", "argv": argv})
        flush_logs()
        try:
            done = subprocess.run(argv, check=False, capture_output=True, text=True, timeout=60)
            if done.returncode != 0:
                log.error("power-off command failed", extra={"argv": argv, "exit_status": done.returncode,
                                                             "stderr": done.stderr.strip()[-300:]})
        except (OSError, subprocess.TimeoutExpired) as error:
            log.error("power-off command could not run", extra={"argv": argv, "error": str(error)})
    flush_logs()
    print(f"bootstrap: error: {exc}", file=sys.stderr)
    return int(ExitCode.UNAVAILABLE)


def _aws_exit_code(exc: BaseException) -> ExitCode | None:
    """Exit code for a botocore error, or None for anything else (a bug: let it raise)."""
    try:
        from botocore.exceptions import BotoCoreError, ClientError
    except ImportError:  # pragma: no cover - boto3 is the agent's one dependency
        return None
    if isinstance(exc, ClientError):
        code = exc.response.get("Error", {}).get("Code", "")
        return ExitCode.CONFIG if code in _PERMANENT_AWS_ERRORS else ExitCode.TEMPFAIL
    if isinstance(exc, BotoCoreError):  # no credentials, endpoint unreachable, waiter timeout
        return ExitCode.TEMPFAIL
    return None


# ---- the steps ----------------------------------------------------------------------------------
def _imds(config: AgentConfig):
    from spot_training.agent.imds import ENDPOINT_ENV, ImdsClient

    if config.imds_endpoint:
        os.environ[ENDPOINT_ENV] = config.imds_endpoint  # botocore's own IMDS use follows the same endpoint
    return ImdsClient(config.imds_endpoint)


def _identity(imds: Any, config: AgentConfig) -> Identity:
    # One request for all three (the identity document) instead of three metadata paths.
    document = imds.identity_document()
    try:
        identity = Identity(instance_id=document["instanceId"], availability_zone=document["availabilityZone"],
                            region=document["region"])
    except (KeyError, TypeError):
        raise AgentError(f"IMDS instance identity document lacks instanceId/availabilityZone/region: {document!r}") from None
    if identity.region != config.region:
        raise ConfigError(f"region: got {config.region!r} but this instance runs in {identity.region!r}; expected "
                          "the instance's region (the stack writes its own region)")
    log.info("instance identity", extra={"instance_id": identity.instance_id,
                                         "availability_zone": identity.availability_zone, "region": identity.region})
    return identity


def _ec2(config: AgentConfig) -> Any:
    from spot_training.agent.cleanup import ec2_client

    return ec2_client(config.region)


def _block_devices() -> Any:
    from spot_training.agent import blockdev

    root = os.environ.get(BLOCKDEV_DIR_ENV)
    return blockdev.DirectoryBlockDevices(Path(root)) if root else blockdev.LinuxBlockDevices()


def _local_mode() -> bool:
    return bool(os.environ.get(BLOCKDEV_DIR_ENV))


def _attach_volume(config: AgentConfig, ec2: Any, identity: Identity, blockdev: Any) -> Path:
    from spot_training.agent.ebs import prepare_data_volume

    mount_point = prepare_data_volume(ec2=ec2, config=config, instance_id=identity.instance_id,
                                      availability_zone=identity.availability_zone, blockdev=blockdev,
                                      log=logging.getLogger("spot_training.agent.ebs"))
    add_file_handler(config.training.log_dir)  # from now on the agent's log is on the volume too
    log.info("data volume mounted", extra={"mount_point": str(mount_point)})
    return Path(mount_point)


def _require_efs_utils(config: AgentConfig) -> None:
    """Exit 78 before any resource is touched when the config has EFS and ``mount.efs`` is missing
    (spot_training.agent.efs: there is no anonymous NFS fallback). Local mode's EFS is a directory: not checked."""
    if config.efs is None or _local_mode():
        return
    from spot_training.agent import efs

    efs.require_mount_helper(config.efs)


def _check_ami(config: AgentConfig) -> None:
    """Exit 78 (boot step ``config``, final) naming what the AMI lacks (spot_training.agent.ami_check)."""
    from spot_training.agent.ami_check import check_node

    check_node(config, local_mode=_local_mode())


def _mount_efs(config: AgentConfig) -> None:
    if config.efs is None:
        return
    if _local_mode():
        # Local mode has no NFS server: the nodes share a plain directory the runner created.
        config.efs.mount_point.mkdir(parents=True, exist_ok=True)
        log.info("local mode: EFS is a shared directory", extra={"mount_point": str(config.efs.mount_point)})
        return
    from spot_training.agent import efs

    efs.mount_efs(config.efs, region=config.region, log=logging.getLogger("spot_training.agent.efs"))


def _prepare_dataset(config: AgentConfig) -> None:
    """Bring ``config.dataset`` onto the volume before the trainer starts (spot_training.agent.dataset)."""
    from spot_training.agent.dataset import prepare_dataset

    result = prepare_dataset(config)
    if result is not None:
        log.info("dataset ready", extra={"dataset": result})


def _is_mounted(devices: Any, mount_point: Path, *, device: str | None = None) -> Callable[[], bool]:
    """A check for the supervisor: something is mounted at ``mount_point`` and, when ``device`` is given
    (what the volume step mounted), it is still that device."""
    from spot_training.agent.blockdev import is_mounted

    if device is None:
        return lambda: is_mounted(devices, str(mount_point))
    return lambda: devices.mounted_source(str(mount_point)) == device


def _supervise(config: AgentConfig, imds: Any, is_mounted: Callable[[], bool], publisher: Any = None,
               on_environment_ready: Callable[[], None] | None = None):
    from spot_training.agent.imds import ImdsForbiddenError
    from spot_training.agent.interruption import InterruptionWatcher, imds_monitors
    from spot_training.agent.supervisor import Supervisor

    supervisor = Supervisor(config, is_mounted=is_mounted, run_as_current_user_if_missing=_local_mode(),
                            output=publisher.add_line if publisher is not None else None)
    if not supervisor.workspace.completed():
        supervisor.workspace.prepare_environment()
        if on_environment_ready is not None:
            on_environment_ready()
    watcher = InterruptionWatcher(imds_monitors(imds), supervisor, poll_interval_s=config.notice_poll_interval_s)
    previous = {sig: signal.signal(sig, lambda *_: supervisor.request_stop()) for sig in (signal.SIGTERM, signal.SIGINT)}
    try:
        outcome = supervisor.run(watcher)
    except ImdsForbiddenError as exc:
        if supervisor.starts == 0:
            raise  # never trained here: IMDS is off from the start, a launch template problem (exit 78)
        # IMDS worked, then turned 403: this node can no longer see interruption notices. The
        # supervisor already stopped the trainer the contract's way (it checkpointed).
        raise NodeUnusableError(f"IMDS answered 403 during training ({exc}); this node can no longer see spot "
                                "interruption notices, so it stops training and hands itself back to the fleet") from exc
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
    log.info("supervision ended", extra={"outcome": outcome.value, "starts": supervisor.starts,
                                         "restarts": supervisor.restarts})
    return outcome


def _start_publisher(config: AgentConfig, imds: Any, identity: Identity) -> Any:
    """The CloudWatch publisher (spot_training.agent.publish) when ``monitoring.enabled``, else None. The
    instance type and launch time come from IMDS; a failure there only leaves them unknown."""
    if config.monitoring is None or not config.monitoring.enabled:
        return None
    import datetime as dt

    from spot_training.agent.publish import start_publisher

    instance_type, boot_time = "unknown", None
    try:
        document = imds.identity_document()
        instance_type = document.get("instanceType") or instance_type
        pending = document.get("pendingTime")
        if pending:
            boot_time = dt.datetime.fromisoformat(pending.replace("Z", "+00:00")).timestamp()
    except Exception as exc:  # noqa: BLE001 - publishing is optional
        log.warning("instance type and launch time unknown for publishing", extra={"error": str(exc)})
    publisher = start_publisher(config, instance_id=identity.instance_id, instance_type=instance_type,
                                availability_zone=identity.availability_zone, boot_time=boot_time)
    if publisher is not None:
        _record_ledger(config, imds, identity, instance_type=instance_type, boot_time=boot_time)
    return publisher


def _record_ledger(config: AgentConfig, imds: Any, identity: Identity, *, instance_type: str,
                   boot_time: float | None) -> None:
    """Write this instance's cost-ledger record (``instance_ledger``: type, AZ, lifecycle, launch time)
    into its log stream, where ``spot-train cost`` and ``status`` find it after EC2 has forgotten the
    instance (about an hour after it terminated); the stream's last event bounds its end. The
    lifecycle is IMDS's ``meta-data/instance-life-cycle`` (``spot``/``on-demand``); where IMDS does not
    say, the node role's (fleet nodes are spot, a cluster's scheduler and servers on demand)."""
    import datetime as dt

    lifecycle = "spot" if config.node_role in ("single", "worker") else "on-demand"
    try:
        status, body = imds.get("meta-data/instance-life-cycle")
        if status == 200 and body.strip() in ("spot", "on-demand", "scheduled"):
            lifecycle = body.strip()
    except Exception as exc:  # noqa: BLE001 - the role's default stands
        log.debug("instance-life-cycle unknown", extra={"error": str(exc)})
    launch = dt.datetime.fromtimestamp(boot_time if boot_time is not None else time.time(), tz=dt.timezone.utc)
    log.info("instance ledger: launched", extra={
        "event": "instance_ledger", "instance_id": identity.instance_id, "instance_type": instance_type,
        "availability_zone": identity.availability_zone, "lifecycle": lifecycle,
        "launch_time": launch.isoformat(timespec="seconds"), "node_role": config.node_role})


def _reset_failed_boots(config: AgentConfig, ec2: Any, identity: Identity, autoscaling: Any = None) -> None:
    """The boot succeeded (storage mounted, trainer's environment ready): remove the failed-boot count
    where the boot-failure script keeps it (spot_training/infra/userdata.py): the data volume attached here (single
    node), else this instance's spot fleet request (cluster worker) or Auto Scaling group (cluster
    scheduler and servers; ``autoscaling`` is a boto3 Auto Scaling client, made when needed). Best
    effort: a failure is logged, never fatal."""
    from spot_training.agent.config import FAILED_BOOTS_TAG

    def cleared(where: dict[str, Any], count: str) -> None:
        log.info("boot succeeded; failed-boot count cleared", extra={**where, "failed_boots": count})

    try:
        if config.node_role == "single":
            filters = [{"Name": "attachment.instance-id", "Values": [identity.instance_id]}]
            filters += [{"Name": f"tag:{k}", "Values": [v]} for k, v in config.volume.tags.items()]
            for volume in ec2.describe_volumes(Filters=filters)["Volumes"]:
                count = {t["Key"]: t["Value"] for t in volume.get("Tags", [])}.get(FAILED_BOOTS_TAG)
                if count is not None:
                    ec2.delete_tags(Resources=[volume["VolumeId"]], Tags=[{"Key": FAILED_BOOTS_TAG}])
                    cleared({"volume_id": volume["VolumeId"]}, count)
            return
        own = {t["Key"]: t["Value"] for t in ec2.describe_tags(Filters=[
            {"Name": "resource-id", "Values": [identity.instance_id]},
            {"Name": "key", "Values": ["aws:ec2spot:fleet-request-id", "aws:autoscaling:groupName"]}])["Tags"]}
        fleet, group = own.get("aws:ec2spot:fleet-request-id"), own.get("aws:autoscaling:groupName")
        if fleet:
            for tag in ec2.describe_tags(Filters=[{"Name": "resource-id", "Values": [fleet]},
                                                  {"Name": "key", "Values": [FAILED_BOOTS_TAG]}])["Tags"]:
                ec2.delete_tags(Resources=[fleet], Tags=[{"Key": FAILED_BOOTS_TAG}])
                cleared({"spot_fleet_request_id": fleet}, tag["Value"])
        elif group:
            if autoscaling is None:
                import boto3

                from spot_training.agent.retry import client_config

                autoscaling = boto3.client("autoscaling", region_name=config.region, config=client_config())
            for tag in autoscaling.describe_tags(Filters=[{"Name": "auto-scaling-group", "Values": [group]},
                                                          {"Name": "key", "Values": [FAILED_BOOTS_TAG]}])["Tags"]:
                autoscaling.delete_tags(Tags=[{"ResourceId": group, "ResourceType": "auto-scaling-group",
                                               "Key": FAILED_BOOTS_TAG}])
                cleared({"auto_scaling_group": group}, tag["Value"])
    except Exception as exc:  # noqa: BLE001 - botocore errors; the count is advisory
        log.warning("could not clear the failed-boot count", extra={"error": repr(exc)})


def _cleanup(config: AgentConfig, ec2: Any, identity: Identity) -> None:
    from spot_training.agent.cleanup import cancel_own_fleet

    if not config.cleanup.cancel_fleet_on_success:
        log.info("training completed; cleanup.cancel_fleet_on_success is false, leaving the fleet running")
        return
    cancel_own_fleet(ec2=ec2, instance_id=identity.instance_id, stack_name=config.stack_name)


# ---- commands -----------------------------------------------------------------------------------
def cmd_run(config: AgentConfig) -> ExitCode:
    """The whole node lifecycle (see the module docstring)."""
    from spot_training.agent.supervisor import Outcome

    _require_efs_utils(config)
    imds = _imds(config)
    identity = _identity(imds, config)
    _check_ami(config)
    if config.node_role != "single":
        # Parameter-server cluster nodes keep data, checkpoints and membership on EFS (no data volume).
        from spot_training.agent.cluster import run_node
        from spot_training.agent.publish import stop_publisher

        publisher = _start_publisher(config, imds, identity)
        try:
            _mount_efs(config)
            # Local mode has an EC2 API only when a moto server is named (AWS_ENDPOINT_URL).
            aws = not _local_mode() or bool(os.environ.get("AWS_ENDPOINT_URL"))
            run_node(config, imds, instance_id=identity.instance_id, local_mode=_local_mode(),
                     on_environment_ready=(lambda: _reset_failed_boots(config, _ec2(config), identity)) if aws else None)
        finally:
            stop_publisher(publisher)
        return ExitCode.OK
    publisher = _start_publisher(config, imds, identity)
    try:
        ec2 = _ec2(config)
        blockdev = _block_devices()
        mount_point = _attach_volume(config, ec2, identity, blockdev)
        _mount_efs(config)
        device = blockdev.mounted_source(str(mount_point))
        _prepare_dataset(config)
        from spot_training.agent.snapshots import PeriodicSnapshots

        # Periodic snapshots while training (volume.snapshot_interval_s; 0: none), so a move copies little.
        snapshots = PeriodicSnapshots(ec2=ec2, stack_name=config.stack_name, volume=config.volume,
                                      instance_id=identity.instance_id, log=logging.getLogger("spot_training.agent.snapshots")).start()
        try:
            outcome = _supervise(config, imds, _is_mounted(blockdev, mount_point, device=device), publisher,
                                 on_environment_ready=lambda: (_reset_failed_boots(config, ec2, identity),
                                                               snapshots.take_soon()))
        finally:
            snapshots.stop()
        if outcome is Outcome.COMPLETED:
            _cleanup(config, ec2, identity)
    finally:
        from spot_training.agent.publish import stop_publisher

        stop_publisher(publisher)  # a last round: the notice->checkpoint figure, the last lines
    return ExitCode.OK


def cmd_check_config(config: AgentConfig) -> ExitCode:
    """Print a one-line JSON summary of the valid config."""
    print(json.dumps({"config": "valid", "stack_name": config.stack_name, "region": config.region,
                      "node_role": config.node_role, "mount_point": str(config.volume.mount_point),
                      "framework": config.training.framework, "command": config.training.argv(),
                      "code": config.training.code.type, "efs": config.efs is not None}))
    return ExitCode.OK


def cmd_attach_volume(config: AgentConfig) -> ExitCode:
    """Find, move if needed, attach and mount the data volume; print its mount point."""
    imds = _imds(config)
    identity = _identity(imds, config)
    mount_point = _attach_volume(config, _ec2(config), identity, _block_devices())
    print(json.dumps({"mount_point": str(mount_point)}))
    return ExitCode.OK


def cmd_supervise(config: AgentConfig) -> ExitCode:
    """Run the trainer on the already-mounted volume, watching for notices (no cleanup)."""
    mounted = _is_mounted(_block_devices(), config.volume.mount_point)
    if mounted():
        add_file_handler(config.training.log_dir)
    outcome = _supervise(config, _imds(config), mounted)
    print(json.dumps({"outcome": outcome.value}))
    return ExitCode.OK


def cmd_cleanup(config: AgentConfig) -> ExitCode:
    """Cancel this instance's spot fleet if it carries our stack tag."""
    from spot_training.agent.cleanup import cancel_own_fleet

    identity = _identity(_imds(config), config)
    fleet_id = cancel_own_fleet(ec2=_ec2(config), instance_id=identity.instance_id, stack_name=config.stack_name)
    print(json.dumps({"cancelled_fleet_request_id": fleet_id}))
    return ExitCode.OK


COMMANDS: dict[str, Callable[[AgentConfig], ExitCode]] = {
    "run": cmd_run,
    "check-config": cmd_check_config,
    "attach-volume": cmd_attach_volume,
    "supervise": cmd_supervise,
    "cleanup": cmd_cleanup,
}
