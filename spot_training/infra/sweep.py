"""Parameter sweeps on AWS Batch: the ``ParallelExperiments`` construct and the ``SpotSweep`` stack.

A sweep is one AWS Batch array job: child ``i`` (``AWS_BATCH_JOB_ARRAY_INDEX``) trains parameter set
``i`` of the sweep's manifest (a JSON list in S3) and writes everything under ``/storage/<sweep>/<i>/``
on EFS (docs/sweeps.md). Built only from aws-cdk-lib's ``aws_batch`` L2s; no scheduler of our own.

- Compute: a managed EC2/ECS compute environment on spot (``SPOT_PRICE_CAPACITY_OPTIMIZED``), and
  optionally an on-demand one behind it in the job queue's order (AWS Batch User Guide, "Job queues":
  the scheduler tries the environments in order). Both use one launch template that requires IMDSv2
  with a hop limit of 2, so that our notice watcher inside the container reaches instance metadata
  (EC2 User Guide, "Configure the instance metadata options": containers need hop limit 2).
- Queue: ``job_state_time_limit_actions`` cancels jobs stuck ``RUNNABLE`` on
  ``CAPACITY:INSUFFICIENT_INSTANCE_CAPACITY`` after ``runnable_timeout`` instead of waiting forever.
- Job definition: the retry rules (``evaluateOnExit``, first match wins; AWS Batch API reference,
  "EvaluateOnExit"): a reclaimed host (``onStatusReason: "Host EC2*"``, aws-cdk-lib
  ``Reason.SPOT_INSTANCE_RECLAIMED``) and our child's "notice seen, host not taken" exit status
  (:data:`spot_training.contract.EXIT_SWEEP_RECLAIM_NOT_TAKEN`) retry; anything else exits, so a code
  error fails after one attempt instead of burning every attempt (the rules, in order:
  :data:`RETRY_RULES`).
- Storage: an encrypted EFS file system with one access point (:class:`SharedFileSystem`), mounted
  with TLS and the job role's IAM authorization at :data:`spot_training.contract.SWEEP_MOUNT_POINT`;
  an encrypted, SSL-only S3 bucket for the manifests.
- IAM: the job role may read the manifests, write under their ``sweeps/`` prefix (each child's
  metrics and attempts) and mount/write this file system only; the execution
  role pulls the one image repository and writes the job log group.

The image (``image_uri``): no ``DockerImageAsset`` (it would need a Docker daemon at synth); the
default is the ECR repository ``spot-training-sweep`` of the stack's account and region, which
``docker/sweep.Dockerfile`` builds from an AWS Deep Learning Container (docs/sweeps.md, "Image").
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Mapping, Sequence
from typing import Any

import aws_cdk as cdk
import cdk_nag
import constructs
from aws_cdk import aws_batch as batch
from aws_cdk import aws_ec2 as ec2
from aws_cdk import aws_ecr as ecr
from aws_cdk import aws_ecs as ecs
from aws_cdk import aws_iam as iam
from aws_cdk import aws_logs as logs
from aws_cdk import aws_s3 as s3

from spot_training import contract

from . import acknowledgements
from .config import (ContextKey, ContextSettings, StackSettings, context_int, context_value_error, instance_types,
                     prop_int, stack_name_setting)
from .filesystem import SharedFileSystem
from .stack import SettingsStack, new_vpc, node_subnets

#: Default spot instance types of the compute environment (single-GPU types, as the fleet's).
DEFAULT_SWEEP_INSTANCE_TYPES: tuple[str, ...] = ("g5.xlarge", "g4dn.xlarge")
#: The ECR repository name the default image lives in (built from docker/sweep.Dockerfile).
DEFAULT_IMAGE_REPOSITORY = "spot-training-sweep"
#: What a child runs: our watcher beside the user's script (spot_training/agent/sweep_child.py).
CHILD_ENTRY = ("python", "-m", "spot_training.agent.sweep_child", "--")
#: The retry rules in Batch's order (first match wins): (action, onStatusReason, onExitCode, onReason).
RETRY_RULES: tuple[tuple[str, str | None, str | None, str | None], ...] = (
    ("RETRY", contract.SWEEP_RECLAIM_STATUS_REASON_GLOB, None, None),
    ("RETRY", None, str(contract.EXIT_SWEEP_RECLAIM_NOT_TAKEN), None),
    ("EXIT", None, None, "*"),
)


def _retry_strategies() -> list[batch.RetryStrategy]:
    out = []
    for action, status_reason, exit_code, reason in RETRY_RULES:
        on = (batch.Reason.SPOT_INSTANCE_RECLAIMED if status_reason == contract.SWEEP_RECLAIM_STATUS_REASON_GLOB
              else batch.Reason.custom(on_exit_code=exit_code, on_reason=reason))
        out.append(batch.RetryStrategy.of(batch.Action[action], on))
    return out


class ParallelExperiments(constructs.Construct):
    """Run many single-node resumable trainings as AWS Batch array children on spot capacity.

    Attributes:
        compute_environments: the spot environment, then the on-demand one when asked for.
        job_queue, job_definition, file_system (:class:`SharedFileSystem`), manifest_bucket,
        job_role, launch_template, log_group.
    """

    def __init__(
        self,
        scope: constructs.Construct,
        construct_id: str,
        *,
        vpc: ec2.IVpc,
        vpc_subnets: ec2.SubnetSelection | None = None,
        instance_types: Sequence[str] = DEFAULT_SWEEP_INSTANCE_TYPES,
        max_vcpus: int = 256,
        on_demand_fallback: bool = False,
        image: ecs.ContainerImage | None = None,
        gpus: int = 1,
        vcpus: int = 4,
        memory_mib: int = 15000,
        retry_attempts: int = 3,
        runnable_timeout: cdk.Duration = cdk.Duration.minutes(30),
        job_timeout: cdk.Duration = cdk.Duration.hours(24),
        environment: Mapping[str, str] | None = None,
        removal_policy: cdk.RemovalPolicy = cdk.RemovalPolicy.DESTROY,
    ) -> None:
        """Define the compute environments, queue, job definition, storage and roles.

        Args:
            scope: the parent construct.
            construct_id: the construct's id, unique within ``scope``.
            vpc: the VPC of the hosts and EFS mount targets.
            vpc_subnets: their subnets (default: the public subnets).
            instance_types: EC2 types Batch may launch (default g5.xlarge, g4dn.xlarge).
            max_vcpus: the compute environments' ``maxvCpus`` (default 256), >= ``vcpus``.
            on_demand_fallback: add an on-demand environment behind the spot one (default False).
            image: the container image; default the ECR repository :data:`DEFAULT_IMAGE_REPOSITORY`
                of this account and region, tag ``latest`` (no build at synth).
            gpus: GPUs per child (default 1; 0 for a CPU sweep). vcpus, memory_mib: per child.
            retry_attempts: Batch attempts per child, 1..10 (default 3: two reclaims survived).
            runnable_timeout: cancel a child stuck RUNNABLE for want of capacity after this (10 min..).
            job_timeout: per-attempt timeout (default 24 h).
            environment: more environment for every child.
            removal_policy: of the file system and the manifest bucket (default DESTROY).

        Raises:
            ValueError: a bad prop, naming it, its value and what is allowed.
        """
        super().__init__(scope, construct_id)
        for name, value, lo, hi in (("retry_attempts", retry_attempts, 1, contract.MAX_BATCH_ATTEMPTS),
                                    ("gpus", gpus, 0, 8), ("vcpus", vcpus, 1, 192), ("memory_mib", memory_mib, 512, 2_000_000),
                                    ("max_vcpus", max_vcpus, vcpus if isinstance(vcpus, int) else 1, 100_000)):
            prop_int(name, value, lo, hi)
        if not instance_types:
            raise ValueError("instance_types must name at least one EC2 instance type, got none")
        stack = cdk.Stack.of(self)
        subnets = vpc_subnets or ec2.SubnetSelection(subnet_type=ec2.SubnetType.PUBLIC)

        self.security_group = ec2.SecurityGroup(self, "HostSecurityGroup", vpc=vpc, allow_all_outbound=True,
                                                description="AWS Batch sweep hosts: no ingress")
        self.file_system = SharedFileSystem(self, "FileSystem", vpc=vpc, vpc_subnets=subnets, removal_policy=removal_policy,
                                            access_point_path="/sweeps")
        self.file_system.connections.allow_default_port_from(self.security_group)
        self.manifest_bucket = s3.Bucket(
            self, "ManifestBucket", encryption=s3.BucketEncryption.S3_MANAGED, enforce_ssl=True,
            block_public_access=s3.BlockPublicAccess.BLOCK_ALL, versioned=True, removal_policy=removal_policy,
            object_ownership=s3.ObjectOwnership.BUCKET_OWNER_ENFORCED)
        self.log_group = logs.LogGroup(self, "JobLogs", retention=logs.RetentionDays.ONE_MONTH,
                                       removal_policy=cdk.RemovalPolicy.DESTROY)

        # IMDSv2 only, hop limit 2: the container's network namespace is one hop behind the host.
        self.launch_template = ec2.LaunchTemplate(
            self, "HostLaunchTemplate", require_imdsv2=True, http_put_response_hop_limit=2,
            http_tokens=ec2.LaunchTemplateHttpTokens.REQUIRED, instance_metadata_tags=False,
            block_devices=[ec2.BlockDevice(device_name="/dev/xvda", volume=ec2.BlockDeviceVolume.ebs(
                100, encrypted=True, volume_type=ec2.EbsDeviceVolumeType.GP3))])
        images = [batch.EcsMachineImage(image_type=batch.EcsMachineImageType.ECS_AL2_NVIDIA if gpus
                                        else batch.EcsMachineImageType.ECS_AL2)]
        types = [ec2.InstanceType(t) for t in instance_types]
        self.compute_environments: list[batch.ManagedEc2EcsComputeEnvironment] = []
        for name, spot in (("Spot", True), ("OnDemand", False))[: 2 if on_demand_fallback else 1]:
            self.compute_environments.append(batch.ManagedEc2EcsComputeEnvironment(
                self, f"{name}ComputeEnvironment", vpc=vpc, vpc_subnets=subnets, security_groups=[self.security_group],
                spot=spot, allocation_strategy=(batch.AllocationStrategy.SPOT_PRICE_CAPACITY_OPTIMIZED if spot
                                                else batch.AllocationStrategy.BEST_FIT_PROGRESSIVE),
                instance_types=types, use_optimal_instance_classes=False, minv_cpus=0, maxv_cpus=max_vcpus,
                launch_template=self.launch_template, images=images, update_to_latest_image_version=True))
        self.job_queue = batch.JobQueue(
            self, "JobQueue", priority=1,
            compute_environments=[batch.OrderedComputeEnvironment(compute_environment=ce, order=i + 1)
                                  for i, ce in enumerate(self.compute_environments)],
            job_state_time_limit_actions=[batch.JobStateTimeLimitAction(
                max_time=runnable_timeout, reason=batch.JobStateTimeLimitActionsReason.INSUFFICIENT_INSTANCE_CAPACITY,
                action=batch.JobStateTimeLimitActionsAction.CANCEL, state=batch.JobStateTimeLimitActionsState.RUNNABLE)])

        self.job_role = iam.Role(self, "JobRole", assumed_by=iam.ServicePrincipal("ecs-tasks.amazonaws.com"),
                                 description="A sweep child: read the manifests, mount and write the sweep file system")
        self.manifest_bucket.grant_read(self.job_role)
        # Each child mirrors its metrics.json and attempts.json under sweeps/ for spot-train sweep.
        self.manifest_bucket.grant_put(self.job_role, "sweeps/*")
        self.file_system.file_system.grant_read_write(self.job_role)
        self.execution_role = iam.Role(self, "ExecutionRole", assumed_by=iam.ServicePrincipal("ecs-tasks.amazonaws.com"),
                                       description="Pull the sweep image, write the job log group")
        if image is None:
            repository = ecr.Repository.from_repository_name(self, "ImageRepository", DEFAULT_IMAGE_REPOSITORY)
            image = ecs.ContainerImage.from_ecr_repository(repository, "latest")
        env = dict(environment or {})
        container = batch.EcsEc2ContainerDefinition(
            self, "Container", image=image, cpu=vcpus, memory=cdk.Size.mebibytes(memory_mib), gpu=gpus or None,
            command=[*CHILD_ENTRY, "Ref::command"], environment=env, job_role=self.job_role,
            execution_role=self.execution_role, readonly_root_filesystem=False,
            logging=ecs.LogDriver.aws_logs(stream_prefix="sweep", log_group=self.log_group),
            volumes=[batch.EcsVolume.efs(name="storage", file_system=self.file_system.file_system,
                                         access_point_id=self.file_system.access_point_id,
                                         container_path=contract.SWEEP_MOUNT_POINT, enable_transit_encryption=True,
                                         use_job_role=True)])
        self.job_definition = batch.EcsJobDefinition(
            self, "JobDefinition", container=container, retry_attempts=retry_attempts,
            retry_strategies=_retry_strategies(), timeout=job_timeout, propagate_tags=True,
            parameters={"command": "python train.py"})
        self._acknowledge()
        acknowledgements.attach(self)  # checkov's (acknowledgements.CHECKOV) as Metadata on its resources

    def _acknowledge(self) -> None:
        """cdk-nag findings of this construct that stay, each with its reason."""
        cdk_nag.NagSuppressions.add_resource_suppressions(self, [
            cdk_nag.NagPackSuppression(
                id="AwsSolutions-IAM4", reason="AWS Batch's ECS hosts need AmazonEC2ContainerServiceforEC2Role (the "
                "ECS agent registers the host, pulls images, reports task state); aws-cdk-lib attaches it to the "
                "compute environment's instance role, as the AWS Batch User Guide's 'Amazon ECS instance role' says.",
                applies_to=["Policy::arn:<AWS::Partition>:iam::aws:policy/service-role/AmazonEC2ContainerServiceforEC2Role"]),
            cdk_nag.NagPackSuppression(
                id="AwsSolutions-IAM5", reason="s3:GetObject*/List* on the stack's own manifest bucket's objects "
                "(grant_read): manifest keys are made per sweep at submit time.",
                applies_to=["Action::s3:GetBucket*", "Action::s3:GetObject*", "Action::s3:List*",
                            cdk_nag.RegexAppliesTo(regex=r"/^Resource::<.*ManifestBucket[0-9A-F]{8}\.Arn>\/\*$/g")]),
            cdk_nag.NagPackSuppression(
                id="AwsSolutions-IAM5", reason="s3:PutObject* (grant_put) only under the bucket's sweeps/ prefix: each "
                "child mirrors its metrics.json and attempts.json to sweeps/<sweep>/<index>/, keys made at run time.",
                applies_to=["Action::s3:Abort*", cdk_nag.RegexAppliesTo(regex=r"/^Resource::<.*ManifestBucket[0-9A-F]{8}\.Arn>\/sweeps\/\*$/g")]),
            cdk_nag.NagPackSuppression(
                id="AwsSolutions-IAM5", reason="ecr:GetAuthorizationToken, which supports no resource-level "
                "permissions (ECR User Guide, 'Private registry authentication'); the image pull itself is "
                "scoped to the one repository.", applies_to=["Resource::*"]),
            cdk_nag.NagPackSuppression(
                id="AwsSolutions-S1", reason="The manifest bucket holds only the parameter lists users upload with "
                "spot-train sweep submit; CloudTrail data events cover access when needed, a log bucket would be a "
                "second bucket to retain and empty."),
        ], apply_to_children=True)


# ---- settings and stack ----------------------------------------------------------------------------
#: Keys of the single-node stack that mean the same for the sweep stack.
SHARED_KEYS: tuple[str, ...] = ("account", "region", "availability_zones", "vpc_id", "vpc_flow_logs", "private_subnets")
SWEEP_CONTEXT_KEYS: tuple[ContextKey, ...] = (
    ContextKey("sweep_stack_name", "SpotSweep", "-", "CloudFormation stack name of the sweep stack"),
    ContextKey("sweep_instance_types", list(DEFAULT_SWEEP_INSTANCE_TYPES), "list", "EC2 types the spot compute environment may launch"),
    ContextKey("sweep_max_vcpus", 256, "vCPUs", "the compute environments' maxvCpus (how many children run at once)"),
    ContextKey("sweep_on_demand_fallback", False, "bool", "an on-demand compute environment behind the spot one in the queue"),
    ContextKey("sweep_image", None, "-", f"container image URI; default: ECR repository {DEFAULT_IMAGE_REPOSITORY}:latest of the stack's account (docker/sweep.Dockerfile)"),
    ContextKey("sweep_gpus", 1, "GPUs", "GPUs per child, 0..8"),
    ContextKey("sweep_vcpus", 4, "vCPUs", "vCPUs per child"),
    ContextKey("sweep_memory_mib", 15000, "MiB", "memory per child"),
    ContextKey("sweep_retry_attempts", 3, "attempts", f"AWS Batch attempts per child, 1..{contract.MAX_BATCH_ATTEMPTS} (reclaims retry, code errors do not)"),
)
_SWEEP_KEY_NAMES = tuple(k.name for k in SWEEP_CONTEXT_KEYS)
_IMAGE = re.compile(r"[a-z0-9][a-z0-9._/:@-]{0,254}", re.IGNORECASE)


@dataclasses.dataclass(frozen=True)
class SweepSettings(ContextSettings):
    """Validated settings of :class:`SpotSweepStack` (units in :data:`SWEEP_CONTEXT_KEYS`)."""

    context_keys = SHARED_KEYS + _SWEEP_KEY_NAMES

    base: StackSettings = StackSettings()
    stack_name: str = "SpotSweep"
    instance_types: tuple[str, ...] = DEFAULT_SWEEP_INSTANCE_TYPES
    max_vcpus: int = 256
    on_demand_fallback: bool = False
    image: str | None = None
    gpus: int = 1
    vcpus: int = 4
    memory_mib: int = 15000
    retry_attempts: int = 3

    @classmethod
    def from_mapping(cls, raw: Mapping[str, Any]) -> SweepSettings:
        """Validate ``raw`` (missing or ``None`` values take the default).

        Raises:
            ValueError: an unknown key, or a bad value (naming the key, the value and what is allowed).
        """
        unknown = sorted(set(raw) - set(cls.context_keys))
        if unknown:
            raise ValueError(f"unknown sweep setting(s) {unknown}; allowed: {', '.join(cls.context_keys)}")
        base = StackSettings.from_mapping({k: raw.get(k) for k in SHARED_KEYS})
        v = {k: raw.get(k) for k in _SWEEP_KEY_NAMES}
        out: dict[str, Any] = {"base": base}
        out["stack_name"] = stack_name_setting("sweep_stack_name", v["sweep_stack_name"], "SpotSweep")
        if v["sweep_instance_types"] is not None:
            out["instance_types"] = instance_types("sweep_instance_types", v["sweep_instance_types"])
        for key, field, lo, hi, unit in (("sweep_max_vcpus", "max_vcpus", 1, 100_000, "vCPUs"), ("sweep_gpus", "gpus", 0, 8, "GPUs"),
                                         ("sweep_vcpus", "vcpus", 1, 192, "vCPUs"), ("sweep_memory_mib", "memory_mib", 512, 2_000_000, "MiB"),
                                         ("sweep_retry_attempts", "retry_attempts", 1, contract.MAX_BATCH_ATTEMPTS, "attempts")):
            if v[key] is not None:
                out[field] = context_int(key, v[key], lo, hi, unit)
        if out.get("max_vcpus", 256) < out.get("vcpus", 4):
            raise context_value_error("sweep_max_vcpus", v["sweep_max_vcpus"], f"at least sweep_vcpus ({out.get('vcpus', 4)})")
        flag = v["sweep_on_demand_fallback"]
        if flag is not None:
            if isinstance(flag, bool):
                out["on_demand_fallback"] = flag
            elif isinstance(flag, str) and flag.strip().lower() in ("true", "false"):
                out["on_demand_fallback"] = flag.strip().lower() == "true"
            else:
                raise context_value_error("sweep_on_demand_fallback", flag, "true or false")
        if v["sweep_image"] is not None:
            if not isinstance(v["sweep_image"], str) or not _IMAGE.fullmatch(v["sweep_image"]):
                raise context_value_error("sweep_image", v["sweep_image"], "a container image URI such as 123456789012.dkr.ecr.us-east-1.amazonaws.com/repo:tag")
            out["image"] = v["sweep_image"]
        return cls(**out)


class SpotSweepStack(SettingsStack):
    """A VPC (new or existing) and :class:`ParallelExperiments`; sweeps are submitted against it with
    ``spot-train sweep submit`` (spot_training.ops.sweep).

    Outputs: ``JobQueue``, ``JobDefinition``, ``ManifestBucket``, ``FileSystemId``, ``AccessPointId``, ``LogGroup``.
    """

    def __init__(self, scope: constructs.Construct, construct_id: str | None = None, *,
                 settings: SweepSettings | None = None, **kwargs: Any) -> None:
        """Define the stack.

        Args:
            scope: the app.
            construct_id: the stack's construct id (default: the stack name).
            settings: the validated settings (default: every default).
            **kwargs: more ``cdk.Stack`` props (``env``, ``synthesizer``...).

        Raises:
            ValueError: from the construct (a bad setting).
        """
        settings = settings or SweepSettings()
        base = settings.base
        super().__init__(scope, construct_id, stack_name=settings.stack_name, account=base.account, region=base.region,
                         availability_zones=base.availability_zones,
                         default_description="Spot training: parameter sweeps as AWS Batch array jobs on spot, EFS per index", **kwargs)
        self.settings = settings
        self.vpc = new_vpc(self, base.vpc_id, flow_logs=base.vpc_flow_logs, private_subnets=base.private_subnets)
        if not base.vpc_flow_logs and not base.vpc_id:
            cdk_nag.NagSuppressions.add_resource_suppressions(self.vpc, [cdk_nag.NagPackSuppression(
                id="AwsSolutions-VPC7", reason="VPC flow logs were turned off on purpose with the vpc_flow_logs context key; they are on by default.")])
        image = ecs.ContainerImage.from_registry(settings.image) if settings.image else None
        self.sweep = ParallelExperiments(
            self, "Sweep", vpc=self.vpc, vpc_subnets=node_subnets(base.private_subnets), instance_types=settings.instance_types,
            max_vcpus=settings.max_vcpus, on_demand_fallback=settings.on_demand_fallback, image=image, gpus=settings.gpus,
            vcpus=settings.vcpus, memory_mib=settings.memory_mib, retry_attempts=settings.retry_attempts)
        s = self.sweep
        for name, value in (("JobQueue", s.job_queue.job_queue_arn), ("JobDefinition", s.job_definition.job_definition_arn),
                            ("ManifestBucket", s.manifest_bucket.bucket_name), ("FileSystemId", s.file_system.file_system_id),
                            ("AccessPointId", s.file_system.access_point_id), ("LogGroup", s.log_group.log_group_name)):
            cdk.CfnOutput(self, name, value=value)


__all__ = ["ParallelExperiments", "SpotSweepStack", "SweepSettings", "SWEEP_CONTEXT_KEYS", "RETRY_RULES"]
