"""``TrainingJob``: one training job (data volume, node role, fleet, user data, monitoring) with its own identity.

A job's identity is its **job id**: the value of the ``spot-training:stack`` tag on everything the
job's nodes may touch (its data volume and the agent's copies and snapshots, its instances, its fleet
request), the ``stack_name`` of its node config, the condition of every mutating statement of its
node role, its log group ``/spot-training/<job id>``, and the ``Stack`` dimension of its metrics.
Jobs with different ids share nothing the agents act on, so any number of them live in one stack
or app; ``spot-train status|cost --job <job id>`` find one by it. ``SpotTrainingStack`` is one job
whose id is the stack name (the tags every earlier deployment carries).
"""

from __future__ import annotations

import inspect
import re
from collections.abc import Mapping, Sequence
from typing import Any

import aws_cdk as cdk
import constructs
import jsii
from aws_cdk import aws_ec2 as ec2
from aws_cdk import aws_iam as iam
from aws_cdk import aws_kms as kms
from aws_cdk import aws_logs as logs
from aws_cdk import aws_s3 as s3

from .asset import DEFAULT_CODE_EXCLUDE, BootstrapAsset, code_asset
from .cleanup import DataCleanup
from .filesystem import SharedFileSystem
from .fleet import DEFAULT_INSTANCE_TYPES, AllocationStrategy, SpotTrainingFleet
from .monitoring import TrainingMonitoring
from .roles import TrainingNodeRole
from .tags import DEPLOYMENT_TAG_KEY, PURPOSE_DATA_VOLUME, PURPOSE_TAG_KEY, STACK_TAG_KEY, deployment_tag_value
from .dataset import add_dataset
from .userdata import USER_CODE_DIR, node_config
from .volume import TrainingVolume
from spot_training.contract import EFS_MOUNT_POINT

__all__ = ["JOB_ID_PATTERN", "TrainingJob"]

#: A job id: what the node agents accept as ``stack_name`` (a letter, then letters, digits, hyphens; 1..128).
JOB_ID_PATTERN = re.compile(r"^[A-Za-z][A-Za-z0-9-]{0,127}$")
#: The default Deep Learning AMI parameter (docs/infra.md, "Default instance types and the AMI parameter").
DEFAULT_AMI_SSM_PARAMETER = "/aws/service/deeplearning/ami/x86_64/base-oss-nvidia-driver-gpu-ubuntu-22.04/latest/ami-id"
#: node_config arguments the job sets itself (identity, wiring); everything else may come in ``node_options``.
_WIRED = frozenset({"region", "stack_name", "volume_tags", "framework", "python", "command", "efs", "monitoring", "dataset"})
_NODE_OPTIONS = frozenset(inspect.signature(node_config).parameters) - _WIRED


def default_job_id(scope: constructs.IConstruct, construct_id: str) -> str:
    """``<stack name>-<construct path below the stack>``: a job id, unique per app when construct paths are.

    Every character other than letters, digits and hyphens is dropped; at most 128 characters.

    Args:
        scope: the job's parent construct (inside a stack).
        construct_id: the job's construct id.

    Returns:
        the job id.
    """
    stack = cdk.Stack.of(scope)
    below = [c.node.id for c in scope.node.scopes[len(stack.node.scopes):]] + [construct_id]
    raw = "-".join([stack.stack_name, *below])
    return re.sub(r"[^A-Za-z0-9-]", "", raw)[:128]


@jsii.implements(iam.IGrantable)
@jsii.implements(ec2.IConnectable)
class TrainingJob(constructs.Construct):
    """One spot training job: the nodes resume it from the checkpoints on its own data volume.

    Wires a :class:`TrainingVolume`, a :class:`TrainingNodeRole`, a :class:`SpotTrainingFleet` whose
    user data (:meth:`BootstrapAsset.user_data` of :func:`node_config`) starts the agent,
    optionally a :class:`TrainingMonitoring` and a :class:`DataCleanup`, all tagged
    ``spot-training:stack = job_id``. It is an ``iam.IGrantable`` (the node role:
    ``bucket.grant_read(job)``) and an ``ec2.IConnectable`` (the nodes' security group:
    ``fs.connections.allow_default_port_from(job)``).

    Construct ids of the parts are ``DataVolume``, ``NodeRole``, ``Monitoring``, ``Fleet`` and
    ``DataCleanup``; a job with construct id ``Default`` is transparent to logical ids (CDK drops
    ``Default`` from them), which :class:`SpotTrainingStack` uses to keep its logical ids.

    Attributes:
        job_id: the identity (str).
        volume: the :class:`TrainingVolume`, or None with ``adopt_volume_id``.
        node_role, fleet, bootstrap_asset, code_asset (the ``code_dir`` asset, or None), user_data (``ec2.UserData``), node_config (dict, may hold tokens),
        monitoring (or None), cleanup (or None), file_system (or None).
        grant_principal: the node role (``iam.IGrantable``). connections: the nodes' ``ec2.Connections``.
    """

    def __init__(
        self,
        scope: constructs.Construct,
        construct_id: str,
        *,
        vpc: ec2.IVpc,
        job_id: str | None = None,
        framework: str | None = None,
        training_command: Sequence[str] | None = None,
        training_python: str | None = None,
        vpc_subnets: ec2.SubnetSelection | None = None,
        machine_image: ec2.IMachineImage | None = None,
        instance_types: Sequence[str | ec2.InstanceType] = DEFAULT_INSTANCE_TYPES,
        target_capacity: int = 1,
        allocation_strategy: AllocationStrategy = AllocationStrategy.PRICE_CAPACITY_OPTIMIZED,
        max_price: str | float | None = None,
        root_volume_size: int | cdk.Size | None = None,
        volume_size: int | cdk.Size | None = None,
        volume_iops: int | None = None,
        volume_throughput_mibps: int | None = None,
        volume_encryption_key: kms.IKey | None = None,
        adopt_volume_id: str | None = None,
        pin_to_volume_az: bool = False,
        file_system: SharedFileSystem | None = None,
        read_buckets: Sequence[s3.IBucket] = (),
        bootstrap_asset: BootstrapAsset | None = None,
        monitoring: bool = True,
        log_retention: logs.RetentionDays = logs.RetentionDays.ONE_MONTH,
        alarm_no_progress_minutes: int = 30,
        alarm_no_capacity_minutes: int = 60,
        notification_email: str | None = None,
        monitoring_interval_s: float | None = None,
        retain_data: bool = False,
        dataset_uri: str | None = None,
        code_dir: str | None = None,
        code_exclude: Sequence[str] | None = None,
        node_options: Mapping[str, Any] | None = None,
    ) -> None:
        """Define the job.

        Args:
            scope: the parent construct.
            construct_id: the construct's id, unique within ``scope``.
            vpc: the VPC of the nodes (an ``ec2.IVpc``: ``ec2.Vpc(...)`` or ``Vpc.from_lookup``).
            job_id: the identity; default: ``<stack name>-<construct path>`` (:func:`default_job_id`).
                Letters, digits and hyphens, starting with a letter, 1..128 characters, unique in the app.
            framework: ``tensorflow`` (default), ``mxnet`` or ``pytorch``: the training extra and default command.
            training_command: the trainer's argv (list of strings); default: the framework's example.
            training_python: the interpreter the trainer runs with; default ``/usr/bin/python3``.
            vpc_subnets: where nodes launch; default: the VPC's public subnets.
            machine_image: default: the Deep Learning Base AMI from :data:`DEFAULT_AMI_SSM_PARAMETER`.
            instance_types: the fleet's (:class:`SpotTrainingFleet`).
            target_capacity: the fleet's.
            allocation_strategy: the fleet's.
            max_price: the fleet's.
            root_volume_size: the nodes' root volume (``cdk.Size`` or GiB); default: the fleet's (150 GiB).
            volume_size: the data volume's (:class:`TrainingVolume`; ``cdk.Size`` or GiB); default: the volume's.
            volume_iops: the data volume's; default: the volume's.
            volume_throughput_mibps: the data volume's (MiB/s); default: the volume's.
            volume_encryption_key: the data volume's KMS key; default: the volume's.
            adopt_volume_id: make this retained volume the job's instead of creating one.
            pin_to_volume_az: launch only in the data volume's AZ (first of ``vpc_subnets``); default false.
            file_system: a :class:`SharedFileSystem` the nodes mount (NFS opened, IAM granted).
            read_buckets: S3 buckets the nodes may read (``bucket.grant_read(job)`` does the same later).
            bootstrap_asset: default: the stack's one ``BootstrapAsset`` (construct id ``BootstrapAsset``).
            monitoring: log group, metrics, dashboard and alarms for this job; default true.
            log_retention: :class:`TrainingMonitoring`'s (with ``monitoring``).
            alarm_no_progress_minutes: :class:`TrainingMonitoring`'s (with ``monitoring``).
            alarm_no_capacity_minutes: :class:`TrainingMonitoring`'s (with ``monitoring``).
            notification_email: :class:`TrainingMonitoring`'s (with ``monitoring``).
            monitoring_interval_s: :class:`TrainingMonitoring`'s (with ``monitoring``).
            retain_data: keep the job's volumes and snapshots when the stack is deleted; default false
                (a :class:`DataCleanup` deletes them, this deployment's only).
            dataset_uri: ``s3://bucket/prefix/`` (or one object) the agent brings onto the data volume before the
                trainer starts; the node role may read only that (:func:`~spot_training.infra.dataset.add_dataset`).
                Default: the examples' digits as an asset of the stack; ``"none"``: no dataset step.
            code_dir: a local directory with your training code, shipped as a CDK S3 asset and unpacked
                on every node to ``/opt/spot-training/user-code``, where the trainer runs; the node role
                may read only that object. Default: none (the library's own asset, or ``code`` in
                ``node_options`` for git).
            code_exclude: .gitignore-style patterns left out of ``code_dir``'s asset; default
                :data:`~spot_training.infra.asset.DEFAULT_CODE_EXCLUDE`.
            node_options: further :func:`node_config` arguments (``user``, ``mount_point``,
                ``keep_snapshots``, ``snapshot_interval_s``, ``code``, ``requirements``, ...).

        Raises:
            ValueError: a malformed or repeated ``job_id``, a ``vpc``, ``file_system`` or ``machine_image`` of
                the wrong kind, an unknown ``framework``, a ``training_command``
                that is not a list of strings, an unknown ``node_options`` key, or any part's ValueError.
        """
        super().__init__(scope, construct_id)
        from .config import DEFAULT_FRAMEWORK, DEFAULT_TRAINING_PYTHON, FRAMEWORKS

        self.job_id = job_id if job_id is not None else default_job_id(scope, construct_id)
        if not isinstance(self.job_id, str) or not JOB_ID_PATTERN.match(self.job_id):
            raise ValueError(f"job_id must start with a letter and hold only letters, digits and hyphens "
                             f"(1..128 characters), got {self.job_id!r}")
        taken = [j for j in self.node.root.node.find_all() if isinstance(j, TrainingJob) and j is not self
                 and getattr(j, "job_id", None) == self.job_id]
        if taken:
            raise ValueError(f"job_id {self.job_id!r} is already used by {taken[0].node.path}; each job needs its own "
                             "(its tags scope its volumes and IAM permissions)")
        framework = framework or DEFAULT_FRAMEWORK
        if framework not in FRAMEWORKS:
            raise ValueError(f"framework must be one of {sorted(FRAMEWORKS)}, got {framework!r}")
        command = list(training_command) if training_command is not None else list(FRAMEWORKS[framework].training_command)
        if isinstance(training_command, str) or not command or not all(isinstance(a, str) and a for a in command):
            raise ValueError(f"training_command must be a non-empty list of strings such as ['python', 'train.py'], "
                             f"got {training_command!r}")
        options = dict(node_options or {})
        unknown = sorted(set(options) - _NODE_OPTIONS)
        if unknown:
            raise ValueError(f"node_options: unknown key(s) {unknown}; allowed: {sorted(_NODE_OPTIONS)}")
        if code_dir is not None and options.get("code") is not None:
            raise ValueError(f"code_dir ({code_dir!r}) and node_options['code'] ({options['code']!r}) both name the "
                             "training code; give one")
        if not hasattr(vpc, "select_subnets"):
            raise ValueError(f"vpc must be an ec2.IVpc (ec2.Vpc(...) or ec2.Vpc.from_lookup(...)), got {type(vpc).__name__}")
        if file_system is not None and not isinstance(file_system, SharedFileSystem):
            raise ValueError(f"file_system must be a SharedFileSystem (an EFS file system with the access point the "
                             f"agents mount), got {type(file_system).__name__}; for an efs.FileSystem of your own use "
                             "fs.connections.allow_default_port_from(job) and fs.grant_read_write(job)")
        if machine_image is not None and not hasattr(machine_image, "get_image"):
            raise ValueError(f"machine_image must be an ec2.IMachineImage (ec2.MachineImage.from_ssm_parameter(...)), "
                             f"got {type(machine_image).__name__}")
        if not isinstance(monitoring, bool) or not isinstance(pin_to_volume_az, bool):
            raise ValueError(f"monitoring and pin_to_volume_az must be True or False, got {monitoring!r}, {pin_to_volume_az!r}")

        stack = cdk.Stack.of(self)
        cdk.Tags.of(self).add(STACK_TAG_KEY, self.job_id)
        deployment = deployment_tag_value()
        subnet_selection = vpc_subnets or ec2.SubnetSelection(subnet_type=ec2.SubnetType.PUBLIC)
        volume_az = vpc.select_subnets(**_selection_kwargs(subnet_selection)).availability_zones[0]

        self.volume = self._volume(adopt_volume_id, volume_az, deployment, size=volume_size, iops=volume_iops,
                                   throughput_mibps=volume_throughput_mibps, encryption_key=volume_encryption_key)
        volume_tags = self.volume.tags if self.volume is not None else {
            STACK_TAG_KEY: self.job_id, PURPOSE_TAG_KEY: PURPOSE_DATA_VOLUME, DEPLOYMENT_TAG_KEY: deployment}

        self.bootstrap_asset = bootstrap_asset or _stack_bootstrap_asset(stack)
        self.node_role = TrainingNodeRole(self, "NodeRole", stack_tag_value=self.job_id, assets=[self.bootstrap_asset.asset],
                                          deployment_tag_value=deployment, adopt_volume_id=adopt_volume_id)
        if volume_encryption_key is not None:
            self.node_role.grant_volume_key(volume_encryption_key)
        _acknowledge_bucket_reads(self.node_role)
        # The dataset the agent brings onto the data volume before the trainer starts (infra/dataset.py).
        self.dataset_asset, dataset_section = add_dataset(self, dataset_uri, self.node_role.role)
        for bucket in read_buckets:
            bucket.grant_read(self)
        # A private git repository: the node role may read exactly the one secret holding its token.
        token_secret = (options.get("code") or {}).get("token_secret")
        if token_secret:
            grant_read_git_token(self, token_secret, self.node_role.role)
        # The user's code directory: one more asset, fetched and unpacked by the boot script (infra/asset.py).
        self.code_asset = None
        if code_dir is not None:
            self.code_asset = code_asset(self, "CodeAsset", code_dir,
                                         DEFAULT_CODE_EXCLUDE if code_exclude is None else code_exclude)
            self.node_role.grant_read_asset(self.code_asset)
            options["code"] = {"type": "asset", "path": USER_CODE_DIR}

        self.file_system = file_system
        efs_config = None
        if file_system is not None:
            file_system.grant_read_write(self)
            efs_config = {"file_system_id": file_system.file_system_id, "access_point_id": file_system.access_point_id,
                          "mount_point": EFS_MOUNT_POINT}

        # The log group must exist before any node writes to it.
        self.monitoring: TrainingMonitoring | None = None
        if monitoring:
            self.monitoring = TrainingMonitoring(
                self, "Monitoring", stack_tag_value=self.job_id, log_retention=log_retention,
                no_progress_minutes=alarm_no_progress_minutes, no_capacity_minutes=alarm_no_capacity_minutes,
                notification_email=notification_email,
                removal_policy=cdk.RemovalPolicy.RETAIN if retain_data else cdk.RemovalPolicy.DESTROY,
            )
            self.monitoring.grant_publish(self.node_role.role)

        self.node_config = node_config(
            region=stack.region, stack_name=self.job_id, volume_tags=volume_tags, framework=framework,
            python=training_python or DEFAULT_TRAINING_PYTHON, command=command, efs=efs_config,
            monitoring=self.monitoring.node_config(interval_s=monitoring_interval_s) if self.monitoring else None,
            dataset=dataset_section, **options,
        )
        if adopt_volume_id:
            self.node_config["volume"]["adopt_volume_id"] = adopt_volume_id
        self.user_data = self.bootstrap_asset.user_data(self.node_config, region=stack.region, code_asset=self.code_asset)

        # pin_to_volume_az: only the data volume's AZ, so a replacement never lands elsewhere and the
        # volume never moves (fewer spot capacity pools; docs/agent-storage.md).
        fleet_subnets = (_with_azs(subnet_selection, [volume_az]) if pin_to_volume_az else subnet_selection)
        self.fleet = SpotTrainingFleet(
            self, "Fleet", vpc=vpc, vpc_subnets=fleet_subnets,
            machine_image=machine_image or ec2.MachineImage.from_ssm_parameter(
                DEFAULT_AMI_SSM_PARAMETER, os=ec2.OperatingSystemType.LINUX),
            instance_profile=self.node_role.instance_profile, user_data=self.user_data,
            instance_types=instance_types, target_capacity=target_capacity, allocation_strategy=allocation_strategy,
            max_price=max_price, stack_tag_value=self.job_id,
            **({"root_volume_size_gib": root_volume_size} if root_volume_size is not None else {}),
        )
        # Nodes must find their volume, their permissions, their log group and EFS mount targets in place.
        self.fleet.resource.node.add_dependency(*[c for c in (self.volume, self.node_role) if c is not None])
        if self.monitoring is not None:
            self.fleet.resource.node.add_dependency(self.monitoring.log_group)
            self.monitoring.add_capacity_alarm(self.fleet.fleet_request_id)
        if file_system is not None:
            file_system.allow_from(self.fleet)
            self.fleet.resource.node.add_dependency(file_system)

        self.cleanup = DataCleanup(self, "DataCleanup", retain_data=retain_data, stack_tag_value=self.job_id,
                                   deployment_tag_value=deployment)
        self.cleanup.run_after(self.fleet.resource)

    def _volume(self, adopt_volume_id: str | None, availability_zone: str, deployment: str, **props: Any) -> TrainingVolume | None:
        if adopt_volume_id:  # the agent makes that retained volume this deployment's: no new one
            return None
        return TrainingVolume(self, "DataVolume", availability_zone=availability_zone, removal_policy=cdk.RemovalPolicy.RETAIN,
                              stack_tag_value=self.job_id, deployment_tag_value=deployment,
                              **{k if k != "size" else "size_gib": v for k, v in props.items() if v is not None})

    @property
    def grant_principal(self) -> iam.IPrincipal:
        """The node role: what ``grant_*`` calls of other constructs grant (``bucket.grant_read(job)``)."""
        return self.node_role.role

    @property
    def connections(self) -> ec2.Connections:
        """The nodes' security group (``fs.connections.allow_default_port_from(job)``)."""
        return self.fleet.connections

    def grant_read_bucket(self, bucket: s3.IBucket, objects_key_pattern: str | None = None) -> iam.Grant:
        """Let the nodes read ``bucket`` (or the keys matching ``objects_key_pattern``): ``bucket.grant_read``.

        Args:
            bucket: the bucket.
            objects_key_pattern: restrict to keys matching this pattern (default: every object).

        Returns:
            the ``iam.Grant``.
        """
        return bucket.grant_read(self, objects_key_pattern)


#: What aws-cdk-lib's ``Bucket.grant_read(job)`` grants, as cdk-nag names it (``applies_to``).
BUCKET_READ_FINDINGS: tuple[str, ...] = ("Action::s3:GetObject*", "Action::s3:GetBucket*", "Action::s3:List*")


def _acknowledge_bucket_reads(node_role: TrainingNodeRole) -> None:
    """Acknowledge, on the node role only, the cdk-nag findings (AwsSolutions-IAM5) of a bucket read
    grant to the job (``bucket.grant_read(job)``, :meth:`TrainingJob.grant_read_bucket`): aws-cdk-lib's
    own read actions on the objects of a bucket the user named. Nothing else is acknowledged, so a
    wider grant (write, ``*`` resources) still fails synth. cdk-nag is optional at run time."""
    try:
        import cdk_nag
    except ImportError:  # no cdk-nag installed: nothing runs its checks either
        return
    cdk_nag.NagSuppressions.add_resource_suppressions(node_role, [cdk_nag.NagPackSuppression(
        id="AwsSolutions-IAM5",
        reason="Read access to a bucket the user granted to the job (bucket.grant_read(job)): aws-cdk-lib's "
               "read actions (s3:GetObject*, s3:GetBucket*, s3:List*) on that bucket and its objects only.",
        applies_to=[*BUCKET_READ_FINDINGS, cdk_nag.RegexAppliesTo(
            regex=r"/^Resource::(<[A-Za-z0-9]+\.Arn>|arn:<AWS::Partition>:s3:::[a-z0-9.-]+)\/\*$/g")],
    )], apply_to_children=True)


def grant_read_git_token(scope: constructs.Construct, secret: str, role: iam.IRole) -> iam.Grant:
    """Let ``role`` read the Secrets Manager secret ``secret`` (a name, or a complete ARN) that holds a
    private git repository's token: aws-cdk-lib's ``ISecret.grant_read`` (``secretsmanager:GetSecretValue``
    and ``DescribeSecret`` on that one secret; a name matches its ARN with the 6-character suffix
    Secrets Manager appends, ``<name>-??????``, and nothing else).

    Args:
        scope: the construct the imported secret is defined in (construct id ``GitTokenSecret``).
        secret: the secret's name, or its complete ARN.
        role: the node role to grant.

    Returns:
        the ``iam.Grant``.
    """
    from aws_cdk import aws_secretsmanager as secretsmanager

    if secret.startswith("arn:"):
        found = secretsmanager.Secret.from_secret_complete_arn(scope, "GitTokenSecret", secret)
    else:
        found = secretsmanager.Secret.from_secret_name_v2(scope, "GitTokenSecret", secret)
    return found.grant_read(role)


def _stack_bootstrap_asset(stack: cdk.Stack) -> BootstrapAsset:
    """The stack's one :class:`BootstrapAsset` (construct id ``BootstrapAsset``), made on first use."""
    found = stack.node.try_find_child("BootstrapAsset")
    if found is None:
        return BootstrapAsset(stack, "BootstrapAsset")
    if not isinstance(found, BootstrapAsset):
        raise ValueError(f"{found.node.path} is not a BootstrapAsset; pass bootstrap_asset= to the job")
    return found


def _selection_kwargs(selection: ec2.SubnetSelection) -> dict[str, Any]:
    keys = ("availability_zones", "one_per_az", "subnet_filters", "subnet_group_name", "subnet_type", "subnets")
    return {k: getattr(selection, k) for k in keys if getattr(selection, k) is not None}


def _with_azs(selection: ec2.SubnetSelection, azs: list[str]) -> ec2.SubnetSelection:
    return ec2.SubnetSelection(**{**_selection_kwargs(selection), "availability_zones": azs})
