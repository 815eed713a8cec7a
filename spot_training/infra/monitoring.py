"""``TrainingMonitoring``: where a training stack's nodes publish, and what watches them.

- a CloudWatch Logs group ``/spot-training/<stack>`` (retention from the ``log_retention_days``
  context key; CloudWatch Logs encrypts every log group at rest with AWS-managed keys, which is what
  cdk-nag's AwsSolutions pack accepts; a customer managed key would cost a key a month and a key
  policy for the logs service principal, and buys nothing for training output), one stream per instance;
- the metrics the agents put (``spot_training.agent.publish.METRICS``) under the stack's namespace ``SpotTraining/<stack name>``,
  dimension ``Stack``;
- a dashboard: progress (global step, steps total), loss, checkpoint age, interruptions (notices,
  rebalance recommendations, volume moves), notice->checkpoint and boot->resume seconds, running
  instances by type and Availability Zone, and the alarms;
- alarms: *no progress* (``StepsDone`` summed per minute is 0 for ``no_progress_minutes`` minutes
  while an agent publishes it, from its trainer's first logged step on that boot; no data, i.e. no
  instance running or none past that step, is not breaching), *no spot capacity*
  (the fleet's ``AWS/EC2Spot`` ``TargetCapacity`` minus ``FulfilledCapacity`` above 0 for
  ``no_capacity_minutes``; SageMaker's ``MaxWaitTimeInSeconds`` idea, but an alarm instead of a stop),
  *completed* and *failed* (the agents' ``Completed`` / ``TrainerFailed`` metrics);
- optionally an SNS topic with an e-mail subscription that every alarm notifies, encrypted with a
  customer managed KMS key (rotation on) whose key policy lets CloudWatch alarms publish (the AWS
  managed ``alias/aws/sns`` key does not allow it: CloudWatch User Guide, "Using Amazon CloudWatch
  alarms", encrypted SNS topics), publishing only over TLS.

Spot Fleet publishes ``AWS/EC2Spot`` metrics by fleet request every 5 minutes (EC2 User Guide, "CloudWatch
metrics for Spot Fleet"), so the capacity alarm works on 5-minute periods.
"""

from __future__ import annotations

import math

import aws_cdk as cdk
import constructs
from aws_cdk import aws_cloudwatch as cloudwatch
from aws_cdk import aws_cloudwatch_actions as cloudwatch_actions
from aws_cdk import aws_iam as iam
from aws_cdk import aws_kms as kms
from aws_cdk import aws_logs as logs
from aws_cdk import aws_sns as sns
from aws_cdk import aws_sns_subscriptions as subscriptions

from . import acknowledgements
from .config import prop_int
from spot_training.contract import METRICS_NAMESPACE_PREFIX, metrics_namespace

#: First part of the CloudWatch namespace of the agents' metrics; each stack's is
#: ``SpotTraining/<stack name>`` (:func:`spot_training.contract.metrics_namespace`).
METRICS_NAMESPACE = METRICS_NAMESPACE_PREFIX
#: Log group name of a stack: ``/spot-training/<stack name>``.
LOG_GROUP_PREFIX = "/spot-training/"
#: Period of the agent-metric alarms, and of the capacity alarm (Spot Fleet's 5-minute metrics).
_PERIOD = cdk.Duration.minutes(1)
_SPOT_PERIOD = cdk.Duration.minutes(5)
#: CloudWatch Logs retention in days (the values PutRetentionPolicy accepts) -> aws-cdk-lib's enum.
RETENTION_DAYS: dict[int, logs.RetentionDays] = dict(zip(
    (1, 3, 5, 7, 14, 30, 60, 90, 120, 150, 180, 365, 400, 545, 731, 1096, 1827, 2192, 2557, 2922, 3288, 3653),
    (logs.RetentionDays.ONE_DAY, logs.RetentionDays.THREE_DAYS, logs.RetentionDays.FIVE_DAYS, logs.RetentionDays.ONE_WEEK,
     logs.RetentionDays.TWO_WEEKS, logs.RetentionDays.ONE_MONTH, logs.RetentionDays.TWO_MONTHS,
     logs.RetentionDays.THREE_MONTHS, logs.RetentionDays.FOUR_MONTHS, logs.RetentionDays.FIVE_MONTHS,
     logs.RetentionDays.SIX_MONTHS, logs.RetentionDays.ONE_YEAR, logs.RetentionDays.THIRTEEN_MONTHS,
     logs.RetentionDays.EIGHTEEN_MONTHS, logs.RetentionDays.TWO_YEARS, logs.RetentionDays.THREE_YEARS,
     logs.RetentionDays.FIVE_YEARS, logs.RetentionDays.SIX_YEARS, logs.RetentionDays.SEVEN_YEARS,
     logs.RetentionDays.EIGHT_YEARS, logs.RetentionDays.NINE_YEARS, logs.RetentionDays.TEN_YEARS),
))


def log_group_name(stack_name: str) -> str:
    """``/spot-training/<stack_name>``: the stack's log group (the CLI finds it by this name)."""
    return f"{LOG_GROUP_PREFIX}{stack_name}"


class TrainingMonitoring(constructs.Construct):
    """Log group, dashboard, alarms and optional e-mail notifications of one training stack.

    Attributes:
        log_group, dashboard, no_progress_alarm, no_capacity_alarm (None without a fleet request id),
        completed_alarm, failed_alarm, topic (None without ``notification_email``), namespace.
    """

    def __init__(
        self,
        scope: constructs.Construct,
        construct_id: str,
        *,
        stack_tag_value: str,
        log_retention: logs.RetentionDays,
        no_progress_minutes: int,
        no_capacity_minutes: int,
        notification_email: str | None = None,
        fleet_request_id: str | None = None,
        removal_policy: cdk.RemovalPolicy = cdk.RemovalPolicy.DESTROY,
    ) -> None:
        """Define the resources.

        Args:
            scope: the parent construct.
            construct_id: the construct's id, unique within ``scope``.
            stack_tag_value: the ``Stack`` dimension value and log group suffix (the stack name).
            log_retention: how long CloudWatch Logs keeps the nodes' logs.
            no_progress_minutes: minutes without a training step, while an agent runs, before the
                hang alarm (1..1440).
            no_capacity_minutes: minutes the fleet stays below its target capacity before the capacity
                alarm (5..1440; rounded up to whole 5-minute periods).
            notification_email: an e-mail address to subscribe to the alarms' SNS topic; None: no topic.
            fleet_request_id: the Spot Fleet request id (a token) for the capacity alarm; None: no alarm.
            removal_policy: of the log group (RETAIN keeps the history after ``cdk destroy``).

        Raises:
            ValueError: a minutes value out of range, or a malformed e-mail address.
        """
        super().__init__(scope, construct_id)
        acknowledgements.attach(self)  # its nag/checkov acknowledgements, on its own resources
        prop_int("no_progress_minutes", no_progress_minutes, 1, 1440)
        prop_int("no_capacity_minutes", no_capacity_minutes, 5, 1440)
        if notification_email is not None and ("@" not in notification_email or " " in notification_email):
            raise ValueError(f"notification_email must be an e-mail address such as ops@example.com, got {notification_email!r}")
        self.namespace = metrics_namespace(stack_tag_value)
        self.stack_tag_value = stack_tag_value
        self.log_group = logs.LogGroup(
            self,
            "NodeLogs",
            log_group_name=log_group_name(stack_tag_value),
            retention=log_retention,
            removal_policy=removal_policy,
        )

        self.topic: sns.Topic | None = None
        if notification_email:
            key = kms.Key(
                self,
                "TopicKey",
                description=f"Encrypts the alarm notifications of stack {stack_tag_value}",
                enable_key_rotation=True,
                removal_policy=cdk.RemovalPolicy.DESTROY,
            )
            key.add_to_resource_policy(
                iam.PolicyStatement(
                    sid="CloudWatchAlarmsPublish",
                    actions=["kms:Decrypt", "kms:GenerateDataKey*"],
                    principals=[iam.ServicePrincipal("cloudwatch.amazonaws.com")],
                    resources=["*"],  # in a key policy, "*" is this key
                    conditions={"StringEquals": {"aws:SourceAccount": cdk.Aws.ACCOUNT_ID}},
                )
            )
            self.topic = sns.Topic(self, "Notifications", master_key=key, enforce_ssl=True,
                                   display_name=f"Spot training {stack_tag_value}")
            self.topic.add_subscription(subscriptions.EmailSubscription(notification_email))
        self.alarms: list[cloudwatch.Alarm] = []
        self.no_progress_alarm = self._alarm(
            "NoProgress",
            description=(f"{stack_tag_value}: no training step for {no_progress_minutes} min after the trainer's "
                         "first on a node (a hung trainer or agent); see spot-train status / logs"),
            metric=self.metric("StepsDone", "Sum"),
            threshold=0,
            comparison=cloudwatch.ComparisonOperator.LESS_THAN_OR_EQUAL_TO_THRESHOLD,
            periods=no_progress_minutes,
        )
        # One alarm per 0/1 outcome metric the agents publish: in alarm as soon as one node reports 1.
        self.completed_alarm, self.failed_alarm = (
            self._alarm(
                metric_name,
                description=f"{stack_tag_value}: {what}",
                metric=self.metric(metric_name, "Maximum"),
                threshold=1,
                comparison=cloudwatch.ComparisonOperator.GREATER_THAN_OR_EQUAL_TO_THRESHOLD,
                periods=1,
            )
            for metric_name, what in (
                ("Completed", "training completed (the trainer wrote COMPLETED)"),
                ("TrainerFailed", "the trainer kept crashing and the agent gave up (exit 75)"),
            )
        )
        self.no_capacity_minutes = no_capacity_minutes
        self.no_capacity_alarm: cloudwatch.Alarm | None = None

        self.dashboard = cloudwatch.Dashboard(self, "Dashboard", dashboard_name=f"{stack_tag_value}-training")
        self.dashboard.add_widgets(
            cloudwatch.GraphWidget(title="Progress (steps)", width=12,
                                   left=[self.metric("GlobalStep", "Maximum"), self.metric("StepsTotal", "Maximum"),
                                         self.metric("CheckpointStep", "Maximum")]),
            cloudwatch.GraphWidget(title="Loss", width=12, left=[self.metric("Loss", "Average")]),
        )
        self.dashboard.add_widgets(
            cloudwatch.GraphWidget(title="Interruptions", width=8,
                                   left=[self.metric("InterruptionNotices", "Sum"),
                                         self.metric("RebalanceRecommendations", "Sum"),
                                         self.metric("VolumeMoves", "Sum")]),
            cloudwatch.GraphWidget(title="Notice -> checkpoint, boot -> resume (s)", width=8,
                                   left=[self.metric("NoticeToCheckpointSeconds", "Maximum"),
                                         self.metric("BootToResumeSeconds", "Maximum")]),
            cloudwatch.GraphWidget(title="Checkpoint age (s)", width=8,
                                   left=[self.metric("CheckpointAgeSeconds", "Maximum")]),
        )
        running = cloudwatch.MathExpression(
            expression=(
                f"SEARCH('{{{self.namespace},Stack,InstanceType,AvailabilityZone}} "
                f"MetricName=\"RunningInstances\" Stack=\"{stack_tag_value}\"', 'Maximum', 60)"
            ),
            label="running instances",
            using_metrics={},
            period=_PERIOD,
        )
        self.dashboard.add_widgets(
            cloudwatch.GraphWidget(title="Running instances by type and AZ", width=24, left=[running]),
        )
        if fleet_request_id is not None:
            self.add_capacity_alarm(fleet_request_id)

    def _alarm(self, construct_id: str, *, description: str, metric: cloudwatch.IMetric, threshold: float,
               comparison: cloudwatch.ComparisonOperator, periods: int) -> cloudwatch.Alarm:
        alarm = cloudwatch.Alarm(
            self,
            construct_id,
            alarm_description=description,
            metric=metric,
            threshold=threshold,
            comparison_operator=comparison,
            evaluation_periods=periods,
            datapoints_to_alarm=periods,
            treat_missing_data=cloudwatch.TreatMissingData.NOT_BREACHING,
        )
        if self.topic is not None:
            alarm.add_alarm_action(cloudwatch_actions.SnsAction(self.topic))
        self.alarms.append(alarm)
        return alarm

    def add_capacity_alarm(self, fleet_request_id: str) -> cloudwatch.Alarm:
        """Add the *no spot capacity* alarm on the fleet request ``fleet_request_id`` (a token), and
        the dashboard row with every alarm's state. Call it once, after the fleet exists."""
        if self.no_capacity_alarm is not None:
            raise ValueError("add_capacity_alarm was already called; a stack has one fleet alarm")
        periods = math.ceil(self.no_capacity_minutes / 5)
        spot = {"FleetRequestId": fleet_request_id}
        missing = cloudwatch.MathExpression(
            expression="target - fulfilled",
            label="capacity missing (instances)",
            period=_SPOT_PERIOD,
            using_metrics={
                "target": cloudwatch.Metric(namespace="AWS/EC2Spot", metric_name="TargetCapacity",
                                            dimensions_map=spot, statistic="Average", period=_SPOT_PERIOD),
                "fulfilled": cloudwatch.Metric(namespace="AWS/EC2Spot", metric_name="FulfilledCapacity",
                                               dimensions_map=spot, statistic="Average", period=_SPOT_PERIOD),
            },
        )
        self.no_capacity_alarm = self._alarm(
            "NoSpotCapacity",
            description=(f"{self.stack_tag_value}: the spot fleet has been below its target capacity for "
                         f"{periods * 5} min (waiting for spot capacity); consider more instance types or AZs"),
            metric=missing,
            threshold=0,
            comparison=cloudwatch.ComparisonOperator.GREATER_THAN_THRESHOLD,
            periods=periods,
        )
        self.dashboard.add_widgets(cloudwatch.AlarmStatusWidget(title="Alarms", width=24, alarms=list(self.alarms)))
        return self.no_capacity_alarm

    def metric(self, name: str, statistic: str) -> cloudwatch.Metric:
        """The agents' metric ``name`` of this stack (dimension ``Stack``), 1-minute period.

        Args:
            name: a metric the agents publish (``spot_training.agent.publish.METRICS``).
            statistic: the CloudWatch statistic (``"Maximum"``, ``"Sum"``...).

        Returns:
            the ``cloudwatch.Metric``.
        """
        return cloudwatch.Metric(namespace=self.namespace, metric_name=name,
                                 dimensions_map={"Stack": self.stack_tag_value}, statistic=statistic, period=_PERIOD)

    def grant_publish(self, role: iam.IRole) -> None:
        """Let ``role`` (the nodes) write to this log group only and put metrics only in this stack's namespace.

        ``logs:CreateLogStream``/``logs:PutLogEvents`` on the group's streams (``LogGroup.grant_write``);
        ``cloudwatch:PutMetricData`` has no resource-level permissions, so it is ``Resource: "*"``
        with the condition ``cloudwatch:namespace`` = ``SpotTraining/<stack name>`` (CloudWatch User
        Guide, "Using condition keys to limit access to CloudWatch namespaces"): another stack's
        nodes cannot put metrics this stack's alarms read.
        """
        self.log_group.grant_write(role)
        role.add_to_principal_policy(
            iam.PolicyStatement(
                sid="PutMetricDataOwnNamespace",
                actions=["cloudwatch:PutMetricData"],
                resources=["*"],
                conditions={"StringEquals": {"cloudwatch:namespace": self.namespace}},
            )
        )

    def node_config(self, *, interval_s: float | None = None) -> dict[str, object]:
        """The node config's ``monitoring`` section (docs/contracts.md)."""
        section: dict[str, object] = {"enabled": True, "log_group": log_group_name(self.stack_tag_value),
                                      "namespace": self.namespace}
        if interval_s is not None:
            section["interval_s"] = interval_s
        return section
