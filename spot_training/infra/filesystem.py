"""``SharedFileSystem``: an encrypted EFS file system with an access point, for what many nodes share."""

from __future__ import annotations

import aws_cdk as cdk
import constructs
import jsii
from aws_cdk import aws_ec2 as ec2
from aws_cdk import aws_efs as efs
from aws_cdk import aws_iam as iam
from aws_cdk import aws_kms as kms


@jsii.implements(ec2.IConnectable)
class SharedFileSystem(constructs.Construct):
    """EFS for the dataset, cluster checkpoints and cluster membership (one per stack).

    Encrypted at rest, elastic throughput by default, automatic backups on, anonymous access
    denied (file system policy of the ``@aws-cdk/aws-efs:denyAnonymousAccess`` flag), one mount
    target per selected subnet, and an access point rooted at ``access_point_path`` owned by
    ``posix_uid``/``posix_gid``. NFS (2049) is open to nobody until you call
    ``fs.connections.allow_default_port_from(nodes)`` (or :meth:`allow_from`), and IAM access needs
    :meth:`grant_read_write`. Mount with TLS and IAM (``mount -t efs -o tls,iam,accesspoint=...``).

    Attributes:
        file_system: the ``efs.FileSystem`` (construct id ``Resource``; its logical id is pinned by a test).
        access_point: the ``efs.AccessPoint``.
        connections: the mount targets' ``ec2.Connections`` (default port 2049).
        file_system_id / access_point_id: tokens.
    """

    def __init__(
        self,
        scope: constructs.Construct,
        construct_id: str,
        *,
        vpc: ec2.IVpc,
        vpc_subnets: ec2.SubnetSelection | None = None,
        security_group: ec2.ISecurityGroup | None = None,
        throughput_mode: efs.ThroughputMode = efs.ThroughputMode.ELASTIC,
        performance_mode: efs.PerformanceMode = efs.PerformanceMode.GENERAL_PURPOSE,
        encryption_key: kms.IKey | None = None,
        removal_policy: cdk.RemovalPolicy = cdk.RemovalPolicy.RETAIN,
        access_point_path: str = "/spot-training",
        posix_uid: int = 1000,
        posix_gid: int = 1000,
    ) -> None:
        """Define the file system, its mount targets and the access point.

        Args:
            scope: the parent construct.
            construct_id: the construct's id, unique within ``scope``.
            vpc: the VPC of the nodes.
            vpc_subnets: where mount targets go, one per AZ; default: the VPC's public subnets
                (where the training nodes of our stacks run; a new VPC of ours has no private ones).
            security_group: for the mount targets; default: a new group with no ingress.
            throughput_mode: default ``ELASTIC`` (pay per use, no burst credits to run out of).
            performance_mode: default ``GENERAL_PURPOSE``.
            encryption_key: a customer managed KMS key; default: the AWS managed key ``aws/elasticfilesystem``.
            removal_policy: default ``RETAIN``.
            access_point_path: the directory the access point exposes (created with mode 0750); default ``/spot-training``.
            posix_uid: owner of that directory and user identity of every client; default 1000
                (``ubuntu`` on the Deep Learning AMI).
            posix_gid: group of that directory and group identity of every client; default 1000.

        Raises:
            ValueError: ``access_point_path`` is not an absolute path, or a uid/gid is negative.
        """
        super().__init__(scope, construct_id)
        if not isinstance(access_point_path, str) or not access_point_path.startswith("/") or access_point_path == "/":
            raise ValueError(f"access_point_path must be an absolute directory below / such as /spot-training, got {access_point_path!r}")
        for prop, value in (("posix_uid", posix_uid), ("posix_gid", posix_gid)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise ValueError(f"{prop} must be an integer >= 0, got {value!r}")
        self.file_system = efs.FileSystem(
            self,
            "Resource",
            vpc=vpc,
            vpc_subnets=vpc_subnets or ec2.SubnetSelection(subnet_type=ec2.SubnetType.PUBLIC),
            security_group=security_group,
            encrypted=True,
            kms_key=encryption_key,
            throughput_mode=throughput_mode,
            performance_mode=performance_mode,
            enable_automatic_backups=True,
            allow_anonymous_access=False,
            removal_policy=removal_policy,
        )
        self.access_point = self.file_system.add_access_point(
            "AccessPoint",
            path=access_point_path,
            create_acl=efs.Acl(owner_uid=str(posix_uid), owner_gid=str(posix_gid), permissions="750"),
            posix_user=efs.PosixUser(uid=str(posix_uid), gid=str(posix_gid)),
        )
        self._granted: list[iam.IGrantable] = []
        self.file_system_id: str = self.file_system.file_system_id
        self.access_point_id: str = self.access_point.access_point_id

    @property
    def connections(self) -> ec2.Connections:
        """The mount targets' ``ec2.Connections`` (default port 2049); ``ec2.IConnectable``."""
        return self.file_system.connections

    def allow_from(self, other: ec2.IConnectable) -> None:
        """Open NFS (TCP 2049) on the mount targets to ``other`` (e.g. a fleet's ``connections``)."""
        self.connections.allow_default_port_from(other, "NFS from the training nodes")

    def grant_read_write(self, grantee: iam.IGrantable) -> iam.Grant:
        """Let ``grantee`` mount and write through IAM (``elasticfilesystem:ClientMount``/``ClientWrite``).

        The grant goes in both places: ``grantee``'s identity policy (CDK's ``grant_read_write``) and
        the file system policy (a statement naming ``grantee``'s principal, only through a mount
        target and over TLS). The agents mount with ``mount -t efs -o tls,iam,accesspoint=...``
        (spot_training.agent.efs); the file system policy of ``@aws-cdk/aws-efs:denyAnonymousAccess`` grants
        anonymous clients no ``ClientMount``, so only IAM-authorized clients mount at all.
        """
        grant = self.file_system.grant_read_write(grantee)
        self.file_system.add_to_resource_policy(
            iam.PolicyStatement(
                sid=f"MountAndWrite{len(self._granted)}",
                effect=iam.Effect.ALLOW,
                principals=[grantee.grant_principal],
                actions=["elasticfilesystem:ClientMount", "elasticfilesystem:ClientWrite"],
                conditions={"Bool": {"elasticfilesystem:AccessedViaMountTarget": "true", "aws:SecureTransport": "true"}},
            )
        )
        self._granted.append(grantee)
        if len(self._granted) == 1:
            # Encryption in transit for every client: plain NFS (no TLS) is refused outright.
            self.file_system.add_to_resource_policy(
                iam.PolicyStatement(
                    sid="DenyWithoutTls",
                    effect=iam.Effect.DENY,
                    principals=[iam.AnyPrincipal()],
                    actions=["*"],
                    conditions={"Bool": {"aws:SecureTransport": "false"}},
                )
            )
        return grant
