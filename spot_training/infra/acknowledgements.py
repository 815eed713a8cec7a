"""The library's acknowledged cdk-nag and checkov findings, attached to its own constructs.

Each construct of the library calls :func:`attach` on itself. At synth, before any other aspect
(priority ``AspectPriority.MUTATING``), every CloudFormation resource under it receives

* cdk-nag suppressions (``NagSuppressions.add_resource_suppressions``, each with its reason and the
  exact finding it covers, ``applies_to``), and
* checkov's resource-level skips: ``Metadata.checkov.skip`` = ``[{"id": ..., "comment": reason}]``
  (checkov's documented CloudFormation suppression),

so a consumer that runs its own ``AwsSolutionsChecks`` or checkov over a template holding our
constructs sees every finding of ours explained, without calling anything of ours. The suppressions
are attached at synth, not in the constructor, because statements and children are added later
(grants add to a role's default policy). Keep reasons specific: they are what a reviewer reads.
"""

from __future__ import annotations

import dataclasses
import re
from typing import Any

import aws_cdk as cdk
import cdk_nag
import constructs
import jsii


@dataclasses.dataclass(frozen=True)
class NagAcknowledgement:
    """One acknowledged cdk-nag finding: rule id, the exact findings (``applies_to``; empty: the rule
    as a whole) and the reason."""

    rule: str
    applies_to: tuple[Any, ...]
    reason: str


@dataclasses.dataclass(frozen=True)
class CheckovAcknowledgement:
    """One acknowledged checkov finding.

    Attributes:
        check_id: checkov's check id such as ``CKV_AWS_117``.
        resource_type: the CloudFormation type it applies to, such as ``AWS::Lambda::Function``.
        reason: why the finding stays (what it would cost to fix, or why it does not apply).
        path: regular expression the resource's construct path below the owner must match
            (``Handler/Resource``); default: any resource of ``resource_type`` under the owner.
    """

    check_id: str
    resource_type: str
    reason: str
    path: str = ".*"


_EC2_TAG_SCOPED = cdk_nag.RegexAppliesTo(regex=r"/^Resource::arn:<AWS::Partition>:ec2:<AWS::Region>:(<AWS::AccountId>)?:(volume|snapshot|instance|spot-fleet-request)\/\*$/g")

_LOG_GROUP_KMS = (
    "CloudWatch Logs encrypts every log group at rest with a service key; a customer managed KMS key "
    "would add a key (USD 1/month) and a key policy for logs.<region>.amazonaws.com for logs that hold "
    "no secrets (flow records, agent and cleanup messages)."
)

#: The acknowledgements of Lambda functions that only a CloudFormation custom resource invokes (the
#: data cleanup's handler and provider framework, aws-cdk-lib's VpcRestrictDefaultSG provider).
_CUSTOM_RESOURCE_LAMBDA: tuple[tuple[str, str], ...] = (
    ("CKV_AWS_116",
     "A dead-letter queue catches failed asynchronous invocations nobody waits for; here CloudFormation "
     "waits for each custom-resource response, and a failure surfaces as the stack's failed event with "
     "the handler's error, which a queue nobody reads would only duplicate."),
    ("CKV_AWS_117",
     "The function only calls AWS APIs (EC2, Lambda) and touches nothing inside the VPC; in the VPC it would "
     "need a NAT gateway or endpoints and ENIs that delay the stack's deletion, for no isolation gain (its "
     "IAM policy is what bounds it)."),
    ("CKV_AWS_115",
     "It runs once per stack create, update or deletion; reserved concurrency would take capacity from the "
     "account's unreserved pool, while nothing can invoke it in a flood (only CloudFormation's custom "
     "resource and the provider framework do)."),
)

#: construct class name -> its cdk-nag acknowledgements.
NAG: dict[str, tuple[NagAcknowledgement, ...]] = {
    "TrainingNodeRole": (
        NagAcknowledgement(
            "AwsSolutions-IAM5", ("Resource::*",),
            "Only the ec2:Describe* calls the agent needs (volumes, snapshots, instances, tags, spot fleet "
            "requests); EC2 supports no resource-level permissions for Describe actions. Session Manager's "
            "ssmmessages:Create/OpenControlChannel/DataChannel (of the Session Manager instance profile AWS "
            "documents, used instead of AmazonSSMManagedInstanceCore with its ssm:GetParameter(s) on *), which "
            "support no resource-level permissions either. Cluster scheduler and server nodes: "
            "autoscaling:DescribeTags (their failed-boot count), which has none either. With monitoring, also "
            "cloudwatch:PutMetricData, which has no resource-level permissions either and is conditioned on "
            "the cloudwatch:namespace (a test asserts it).",
        ),
        NagAcknowledgement(
            "AwsSolutions-IAM5", (_EC2_TAG_SCOPED,),
            "The agent creates, moves, attaches and deletes volumes and snapshots whose ids are not known at "
            "deploy time; every such statement is conditioned on the stack tag (aws:ResourceTag / "
            "aws:RequestTag spot-training:stack), which a test asserts. The one exception is "
            "ssm:UpdateInstanceInformation on this account's and region's instances (instance/*): the SSM "
            "Agent registers the instance it runs on for Session Manager, and SSM documents no instance-tag "
            "condition for it.",
        ),
        NagAcknowledgement(
            "AwsSolutions-IAM5",
            (cdk_nag.RegexAppliesTo(regex=r"/^Resource::arn:<AWS::Partition>:autoscaling:<AWS::Region>:<AWS::AccountId>:autoScalingGroup:\*:autoScalingGroupName\/\*$/g"),),
            "Cluster scheduler and server nodes count their failed boots on their Auto Scaling group and, at the "
            "bound, suspend its launches (spot_training/infra/userdata.py, boot_failed_script); the group's ARN holds a UUID "
            "not known at synth time, so the statements are conditioned on aws:ResourceTag/spot-training:stack "
            "and the count's one tag key, which a test asserts.",
        ),
        NagAcknowledgement(
            "AwsSolutions-IAM5",
            (cdk_nag.RegexAppliesTo(regex=r"/^Resource::arn:<AWS::Partition>:s3:::[a-z0-9][a-z0-9.-]+\/[^*]*\*$/g"),),
            "The job's dataset (-c dataset_uri=s3://bucket/prefix/): s3:GetObject on the objects under that one "
            "prefix, which the agent lists and copies onto the data volume (spot_training/agent/dataset.py); "
            "the object keys are the user's and not known at synth time. s3:ListBucket on the bucket is "
            "conditioned on s3:prefix to the same prefix (spot_training/infra/dataset.py; a test asserts both).",
        ),
    ),
    "SpotFleetRole": (
        NagAcknowledgement(
            "AwsSolutions-IAM4", ("Policy::arn:<AWS::Partition>:iam::aws:policy/service-role/AmazonEC2SpotFleetTaggingRole",),
            "The Spot Fleet documentation prescribes this AWS managed policy for the fleet role; AWS updates "
            "it when Spot Fleet needs new permissions.",
        ),
    ),
    "DataCleanup": (
        NagAcknowledgement(
            "AwsSolutions-IAM4", ("Policy::arn:<AWS::Partition>:iam::aws:policy/service-role/AWSLambdaBasicExecutionRole",),
            "Lambda's basic execution policy (CloudWatch Logs only) for the cleanup handler and the "
            "custom_resources.Provider framework function, which aws-cdk-lib attaches itself.",
        ),
        NagAcknowledgement(
            "AwsSolutions-IAM5", ("Resource::*",),
            "ec2:DescribeVolumes/DescribeSnapshots/DescribeInstances to find the stack's tagged resources; EC2 "
            "supports no resource-level permissions for Describe actions.",
        ),
        NagAcknowledgement(
            "AwsSolutions-IAM5", (_EC2_TAG_SCOPED,),
            "DeleteVolume/DeleteSnapshot on ids created at run time by the agents, conditioned on "
            "aws:ResourceTag/spot-training:stack.",
        ),
        NagAcknowledgement(
            "AwsSolutions-IAM5", (cdk_nag.RegexAppliesTo(regex=r"/^Resource::<[A-Za-z0-9]*DataCleanupHandler[A-Za-z0-9]*\.Arn>:\*$/g"),),
            "custom_resources.Provider lets its framework function invoke every version of the handler "
            "(aws-cdk-lib's own grant).",
        ),
    ),
    "SpotInterruptionDrill": (
        NagAcknowledgement(
            "AwsSolutions-IAM5", ("Resource::*",),
            "FIS resolves the experiment's targets with ec2:DescribeInstances, which supports no resource-level "
            "permissions (AWS's own FIS spot interruption sample grants it on *).",
        ),
        NagAcknowledgement(
            "AwsSolutions-IAM5", (_EC2_TAG_SCOPED,),
            "ec2:SendSpotInstanceInterruptions on the instances the fleet launches at run time, conditioned on "
            "aws:ResourceTag/spot-training:stack; only with -c fis_drill=true.",
        ),
    ),
    "ParameterServerCluster": (
        NagAcknowledgement(
            "AwsSolutions-AS3", (),
            "The scheduler and server groups have a fixed size (min = max); their only scaling activity is "
            "replacing a lost node, which the agents already handle (the replacement registers and the "
            "coordinator starts the next generation, logged in events.jsonl on EFS) and which the group's "
            "activity history records. There is no subscriber to notify by default.",
        ),
    ),
}

#: construct class name -> its checkov acknowledgements.
CHECKOV: dict[str, tuple[CheckovAcknowledgement, ...]] = {
    "DataCleanup": (
        *(CheckovAcknowledgement(check, "AWS::Lambda::Function", reason) for check, reason in _CUSTOM_RESOURCE_LAMBDA),
        CheckovAcknowledgement(
            "CKV_AWS_173", "AWS::Lambda::Function",
            "The only environment variable is the handler function's ARN, which aws-cdk-lib's Provider "
            "framework sets (USER_ON_EVENT_FUNCTION_ARN); it is no secret, and Lambda encrypts environment "
            "variables at rest with an AWS managed key anyway.",
        ),
        CheckovAcknowledgement("CKV_AWS_158", "AWS::Logs::LogGroup", _LOG_GROUP_KMS),
    ),
    "TrainingMonitoring": (
        CheckovAcknowledgement("CKV_AWS_158", "AWS::Logs::LogGroup", _LOG_GROUP_KMS),
    ),
    # A sweep's children's logs and its manifest bucket (spot_training/infra/sweep.py).
    "ParallelExperiments": (
        CheckovAcknowledgement(
            "CKV_AWS_158", "AWS::Logs::LogGroup",
            "The children's stdout/stderr; CloudWatch Logs encrypts every log group at rest with a service "
            "key, and a customer managed key would add a key and a key policy for logs that hold no secrets.",
            path=r"JobLogs/Resource"),
        CheckovAcknowledgement(
            "CKV_AWS_18", "AWS::S3::Bucket",
            "The manifest bucket holds only the parameter lists users upload with spot-train sweep submit; "
            "access logging would need a second bucket to keep and empty on destroy.",
            path=r"ManifestBucket/Resource"),
    ),
    # The stacks: their VPC's flow-log group, and the Lambda function that aws-cdk-lib adds to a new VPC
    # under the feature flag @aws-cdk/aws-ec2:restrictDefaultSecurityGroup (cdk.json) to strip the
    # default security group's rules.
    "SettingsStack": (
        CheckovAcknowledgement("CKV_AWS_158", "AWS::Logs::LogGroup", _LOG_GROUP_KMS, path=r"FlowLogs/Resource"),
        *(CheckovAcknowledgement(check, "AWS::Lambda::Function", reason, path=r"Custom::VpcRestrictDefaultSGCustomResourceProvider/Handler")
          for check, reason in _CUSTOM_RESOURCE_LAMBDA),
    ),
}


def _kinds(owner: constructs.IConstruct) -> list[str]:
    """The class names of ``owner`` and its bases (a subclass keeps its base's acknowledgements)."""
    return [cls.__name__ for cls in type(owner).__mro__]


@jsii.implements(cdk.IAspect)
class _Acknowledge:
    """Attaches the owner's acknowledgements to the resources under it, once, when synth visits it."""

    def __init__(self, owner: constructs.Construct) -> None:
        self._owner_path = owner.node.path
        self._done = False

    def visit(self, node: constructs.IConstruct) -> None:
        if self._done or node.node.path != self._owner_path:
            return
        self._done = True
        for kind in _kinds(node):
            for ack in NAG.get(kind, ()):
                cdk_nag.NagSuppressions.add_resource_suppressions(
                    node, [cdk_nag.NagPackSuppression(id=ack.rule, reason=ack.reason, applies_to=list(ack.applies_to) or None)],
                    apply_to_children=True,
                )
            skips = CHECKOV.get(kind, ())
            if skips:
                add_checkov_skips(node, skips)


def add_checkov_skips(owner: constructs.IConstruct, skips: tuple[CheckovAcknowledgement, ...]) -> None:
    """Add ``Metadata.checkov.skip`` entries to every matching CloudFormation resource under ``owner``.

    Args:
        owner: the construct whose resources the skips are for.
        skips: the acknowledgements; each applies to resources of its type whose path below
            ``owner`` matches its ``path``.
    """
    prefix = owner.node.path + "/"
    for child in owner.node.find_all():
        if not isinstance(child, cdk.CfnResource):
            continue
        relative = child.node.path[len(prefix):] if child.node.path.startswith(prefix) else child.node.path
        wanted = [s for s in skips if s.resource_type == child.cfn_resource_type and re.fullmatch(s.path, relative)]
        if not wanted:
            continue
        existing = child.get_metadata("checkov") or {}
        entries = list(existing.get("skip", []))
        for skip in wanted:
            if all(e.get("id") != skip.check_id for e in entries):
                entries.append({"id": skip.check_id, "comment": skip.reason})
        child.add_metadata("checkov", {**existing, "skip": entries})


def attach(owner: constructs.Construct) -> None:
    """Acknowledge ``owner``'s known cdk-nag and checkov findings on its own resources at synth.

    Each library construct calls this on itself at the end of its constructor; nothing else needs to.
    The aspect runs with ``AspectPriority.MUTATING``, before cdk-nag's checks (default priority), and
    visits ``owner`` before its children, so the suppressions are in place when the checks read them.
    """
    cdk.Aspects.of(owner).add(_Acknowledge(owner), priority=cdk.AspectPriority.MUTATING)
