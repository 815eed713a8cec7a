"""``DataCleanup``: on stack delete, remove the volumes and snapshots carrying the stack's tag.

The node agents create volumes and snapshots at run time (moving the data volume between
Availability Zones); CloudFormation does not know them. This custom resource (the handler in
``spot_training/infra/handlers/data_cleanup/index.py``, run by ``aws_cdk.custom_resources.Provider``) deletes every
EBS volume and snapshot tagged ``spot-training:stack=<stack>`` when the stack is deleted, unless
``retain_data`` is true. Make the fleet depend on it (:meth:`run_after`) so that CloudFormation
deletes the fleet, and with it the instances, before the cleanup runs.
"""

from __future__ import annotations

from pathlib import Path

import aws_cdk as cdk
import constructs
from aws_cdk import aws_iam as iam
from aws_cdk import aws_lambda as lambda_
from aws_cdk import aws_logs as logs
from aws_cdk import custom_resources as cr

from . import acknowledgements
from .tags import STACK_TAG_KEY

HANDLER_DIR = Path(__file__).resolve().parent / "handlers" / "data_cleanup"
#: The handler waits for volumes to detach; give it Lambda's maximum.
HANDLER_TIMEOUT = cdk.Duration.minutes(15)
#: Python runtime of the handler (the newest Lambda offers; cdk-nag AwsSolutions-L1 checks it).
HANDLER_RUNTIME = lambda_.Runtime.PYTHON_3_14


class DataCleanup(constructs.Construct):
    """A custom resource that deletes the stack's tagged volumes and snapshots on stack delete.

    Attributes:
        function: the handler ``lambda_.Function``.
        log_group: the handler's CloudWatch Logs group (kept ``log_retention``, deleted with the stack).
        provider: the ``custom_resources.Provider``.
        resource: the ``cdk.CustomResource`` (properties ``StackName``, ``TagKey``, ``TagValue``,
            ``RetainData`` as ``"true"``/``"false"``).
    """

    def __init__(
        self,
        scope: constructs.Construct,
        construct_id: str,
        *,
        retain_data: bool = False,
        stack_tag_value: str | None = None,
        deployment_tag_value: str | None = None,
        log_retention: logs.RetentionDays = logs.RetentionDays.ONE_MONTH,
    ) -> None:
        """Define the handler, its tag-scoped policy, the provider and the custom resource.

        Args:
            scope: the parent construct.
            construct_id: the construct's id, unique within ``scope``.
            retain_data: keep every volume and snapshot on stack delete; default false (delete them).
            stack_tag_value: value of ``spot-training:stack`` to clean up; default: the stack's name.
            deployment_tag_value: also require ``spot-training:deployment`` = this value (a token, e.g.
                :func:`spot_training.infra.tags.deployment_tag_value`), so an earlier deployment's retained data stays;
                default: none (every volume and snapshot with the stack tag).
            log_retention: how long the handler's logs are kept; default one month.

        Raises:
            ValueError: ``retain_data`` is not a bool, or the handler file is missing.
        """
        super().__init__(scope, construct_id)
        acknowledgements.attach(self)  # its nag/checkov acknowledgements, on its own resources
        if not isinstance(retain_data, bool):
            raise ValueError(f"retain_data must be True or False, got {retain_data!r}")
        if not (HANDLER_DIR / "index.py").is_file():
            raise ValueError(f"the data cleanup handler {HANDLER_DIR / 'index.py'} is missing")
        stack = cdk.Stack.of(self)
        tag_value = stack_tag_value or stack.stack_name
        tagged = {"StringEquals": {f"aws:ResourceTag/{STACK_TAG_KEY}": tag_value}}
        partition, region, account = cdk.Aws.PARTITION, cdk.Aws.REGION, cdk.Aws.ACCOUNT_ID
        self.function = lambda_.Function(
            self,
            "Handler",
            runtime=HANDLER_RUNTIME,
            handler="index.handler",
            code=lambda_.Code.from_asset(str(HANDLER_DIR), exclude=["__pycache__", "*.pyc"]),
            timeout=HANDLER_TIMEOUT,
            memory_size=256,
            description=f"Deletes the EBS volumes and snapshots tagged {STACK_TAG_KEY}={tag_value} on stack delete",
            log_group=self._handler_logs(log_retention),
            initial_policy=[
                iam.PolicyStatement(
                    sid="Describe",
                    actions=["ec2:DescribeVolumes", "ec2:DescribeSnapshots", "ec2:DescribeInstances"],
                    resources=["*"],
                ),
                iam.PolicyStatement(
                    sid="DeleteOwnVolumesAndSnapshots",
                    actions=["ec2:DeleteVolume", "ec2:DeleteSnapshot"],
                    resources=[
                        f"arn:{partition}:ec2:{region}:{account}:volume/*",
                        f"arn:{partition}:ec2:{region}::snapshot/*",
                    ],
                    conditions=tagged,
                ),
            ],
        )
        self.provider = cr.Provider(
            self,
            "Provider",
            on_event_handler=self.function,
            log_group=logs.LogGroup(
                self, "ProviderLogs", retention=log_retention, removal_policy=cdk.RemovalPolicy.DESTROY
            ),
        )
        self.resource = cdk.CustomResource(
            self,
            "Resource",
            service_token=self.provider.service_token,
            resource_type="Custom::SpotTrainingDataCleanup",
            properties={
                "StackName": stack.stack_name,
                "TagKey": STACK_TAG_KEY,
                "TagValue": tag_value,
                "RetainData": "true" if retain_data else "false",
                **({"DeploymentTagValue": deployment_tag_value} if deployment_tag_value is not None else {}),
            },
        )

    def _handler_logs(self, retention: logs.RetentionDays) -> logs.LogGroup:
        self.log_group = logs.LogGroup(self, "HandlerLogs", retention=retention, removal_policy=cdk.RemovalPolicy.DESTROY)
        return self.log_group

    def run_after(self, *constructs_: constructs.IConstruct) -> None:
        """Make CloudFormation delete ``constructs_`` (the fleet) before this cleanup runs its Delete.

        CloudFormation deletes in reverse dependency order, so the given constructs are made to
        depend on this custom resource: created after it, deleted before it.
        """
        for c in constructs_:
            c.node.add_dependency(self.resource)
