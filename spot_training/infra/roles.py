"""IAM for the training nodes (``TrainingNodeRole``) and for Spot Fleet (``SpotFleetRole``).

The source article gives its instance role ten EC2 actions on ``Resource: "*"``. Here every
mutating EC2 action is conditioned on the stack's tag (docs/contracts.md): ``aws:ResourceTag`` for
resources that exist, ``aws:RequestTag`` plus ``ec2:CreateAction`` for those being created, so a
node can only touch the volumes, snapshots, instances and fleet request of its own stack.

aws-cdk-lib's ``Volume.grant_attach_volume_by_resource_tag`` conditions on a tag of its own making
(``VolumeGrantAttach-<hash>``) on one CloudFormation volume; our data volume moves between
Availability Zones as agent-made copies that carry only the contract tags, so these statements
are written here instead, on the contract's tag.
"""

from __future__ import annotations

from collections.abc import Sequence

import aws_cdk as cdk
import constructs
import jsii
from aws_cdk import aws_iam as iam
from aws_cdk import aws_kms as kms
from aws_cdk import aws_s3_assets as s3_assets

from . import acknowledgements
from .tags import AGENT_BOOKKEEPING_TAG_KEYS, DEPLOYMENT_TAG_KEY, STACK_TAG_KEY
from .userdata import BOOT_ERROR_TAG, FAILED_BOOTS_TAG

#: The instance-id condition key of the instance a request acts on, as an IAM policy variable.
TARGET_INSTANCE_ID_VARIABLE = "${ec2:InstanceID}"

#: What the SSM Agent needs for Session Manager (the Systems Manager user guide, "Create a custom
#: IAM instance profile for Session Manager"; the same actions as the AWS managed policy
#: ``AWSCloud9SSMInstanceProfile``). Only ``ssm:UpdateInstanceInformation`` supports resource-level
#: permissions (EC2 instance ARNs); session logging to S3 or CloudWatch, not set up here, would need more.
SESSION_MANAGER_ACTIONS: tuple[str, ...] = (
    "ssm:UpdateInstanceInformation",
    "ssmmessages:CreateControlChannel",
    "ssmmessages:CreateDataChannel",
    "ssmmessages:OpenControlChannel",
    "ssmmessages:OpenDataChannel",
)

#: Read-only EC2 calls the agents make; EC2 does not support resource-level permissions for them.
DESCRIBE_ACTIONS: tuple[str, ...] = (
    "ec2:DescribeInstances",
    "ec2:DescribeVolumes",
    "ec2:DescribeSnapshots",
    "ec2:DescribeTags",
    "ec2:DescribeSpotFleetRequests",
    "ec2:DescribeSpotFleetInstances",
)


@jsii.implements(iam.IGrantable)
class TrainingNodeRole(constructs.Construct):
    """The training nodes' instance role and instance profile, with exactly what the agents need.

    Grants (all EC2 mutations conditioned on ``spot-training:stack = <stack tag value>``):

    - ``ec2:Describe*`` calls in :data:`DESCRIBE_ACTIONS` on ``*`` (no resource-level support);
    - ``ec2:CreateVolume`` (new volume must be requested with the tag; a source snapshot must carry it),
      ``ec2:CreateSnapshot`` (source volume must carry it; new snapshot must be requested with it);
    - ``ec2:AttachVolume`` / ``ec2:DetachVolume`` on tagged volumes and tagged instances;
    - ``ec2:DeleteVolume`` / ``ec2:DeleteSnapshot`` on tagged volumes and snapshots;
    - ``ec2:CreateTags`` on volumes and snapshots while creating them (``ec2:CreateAction``), and
      ``ec2:CreateTags`` on already tagged ones for any key but the stack tag itself (the agent's
      attach lease); ``ec2:DeleteTags`` only of the agent's bookkeeping tags, named in the request;
    - ``ec2:CreateTags`` of the ``spot-training:boot-error`` key only, on this stack's instances (a
      failed boot reports itself there; docs/agent.md, "Boot failures");
    - ``ec2:CancelSpotFleetRequests`` on this stack's fleet request only;
    - ``s3:GetObject`` on each given asset's one object (not the whole CDK assets bucket);
    - use of a customer managed volume key through EBS only, if :meth:`grant_volume_key` is called;
    - Session Manager instead of SSH: :data:`SESSION_MANAGER_ACTIONS` only (not the AWS managed
      policy ``AmazonSSMManagedInstanceCore``, whose ``ssm:GetParameter(s)``, ``ssm:GetDocument``,
      ``ec2messages:*`` ... on ``*`` serve Run Command, State Manager and Patch Manager, which the
      nodes do not use).

    An ``iam.IGrantable``: ``bucket.grant_read(node_role)`` grants the role.

    Attributes:
        role: the ``iam.Role`` (``ec2.amazonaws.com``).
        instance_profile: the ``iam.InstanceProfile`` for the launch template.
        stack_tag_value: the tag value the conditions test.
    """

    def __init__(
        self,
        scope: constructs.Construct,
        construct_id: str,
        *,
        stack_tag_value: str | None = None,
        assets: Sequence[s3_assets.Asset] = (),
        description: str | None = None,
        data_volume_access: bool = True,
        deployment_tag_value: str | None = None,
        adopt_volume_id: str | None = None,
    ) -> None:
        """Define the role, its policy and the instance profile.

        Args:
            scope: the parent construct.
            construct_id: the construct's id, unique within ``scope``.
            stack_tag_value: the ``spot-training:stack`` value the IAM conditions require;
                default: the stack's name.
            assets: S3 assets the nodes download (the bootstrap asset); default: none.
            description: the role's description; default: a generic one.
            data_volume_access: grant the EBS statements that find, move, attach and delete the data
                volume and its snapshots, and cancel the stack's fleet; default true. Parameter-server
                cluster nodes keep their data on EFS, cancel nothing, and get only the Describe statement.
            deployment_tag_value: the ``spot-training:deployment`` value (a token,
                :func:`spot_training.infra.tags.deployment_tag_value`) every volume and snapshot statement
                requires too, so that a node cannot touch, copy or retag data kept by an earlier deployment
                of the same stack name; default None: the stack tag alone (a role outside a stack).
            adopt_volume_id: the retained volume this deployment adopts (``adopt_volume_id``): the one
                resource on which the node may set the deployment tag to its own value.

        Raises:
            ValueError: ``stack_tag_value`` is empty, or ``data_volume_access`` is not a bool.
        """
        super().__init__(scope, construct_id)
        acknowledgements.attach(self)  # its nag/checkov acknowledgements, on its own resources
        stack = cdk.Stack.of(self)
        if stack_tag_value is not None and not stack_tag_value:
            raise ValueError(f"stack_tag_value must be a non-empty string (the stack name), got {stack_tag_value!r}")
        self.stack_tag_value: str = stack_tag_value or stack.stack_name
        self.role = iam.Role(
            self,
            "Role",
            assumed_by=iam.ServicePrincipal("ec2.amazonaws.com"),
            description=description or f"Spot training nodes of stack {self.stack_tag_value}",
        )
        # ssm:UpdateInstanceInformation (the SSM Agent registering its instance) supports EC2 instance
        # ARNs; the ssmmessages channel actions support no resource-level permissions.
        self.role.add_to_principal_policy(
            iam.PolicyStatement(sid="SessionManagerRegister", actions=["ssm:UpdateInstanceInformation"],
                                resources=[_arn("instance/*")])
        )
        self.role.add_to_principal_policy(
            iam.PolicyStatement(sid="SessionManagerChannels", resources=["*"],
                                actions=[a for a in SESSION_MANAGER_ACTIONS if a.startswith("ssmmessages:")])
        )
        self.instance_profile = iam.InstanceProfile(self, "InstanceProfile", role=self.role)
        if not isinstance(data_volume_access, bool):
            raise ValueError(f"data_volume_access must be True or False, got {data_volume_access!r}")
        self.deployment_tag_value = deployment_tag_value
        self.adopt_volume_id = adopt_volume_id
        statements = (node_policy_statements(self.stack_tag_value, deployment_tag_value=deployment_tag_value,
                                             adopt_volume_id=adopt_volume_id)
                      if data_volume_access else [_describe_statement()])
        for statement in statements:
            self.role.add_to_principal_policy(statement)
        for asset in assets:
            self.grant_read_asset(asset)

    def grant_read_asset(self, asset: s3_assets.Asset) -> None:
        """Let the nodes download ``asset``: ``s3:GetObject`` on its one object (bucket + object key).

        aws-cdk-lib's ``Asset.grant_read`` grants ``s3:GetObject*``, ``s3:GetBucket*`` and ``s3:List*``
        on the whole CDK assets bucket, i.e. every asset of every stack deployed to the account and
        region; ``aws s3 cp s3://bucket/key`` needs only ``s3:GetObject`` (its HeadObject is
        authorised by the same action). The bootstrap bucket's default encryption (SSE-S3 or the AWS
        managed key ``aws/s3``) needs no KMS grant; a bootstrap with a customer managed key
        (``cdk bootstrap --bootstrap-kms-key-id``) would need ``kms:Decrypt`` on it in addition.
        """
        self.role.add_to_principal_policy(
            iam.PolicyStatement(actions=["s3:GetObject"], resources=[asset.bucket.arn_for_objects(asset.s3_object_key)])
        )

    def grant_volume_key(self, key: kms.IKey) -> None:
        """Let the nodes use a customer managed KMS key of the data volume.

        Moving the volume (snapshot, new volume from it) and attaching it need the key, only ever
        through EBS: ``kms:Decrypt``, ``kms:DescribeKey``, ``kms:GenerateDataKeyWithoutPlaintext`` and
        ``kms:ReEncrypt*`` with ``kms:ViaService = ec2.<region>.amazonaws.com`` (the node cannot use the
        key directly), plus ``kms:CreateGrant`` only for AWS resources (``kms:GrantIsForAWSResource``).
        These are the permissions the EBS documentation lists for a customer managed key ("Amazon EBS
        encryption", key policy for EBS); aws-cdk-lib's ``grant_encrypt_decrypt`` has no ViaService
        condition and grants ``kms:Encrypt``/``GenerateDataKey*`` EBS does not use, hence own statements.
        """
        self.role.add_to_principal_policy(
            iam.PolicyStatement(
                sid="UseVolumeKeyThroughEbs",
                actions=["kms:Decrypt", "kms:DescribeKey", "kms:GenerateDataKeyWithoutPlaintext",
                         "kms:ReEncryptFrom", "kms:ReEncryptTo"],
                resources=[key.key_arn],
                conditions={"StringEquals": {"kms:ViaService": f"ec2.{cdk.Aws.REGION}.amazonaws.com"}},
            )
        )
        self.role.add_to_principal_policy(
            iam.PolicyStatement(
                sid="EbsGrantsOnVolumeKey",
                actions=["kms:CreateGrant"],
                resources=[key.key_arn],
                conditions={"Bool": {"kms:GrantIsForAWSResource": "true"}},
            )
        )

    def grant_cancel_own_fleet(self) -> None:
        """Let the nodes cancel their own stack's spot fleet request (``ec2:CancelSpotFleetRequests`` on a
        request tagged with this role's stack tag value): what a worker does when training completed.
        Roles with ``data_volume_access`` have it already."""
        self.role.add_to_principal_policy(_cancel_own_fleet_statement(self.stack_tag_value))

    def allow_leaving_fleet(self) -> None:
        """Let a cluster worker leave its spot fleet (docs/contracts.md, "Parameter-server cluster").

        A worker whose member tag was removed lowers its fleet's target capacity by one
        (``ec2:ModifySpotFleetRequest`` on a fleet request tagged with this stack) and terminates its
        own instance: ``ec2:TerminateInstances`` on an instance tagged with this stack, running with
        this role's instance profile (``ec2:InstanceProfile``), and whose ARN equals the request's
        ``ec2:SourceInstanceARN`` (the instance whose role credentials sign the request): the condition
        compares ``ec2:SourceInstanceARN`` with ``arn:...:instance/${ec2:InstanceID}``, the target's id
        as a policy variable. A worker can thus terminate itself and no other instance. IAM fails closed
        here: a request without these keys is denied, so the worst case is a worker whose terminate call
        fails (UnauthorizedOperation), never one that ends another. Moto ignores conditions, so only a
        real account exercises this (docs/infra.md, the DistributedTraining stack). A Resource of ``${ec2:SourceInstanceARN}`` alone
        would say the same more directly, but is not an ARN to CloudFormation's schema (cfn-lint E3510).

        What IAM cannot bound: ``ec2:ModifySpotFleetRequest`` has no condition key for the target
        capacity, so a worker may set any target capacity (and excess-capacity policy) of its own
        stack's fleet requests, never another stack's (docs/contracts.md says so).
        """
        tagged = {f"aws:ResourceTag/{STACK_TAG_KEY}": self.stack_tag_value}
        self.role.add_to_principal_policy(
            iam.PolicyStatement(
                sid="LowerOwnSpotFleetTarget",
                actions=["ec2:ModifySpotFleetRequest"],
                resources=[_arn("spot-fleet-request/*")],
                conditions={"StringEquals": tagged},
            )
        )
        self.role.add_to_principal_policy(
            iam.PolicyStatement(
                sid="TerminateItself",
                actions=["ec2:TerminateInstances"],
                resources=[_arn("instance/*")],
                conditions={
                    "StringEquals": {**tagged, "ec2:SourceInstanceARN": _arn(f"instance/{TARGET_INSTANCE_ID_VARIABLE}")},
                    "ArnEquals": {"ec2:InstanceProfile": self.instance_profile.instance_profile_arn},
                },
            )
        )

    def allow_boot_failure_reporting(self, *, counted_on: str) -> None:
        """Let a cluster node's boot-failure script report and bound its failed boots (spot_training/infra/userdata.py,
        ``boot_failed_script``; docs/agent.md, "Boot failures"). Single nodes get the same through the
        data-volume statements (the count lives on the data volume).

        Args:
            counted_on: ``"fleet"`` (spot workers: the count is a tag on their spot fleet request, the
                bound cancels it) or ``"auto-scaling-group"`` (scheduler and servers: the count is a tag on
                their group, the bound suspends the group's ``Launch`` process and cancels the stack's
                spot fleets).

        Every statement is scoped to resources tagged with this stack, and tag writes to the one key
        :data:`~spot_training.infra.userdata.FAILED_BOOTS_TAG` (plus :data:`~spot_training.infra.userdata.BOOT_ERROR_TAG` on instances).

        Raises:
            ValueError: ``counted_on`` is neither value.
        """
        if counted_on not in ("fleet", "auto-scaling-group"):
            raise ValueError(f"counted_on must be 'fleet' or 'auto-scaling-group', got {counted_on!r}")
        tagged = {f"aws:ResourceTag/{STACK_TAG_KEY}": self.stack_tag_value}
        count_key = {"ForAllValues:StringEquals": {"aws:TagKeys": [FAILED_BOOTS_TAG]}, "Null": {"aws:TagKeys": "false"}}
        self.role.add_to_principal_policy(_boot_error_statement(self.stack_tag_value))
        if counted_on == "fleet":
            self.role.add_to_principal_policy(iam.PolicyStatement(
                sid="CountFailedBootsOnOwnFleet", actions=["ec2:CreateTags", "ec2:DeleteTags"],
                resources=[_arn("spot-fleet-request/*")], conditions={"StringEquals": tagged, **count_key}))
            return
        group_arn = (f"arn:{cdk.Aws.PARTITION}:autoscaling:{cdk.Aws.REGION}:{cdk.Aws.ACCOUNT_ID}:"
                     "autoScalingGroup:*:autoScalingGroupName/*")
        # Auto Scaling's Describe calls support no resource-level permissions.
        self.role.add_to_principal_policy(iam.PolicyStatement(
            sid="DescribeAutoScalingTags", actions=["autoscaling:DescribeTags"], resources=["*"]))
        self.role.add_to_principal_policy(iam.PolicyStatement(
            sid="CountFailedBootsOnOwnGroup", actions=["autoscaling:CreateOrUpdateTags", "autoscaling:DeleteTags"],
            resources=[group_arn], conditions={"StringEquals": tagged, **count_key}))
        self.role.add_to_principal_policy(iam.PolicyStatement(
            sid="SuspendLaunchesOfOwnGroup", actions=["autoscaling:SuspendProcesses"], resources=[group_arn],
            conditions={"StringEquals": tagged}))
        self.role.add_to_principal_policy(_cancel_own_fleet_statement(self.stack_tag_value))

    @property
    def grant_principal(self) -> iam.IPrincipal:
        """The role, for ``grant_*`` calls of other constructs (EFS, S3)."""
        return self.role


def _describe_statement() -> iam.PolicyStatement:
    """EC2's Describe calls the agent makes; they support no resource-level permissions (``"*"``)."""
    return iam.PolicyStatement(sid="Describe", actions=list(DESCRIBE_ACTIONS), resources=["*"])


def _boot_error_statement(stack_tag_value: str) -> iam.PolicyStatement:
    """Tag an instance of this stack with the failed boot step (only that key).

    The boot-failure script (spot_training/infra/userdata.py) tags its own instance with the failed
    step, where the user sees it in the console.
    """
    return iam.PolicyStatement(
        sid="TagOwnInstanceBootError",
        actions=["ec2:CreateTags"],
        resources=[_arn("instance/*")],
        conditions={"StringEquals": {f"aws:ResourceTag/{STACK_TAG_KEY}": stack_tag_value},
                    "ForAllValues:StringEquals": {"aws:TagKeys": [BOOT_ERROR_TAG]}},
    )


def _cancel_own_fleet_statement(stack_tag_value: str) -> iam.PolicyStatement:
    """``ec2:CancelSpotFleetRequests`` on spot fleet requests tagged with this stack only."""
    return iam.PolicyStatement(
        sid="CancelOwnSpotFleet",
        actions=["ec2:CancelSpotFleetRequests"],
        resources=[_arn("spot-fleet-request/*")],
        conditions={"StringEquals": {f"aws:ResourceTag/{STACK_TAG_KEY}": stack_tag_value}},
    )


def _arn(resource: str) -> str:
    """``arn:<partition>:ec2:<region>:<account>:<resource>`` of the current stack (tokens)."""
    return f"arn:{cdk.Aws.PARTITION}:ec2:{cdk.Aws.REGION}:{cdk.Aws.ACCOUNT_ID}:{resource}"


def _snapshot_arn() -> str:
    # EC2 snapshot ARNs have an empty account field: arn:aws:ec2:us-east-1::snapshot/snap-...
    return f"arn:{cdk.Aws.PARTITION}:ec2:{cdk.Aws.REGION}::snapshot/*"


def node_policy_statements(stack_tag_value: str, *, deployment_tag_value: str | None = None,
                           adopt_volume_id: str | None = None) -> list[iam.PolicyStatement]:
    """The EC2 policy statements of :class:`TrainingNodeRole` for stack tag value ``stack_tag_value``.

    Every volume and snapshot statement (create, copy, attach, delete, tag, untag) also requires
    ``spot-training:deployment`` = ``deployment_tag_value`` when given: the resource's tag for existing
    resources, the request's tag for new ones, and no request may set or change the stack or
    deployment tag of an existing resource. The one exception is ``adopt_volume_id`` (exact ARN): the
    node may set that retained volume's deployment tag to its own value (the agent's adoption).
    Instance and fleet statements test the stack tag (instances carry no deployment tag). Source:
    IAM User Guide, "Single-valued context key policy examples" (``aws:RequestTag`` and
    ``aws:ResourceTag`` conditions on EC2 volume requests).

    Args:
        stack_tag_value: the ``spot-training:stack`` tag value (may be a token).
        deployment_tag_value: the ``spot-training:deployment`` tag value (may be a token), or None.
        adopt_volume_id: a retained volume the node may adopt (``vol-…``), or None.

    Returns:
        a list of ``iam.PolicyStatement``; only the Describe statement has ``Resource: "*"``.
    """
    tagged = {"StringEquals": {f"aws:ResourceTag/{STACK_TAG_KEY}": stack_tag_value}}
    own = {f"aws:ResourceTag/{STACK_TAG_KEY}": stack_tag_value}
    new_tags = {f"aws:RequestTag/{STACK_TAG_KEY}": stack_tag_value}
    if deployment_tag_value is not None:
        own[f"aws:ResourceTag/{DEPLOYMENT_TAG_KEY}"] = deployment_tag_value
        new_tags[f"aws:RequestTag/{DEPLOYMENT_TAG_KEY}"] = deployment_tag_value
    data = {"StringEquals": own}
    requested = {"StringEquals": new_tags}
    # Tag writes on this deployment's resources that name neither identity tag: the one guard of both the
    # retag and the untag statement, so a node can never move a resource to another stack or deployment.
    keeps_identity = {**data, "ForAllValues:StringNotEquals": {"aws:TagKeys": [STACK_TAG_KEY, DEPLOYMENT_TAG_KEY]}}
    volume, snapshot, instance = _arn("volume/*"), _snapshot_arn(), _arn("instance/*")
    statements = [
        _describe_statement(),
        # Each create call is authorised on two resources: the new one (must be requested with the
        # stack and deployment tags) and its source (must already carry them): CreateVolume's source
        # snapshot, CreateSnapshot's source volume.
        iam.PolicyStatement(sid="CreateTaggedVolume", actions=["ec2:CreateVolume"], resources=[volume], conditions=requested),
        iam.PolicyStatement(sid="CreateVolumeFromOwnSnapshot", actions=["ec2:CreateVolume"], resources=[snapshot], conditions=data),
        iam.PolicyStatement(sid="CreateTaggedSnapshot", actions=["ec2:CreateSnapshot"], resources=[snapshot], conditions=requested),
        iam.PolicyStatement(sid="SnapshotOwnVolume", actions=["ec2:CreateSnapshot"], resources=[volume], conditions=data),
        iam.PolicyStatement(
            sid="TagOnCreate",
            actions=["ec2:CreateTags"],
            resources=[volume, snapshot],
            conditions={
                "StringEquals": {
                    "ec2:CreateAction": ["CreateVolume", "CreateSnapshot"],
                    **new_tags,
                }
            },
        ),
        iam.PolicyStatement(sid="RetagOwnResources", actions=["ec2:CreateTags"], resources=[volume, snapshot],
                            conditions=keeps_identity),
        # DeleteTags naming no tag deletes every tag (the stack tag too): only the agent's bookkeeping
        # tags, and only when named (Null: aws:TagKeys must be present).
        iam.PolicyStatement(sid="UntagOwnBookkeeping", actions=["ec2:DeleteTags"], resources=[volume, snapshot],
                            conditions={**keeps_identity,
                                        "ForAllValues:StringEquals": {"aws:TagKeys": list(AGENT_BOOKKEEPING_TAG_KEYS)},
                                        "Null": {"aws:TagKeys": "false"}}),
        # AttachVolume/DetachVolume are authorised on the volume and on the instance: the volume must
        # be this deployment's, the instance this stack's.
        iam.PolicyStatement(
            sid="AttachOwnVolumes",
            actions=["ec2:AttachVolume", "ec2:DetachVolume"],
            resources=[volume],
            conditions=data,
        ),
        iam.PolicyStatement(
            sid="AttachToOwnInstances",
            actions=["ec2:AttachVolume", "ec2:DetachVolume"],
            resources=[instance],
            conditions=tagged,
        ),
        iam.PolicyStatement(
            sid="DeleteOwnVolumesAndSnapshots",
            actions=["ec2:DeleteVolume", "ec2:DeleteSnapshot"],
            resources=[volume, snapshot],
            conditions=data,
        ),
        _boot_error_statement(stack_tag_value),
        _cancel_own_fleet_statement(stack_tag_value),
    ]
    if adopt_volume_id is not None and deployment_tag_value is not None:
        # The user named this retained volume: the agent sets its deployment tag to ours (and only that).
        statements.append(iam.PolicyStatement(
            sid="AdoptNamedVolume",
            actions=["ec2:CreateTags"],
            resources=[_arn(f"volume/{adopt_volume_id}")],
            conditions={
                "StringEquals": {f"aws:ResourceTag/{STACK_TAG_KEY}": stack_tag_value,
                                 f"aws:RequestTag/{DEPLOYMENT_TAG_KEY}": deployment_tag_value},
                "ForAllValues:StringEquals": {"aws:TagKeys": [DEPLOYMENT_TAG_KEY]},
                "Null": {"aws:TagKeys": "false"},
            },
        ))
    return statements


class SpotFleetRole(constructs.Construct):
    """The role Spot Fleet assumes to launch, tag and terminate the fleet's instances.

    Trusts ``spotfleet.amazonaws.com`` and carries the AWS managed policy
    ``service-role/AmazonEC2SpotFleetTaggingRole`` (what the Spot Fleet documentation prescribes).
    Because the launch template names an instance profile, the managed policy's ``iam:PassRole``
    (to ``ec2.amazonaws.com``) covers passing the node role.

    Attributes:
        role: the ``iam.Role``.
    """

    def __init__(self, scope: constructs.Construct, construct_id: str) -> None:
        """Define the role. Raises nothing.

        Args:
            scope: the parent construct.
            construct_id: the construct's id, unique within ``scope``.
        """
        super().__init__(scope, construct_id)
        acknowledgements.attach(self)  # its nag/checkov acknowledgements, on its own resources
        self.role = iam.Role(
            self,
            "Role",
            assumed_by=iam.ServicePrincipal("spotfleet.amazonaws.com"),
            description="Lets Spot Fleet launch, tag and terminate the training nodes",
            managed_policies=[iam.ManagedPolicy.from_aws_managed_policy_name("service-role/AmazonEC2SpotFleetTaggingRole")],
        )
