"""``TrainingVolume``: the persistent gp3 EBS volume that holds datasets and checkpoints."""

from __future__ import annotations

import aws_cdk as cdk
import constructs
from aws_cdk import aws_ec2 as ec2
from aws_cdk import aws_iam as iam
from aws_cdk import aws_kms as kms

from .config import prop_int
from .tags import DEPLOYMENT_TAG_KEY, PURPOSE_DATA_VOLUME, PURPOSE_TAG_KEY, STACK_TAG_KEY

#: gp3 limits this construct accepts (the issue's range for size; the classic gp3 IOPS and throughput ranges).
MIN_SIZE_GIB, MAX_SIZE_GIB = 1, 16384
MIN_IOPS, MAX_IOPS = 3000, 16000
MIN_THROUGHPUT_MIBPS, MAX_THROUGHPUT_MIBPS = 125, 1000


def _check_int(prop: str, value: object, lo: int, hi: int, unit: str) -> int:
    if prop == "size_gib" and isinstance(value, cdk.Size):
        value = value.to_gibibytes(rounding=cdk.SizeRoundingBehavior.NONE)
        value = int(value) if float(value).is_integer() else value
    return prop_int(prop, value, lo, hi, unit)


class TrainingVolume(constructs.Construct):
    """A gp3 EBS volume for datasets (``datasets/``) and checkpoints (``checkpoints/``), encrypted.

    The node agent finds it by the stack-scoped tags ``spot-training:stack=<stack>`` and
    ``spot-training:purpose=data-volume`` (never by ``Name``), moves it to the instance's
    Availability Zone through a snapshot when needed, and mounts it (``/dltraining`` by default).
    The IAM conditions of :class:`spot_training.infra.roles.TrainingNodeRole` test the same tags.

    The construct id of the volume is ``Resource``: renaming this construct or its parent replaces
    the volume, and with it the data, so the stack pins the logical id in a test.

    Attributes:
        volume: the ``ec2.Volume``.
        volume_id: its id (token).
        availability_zone: where it is created.
        tags: the stack-scoped tags it carries (dict).
    """

    def __init__(
        self,
        scope: constructs.Construct,
        construct_id: str,
        *,
        availability_zone: str,
        size_gib: int | cdk.Size = 100,
        iops: int = 3000,
        throughput_mibps: int = 125,
        encryption_key: kms.IKey | None = None,
        removal_policy: cdk.RemovalPolicy = cdk.RemovalPolicy.RETAIN,
        stack_tag_value: str | None = None,
        volume_name: str | None = None,
        deployment_tag_value: str | None = None,
    ) -> None:
        """Define the volume.

        Args:
            scope: the parent construct.
            construct_id: the construct's id, unique within ``scope``.
            availability_zone: the AZ to create it in (the agent moves it later if needed).
            size_gib: size as a ``cdk.Size`` or whole GiB (int), 1..16384 GiB; default 100.
            iops: provisioned IOPS, 3000..16000 and at most 500 per GiB; default 3000 (gp3 baseline).
            throughput_mibps: throughput in MiB/s, 125..1000 and at most IOPS/4; default 125 (gp3 baseline).
            encryption_key: a customer managed KMS key; default: the AWS managed key ``aws/ebs``.
                The volume is always encrypted.
            removal_policy: default ``RETAIN`` (the data outlives the stack unless deleted on purpose).
            stack_tag_value: value of the ``spot-training:stack`` tag; default: the stack's name.
            volume_name: the ``Name`` tag; default: ``<stack tag value>-data`` (informational only).
            deployment_tag_value: value of the ``spot-training:deployment`` tag (may be a token such as
                :func:`spot_training.infra.tags.deployment_tag_value`); default: none (no deployment tag).

        Raises:
            ValueError: a size, IOPS or throughput out of range (the message names the prop, the
                value and the range), or ``iops`` above 500 per GiB, or throughput above IOPS/4.
        """
        super().__init__(scope, construct_id)
        size_gib = _check_int("size_gib", size_gib, MIN_SIZE_GIB, MAX_SIZE_GIB, "GiB")
        _check_int("iops", iops, MIN_IOPS, MAX_IOPS, "IOPS")
        _check_int("throughput_mibps", throughput_mibps, MIN_THROUGHPUT_MIBPS, MAX_THROUGHPUT_MIBPS, "MiB/s")
        if iops > 3000 and iops > 500 * size_gib:
            raise ValueError(f"iops must be at most 500 per GiB for gp3, got iops={iops} with size_gib={size_gib} (max {500 * size_gib})")
        if throughput_mibps > 125 and throughput_mibps * 4 > iops:
            raise ValueError(
                f"throughput_mibps must be at most iops/4 for gp3, got throughput_mibps={throughput_mibps} with iops={iops} (max {iops // 4})"
            )
        stack = cdk.Stack.of(self)
        tag_value = stack_tag_value or stack.stack_name
        self.tags: dict[str, str] = {STACK_TAG_KEY: tag_value, PURPOSE_TAG_KEY: PURPOSE_DATA_VOLUME}
        if deployment_tag_value is not None:
            self.tags[DEPLOYMENT_TAG_KEY] = deployment_tag_value
        self.availability_zone = availability_zone
        self.volume = ec2.Volume(
            self,
            "Resource",
            availability_zone=availability_zone,
            size=cdk.Size.gibibytes(size_gib),
            volume_type=ec2.EbsDeviceVolumeType.GP3,
            iops=iops,
            throughput=throughput_mibps,
            encrypted=True,
            encryption_key=encryption_key,
            removal_policy=removal_policy,
            volume_name=volume_name or f"{tag_value}-data",
        )
        for key, value in self.tags.items():
            cdk.Tags.of(self.volume).add(key, value)
        self.volume_id: str = self.volume.volume_id

    def grant_attach_volume(self, grantee: iam.IGrantable) -> iam.Grant:
        """Let ``grantee`` attach and detach this data volume, and the copies the agent makes of it when
        it moves between Availability Zones, to instances of the same job.

        aws-cdk-lib's ``Volume.grant_attach_volume`` names this one volume's ARN, which the copies do not
        have; the grant is therefore on volumes and instances tagged ``spot-training:stack`` = this
        volume's value (the tag the copies and the job's instances carry).

        Returns:
            The ``iam.Grant`` (``ec2:AttachVolume``, ``ec2:DetachVolume``).
        """
        arn = f"arn:{cdk.Aws.PARTITION}:ec2:{cdk.Aws.REGION}:{cdk.Aws.ACCOUNT_ID}:"
        return iam.Grant.add_to_principal(
            grantee=grantee,
            actions=["ec2:AttachVolume", "ec2:DetachVolume"],
            resource_arns=[f"{arn}volume/*", f"{arn}instance/*"],
            conditions={"StringEquals": {f"aws:ResourceTag/{STACK_TAG_KEY}": self.tags[STACK_TAG_KEY]}},
        )
