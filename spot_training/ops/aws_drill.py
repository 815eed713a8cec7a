"""``spot-train drill --aws``: the local drill's story on a real AWS account, with one real interruption.

Steps (each printed as it happens; the report is ``<work_dir>/report.json``):

1. **preflight** (spot_training/infra/preflight.py) for the drill's types; a failed check stops the drill before
   anything is created.
2. **deploy**: the real ``cdk deploy <stack> --require-approval never -c fis_drill=true -c region=...
   -c instance_types=<small cheap types>`` with ``--outputs-file``.
3. **first node**: the fleet's first running instance (tag ``aws:ec2spot:fleet-request-id``), then its
   newest checkpoint (``LATEST`` on the data volume, read through SSM Run Command
   ``AWS-RunShellScript``, the nodes' only way in: no SSH).
4. **interrupt**: ``fis:StartExperiment`` of the stack's template (``aws:ec2:send-spot-instance-
   interruptions``: the 2-minute notice, then the interruption), wait for the instance to terminate.
5. **resume**: the fleet's replacement; passed when the checkpoint it finds on the volume is at least
   the one seen before the notice (nothing lost with the volume, wherever the replacement landed) and
   a newer one follows (training went on from there).
6. **destroy** (``cdk destroy --force``, unless ``--keep-stack``) and the **orphan** check
   (spot_training.ops.orphans.find_orphans on the real account: tagged instances, volumes, snapshots, fleet
   requests, the stack).
7. **cost**: each drill instance's running time x its Spot price (``ec2:DescribeSpotPriceHistory`` for
   its type and AZ over that time), in USD. Not counted: EBS volumes and snapshots, FIS action
   minutes, data transfer, the CDK asset bucket.

It cannot run without an account; tests/infra/test_aws_drill.py runs the orchestration against the
moto server with a stand-in for the cdk CLI and for the AWS side of the interruption.
Exit codes of :func:`main`: 0 passed, 1 failed (report written), 2 bad arguments or plan only
(no ``--yes``: prints the plan, changes nothing).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
import subprocess
import sys
import time
import uuid
from collections.abc import Callable, Sequence
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

from spot_training.infra.preflight import EXIT_FAILED, Target, default_client_factory, exit_code, format_checks, run_checks
from spot_training.contract import DEFAULT_MOUNT_POINT, STACK_TAG

FLEET_TAG = "aws:ec2spot:fleet-request-id"
#: Small, cheap single-GPU types the current Deep Learning Base AMI supports (docs/infra.md).
DRILL_INSTANCE_TYPES: tuple[str, ...] = ("g4dn.xlarge", "g5.xlarge", "g6.xlarge")


class DrillError(RuntimeError):
    """A drill step failed or ran past its deadline (the message names the step)."""


@dataclasses.dataclass
class AwsDrillOptions:
    """What the drill deploys and how long it waits (seconds)."""

    region: str
    stack: str = "SpotTraining"
    instance_types: tuple[str, ...] = DRILL_INSTANCE_TYPES
    context: tuple[str, ...] = ()
    work_dir: Path = Path("out/aws-drill")
    cdk: str = "cdk"
    mount_point: str = DEFAULT_MOUNT_POINT
    keep_stack: bool = False
    launch_timeout_s: float = 1800.0
    progress_timeout_s: float = 3600.0
    poll_s: float = 30.0

    def deploy_command(self, outputs_file: Path) -> list[str]:
        """The ``cdk deploy`` argv."""
        argv = [self.cdk, "deploy", self.stack, "--require-approval", "never", "--outputs-file", str(outputs_file),
                "-c", "fis_drill=true", "-c", f"region={self.region}", "-c", f"instance_types={','.join(self.instance_types)}"]
        for item in self.context:
            argv += ["-c", item]
        return argv

    def destroy_command(self) -> list[str]:
        """The ``cdk destroy`` argv (same context, so the app synthesizes the same stack)."""
        argv = [self.cdk, "destroy", self.stack, "--force", "-c", "fis_drill=true", "-c", f"region={self.region}",
                "-c", f"instance_types={','.join(self.instance_types)}"]
        for item in self.context:
            argv += ["-c", item]
        return argv


def _run(argv: Sequence[str]) -> subprocess.CompletedProcess[str]:
    return subprocess.run(list(argv), check=False, text=True)


def ssm_checkpoint_probe(ssm: Any, checkpoint_dir: str, *, timeout_s: float = 120.0,
                         sleep: Callable[[float], None] = time.sleep) -> Callable[[str], dict[str, Any] | None]:
    """A probe reading ``LATEST`` and ``COMPLETED`` of ``checkpoint_dir`` on an instance through SSM Run Command.

    The returned callable maps an instance id to ``{"latest": {...} | None, "completed": {...} | None}``,
    or None when the instance cannot be reached yet (SSM agent not registered, command failed).

    Args:
        ssm: a boto3 SSM client.
        checkpoint_dir: the checkpoint directory on the instance.
        timeout_s: seconds one probe waits for its command (default 120).
        sleep: sleeps the given seconds (default ``time.sleep``).

    Returns:
        the probe.
    """
    script = ("import json,os;d=%r;r=lambda n:json.load(open(os.path.join(d,n))) if os.path.exists(os.path.join(d,n)) else None;"
              "print(json.dumps({'latest':r('LATEST'),'completed':r('COMPLETED')}))") % checkpoint_dir

    def probe(instance_id: str) -> dict[str, Any] | None:
        try:
            command_id = ssm.send_command(InstanceIds=[instance_id], DocumentName="AWS-RunShellScript",
                                          Parameters={"commands": [f"python3 -c \"{script}\""]})["Command"]["CommandId"]
            deadline = time.monotonic() + timeout_s
            while time.monotonic() < deadline:
                sleep(3)
                try:
                    result = ssm.get_command_invocation(CommandId=command_id, InstanceId=instance_id)
                except Exception:  # noqa: BLE001 - InvocationDoesNotExist right after send_command
                    continue
                if result["Status"] in ("Pending", "InProgress", "Delayed"):
                    continue
                if result["Status"] != "Success":
                    return None
                return json.loads(result["StandardOutputContent"].strip().splitlines()[-1])
        except Exception:  # noqa: BLE001 - not registered with SSM yet, throttled: the caller polls again
            return None
        return None

    return probe


class AwsDrill:
    """The drill (module docstring).

    Args:
        options: the drill's options.
        client: ``client(service)`` makes boto3 clients.
        run: ``run(argv)`` runs the cdk CLI (default: ``subprocess.run``, no capture).
        probe: ``probe(instance_id)`` reads the node's checkpoint pointer (default: :func:`ssm_checkpoint_probe`).
        clock: monotonic seconds (default ``time.monotonic``).
        sleep: sleeps the given seconds (default ``time.sleep``).
        say: prints one progress line (default ``print``).
    """

    def __init__(self, options: AwsDrillOptions, *, client: Callable[[str], Any],
                 run: Callable[[Sequence[str]], subprocess.CompletedProcess[str]] = _run,
                 probe: Callable[[str], dict[str, Any] | None] | None = None,
                 clock: Callable[[], float] = time.monotonic, sleep: Callable[[float], None] = time.sleep,
                 say: Callable[[str], None] = print) -> None:
        self.o = options
        self.client = client
        self.ec2 = client("ec2")
        self.run_cmd = run
        self.probe = probe or ssm_checkpoint_probe(client("ssm"), f"{options.mount_point}/checkpoints", sleep=sleep)
        self.clock, self.sleep, self.say = clock, sleep, say
        self.t0 = clock()
        self.report: dict[str, Any] = {"passed": False, "stack": options.stack, "region": options.region,
                                       "instance_types": list(options.instance_types), "steps": []}

    # ---- helpers ----------------------------------------------------------------------------------
    def step(self, name: str, message: str) -> None:
        """Print and record one step of the drill (seconds since the start, name, message).

        Args:
            name: the step's name.
            message: what it does.
        """
        line = f"[{self.clock() - self.t0:7.1f}s] == {name}: {message}"
        self.say(line)
        self.report["steps"].append({"t": round(self.clock() - self.t0, 1), "step": name, "message": message})

    def _until(self, what: str, timeout_s: float, check: Callable[[], Any]) -> Any:
        deadline = self.clock() + timeout_s
        while True:
            value = check()
            if value:
                return value
            if self.clock() >= deadline:
                raise DrillError(f"{what}: not within {timeout_s:g} s")
            self.sleep(self.o.poll_s)

    def fleet_instances(self, fleet_id: str) -> list[dict[str, Any]]:
        """Instances the fleet launched (any state), oldest first."""
        found = [i for r in self.ec2.describe_instances(Filters=[{"Name": f"tag:{FLEET_TAG}", "Values": [fleet_id]}])["Reservations"]
                 for i in r["Instances"]]
        return sorted(found, key=lambda i: (str(i.get("LaunchTime")), i["InstanceId"]))

    def running_instance(self, fleet_id: str, exclude: set[str]) -> dict[str, Any] | None:
        """The fleet's oldest running instance not in ``exclude``, or None.

        Args:
            fleet_id: the spot fleet request id.
            exclude: instance ids to skip (the interrupted ones).
        """
        for instance in self.fleet_instances(fleet_id):
            if instance["InstanceId"] not in exclude and instance["State"]["Name"] == "running":
                return instance
        return None

    def state(self, instance_id: str) -> str:
        """The instance's state name (``running``, ``terminated``...).

        Args:
            instance_id: the instance.
        """
        [reservation] = self.ec2.describe_instances(InstanceIds=[instance_id])["Reservations"]
        return reservation["Instances"][0]["State"]["Name"]

    def latest_step(self, instance_id: str) -> int | None:
        """The step of the node's newest committed checkpoint (``LATEST``), or None (none, or not reachable).

        Args:
            instance_id: the instance.
        """
        found = self.probe(instance_id)
        if not found or not found.get("latest"):
            return None
        return int(found["latest"]["step"])

    # ---- steps -------------------------------------------------------------------------------------
    def preflight(self) -> None:
        """Run the preflight checks for the drill's instance types.

        Raises:
            DrillError: a check failed.
        """
        self.step("preflight", "service-linked roles, spot vCPU quota, AMI parameter, capacity")
        from spot_training.infra.config import DEFAULT_AMI_SSM_PARAMETER

        given = dict(item.partition("=")[::2] for item in self.o.context)
        checks = run_checks(Target(self.o.region, self.o.instance_types, 1,
                                   None if given.get("image_id") else given.get("ami_ssm_parameter", DEFAULT_AMI_SSM_PARAMETER),
                                   given.get("image_id") or None, None), self.client)
        self.say(format_checks(checks))
        self.report["preflight"] = [dataclasses.asdict(c) for c in checks]
        if exit_code(checks) == EXIT_FAILED:
            raise DrillError("preflight failed: fix what it printed, then run the drill again")

    def deploy(self) -> dict[str, str]:
        """``cdk deploy`` the stack with the FIS drill on.

        Returns:
            the stack's outputs (``FleetRequestId``, ``FisExperimentTemplateId``, ``DataVolumeId``...).

        Raises:
            DrillError: the deploy failed or an output is missing.
        """
        outputs_file = self.o.work_dir / "outputs.json"
        argv = self.o.deploy_command(outputs_file)
        self.step("deploy", " ".join(argv))
        if self.run_cmd(argv).returncode != 0:
            raise DrillError(f"cdk deploy failed: {' '.join(argv)}")
        outputs = json.loads(outputs_file.read_text())[self.o.stack]
        for key in ("FleetRequestId", "FisExperimentTemplateId", "DataVolumeId"):
            if key not in outputs:
                raise DrillError(f"stack output {key} missing in {outputs_file}: was -c fis_drill=true applied?")
        self.report["outputs"] = outputs
        return outputs

    def interrupt(self, template_id: str) -> str:
        """Start the FIS experiment that sends a spot interruption notice to the node.

        Args:
            template_id: the FIS experiment template id.

        Returns:
            the experiment id.
        """
        experiment = self.client("fis").start_experiment(experimentTemplateId=template_id, clientToken=str(uuid.uuid4()),
                                                         tags={STACK_TAG: self.o.stack})
        return experiment["experiment"]["id"]

    def destroy(self) -> None:
        """``cdk destroy`` the stack.

        Raises:
            DrillError: the destroy failed.
        """
        argv = self.o.destroy_command()
        self.step("destroy", " ".join(argv))
        if self.run_cmd(argv).returncode != 0:
            raise DrillError(f"cdk destroy failed: {' '.join(argv)}; delete the stack in the console and check for orphans")

    def orphans(self, fleet_ids: Sequence[str]) -> list[str]:
        """What of the stack is left after destroy (:func:`spot_training.ops.orphans.find_orphans`).

        Args:
            fleet_ids: the fleet requests the drill saw.

        Returns:
            ``"kind id (state)"`` strings; empty when nothing is left.
        """
        from spot_training.ops.orphans import Clients, find_orphans

        return find_orphans(Clients(ec2=self.ec2, cloudformation=self.client("cloudformation"), s3=None), self.o.stack,
                            fleet_request_ids=list(fleet_ids))

    def cost(self, instances: Sequence[dict[str, Any]], ended: dict[str, datetime]) -> dict[str, Any]:
        """Instance running time x Spot price (USD) per instance and in total.

        Averages the spot price history over each instance's running time (Linux/UNIX); EBS, FIS minutes
        and data transfer are not counted.

        Args:
            instances: the instances (DescribeInstances records).
            ended: ``{instance id: end time}`` of those that ended (others: now).

        Returns:
            ``{"instances_usd", "by_instance", "not_counted"}``.
        """
        rows, total = [], 0.0
        now = datetime.now(timezone.utc)
        for instance in instances:
            start = instance["LaunchTime"]
            end = ended.get(instance["InstanceId"], now)
            az = instance["Placement"]["AvailabilityZone"]
            history = self.ec2.describe_spot_price_history(
                InstanceTypes=[instance["InstanceType"]], AvailabilityZone=az, ProductDescriptions=["Linux/UNIX"],
                StartTime=start, EndTime=end)["SpotPriceHistory"]
            prices = [float(p["SpotPrice"]) for p in history]
            price = statistics.fmean(prices) if prices else None
            hours = max(0.0, (end - start).total_seconds() / 3600.0)
            usd = hours * price if price is not None else None
            total += usd or 0.0
            rows.append({"instance_id": instance["InstanceId"], "instance_type": instance["InstanceType"],
                         "availability_zone": az, "hours": round(hours, 4), "spot_price_usd_per_hour": price,
                         "usd": None if usd is None else round(usd, 4)})
        return {"instances_usd": round(total, 4), "by_instance": rows,
                "not_counted": "EBS volumes and snapshots, FIS action minutes, data transfer, the CDK asset bucket"}

    # ---- the drill ---------------------------------------------------------------------------------
    def run(self) -> dict[str, Any]:
        """Run every step; always try to destroy once something was deployed.

        Returns:
            the report.
        """
        self.o.work_dir.mkdir(parents=True, exist_ok=True)
        deployed, fleet_ids, ended = False, [], {}
        try:
            self.preflight()
            outputs = self.deploy()
            deployed = True
            fleet_id = outputs["FleetRequestId"]
            fleet_ids.append(fleet_id)
            first = self._until("the fleet's first instance running", self.o.launch_timeout_s,
                                lambda: self.running_instance(fleet_id, set()))
            self.step("first node", f"{first['InstanceId']} ({first['InstanceType']}, {first['Placement']['AvailabilityZone']})")
            before = self._until(f"a checkpoint on {first['InstanceId']}", self.o.progress_timeout_s,
                                 lambda: self.latest_step(first["InstanceId"]))
            self.step("training", f"newest checkpoint on {first['InstanceId']}: step {before}")
            experiment_id = self.interrupt(outputs["FisExperimentTemplateId"])
            self.step("interrupt", f"FIS experiment {experiment_id}: spot interruption notice to {first['InstanceId']}")
            self._until(f"{first['InstanceId']} terminated", self.o.launch_timeout_s,
                        lambda: self.state(first["InstanceId"]) in ("shutting-down", "terminated"))
            ended[first["InstanceId"]] = datetime.now(timezone.utc)
            second = self._until("the replacement running", self.o.launch_timeout_s,
                                 lambda: self.running_instance(fleet_id, {first["InstanceId"]}))
            self.step("replacement", f"{second['InstanceId']} ({second['InstanceType']}, {second['Placement']['AvailabilityZone']})")
            found = self._until(f"the checkpoint on {second['InstanceId']}", self.o.progress_timeout_s,
                                lambda: self.latest_step(second["InstanceId"]))
            later = self._until(f"a newer checkpoint on {second['InstanceId']}", self.o.progress_timeout_s,
                                lambda: (lambda s: s if s is not None and s > found else None)(self.latest_step(second["InstanceId"])))
            self.report["interruption"] = {
                "experiment_id": experiment_id, "interrupted": first["InstanceId"], "replacement": second["InstanceId"],
                "az_from": first["Placement"]["AvailabilityZone"], "az_to": second["Placement"]["AvailabilityZone"],
                "step_before_notice": before, "step_found_by_replacement": found, "step_after_resume": later,
                "resumed": found >= before and later > found}
            self.step("resume", f"replacement found step {found} (>= {before} before the notice), then reached step {later}")
        except DrillError as error:
            self.report["error"] = str(error)
            self.step("error", str(error))
        finally:
            instances = [i for f in fleet_ids for i in self.fleet_instances(f)]
            if deployed and not self.o.keep_stack:
                try:
                    self.destroy()
                except DrillError as error:
                    self.report["error"] = self.report.get("error") or str(error)
                    self.step("error", str(error))
                orphans = self.orphans(fleet_ids)
                self.report["orphans_after_destroy"] = orphans
                self.step("orphans", ", ".join(orphans) or "none")
            self.report["cost"] = self.cost(instances, ended)
            self.step("cost", f"{self.report['cost']['instances_usd']:.4f} USD of spot instance time "
                              f"(not counted: {self.report['cost']['not_counted']})")
        interruption = self.report.get("interruption", {})
        self.report["passed"] = bool(interruption.get("resumed")) and "error" not in self.report and (
            self.o.keep_stack or self.report.get("orphans_after_destroy") == [])
        (self.o.work_dir / "report.json").write_text(json.dumps(self.report, indent=2, default=str))
        return self.report


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The ``spot-train drill`` options."""
    parser.add_argument("--aws", action="store_true", required=True, help="run on the AWS account your credentials name (costs money)")
    parser.add_argument("--region", required=True, help="AWS region")
    parser.add_argument("--stack", default="SpotTraining", help="stack name (default SpotTraining)")
    parser.add_argument("--instance-types", default=",".join(DRILL_INSTANCE_TYPES),
                        help=f"spot types to deploy (default {','.join(DRILL_INSTANCE_TYPES)})")
    parser.add_argument("-c", "--context", action="append", default=[], metavar="KEY=VALUE", help="more context for cdk deploy")
    parser.add_argument("--work-dir", type=Path, default=Path("out/aws-drill"), help="report and cdk outputs (default out/aws-drill)")
    parser.add_argument("--keep-stack", action="store_true", help="do not destroy the stack at the end")
    parser.add_argument("--yes", action="store_true", help="really deploy; without it the plan is printed and nothing changes")


def run(args: argparse.Namespace) -> int:
    """``spot-train drill --aws`` (module docstring for the exit codes)."""
    types = tuple(t.strip() for t in args.instance_types.split(",") if t.strip())
    options = AwsDrillOptions(region=args.region, stack=args.stack, instance_types=types, context=tuple(args.context),
                              work_dir=args.work_dir, keep_stack=args.keep_stack)
    if not args.yes:
        print("plan (add --yes to run it; it deploys real spot instances and costs money):")
        print("  1. spot-train preflight for", ", ".join(types), "in", args.region)
        print("  2.", " ".join(options.deploy_command(options.work_dir / "outputs.json")))
        print("  3. wait for the first node and a checkpoint; FIS start-experiment (spot interruption notice)")
        print("  4. wait for the replacement to resume from the volume's checkpoint")
        if not args.keep_stack:
            print("  5.", " ".join(options.destroy_command()), "; orphan check")
        print("  6. cost of the spot instance time")
        return 2
    report = AwsDrill(options, client=default_client_factory(args.region)).run()
    print(json.dumps({k: report.get(k) for k in ("passed", "interruption", "orphans_after_destroy", "cost", "error")},
                     indent=2, default=str))
    return 0 if report["passed"] else 1


if __name__ == "__main__":  # pragma: no cover
    parser = argparse.ArgumentParser(prog="python -m spot_training.ops.aws_drill")
    add_arguments(parser)
    sys.exit(run(parser.parse_args()))
