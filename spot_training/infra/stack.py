"""``SpotTrainingStack``: the single-node spot training stack (stack name ``SpotTraining`` by default)."""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

import aws_cdk as cdk
import constructs
import jsii
from aws_cdk import aws_ec2 as ec2
from aws_cdk import aws_kms as kms
from aws_cdk import aws_logs as logs
from aws_cdk import aws_s3 as s3

from . import acknowledgements
from .asset import BOTO3_REQUIREMENT
from .config import StackSettings
from .filesystem import SharedFileSystem
from .fis import SpotInterruptionDrill
from .job import TrainingJob
from .monitoring import RETENTION_DAYS, TrainingMonitoring
from .tags import STACK_TAG_KEY
from .userdata import SERVICE_NAME
from spot_training.contract import EFS_MOUNT_POINT  # where the node mounts the shared file system, when there is one

__all__ = ["BOTO3_REQUIREMENT", "EFS_MOUNT_POINT", "FixedImage", "SettingsStack", "SpotTrainingStack", "machine_image", "new_vpc", "node_subnets"]


@jsii.implements(ec2.IMachineImage)
class FixedImage:
    """An AMI given by id, valid in whatever region the stack deploys to.

    aws-cdk-lib's ``MachineImage.generic_linux`` needs a region-to-AMI map, which an
    environment-agnostic stack cannot key; this hands the id through unchanged.
    """

    def __init__(self, image_id: str) -> None:
        """``image_id``: ``ami-...`` (validated by :class:`StackSettings`)."""
        self.image_id = image_id

    def get_image(self, scope: constructs.Construct) -> ec2.MachineImageConfig:
        """The image config: this id, Linux, empty Linux user data."""
        return ec2.MachineImageConfig(
            image_id=self.image_id, os_type=ec2.OperatingSystemType.LINUX, user_data=ec2.UserData.for_linux()
        )


class SettingsStack(cdk.Stack):
    """A ``cdk.Stack`` whose environment, name and Availability Zones come from the shared settings.

    The base of :class:`SpotTrainingStack` and ``DistributedTrainingStack`` (one rule for both,
    so that the shared keys ``account``, ``region`` and ``availability_zones`` mean the same in
    each). Every resource in it carries ``spot-training:stack=<stack name>``.
    """

    def __init__(
        self,
        scope: constructs.Construct,
        construct_id: str | None,
        *,
        stack_name: str,
        account: str | None,
        region: str | None,
        availability_zones: Sequence[str] | None,
        default_description: str,
        **kwargs: Any,
    ) -> None:
        """Define the stack.

        Args:
            scope: the app.
            construct_id: default: ``stack_name``.
            stack_name: the CloudFormation stack name unless ``kwargs`` holds one.
            account: the environment's account unless ``kwargs`` holds ``env`` (None with ``region``
                None: an environment-agnostic stack).
            region: the environment's region unless ``kwargs`` holds ``env`` (None with ``account``
                None: an environment-agnostic stack).
            availability_zones: pinned AZs (no lookup); None or empty: CDK's.
            default_description: the stack description unless ``kwargs`` holds ``description``.
            kwargs: passed to ``cdk.Stack``.
        """
        if "env" not in kwargs and (account or region):
            kwargs["env"] = cdk.Environment(account=account, region=region)
        kwargs.setdefault("stack_name", stack_name)
        kwargs.setdefault("description", default_description)
        self._pinned_azs = list(availability_zones) if availability_zones else None
        super().__init__(scope, construct_id or stack_name, **kwargs)
        acknowledgements.attach(self)  # its nag/checkov acknowledgements, on its own resources
        cdk.Tags.of(self).add(STACK_TAG_KEY, self.stack_name)

    @property
    def availability_zones(self) -> list[str]:
        """The AZs from the ``availability_zones`` setting when pinned (no lookup), else CDK's."""
        pinned = getattr(self, "_pinned_azs", None)
        return list(pinned) if pinned else super().availability_zones

    def add_monitoring(self, settings: StackSettings) -> TrainingMonitoring | None:
        """The stack's :class:`TrainingMonitoring` (construct id ``Monitoring``) from the shared
        monitoring keys of ``settings``, or None when ``settings.monitoring`` is false. Its log group
        is kept on delete when ``settings.retain_data``; the fleet's capacity alarm is the caller's
        (``add_capacity_alarm``, once the fleet exists)."""
        if not settings.monitoring:
            return None
        return TrainingMonitoring(
            self,
            "Monitoring",
            stack_tag_value=self.stack_name,
            log_retention=RETENTION_DAYS[settings.log_retention_days],
            no_progress_minutes=settings.alarm_no_progress_minutes,
            no_capacity_minutes=settings.alarm_no_capacity_minutes,
            notification_email=settings.notification_email,
            removal_policy=cdk.RemovalPolicy.RETAIN if settings.retain_data else cdk.RemovalPolicy.DESTROY,
        )


class SpotTrainingStack(SettingsStack):
    """One spot training node that resumes where the last one stopped.

    Resources: a VPC (new, public subnets and no NAT gateway, flow logs; or an existing one by id),
    the data volume (:class:`TrainingVolume`) in the first Availability Zone, the node role and
    instance profile (:class:`TrainingNodeRole`), the bootstrap asset, a Spot Fleet
    (:class:`SpotTrainingFleet`) across every AZ of the VPC, optionally an EFS file system
    (:class:`SharedFileSystem`), and the data cleanup custom resource (:class:`DataCleanup`).
    Everything carries ``spot-training:stack=<stack name>``.

    Outputs: ``FleetRequestId``, ``DataVolumeId``, ``DataVolumeAvailabilityZone``, ``Logs``, and
    ``FileSystemId`` / ``AccessPointId`` with EFS.

    Attributes:
        settings, vpc, volume, node_role, bootstrap_asset, fleet, file_system (or None), cleanup,
        node_config (dict, may hold tokens).
    """

    def __init__(
        self,
        scope: constructs.Construct,
        construct_id: str | None = None,
        *,
        settings: StackSettings | None = None,
        vpc: ec2.IVpc | None = None,
        vpc_subnets: ec2.SubnetSelection | None = None,
        read_buckets: Sequence[s3.IBucket] = (),
        **kwargs: Any,
    ) -> None:
        """Define the stack.

        Args:
            scope: the app.
            construct_id: default: ``settings.stack_name``.
            settings: validated settings; default: ``StackSettings()`` (every default).
            vpc: an ``ec2.IVpc`` of your own (then ``settings.vpc_id``, ``vpc_flow_logs`` and
                ``private_subnets`` do not apply); default: a new VPC, or ``settings.vpc_id`` looked up.
            vpc_subnets: where the nodes (and EFS mount targets) go; default: the public subnets, or
                the isolated ones with ``settings.private_subnets``.
            read_buckets: S3 buckets the nodes may read (datasets); default: none.
            kwargs: passed to ``cdk.Stack`` (``env`` overrides ``settings.account``/``region``).

        Raises:
            ValueError: from the constructs, naming the bad prop; a ``vpc`` that is not an ``ec2.IVpc``.
        """
        settings = settings or StackSettings()
        super().__init__(
            scope, construct_id, stack_name=settings.stack_name, account=settings.account, region=settings.region,
            availability_zones=settings.availability_zones,
            default_description="Spot training: one GPU node on EC2 Spot that resumes from checkpoints on a persistent EBS volume",
            **kwargs,
        )
        self.settings = settings
        if vpc is not None and not hasattr(vpc, "select_subnets"):
            raise ValueError(f"vpc must be an ec2.IVpc (ec2.Vpc(...) or ec2.Vpc.from_lookup(...)), got {type(vpc).__name__}")
        self.vpc = vpc if vpc is not None else self._vpc(settings)
        selection = vpc_subnets or node_subnets(settings.private_subnets)

        self.file_system: SharedFileSystem | None = None
        if settings.efs:
            self.file_system = SharedFileSystem(self, "SharedFileSystem", vpc=self.vpc, vpc_subnets=selection)

        code = {"type": "git", "url": settings.code_git_url, "ref": settings.code_git_ref} if settings.code_git_url else None
        if code is not None and settings.code_git_token_secret:
            code["token_secret"] = settings.code_git_token_secret
        node_options = {
            "user": settings.training_user, "mount_point": settings.mount_point, "keep_snapshots": settings.keep_snapshots,
            "snapshot_interval_s": settings.snapshot_interval_minutes * 60,
            "initialization_rate_mibps": settings.volume_initialization_rate_mibps, "code": code,
            "cancel_fleet_on_success": settings.cancel_fleet_on_success, "imds_endpoint": settings.imds_endpoint,
            "notice_poll_interval_s": settings.notice_poll_interval_s,
            "checkpoint_every_steps": settings.checkpoint_every_steps,
            "checkpoint_every_seconds": settings.checkpoint_every_seconds,
            "requirements": settings.training_requirements,
            "inherit_site_packages": settings.training_inherit_site_packages,
        }
        # The one job of this stack: its id is the stack name (the tags of every earlier deployment),
        # and its construct id "Default" keeps the logical ids the parts had as the stack's children.
        # Only what the user set goes to the job: the constructs own their defaults (TrainingVolume's size,
        # SpotTrainingFleet's types and capacity, ...); a test keeps StackSettings' defaults equal to them.
        given = user_set(settings)
        props = {prop: given[key] for key, prop in CONSTRUCT_OWNED.items() if key in given}
        self.job = TrainingJob(
            self, "Default", vpc=self.vpc, job_id=self.stack_name, framework=settings.framework,
            training_command=settings.training_command, training_python=settings.training_python,
            vpc_subnets=selection, machine_image=machine_image(settings.image_id, settings.ami_ssm_parameter),
            volume_encryption_key=(kms.Key.from_key_arn(self, "VolumeKey", settings.volume_kms_key_arn)
                                   if settings.volume_kms_key_arn else None),
            adopt_volume_id=settings.adopt_volume_id, file_system=self.file_system, read_buckets=read_buckets,
            log_retention=RETENTION_DAYS[settings.log_retention_days],
            notification_email=settings.notification_email, monitoring_interval_s=settings.monitoring_interval_s,
            dataset_uri=settings.dataset_uri, code_dir=settings.code_dir, code_exclude=settings.code_exclude,
            node_options=node_options, **props,
        )
        job = self.job
        self.volume, self.node_role, self.fleet = job.volume, job.node_role, job.fleet
        self.bootstrap_asset, self.monitoring, self.cleanup, self.node_config = (
            job.bootstrap_asset, job.monitoring, job.cleanup, job.node_config)
        self.dataset_asset = job.dataset_asset
        tag_value = self.stack_name

        cdk.CfnOutput(self, "FleetRequestId", value=self.fleet.fleet_request_id, description="Spot Fleet request id")
        cdk.CfnOutput(
            self,
            "DataVolumeId",
            value=self.volume.volume_id if self.volume is not None else settings.adopt_volume_id,
            description=("The data volume as created; the agent may move it to another AZ (find it by its tags)"
                         if self.volume is not None else
                         "The adopted data volume (adopt_volume_id); the agent may move it to another AZ (find it by its tags)"),
        )
        if self.volume is not None:
            cdk.CfnOutput(self, "DataVolumeAvailabilityZone", value=self.volume.availability_zone)
        cdk.CfnOutput(
            self,
            "Logs",
            value=(
                f"agent: journalctl -u {SERVICE_NAME} on the node (aws ssm start-session --target INSTANCE_ID); "
                f"trainer: {settings.mount_point}/logs on the data volume; "
                f"cleanup: CloudWatch Logs group {self.cleanup.log_group.log_group_name}"
                + (f"; agents and trainers: CloudWatch Logs group {self.monitoring.log_group.log_group_name} "
                   f"(spot-train logs --stack {self.stack_name})" if self.monitoring else "")
            ),
            description="Where the logs go",
        )
        self.interruption_drill: SpotInterruptionDrill | None = None
        if settings.fis_drill:
            # Only on request: a standing permission to interrupt the stack's instances (spot-train drill --aws).
            self.interruption_drill = SpotInterruptionDrill(self, "SpotInterruptionDrill", stack_tag_value=tag_value)
            cdk.CfnOutput(self, "FisExperimentTemplateId", value=self.interruption_drill.experiment_template_id,
                          description="aws fis start-experiment --experiment-template-id <this>: one spot interruption")
        if self.monitoring is not None:
            cdk.CfnOutput(self, "Dashboard", value=self.monitoring.dashboard.dashboard_name,
                          description="CloudWatch dashboard of this training job")
        if self.file_system is not None:
            cdk.CfnOutput(self, "FileSystemId", value=self.file_system.file_system_id)
            cdk.CfnOutput(self, "AccessPointId", value=self.file_system.access_point_id)

    def _vpc(self, settings: StackSettings) -> ec2.IVpc:
        vpc = new_vpc(self, settings.vpc_id, flow_logs=settings.vpc_flow_logs, private_subnets=settings.private_subnets)
        if settings.private_subnets and settings.code_git_token_secret:
            # The agent reads the git token from Secrets Manager; isolated subnets reach it only through an endpoint.
            vpc.add_interface_endpoint("SecretsManagerEndpoint", private_dns_enabled=True,
                                       service=ec2.InterfaceVpcEndpointAwsService.SECRETS_MANAGER)
        return vpc


#: StackSettings field -> TrainingJob prop, for the props whose default the constructs own.
CONSTRUCT_OWNED: dict[str, str] = {
    "instance_types": "instance_types", "target_capacity": "target_capacity",
    "allocation_strategy": "allocation_strategy", "max_price": "max_price",
    "root_volume_size_gib": "root_volume_size", "volume_size_gib": "volume_size", "volume_iops": "volume_iops",
    "volume_throughput_mibps": "volume_throughput_mibps", "pin_to_volume_az": "pin_to_volume_az",
    "monitoring": "monitoring", "alarm_no_progress_minutes": "alarm_no_progress_minutes",
    "alarm_no_capacity_minutes": "alarm_no_capacity_minutes", "retain_data": "retain_data",
}


def user_set(settings: StackSettings) -> dict[str, Any]:
    """The fields of ``settings`` whose value differs from the field's declared default (what the user set)."""
    return {f.name: getattr(settings, f.name) for f in dataclasses.fields(settings)
            if f.default is dataclasses.MISSING or getattr(settings, f.name) != f.default}


def machine_image(image_id: str | None, ami_ssm_parameter: str) -> ec2.IMachineImage:
    """``image_id`` as is when given, else the AMI id in the public SSM parameter ``ami_ssm_parameter``.

    The SSM parameter is resolved by CloudFormation at deploy time (no credentials at synth).

    Args:
        image_id: an AMI id (``ami-…``), or None.
        ami_ssm_parameter: the SSM parameter name (e.g. the Deep Learning AMI's public parameter).

    Returns:
        the machine image.
    """
    if image_id:
        return FixedImage(image_id)
    return ec2.MachineImage.from_ssm_parameter(ami_ssm_parameter, os=ec2.OperatingSystemType.LINUX)


#: Interface VPC endpoints of a VPC with private subnets: what the nodes call (EC2 for the agent and
#: the boot-failure script, CloudWatch Logs and metrics for monitoring, EFS for amazon-efs-utils)
#: and what the SSM Agent needs for Session Manager (ssm, ssmmessages, ec2messages). S3 (the
#: bootstrap asset) goes through a gateway endpoint, which costs nothing.
PRIVATE_SUBNET_INTERFACE_ENDPOINTS: dict[str, ec2.InterfaceVpcEndpointAwsService] = {
    "Ec2": ec2.InterfaceVpcEndpointAwsService.EC2,
    "Ssm": ec2.InterfaceVpcEndpointAwsService.SSM,
    "SsmMessages": ec2.InterfaceVpcEndpointAwsService.SSM_MESSAGES,
    "Ec2Messages": ec2.InterfaceVpcEndpointAwsService.EC2_MESSAGES,
    "Logs": ec2.InterfaceVpcEndpointAwsService.CLOUDWATCH_LOGS,
    "Monitoring": ec2.InterfaceVpcEndpointAwsService.CLOUDWATCH_MONITORING,
    "Efs": ec2.InterfaceVpcEndpointAwsService.ELASTIC_FILESYSTEM,
}


def node_subnets(private_subnets: bool, **kwargs: Any) -> ec2.SubnetSelection:
    """The subnets the nodes (and EFS mount targets) go in: the public ones, or with
    ``private_subnets`` the isolated ones of :func:`new_vpc`. ``kwargs`` go to ``SubnetSelection``."""
    subnet_type = ec2.SubnetType.PRIVATE_ISOLATED if private_subnets else ec2.SubnetType.PUBLIC
    return ec2.SubnetSelection(subnet_type=subnet_type, **kwargs)


def new_vpc(stack: cdk.Stack, vpc_id: str | None, *, flow_logs: bool, private_subnets: bool = False) -> ec2.IVpc:
    """The existing VPC ``vpc_id`` (``Vpc.from_lookup``), else a new one (construct id ``Vpc``):
    10.20.0.0/16, one /20 subnet per AZ of ``stack``, no NAT gateway, and with ``flow_logs``
    flow logs to a CloudWatch Logs group kept one month.

    The subnets are public (instances get public IPs and reach AWS and the internet through the
    internet gateway) unless ``private_subnets``: then they are isolated (no route out of the VPC, no
    public IP) and the VPC gets an S3 gateway endpoint and the interface endpoints of
    :data:`PRIVATE_SUBNET_INTERFACE_ENDPOINTS` (private DNS, in every AZ; each endpoint's security
    group allows HTTPS from the VPC's CIDR only). Trade-off: docs/infra.md, "Private subnets".

    Args:
        stack: the stack the VPC (or its lookup) belongs to.
        vpc_id: an existing VPC's id (``vpc-…``), or None for a new VPC.
        flow_logs: a new VPC gets flow logs.
        private_subnets: isolated subnets with VPC endpoints instead of public ones (default False).

    Returns:
        the VPC.

    Raises:
        ValueError: ``private_subnets`` with ``vpc_id`` (endpoints are only made in a new VPC).
    """
    if vpc_id:
        if private_subnets:
            raise ValueError(f"private_subnets=true needs a new VPC, got vpc_id={vpc_id!r}")
        return ec2.Vpc.from_lookup(stack, "Vpc", vpc_id=vpc_id)
    subnet = (
        ec2.SubnetConfiguration(name="Private", subnet_type=ec2.SubnetType.PRIVATE_ISOLATED, cidr_mask=20)
        if private_subnets
        else ec2.SubnetConfiguration(name="Public", subnet_type=ec2.SubnetType.PUBLIC, cidr_mask=20)
    )
    vpc = ec2.Vpc(
        stack,
        "Vpc",
        ip_addresses=ec2.IpAddresses.cidr("10.20.0.0/16"),
        max_azs=len(stack.availability_zones),
        nat_gateways=0,
        subnet_configuration=[subnet],
    )
    if private_subnets:
        vpc.add_gateway_endpoint("S3Endpoint", service=ec2.GatewayVpcEndpointAwsService.S3)
        for name, service in PRIVATE_SUBNET_INTERFACE_ENDPOINTS.items():
            vpc.add_interface_endpoint(f"{name}Endpoint", service=service, private_dns_enabled=True)
    if flow_logs:
        log_group = logs.LogGroup(
            stack, "FlowLogs", retention=logs.RetentionDays.ONE_MONTH, removal_policy=cdk.RemovalPolicy.DESTROY
        )
        vpc.add_flow_log("FlowLog", destination=ec2.FlowLogDestination.to_cloud_watch_logs(log_group))
    return vpc
