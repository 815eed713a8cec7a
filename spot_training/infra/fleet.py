"""``SpotTrainingFleet``: Spot capacity for training nodes behind capacity props, not Spot Fleet JSON.

Today the construct renders an ``AWS::EC2::SpotFleet`` (request type ``maintain``) with one launch
template and an override for every (instance type, subnet) pair. AWS calls Spot Fleet a legacy API;
users pass capacity settings (instance types, target capacity, allocation strategy, max price) so
that EC2 Fleet or an Auto Scaling group can be offered later behind the same props.

aws-cdk-lib has no L2 for Spot Fleet, so the request itself is the L1 ``CfnSpotFleet``; the launch
template, security group and roles are L2s.
"""

from __future__ import annotations

import enum
import re
from collections.abc import Sequence
from typing import Any

import aws_cdk as cdk
import constructs
import jsii
from aws_cdk import aws_ec2 as ec2
from aws_cdk import aws_iam as iam
from aws_cdk import aws_kms as kms

from .roles import SpotFleetRole
from .tags import STACK_TAG_KEY

#: Default instance types (one NVIDIA GPU each): L4, A10G, T4. All three families are in the
#: ``supported_ec2_instances`` of the current x86_64 Deep Learning Base AMI (Ubuntu 22.04) release notes
#: (G4dn, G5, G6, Gr6, G6e, P4d, P4de, P5, P5e, P5en, P6-B200, P6-B300; NVIDIA driver 580); P3 (Volta
#: V100) is not, so p3.2xlarge is no default (docs/infra.md, "Default instance types", has the sources).
DEFAULT_INSTANCE_TYPES: tuple[str, ...] = ("g6.xlarge", "g5.xlarge", "g4dn.xlarge")
#: Instance families in ``supported_ec2_instances`` of the x86_64 Deep Learning Base AMI (Ubuntu
#: 22.04) release notes (AWS DLAMI developer guide, release notes of 2026-01-02; docs/infra.md).
DLAMI_SUPPORTED_FAMILIES: frozenset[str] = frozenset(
    {"g4dn", "g5", "g6", "gr6", "g6e", "p4d", "p4de", "p5", "p5e", "p5en", "p6-b200", "p6-b300"}
)


#: When :data:`DLAMI_SUPPORTED_FAMILIES` was last checked against the release notes (docs/infra.md,
#: "Default instance types"); the list of existing types is botocore's ``InstanceType`` enum.
DLAMI_SUPPORTED_FAMILIES_CHECKED = "2026-11-23"


def instance_family(instance_type: str) -> str:
    """The family of an EC2 instance type: ``"g5"`` for ``"g5.xlarge"``, ``"p6-b200"`` for ``"p6-b200.48xlarge"``."""
    return instance_type.split(".", 1)[0]

# family (letters and digits, a digit somewhere, optional "-flex"-style suffix) "." size
_INSTANCE_TYPE_RE = re.compile(
    r"^[a-z][a-z0-9-]*[0-9][a-z0-9-]*\.(nano|micro|small|medium|large|[0-9]*xlarge|metal(-[0-9]+xl)?)$"
)


def known_instance_types() -> frozenset[str]:
    """Every EC2 instance type in botocore's EC2 service model (the ``InstanceType`` enum; as current as
    the installed botocore, which AWS updates with each new type). Empty when botocore is missing."""
    global _KNOWN_INSTANCE_TYPES
    if _KNOWN_INSTANCE_TYPES is None:
        try:
            import botocore.session
        except ImportError:  # a CDK-only install without boto3: no existence check
            _KNOWN_INSTANCE_TYPES = frozenset()
        else:
            model = botocore.session.get_session().get_service_model("ec2")
            _KNOWN_INSTANCE_TYPES = frozenset(model.shape_for("InstanceType").enum)
    return _KNOWN_INSTANCE_TYPES


_KNOWN_INSTANCE_TYPES: frozenset[str] | None = None


def instance_type_name(value: object, *, prop: str = "instance_types") -> str:
    """The name of an instance type given as ``ec2.InstanceType`` or ``str`` (``"g5.xlarge"``).

    Args:
        value: an ``ec2.InstanceType`` or a name such as ``"g5.xlarge"``.
        prop: the prop named in the message (default ``instance_types``).

    Returns:
        the instance type's name.

    Raises:
        ValueError: neither kind, or a malformed name (names ``prop``, the value and the expected form).
    """
    if isinstance(value, ec2.InstanceType):
        value = value.to_string()
    return validate_instance_type(value, prop=prop)


def check_instance_types(scope: constructs.IConstruct, types: Sequence[str], *, prop: str = "instance_types") -> None:
    """Fail synth on an instance type that does not exist (not in :func:`known_instance_types`), and warn
    (a CDK warning annotation) on one whose family the default Deep Learning AMI does not support
    (:data:`DLAMI_SUPPORTED_FAMILIES`, checked :data:`DLAMI_SUPPORTED_FAMILIES_CHECKED`): with that AMI
    the trainer may find no GPU. An AMI of your own may support it, hence only a warning.

    Args:
        scope: the construct that gets the warning annotation.
        types: the instance type names.
        prop: the prop named in messages (default ``instance_types``).

    Raises:
        ValueError: an unknown type (names it and ``prop``).
    """
    known = known_instance_types()
    for name in types:
        if known and name not in known:
            raise ValueError(f"{prop}: {name!r} is not an EC2 instance type botocore knows; check the spelling "
                             f"(such as g5.xlarge, g6.xlarge, g4dn.12xlarge)")
        if instance_family(name) not in DLAMI_SUPPORTED_FAMILIES:
            cdk.Annotations.of(scope).add_warning_v2(
                "spot-training:unsupported-instance-type",
                f"{prop}: {name} is not in the Deep Learning Base AMI's supported families "
                f"({', '.join(sorted(DLAMI_SUPPORTED_FAMILIES))}; checked {DLAMI_SUPPORTED_FAMILIES_CHECKED}); "
                "with the default AMI its GPU may not be usable")


def root_volume_gib(value: object, *, prop: str = "root_volume_size") -> int:
    """``value`` (``cdk.Size`` or whole GiB as int) in GiB, checked to 8..16384.

    Args:
        value: a ``cdk.Size`` or whole GiB as an int.
        prop: the prop named in the message (default ``root_volume_size``).

    Returns:
        the size in GiB.

    Raises:
        ValueError: another kind, a size that is not whole GiB, or out of range.
    """
    if isinstance(value, cdk.Size):
        value = value.to_gibibytes()
    if isinstance(value, float) and value.is_integer():
        value = int(value)
    if isinstance(value, bool) or not isinstance(value, int) or not 8 <= value <= 16384:
        raise ValueError(f"{prop} must be an integer from 8 to 16384 (GiB), got {value!r} (or a cdk.Size of whole GiB)")
    return value


class AllocationStrategy(enum.Enum):
    """How the fleet picks Spot capacity pools (the Spot Fleet ``AllocationStrategy`` values)."""

    #: Lowest price among the pools with the most spare capacity (AWS's recommendation; default).
    PRICE_CAPACITY_OPTIMIZED = "priceCapacityOptimized"
    #: Pools with the most spare capacity: fewest interruptions.
    CAPACITY_OPTIMIZED = "capacityOptimized"
    #: Cheapest pools: most interruptions.
    LOWEST_PRICE = "lowestPrice"
    #: Spread across all pools.
    DIVERSIFIED = "diversified"


def validate_instance_type(value: object, *, prop: str = "instance_types") -> str:
    """Return ``value`` if it looks like an EC2 instance type (``g5.xlarge``), else raise.

    Args:
        value: the value to check.
        prop: the prop named in the message (default ``instance_types``).

    Returns:
        ``value`` unchanged.

    Raises:
        ValueError: naming ``prop``, the value and the expected form.
    """
    if not isinstance(value, str) or not _INSTANCE_TYPE_RE.match(value):
        raise ValueError(
            f"{prop}: {value!r} is not an EC2 instance type; allowed: FAMILY.SIZE such as g5.xlarge, g6.xlarge, g4dn.12xlarge"
        )
    return value


@jsii.implements(ec2.IConnectable)
class SpotTrainingFleet(constructs.Construct):
    """Spot capacity for training nodes: a launch template and a Spot Fleet request of type ``maintain``.

    The launch template requires IMDSv2 (``HttpTokens=required``, hop limit 2), encrypts the root
    volume (gp3), sets no key pair unless given one (use SSM Session Manager), and uses a security
    group with no ingress rules. The fleet has one override per (instance type, subnet) pair, so it
    can place the node in any allowed type and Availability Zone. Tags on this construct (and the
    stack's tags) reach the instances and their volumes through the launch template's tag
    specifications; the fleet request itself carries the ``spot-training:stack`` tag so that
    ``ec2:CancelSpotFleetRequests`` can be conditioned on it.

    Attributes:
        launch_template: the ``ec2.LaunchTemplate``.
        security_group: the nodes' security group.
        connections: the nodes' ``ec2.Connections``; the fleet is an ``ec2.IConnectable``
            (``fs.connections.allow_default_port_from(fleet)``).
        fleet_role: the role Spot Fleet assumes.
        resource: the ``ec2.CfnSpotFleet`` (construct id ``Resource``).
        fleet_request_id: the Spot Fleet request id (token).
    """

    def __init__(
        self,
        scope: constructs.Construct,
        construct_id: str,
        *,
        vpc: ec2.IVpc,
        machine_image: ec2.IMachineImage,
        instance_profile: iam.IInstanceProfile,
        user_data: ec2.UserData | None = None,
        instance_types: Sequence[str | ec2.InstanceType] = DEFAULT_INSTANCE_TYPES,
        target_capacity: int = 1,
        allocation_strategy: AllocationStrategy = AllocationStrategy.PRICE_CAPACITY_OPTIMIZED,
        max_price: str | float | None = None,
        vpc_subnets: ec2.SubnetSelection | None = None,
        security_group: ec2.ISecurityGroup | None = None,
        fleet_role: iam.IRole | None = None,
        root_volume_size_gib: int | cdk.Size = 150,
        root_volume_encryption_key: kms.IKey | None = None,
        root_device_name: str = "/dev/sda1",
        key_pair: ec2.IKeyPair | None = None,
        stack_tag_value: str | None = None,
        instance_metadata_tags: bool = False,
    ) -> None:
        """Define the launch template and the Spot Fleet request.

        Args:
            scope: the parent construct.
            construct_id: the construct's id, unique within ``scope``.
            vpc: the VPC to launch into.
            machine_image: the AMI (e.g. ``ec2.MachineImage.from_ssm_parameter(...)`` for the Deep Learning AMI).
            instance_profile: the nodes' ``iam.IInstanceProfile`` (``TrainingNodeRole.instance_profile``,
                not the role construct itself).
            user_data: the nodes' user data; default: none.
            instance_types: EC2 instance types (``"g5.xlarge"`` or ``ec2.InstanceType``), at least one, no
                duplicates; a type botocore does not know fails synth, one outside the Deep Learning AMI's
                families warns (:func:`check_instance_types`);
                default: :data:`DEFAULT_INSTANCE_TYPES` (``g6.xlarge``, ``g5.xlarge``, ``g4dn.xlarge``).
            target_capacity: instances to keep running, >= 0 (0 pauses the fleet); default 1.
            allocation_strategy: default ``PRICE_CAPACITY_OPTIMIZED``.
            max_price: highest price in USD per instance-hour (``"0.75"`` or ``0.75``);
                default: none (the On-Demand price caps it).
            vpc_subnets: where instances may launch, one override per subnet; default: the VPC's
                public subnets (a new VPC of ours has no NAT gateway).
            security_group: default: a new group that allows all outbound and no inbound traffic.
            fleet_role: the role Spot Fleet assumes; default: a new :class:`SpotFleetRole`.
            root_volume_size_gib: encrypted gp3 root volume, GiB (int) or a ``cdk.Size``, 8..16384 GiB; default 150
                (the Deep Learning AMI's snapshot needs more than 100).
            root_volume_encryption_key: an ``aws_kms.IKey`` for the root volume; default: the AWS managed EBS key.
            root_device_name: the AMI's root device; default ``/dev/sda1`` (Ubuntu AMIs).
            key_pair: an SSH key pair; default: none (connect with SSM Session Manager).
            stack_tag_value: value of the ``spot-training:stack`` tag on the fleet request;
                default: the stack's name.
            instance_metadata_tags: expose the instance's tags in instance metadata
                (``InstanceMetadataTags=enabled``; a cluster worker watches its member tag there);
                default false. Tag keys then must not contain ``/`` or spaces.

        Raises:
            ValueError: an empty, malformed or unknown ``instance_types``, an ``instance_profile`` that is
                not an instance profile, a negative ``target_capacity``,
                a ``max_price`` that is not a positive decimal, an out-of-range root volume size, or
                an ``allocation_strategy`` that is not an :class:`AllocationStrategy`.
        """
        super().__init__(scope, construct_id)
        if isinstance(instance_types, str) or instance_types is None or len(instance_types) == 0:
            raise ValueError(
                f"instance_types must be a non-empty list of EC2 instance types such as ['g5.xlarge'], got {instance_types!r}"
            )
        types = [instance_type_name(t) for t in instance_types]
        if len(set(types)) != len(types):
            raise ValueError(f"instance_types must not repeat a type, got {list(instance_types)!r}")
        if isinstance(target_capacity, bool) or not isinstance(target_capacity, int) or target_capacity < 0:
            raise ValueError(f"target_capacity must be an integer >= 0 (instances), got {target_capacity!r}")
        if not isinstance(allocation_strategy, AllocationStrategy):
            raise ValueError(
                f"allocation_strategy must be an AllocationStrategy ({', '.join(s.name for s in AllocationStrategy)}), got {allocation_strategy!r}"
            )
        if isinstance(max_price, (int, float)) and not isinstance(max_price, bool) and max_price > 0:
            max_price = f"{max_price:.6f}".rstrip("0").rstrip(".")
        if max_price is not None and (
            not isinstance(max_price, str) or not re.fullmatch(r"\d+(\.\d+)?", max_price) or float(max_price) <= 0
        ):
            raise ValueError(f"max_price must be a positive decimal string in USD per instance-hour such as '0.75' (or a number), got {max_price!r}")
        root_volume_size_gib = root_volume_gib(root_volume_size_gib, prop="root_volume_size_gib")
        if not hasattr(instance_profile, "instance_profile_arn"):
            hint = (" (pass the role's .instance_profile)" if hasattr(instance_profile, "instance_profile") else "")
            raise ValueError(f"instance_profile must be an iam.IInstanceProfile, got {type(instance_profile).__name__}{hint}")
        check_instance_types(self, types)

        stack = cdk.Stack.of(self)
        tag_value = stack_tag_value or stack.stack_name
        self.instance_types: tuple[str, ...] = tuple(types)
        self.security_group = security_group or ec2.SecurityGroup(
            self,
            "SecurityGroup",
            vpc=vpc,
            description="Spot training nodes: no inbound rules (SSM Session Manager instead of SSH)",
            allow_all_outbound=True,
        )
        self._connections = ec2.Connections(security_groups=[self.security_group])
        self.launch_template = node_launch_template(
            self, "LaunchTemplate", machine_image=machine_image, user_data=user_data, instance_profile=instance_profile,
            security_group=self.security_group, root_volume_size_gib=root_volume_size_gib, key_pair=key_pair,
            instance_metadata_tags=instance_metadata_tags or None, root_device_name=root_device_name,
            root_volume_encryption_key=root_volume_encryption_key)
        self.fleet_role: iam.IRole = fleet_role or SpotFleetRole(self, "FleetRole").role

        subnets = vpc.select_subnets(**_subnet_selection_kwargs(vpc_subnets)).subnets
        overrides = [
            ec2.CfnSpotFleet.LaunchTemplateOverridesProperty(instance_type=t, subnet_id=s.subnet_id)
            for t in types
            for s in subnets
        ]
        self.resource = ec2.CfnSpotFleet(
            self,
            "Resource",
            spot_fleet_request_config_data=ec2.CfnSpotFleet.SpotFleetRequestConfigDataProperty(
                iam_fleet_role=self.fleet_role.role_arn,
                target_capacity=target_capacity,
                type="maintain",
                allocation_strategy=allocation_strategy.value,
                spot_price=max_price,
                replace_unhealthy_instances=True,
                terminate_instances_with_expiration=True,
                # No SpotMaintenanceStrategies (capacity rebalancing): a second node launched early
                # would race the first for the volume; the agent checkpoints on a rebalance
                # recommendation instead.
                launch_template_configs=[
                    ec2.CfnSpotFleet.LaunchTemplateConfigProperty(
                        launch_template_specification=ec2.CfnSpotFleet.FleetLaunchTemplateSpecificationProperty(
                            launch_template_id=self.launch_template.launch_template_id,
                            version=self.launch_template.latest_version_number,
                        ),
                        overrides=overrides,
                    )
                ],
                tag_specifications=[
                    ec2.CfnSpotFleet.SpotFleetTagSpecificationProperty(
                        resource_type="spot-fleet-request",
                        tags=[cdk.CfnTag(key=STACK_TAG_KEY, value=tag_value)],
                    )
                ],
            ),
        )
        self.fleet_request_id: str = self.resource.ref

    @property
    def connections(self) -> ec2.Connections:
        """The nodes' security group as ``ec2.Connections`` (``ec2.IConnectable``; a property, as jsii
        reads interface members of a construct subclass only from the class)."""
        return self._connections


def node_launch_template(scope: constructs.Construct, construct_id: str, *, root_volume_size_gib: int,
                         root_device_name: str = "/dev/sda1", root_volume_encryption_key: kms.IKey | None = None,
                         **props: Any) -> ec2.LaunchTemplate:
    """The launch template of every training node, spot or on-demand: IMDSv2 only (hop limit 2, for
    containers), terminate on an instance-initiated shutdown, an encrypted gp3 root volume deleted
    with the instance and without the stack tag (:func:`keep_stack_tag_off_root_volumes`).

    Args:
        scope, construct_id: where the ``ec2.LaunchTemplate`` goes.
        root_volume_size_gib: the root volume's size (checked by :func:`root_volume_gib`).
        root_device_name: the AMI's root device; default ``/dev/sda1`` (Ubuntu AMIs).
        root_volume_encryption_key: the root volume's KMS key; default: the AWS managed EBS key.
        **props: the node's own ``ec2.LaunchTemplate`` props (``machine_image``, ``user_data``,
            ``instance_profile``, ``security_group``; ``instance_type``: none lets the fleet's
            overrides choose; ``key_pair``: none, connect with SSM; ``instance_metadata_tags``).

    Returns:
        The launch template.
    """
    template = ec2.LaunchTemplate(
        scope,
        construct_id,
        **props,
        require_imdsv2=True,
        http_tokens=ec2.LaunchTemplateHttpTokens.REQUIRED,
        http_put_response_hop_limit=2,
        http_endpoint=True,
        # The agent powers off a node that can no longer work (IMDS 403 during training), and a failed
        # boot shuts the node down (spot_training/infra/userdata.py, boot-failed): terminate, not stop (EC2's
        # default), so the fleet or the Auto Scaling group replaces it (EC2 User Guide, "Change instance
        # initiated shutdown behavior").
        instance_initiated_shutdown_behavior=ec2.InstanceInitiatedShutdownBehavior.TERMINATE,
        block_devices=[
            ec2.BlockDevice(
                device_name=root_device_name,
                volume=ec2.BlockDeviceVolume.ebs(
                    root_volume_size_gib,
                    encrypted=True,
                    kms_key=root_volume_encryption_key,
                    volume_type=ec2.EbsDeviceVolumeType.GP3,
                    delete_on_termination=True,
                ),
            )
        ],
    )
    # Root volumes (DeleteOnTermination) get the construct's tags but not the stack tag: the
    # instance role may delete volumes carrying it (the agent's data volume and its copies), so
    # with it every node could delete every other node's root volume, and the data-cleanup
    # handler would wait for volumes EC2 deletes with their instances.
    keep_stack_tag_off_root_volumes(template)
    return template


def keep_stack_tag_off_root_volumes(launch_template: ec2.LaunchTemplate) -> None:
    """Render ``launch_template``'s TagSpecifications so that its instances get all its tags and their
    volumes all but ``spot-training:stack`` (the tag the instance role may delete volumes by). The L2
    gives instances and volumes the same tags and has no option for this, hence the override; the
    tags are read at synth time, after every ``Tags.of(...)`` aspect has run."""
    cfn_launch_template = launch_template.node.default_child
    assert isinstance(cfn_launch_template, ec2.CfnLaunchTemplate)
    cfn_launch_template.add_property_override(
        "LaunchTemplateData.TagSpecifications", cdk.Lazy.any(_InstanceAndRootVolumeTags(launch_template)))


@jsii.implements(cdk.IStableAnyProducer)
class _InstanceAndRootVolumeTags:
    """The launch template's TagSpecifications: all its tags on instances; all but the stack tag on
    their (root) volumes; None when it has no tags."""

    def __init__(self, launch_template: ec2.LaunchTemplate) -> None:
        self._launch_template = launch_template

    def produce(self) -> object:
        manager = cdk.TagManager.of(self._launch_template)
        tags = [{"Key": t["Key"], "Value": t["Value"]} for t in (manager.render_tags() if manager else None) or []]
        if not tags:
            return None
        specs = [{"ResourceType": "instance", "Tags": tags}]
        volume_tags = [t for t in tags if t["Key"] != STACK_TAG_KEY]
        if volume_tags:
            specs.append({"ResourceType": "volume", "Tags": volume_tags})
        return specs


def _subnet_selection_kwargs(selection: ec2.SubnetSelection | None) -> dict[str, object]:
    """Keyword arguments for ``IVpc.select_subnets`` (default: public subnets)."""
    if selection is None:
        return {"subnet_type": ec2.SubnetType.PUBLIC}
    return {
        key: getattr(selection, key)
        for key in ("availability_zones", "one_per_az", "subnet_filters", "subnet_group_name", "subnet_type", "subnets")
        if getattr(selection, key) is not None
    }
