"""cdk-nag (``AwsSolutionsChecks``) for our stacks, and every acknowledgement with its reason.

This is the one place findings are acknowledged. cdk-nag v2 (``NagSuppressions``) is pinned in
requirements.txt; v3 replaced the API with ``Validations.of(x).acknowledge``. Acknowledgements are
attached by construct type (not by path) so they follow our constructs into any stack, and each
names exactly the finding it covers (``applies_to``), so a new wildcard still fails synth.
"""

from __future__ import annotations

import aws_cdk as cdk
import cdk_nag
import constructs

from .cleanup import DataCleanup
from .cluster import ParameterServerCluster
from .cluster_stack import DistributedTrainingStack
from .fis import SpotInterruptionDrill
from .roles import SpotFleetRole, TrainingNodeRole
from .stack import SpotTrainingStack

_EC2_TAG_SCOPED = cdk_nag.RegexAppliesTo(regex=r"/^Resource::arn:<AWS::Partition>:ec2:<AWS::Region>:(<AWS::AccountId>)?:(volume|snapshot|instance|spot-fleet-request)\/\*$/g")

#: (construct type, rule id, applies_to, reason)
ACKNOWLEDGEMENTS: tuple[tuple[type, str, list[object], str], ...] = (
    (
        TrainingNodeRole,
        "AwsSolutions-IAM5",
        ["Resource::*"],
        "Only the ec2:Describe* calls the agent needs (volumes, snapshots, instances, tags, spot fleet "
        "requests); EC2 supports no resource-level permissions for Describe actions. Session Manager's "
        "ssmmessages:Create/OpenControlChannel/DataChannel (of the Session Manager instance profile AWS "
        "documents, used instead of AmazonSSMManagedInstanceCore with its ssm:GetParameter(s) on *), which "
        "support no resource-level permissions either. Cluster scheduler and server nodes: "
        "autoscaling:DescribeTags (their failed-boot count), which has none either. With monitoring, also "
        "cloudwatch:PutMetricData, which has no resource-level permissions either and is conditioned on "
        "cloudwatch:namespace = SpotTraining (a test asserts it).",
    ),
    (
        TrainingNodeRole,
        "AwsSolutions-IAM5",
        [_EC2_TAG_SCOPED],
        "The agent creates, moves, attaches and deletes volumes and snapshots whose ids are not known at "
        "deploy time; every such statement is conditioned on the stack tag (aws:ResourceTag / "
        "aws:RequestTag spot-training:stack), which a test asserts. The one exception is "
        "ssm:UpdateInstanceInformation on this account's and region's instances (instance/*): the SSM "
        "Agent registers the instance it runs on for Session Manager, and SSM documents no instance-tag "
        "condition for it.",
    ),
    (
        TrainingNodeRole,
        "AwsSolutions-IAM5",
        [cdk_nag.RegexAppliesTo(regex=r"/^Resource::arn:<AWS::Partition>:autoscaling:<AWS::Region>:<AWS::AccountId>:autoScalingGroup:\*:autoScalingGroupName\/\*$/g")],
        "Cluster scheduler and server nodes count their failed boots on their Auto Scaling group and, at the "
        "bound, suspend its launches (spot_training/infra/userdata.py, boot_failed_script); the group's ARN holds a UUID "
        "not known at synth time, so the statements are conditioned on aws:ResourceTag/spot-training:stack "
        "and the count's one tag key, which a test asserts.",
    ),
    (
        TrainingNodeRole,
        "AwsSolutions-IAM5",
        [cdk_nag.RegexAppliesTo(regex=r"/^Resource::arn:<AWS::Partition>:s3:::[a-z0-9][a-z0-9.-]+\/[^*]*\*$/g")],
        "The job's dataset (-c dataset_uri=s3://bucket/prefix/): s3:GetObject on the objects under that one "
        "prefix, which the agent lists and copies onto the data volume (spot_training/agent/dataset.py); "
        "the object keys are the user's and not known at synth time. s3:ListBucket on the bucket is "
        "conditioned on s3:prefix to the same prefix (spot_training/infra/dataset.py; a test asserts both).",
    ),
    (
        SpotFleetRole,
        "AwsSolutions-IAM4",
        ["Policy::arn:<AWS::Partition>:iam::aws:policy/service-role/AmazonEC2SpotFleetTaggingRole"],
        "The Spot Fleet documentation prescribes this AWS managed policy for the fleet role; AWS updates "
        "it when Spot Fleet needs new permissions.",
    ),
    (
        DataCleanup,
        "AwsSolutions-IAM4",
        ["Policy::arn:<AWS::Partition>:iam::aws:policy/service-role/AWSLambdaBasicExecutionRole"],
        "Lambda's basic execution policy (CloudWatch Logs only) for the cleanup handler and the "
        "custom_resources.Provider framework function, which aws-cdk-lib attaches itself.",
    ),
    (
        DataCleanup,
        "AwsSolutions-IAM5",
        ["Resource::*"],
        "ec2:DescribeVolumes/DescribeSnapshots/DescribeInstances to find the stack's tagged resources; EC2 "
        "supports no resource-level permissions for Describe actions.",
    ),
    (
        DataCleanup,
        "AwsSolutions-IAM5",
        [_EC2_TAG_SCOPED],
        "DeleteVolume/DeleteSnapshot on ids created at run time by the agents, conditioned on "
        "aws:ResourceTag/spot-training:stack.",
    ),
    (
        DataCleanup,
        "AwsSolutions-IAM5",
        [cdk_nag.RegexAppliesTo(regex=r"/^Resource::<[A-Za-z0-9]*DataCleanupHandler[A-Za-z0-9]*\.Arn>:\*$/g")],
        "custom_resources.Provider lets its framework function invoke every version of the handler "
        "(aws-cdk-lib's own grant).",
    ),
    (
        SpotInterruptionDrill,
        "AwsSolutions-IAM5",
        ["Resource::*"],
        "FIS resolves the experiment's targets with ec2:DescribeInstances, which supports no resource-level "
        "permissions (AWS's own FIS spot interruption sample grants it on *).",
    ),
    (
        SpotInterruptionDrill,
        "AwsSolutions-IAM5",
        [_EC2_TAG_SCOPED],
        "ec2:SendSpotInstanceInterruptions on the instances the fleet launches at run time, conditioned on "
        "aws:ResourceTag/spot-training:stack; only with -c fis_drill=true.",
    ),
    (
        ParameterServerCluster,
        "AwsSolutions-AS3",
        [],
        "The scheduler and server groups have a fixed size (min = max); their only scaling activity is "
        "replacing a lost node, which the agents already handle (the replacement registers and the "
        "coordinator starts the next generation, logged in events.jsonl on EFS) and which the group's "
        "activity history records. There is no subscriber to notify by default.",
    ),
)


def apply_nag(scope: cdk.App | cdk.Stack, *, verbose: bool = True) -> None:
    """Run ``AwsSolutionsChecks`` on ``scope`` at synth time and acknowledge our known findings.

    Unacknowledged findings become error annotations, which fail ``cdk synth``.
    """
    cdk.Aspects.of(scope).add(cdk_nag.AwsSolutionsChecks(verbose=verbose))
    acknowledge(scope)


#: Only when the user turned flow logs off (``-c vpc_flow_logs=false``, e.g. local mode on moto).
FLOW_LOGS_OFF_REASON = (
    "VPC flow logs were turned off on purpose with the vpc_flow_logs context key; they are on by default."
)


def acknowledge(scope: constructs.IConstruct) -> None:
    """Attach :data:`ACKNOWLEDGEMENTS` to every matching construct under ``scope``."""
    for node in scope.node.find_all():
        flow_logs_off = (
            isinstance(node, SpotTrainingStack) and not node.settings.vpc_flow_logs and not node.settings.vpc_id
        ) or (
            isinstance(node, DistributedTrainingStack) and not node.settings.base.vpc_flow_logs and not node.settings.base.vpc_id
        )
        if flow_logs_off:
            cdk_nag.NagSuppressions.add_resource_suppressions(
                node.vpc, [cdk_nag.NagPackSuppression(id="AwsSolutions-VPC7", reason=FLOW_LOGS_OFF_REASON)]
            )
        for construct_type, rule, applies_to, reason in ACKNOWLEDGEMENTS:
            if isinstance(node, construct_type):
                cdk_nag.NagSuppressions.add_resource_suppressions(
                    node,
                    [cdk_nag.NagPackSuppression(id=rule, reason=reason, applies_to=applies_to or None)],
                    apply_to_children=True,
                )
