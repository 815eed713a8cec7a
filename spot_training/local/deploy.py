"""The real AWS CDK CLI (``cdk bootstrap``, ``cdk deploy``, ``cdk destroy``) against the local moto server.

Local mode deploys the very stacks users deploy to AWS, with the CDK CLI pinned in the project's
``node_modules``: only the environment differs (fake credentials, ``AWS_ENDPOINT_URL`` and
``AWS_ENDPOINT_URL_S3_FOR_CLOUDFORMATION``; the word ``localhost`` in the latter matters, because
moto only parses path-style template URLs whose host contains it). The CLI's exit code is never
trusted against moto: :func:`stack_resources` and :func:`find_orphans` read what exists with boto3.

Everything the CLI writes stays under the work directory: the cloud assembly (``--output``), and
the CLI's own ``~/.cdk`` state (``HOME`` is pointed at ``<work_dir>/home``).

Usage::

    with MotoServer(work / "moto") as server:
        cdk = CdkCli(server.endpoint_url, work_dir=work)
        cdk.bootstrap()
        cdk.deploy("SpotTraining", context=local_context())
        resources = stack_resources(clients(server.endpoint_url), "SpotTraining")
        cdk.destroy("SpotTraining")
        assert find_orphans(clients(server.endpoint_url), "SpotTraining") == []
"""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any
from urllib.parse import urlparse

import boto3
from botocore.config import Config

from spot_training.local.wheels import PROBE_DISTRIBUTION

REPO_ROOT = Path(__file__).resolve().parents[2]
CDK_BIN = REPO_ROOT / "node_modules" / ".bin" / "cdk"
#: moto's default account; the stacks need an explicit environment to deploy with the CLI.
ACCOUNT = "123456789012"
REGION = "us-east-1"
#: Two AZs are enough for an AZ move; moto's us-east-1 has a..f.
AVAILABILITY_ZONES = ("us-east-1a", "us-east-1b")
#: Any well-formed AMI id: moto does not validate it, and local nodes are processes, not VMs.
LOCAL_IMAGE_ID = "ami-0123456789abcdef0"
from spot_training.contract import STACK_TAG as STACK_TAG_KEY  # noqa: E402
# The orphan check serves the drill on a real account too (spot_training.ops.aws_drill): it lives in ops.
from spot_training.ops.orphans import FLEET_TAG, Clients, find_orphans  # noqa: E402,F401
#: Seconds a CLI command may take before it is killed (bootstrap takes ~20 s on 2 cores).
DEFAULT_CLI_TIMEOUT_S = 600
_RETRY = Config(retries={"mode": "standard"})


class CdkCliError(RuntimeError):
    """A CDK CLI command failed or timed out; the message names the command and the log file."""


#: Seconds between a local node's instance-metadata polls for notices. The digits trainer runs ~50
#: steps/s here: one 5 s polling round (AWS's recommendation, the default) can outlast the steps left
#: after a late notice, and the drill would see training complete instead of an interruption.
LOCAL_NOTICE_POLL_INTERVAL_S = 1.0


def local_context(
    *,
    availability_zones: Sequence[str] = AVAILABILITY_ZONES,
    training_command: Sequence[str] | None = None,
    framework: str = "tensorflow",
    extra: Mapping[str, str] | None = None,
) -> dict[str, str]:
    """CDK context (``-c key=value``) that makes the app's stack deployable to the moto server.

    Args:
        availability_zones: pinned AZs (no lookup); default us-east-1a and us-east-1b.
        training_command: the trainer command (``{python}`` is the node's Python); default: the
            stack's for ``framework`` (``spot_training.infra.config.FRAMEWORKS``).
        framework: ``tensorflow`` (default), ``mxnet`` or ``pytorch``.
        extra: more context keys (see ``spot_training/infra/config.py``), strings as ``-c`` passes them.

    Returns:
        ``{key: value}``: account 123456789012, region us-east-1, the AZs, a placeholder AMI id,
        ``training_python`` = this interpreter, ``training_requirements`` = the probe wheel local mode
        serves offline (spot_training/local/wheels.py) with ``training_inherit_site_packages``, and
        ``notice_poll_interval_s`` = :data:`LOCAL_NOTICE_POLL_INTERVAL_S`.
    """
    context = {
        "account": ACCOUNT,
        "region": REGION,
        "availability_zones": ",".join(availability_zones),
        "image_id": LOCAL_IMAGE_ID,
        "framework": framework,
        "training_python": sys.executable,
        # The trainer's environment is built for real, once per drill, on the data volume: a venv of this
        # interpreter that sees its packages (the frameworks) and installs the probe wheel offline.
        "training_requirements": PROBE_DISTRIBUTION,
        "training_inherit_site_packages": "true",
        "notice_poll_interval_s": str(LOCAL_NOTICE_POLL_INTERVAL_S),
    }
    if training_command is not None:
        context["training_command"] = json.dumps(list(training_command))  # -c takes a JSON list as is
    context.update(dict(extra or {}))
    return context


def cli_env(endpoint_url: str, *, home: Path, region: str = REGION) -> dict[str, str]:
    """Environment for the CDK CLI (and boto3) that points every AWS call at ``endpoint_url``.

    Args:
        endpoint_url: the moto server, ``http://127.0.0.1:PORT``.
        home: the CLI's ``HOME`` (its caches and config stay in the work directory).
        region: the region (default us-east-1).

    Returns:
        the environment: this one without ``AWS_*`` variables, plus the endpoint, fake credentials and region.

    Raises:
        ValueError: ``endpoint_url`` is not ``http://127.0.0.1:PORT`` (or localhost).
    """
    parsed = urlparse(endpoint_url)
    if parsed.scheme != "http" or parsed.hostname not in ("127.0.0.1", "localhost") or not parsed.port:
        raise ValueError(f"endpoint_url must be http://127.0.0.1:PORT (the local moto server), got {endpoint_url!r}")
    env = {k: v for k, v in os.environ.items() if not k.startswith("AWS_")}
    env.update(
        {
            "AWS_ACCESS_KEY_ID": "testing",
            "AWS_SECRET_ACCESS_KEY": "testing",
            "AWS_SESSION_TOKEN": "testing",
            "AWS_REGION": region,
            "AWS_DEFAULT_REGION": region,
            "AWS_ENDPOINT_URL": endpoint_url,
            # moto's get_stack_from_s3_url parses path-style URLs only when the host says "localhost".
            "AWS_ENDPOINT_URL_S3_FOR_CLOUDFORMATION": f"http://localhost:{parsed.port}",
            "AWS_EC2_METADATA_DISABLED": "true",
            "HOME": str(home),
            "CDK_DISABLE_CLI_TELEMETRY": "true",
            "JSII_SILENCE_WARNING_DEPRECATED_NODE_VERSION": "1",
            "JSII_SILENCE_WARNING_UNTESTED_NODE_VERSION": "1",
            "JSII_SILENCE_WARNING_END_OF_LIFE_NODE_VERSION": "14,16,18,20",
            "PATH": os.pathsep.join([str(Path(sys.executable).parent), env.get("PATH", "/usr/bin:/bin")]),
        }
    )
    return env


class CdkCli:
    """The project's pinned CDK CLI, run against the moto server at ``endpoint_url``.

    Args:
        endpoint_url: the moto server (``http://127.0.0.1:PORT``).
        work_dir: the cloud assembly goes to ``<work_dir>/cdk.out``, the CLI's state to
            ``<work_dir>/home``, each command's output to ``<work_dir>/logs/cdk-<command>.log``.
        app_dir: directory holding ``app.py`` and ``cdk.json`` (default: this repository).
        app_command: the app the CLI synthesizes (``--app``, run in ``app_dir``); default
            ``<this python> app.py``. ``spot-train local drill --jobs`` passes
            ``<this python> -m spot_training.local.jobs_app``.
        timeout_s: seconds each command may take (default 600).
        on_line: called with each line the CLI prints (for a live display); default: none.

    Raises:
        CdkCliError: from each command when the CLI exits non-zero or times out.
    """

    def __init__(
        self,
        endpoint_url: str,
        *,
        work_dir: str | os.PathLike[str],
        app_dir: str | os.PathLike[str] = REPO_ROOT,
        app_command: str | None = None,
        timeout_s: float = DEFAULT_CLI_TIMEOUT_S,
        on_line: Callable[[str], None] | None = None,
    ) -> None:
        if not CDK_BIN.exists():
            raise CdkCliError(f"the CDK CLI is missing at {CDK_BIN}; run `make setup` (npm ci) first")
        self.work_dir = Path(work_dir)
        self.app_dir = Path(app_dir)
        self.app_command = app_command or f"{sys.executable} app.py"
        self.timeout_s = timeout_s
        self.on_line = on_line
        (self.work_dir / "home").mkdir(parents=True, exist_ok=True)
        (self.work_dir / "logs").mkdir(parents=True, exist_ok=True)
        self.env = cli_env(endpoint_url, home=self.work_dir / "home")
        self.durations_s: dict[str, float] = {}

    @property
    def output_dir(self) -> Path:
        """The cloud assembly directory (``<work_dir>/cdk.out``)."""
        return self.work_dir / "cdk.out"

    def _run(self, name: str, args: Sequence[str], *, app: str = "synth") -> str:
        # app="synth": run app.py (in app_dir); "assembly": the cloud assembly the deploy wrote (no
        # second synth: 20-60 s saved on 2 cores); "none": no app at all (cdk bootstrap with an explicit
        # environment needs none; run in the work dir, where no cdk.json names one).
        cwd = self.app_dir
        if app == "synth":
            app_args = ["--app", self.app_command, "--output", str(self.output_dir)]
        elif app == "assembly":
            app_args = ["--app", str(self.output_dir)]
        else:
            app_args, cwd = [], self.work_dir
        command = [str(CDK_BIN), *args, "--no-notices", "--no-version-reporting", *app_args]
        log_path = self.work_dir / "logs" / f"cdk-{name}.log"
        started = time.monotonic()
        lines: list[str] = []
        with open(log_path, "w", encoding="utf-8") as log:
            log.write("$ " + " ".join(command) + "\n")
            process = subprocess.Popen(
                command, cwd=cwd, env=self.env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL, text=True, start_new_session=True,
            )
            try:
                assert process.stdout is not None
                for line in process.stdout:
                    log.write(line)
                    lines.append(line)
                    if self.on_line is not None:
                        self.on_line(line.rstrip("\n"))
                    if time.monotonic() - started > self.timeout_s:
                        raise subprocess.TimeoutExpired(command, self.timeout_s)
                process.wait(timeout=max(1.0, self.timeout_s - (time.monotonic() - started)))
            except subprocess.TimeoutExpired as error:
                os.killpg(process.pid, 9)
                process.wait()
                raise CdkCliError(f"cdk {name} timed out after {self.timeout_s} s; see {log_path}") from error
        self.durations_s[name] = time.monotonic() - started
        if process.returncode != 0:
            tail = "".join(lines[-15:])
            raise CdkCliError(f"cdk {name} exited {process.returncode}; see {log_path}:\n{tail}")
        return "".join(lines)

    def bootstrap(self, account: str = ACCOUNT, region: str = REGION) -> str:
        """``cdk bootstrap aws://ACCOUNT/REGION``.

        Args:
            account: the account (default: moto's).
            region: the region (default us-east-1).

        Returns:
            the CLI's output.

        Raises:
            CdkCliError: the CLI failed or timed out (the message names its log).
        """
        return self._run("bootstrap", ["bootstrap", f"aws://{account}/{region}"], app="none")

    def deploy(self, stack: str, *, context: Mapping[str, str]) -> str:
        """``cdk deploy STACK --require-approval never -c k=v ...``.

        Args:
            stack: the stack name.
            context: the context values.

        Returns:
            the CLI's output.

        Raises:
            CdkCliError: the CLI failed or timed out (the message names its log).
        """
        return self._run("deploy", ["deploy", stack, "--require-approval", "never", *_context_args(context)])

    def destroy(self, stack: str, *, context: Mapping[str, str]) -> str:
        """``cdk destroy STACK --force``, from the deploy's cloud assembly when there is one.

        Otherwise the app is synthesized again with the same context.

        Args:
            stack: the stack name.
            context: the context values of the deploy.

        Returns:
            the CLI's output.

        Raises:
            CdkCliError: the CLI failed or timed out (the message names its log).
        """
        if (self.output_dir / "manifest.json").exists():
            return self._run("destroy", ["destroy", stack, "--force"], app="assembly")
        return self._run("destroy", ["destroy", stack, "--force", *_context_args(context)])


def _context_args(context: Mapping[str, str]) -> list[str]:
    args: list[str] = []
    for key, value in context.items():
        args += ["-c", f"{key}={value}"]
    return args


def client(endpoint_url: str, service: str, region: str = REGION) -> Any:
    """A boto3 client of ``service`` for the moto server at ``endpoint_url``: fake credentials, standard retries.

    Args:
        endpoint_url: the moto server.
        service: the service name (``"ec2"``, ``"autoscaling"``, ``"efs"`` ...).
        region: the region (default us-east-1).

    Returns:
        the client.
    """
    return boto3.client(
        service, region_name=region, endpoint_url=endpoint_url, aws_access_key_id="testing",
        aws_secret_access_key="testing", aws_session_token="testing", config=_RETRY,
    )


def clients(endpoint_url: str, region: str = REGION) -> Clients:
    """boto3 clients (EC2, CloudFormation, S3) for the moto server at ``endpoint_url`` (see :func:`client`).

    Args:
        endpoint_url: the moto server.
        region: the region (default us-east-1).

    Returns:
        the clients.
    """
    return Clients(ec2=client(endpoint_url, "ec2", region), cloudformation=client(endpoint_url, "cloudformation", region),
                   s3=client(endpoint_url, "s3", region))


@dataclasses.dataclass(frozen=True)
class DeployedStack:
    """What local mode needs from a deployed stack, read with boto3 (moto returns no Outputs).

    Attributes:
        name: the stack name, or with ``stack_resources(..., job=...)`` the job id: the ``spot-training:stack``
            tag value of the job's resources (the node runner tags replacements with it).
        fleet_request_id: ``sfr-...``.
        launch_template_id: ``lt-...`` of the fleet.
        data_volume_id: ``vol-...`` as created by the stack.
        subnets: ``{availability_zone: subnet_id}`` of the stack's VPC.
        resources: ``{logical_id: (resource_type, physical_id)}``.
    """

    name: str
    fleet_request_id: str
    launch_template_id: str
    data_volume_id: str
    subnets: dict[str, str]
    resources: dict[str, tuple[str, str]]


def stack_resources(aws: Clients, stack: str, *, job: str | None = None) -> DeployedStack:
    """Read the deployed ``stack``'s resources with boto3.

    Args:
        aws: clients of the moto server.
        stack: the CloudFormation stack name.
        job: one ``TrainingJob`` of a stack that holds several: its job id (the ``spot-training:stack``
            tag value of its fleet request and data volume); the result's ``name`` is the job id, which
            the node runner tags replacement instances with. Default: the stack's one fleet and volume.

    Returns:
        the fleet, its launch template, the data volume, the subnets per AZ and every resource.

    Raises:
        RuntimeError: the stack is not ``CREATE_COMPLETE`` or lacks a fleet, launch template or volume
            (of ``job``: names the job ids the stack's fleets carry).
    """
    status = aws.cloudformation.describe_stacks(StackName=stack)["Stacks"][0]["StackStatus"]
    if status not in ("CREATE_COMPLETE", "UPDATE_COMPLETE"):
        raise RuntimeError(f"stack {stack} is {status}, expected CREATE_COMPLETE")
    resources = {
        r["LogicalResourceId"]: (r["ResourceType"], r["PhysicalResourceId"])
        for r in aws.cloudformation.describe_stack_resources(StackName=stack)["StackResources"]
        if "LogicalResourceId" in r
    }

    def one(resource_type: str) -> str:
        found = [physical for kind, physical in resources.values() if kind == resource_type]
        if len(found) != 1:
            several = " (a stack of several TrainingJobs: name one with job=<job id>)" if len(found) > 1 else ""
            raise RuntimeError(f"stack {stack} has {len(found)} {resource_type} resources, expected 1: {found}{several}")
        return found[0]

    vpc_id = one("AWS::EC2::VPC")
    subnets = {
        s["AvailabilityZone"]: s["SubnetId"]
        for s in aws.ec2.describe_subnets(Filters=[{"Name": "vpc-id", "Values": [vpc_id]}])["Subnets"]
    }
    if job is None:
        fleet_id, template_id, volume_id = one("AWS::EC2::SpotFleet"), one("AWS::EC2::LaunchTemplate"), one("AWS::EC2::Volume")
    else:
        fleet_id, template_id, volume_id = _job_parts(aws, stack, job, resources)
    return DeployedStack(
        name=job or stack,
        fleet_request_id=fleet_id,
        launch_template_id=template_id,
        data_volume_id=volume_id,
        subnets=dict(sorted(subnets.items())),
        resources=resources,
    )


def _job_parts(aws: Clients, stack: str, job: str, resources: dict[str, tuple[str, str]]) -> tuple[str, str, str]:
    """``(fleet request id, launch template id, data volume id)`` of job ``job`` among ``stack``'s
    ``resources``: the fleet request and the volume tagged with the job id, and the launch template
    that fleet's resource refers to in the deployed template (moto's DescribeSpotFleetRequests leaves
    ``LaunchTemplateConfigs`` out). Raises RuntimeError naming what is missing."""
    from spot_training.local.cfn_compat import references

    def of(resource_type: str) -> dict[str, str]:
        return {physical: logical for logical, (kind, physical) in resources.items() if kind == resource_type}

    def tag(item: dict[str, Any]) -> str | None:
        return {t["Key"]: t["Value"] for t in item.get("Tags", [])}.get(STACK_TAG_KEY)

    # An empty id list would describe every fleet request (volume) of the account, not none.
    fleet_ids, volume_ids = list(of("AWS::EC2::SpotFleet")), list(of("AWS::EC2::Volume"))
    configs = aws.ec2.describe_spot_fleet_requests(SpotFleetRequestIds=fleet_ids)["SpotFleetRequestConfigs"] if fleet_ids else []
    fleets = [c["SpotFleetRequestId"] for c in configs if tag(c) == job]
    volumes = [v["VolumeId"] for v in (aws.ec2.describe_volumes(VolumeIds=volume_ids)["Volumes"] if volume_ids else [])
               if tag(v) == job]
    if len(fleets) != 1 or len(volumes) != 1:
        raise RuntimeError(f"stack {stack}: job {job!r} has {len(fleets)} fleet requests and {len(volumes)} data volumes, "
                           f"expected 1 each; the job ids of its fleets: {sorted(str(tag(c)) for c in configs)}")
    body = aws.cloudformation.get_template(StackName=stack)["TemplateBody"]
    template = json.loads(body) if isinstance(body, str) else body
    fleet_resource = template["Resources"][of("AWS::EC2::SpotFleet")[fleets[0]]]
    launch_templates = {logical: physical for physical, logical in of("AWS::EC2::LaunchTemplate").items()}
    used = references(fleet_resource.get("Properties", {}), set(launch_templates))
    if len(used) != 1:
        raise RuntimeError(f"stack {stack}: job {job!r}'s fleet refers to {len(used)} launch templates, expected 1")
    return fleets[0], launch_templates[used.pop()], volumes[0]


def destroy_and_check(cdk: CdkCli, aws: Clients, stack: str, *, context: Mapping[str, str], report: dict[str, Any],
                      record: Callable[[dict[str, Any]], None], fleet_request_ids: Sequence[str] = (),
                      jobs: Mapping[str, Sequence[str]] | None = None, before_destroy: Callable[[], None] | None = None,
                      more_orphans: Callable[[], list[str]] | None = None,
                      message: str = "cdk destroy (real CLI), then the orphan check") -> list[str]:
    """The drills' teardown: ``cdk destroy`` of ``stack``, then the orphan check of the stack and of its jobs.

    A failed destroy does not stop the orphan check: the check says what the failure left.

    Args:
        cdk: the CDK CLI of the local AWS.
        aws: boto3 clients of the same local AWS.
        stack: the stack name.
        context: the CDK context the stack was deployed with.
        report: the drill's report; gets ``phases_s["destroy"]`` (seconds), ``orphans_after_destroy`` and,
            when destroy raised, ``destroy_error`` (the error's last 2000 characters).
        record: the drill's event log; gets a ``phase`` event before and a ``destroyed`` event after.
        fleet_request_ids: spot fleet requests known to be the stack's (default none).
        jobs: ``{job id: its fleet request ids}`` of jobs whose resources carry the job id as their
            ``spot-training:stack`` tag (default none).
        before_destroy: runs first inside the same error handling as destroy (e.g. empty a bucket).
        more_orphans: what else a drill checks (Batch, Auto Scaling, EFS), ``"kind id (state)"`` strings.
        message: the ``phase`` event's message.

    Returns:
        the orphans (also in ``report["orphans_after_destroy"]``); empty when nothing is left.
    """
    record({"event": "phase", "phase": "destroy", "message": message})
    t = time.time()
    try:
        if before_destroy is not None:
            before_destroy()
        cdk.destroy(stack, context=context)
    except Exception as error:  # noqa: BLE001 - the orphan check below says what it left
        report["destroy_error"] = str(error)[-2000:]
    report["phases_s"]["destroy"] = round(time.time() - t, 3)
    orphans = find_orphans(aws, stack, fleet_request_ids=fleet_request_ids)
    found = [find_orphans(aws, job, fleet_request_ids=fleets) for job, fleets in (jobs or {}).items()]
    found.append(more_orphans() if more_orphans is not None else [])
    for more in found:
        orphans += [o for o in more if o not in orphans]
    report["orphans_after_destroy"] = orphans
    record({"event": "destroyed", "orphans": orphans})
    return orphans
