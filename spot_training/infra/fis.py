"""``SpotInterruptionDrill``: an AWS Fault Injection Service experiment template that sends a real spot
interruption notice to the stack's running spot instances, for the real-account drill.

The stacks create it only with ``-c fis_drill=true`` (spot_training.infra.config): it costs nothing until an
experiment is started, but it is a standing permission to interrupt the stack's instances. The action
is ``aws:ec2:send-spot-instance-interruptions`` on targets of resource type ``aws:ec2:spot-instance``
(EC2 User Guide, "Initiate a Spot Instance interruption": EC2 notifies the instance two minutes ahead,
through instance metadata, then interrupts it; the underlying service is FIS). The template's shape
follows AWS's own sample (awslabs/ec2-spot-workshops, ``workshops/fis/fisspotinterruption.yaml``):
a role FIS assumes with ``ec2:DescribeInstances`` and ``ec2:SendSpotInstanceInterruptions``, targets
selected by tag and ``State.Name=running``, stop condition ``none``. Here the interrupt permission is
scoped to instances tagged with this stack.

aws-cdk-lib has no L2 for FIS, so the template is the L1 ``CfnExperimentTemplate``; the role is an L2.
"""

from __future__ import annotations

import re

import aws_cdk as cdk
import constructs
from aws_cdk import aws_fis as fis
from aws_cdk import aws_iam as iam

from . import acknowledgements
from .tags import STACK_TAG_KEY

#: FIS accepts 2..15 minutes (ISO 8601) for ``durationBeforeInterruption``; 2 is what a real
#: interruption gives.
DEFAULT_DURATION_BEFORE_INTERRUPTION = "PT2M"
_DURATION_RE = re.compile(r"^PT([2-9]|1[0-5])M$")


class SpotInterruptionDrill(constructs.Construct):
    """An FIS experiment template that interrupts the stack's running spot instances, and its role.

    Attributes:
        role: the ``iam.Role`` FIS assumes.
        template: the ``aws_fis.CfnExperimentTemplate`` (construct id ``Resource``).
        experiment_template_id: its id (token), for ``aws fis start-experiment --experiment-template-id``.
    """

    def __init__(
        self,
        scope: constructs.Construct,
        construct_id: str,
        *,
        stack_tag_value: str | None = None,
        selection_mode: str = "COUNT(1)",
        duration_before_interruption: str = DEFAULT_DURATION_BEFORE_INTERRUPTION,
    ) -> None:
        """Define the role and the experiment template.

        Args:
            scope: the parent construct.
            construct_id: the construct's id, unique within ``scope``.
            stack_tag_value: value of the ``spot-training:stack`` tag the targets carry; default: the stack's name.
            selection_mode: FIS selection mode, ``ALL`` or ``COUNT(n)``; default ``COUNT(1)`` (one instance).
            duration_before_interruption: ``PT2M``..``PT15M``; default ``PT2M``.

        Raises:
            ValueError: a malformed ``selection_mode`` or ``duration_before_interruption``.
        """
        super().__init__(scope, construct_id)
        acknowledgements.attach(self)  # its nag/checkov acknowledgements, on its own resources
        if not isinstance(selection_mode, str) or not re.fullmatch(r"ALL|COUNT\([1-9][0-9]*\)", selection_mode):
            raise ValueError(f"selection_mode must be ALL or COUNT(n) with n >= 1, got {selection_mode!r}")
        if not isinstance(duration_before_interruption, str) or not _DURATION_RE.match(duration_before_interruption):
            raise ValueError(f"duration_before_interruption must be PT2M..PT15M, got {duration_before_interruption!r}")
        stack = cdk.Stack.of(self)
        tag_value = stack_tag_value or stack.stack_name
        self.role = iam.Role(
            self,
            "Role",
            assumed_by=iam.ServicePrincipal("fis.amazonaws.com"),
            description=f"AWS FIS: send spot interruption notices to the instances of stack {tag_value} (drill)",
        )
        self.role.add_to_policy(
            iam.PolicyStatement(
                sid="InterruptOwnSpotInstances",
                actions=["ec2:SendSpotInstanceInterruptions"],
                resources=[stack.format_arn(service="ec2", resource="instance", resource_name="*")],
                conditions={"StringEquals": {f"aws:ResourceTag/{STACK_TAG_KEY}": tag_value}},
            )
        )
        self.role.add_to_policy(
            iam.PolicyStatement(sid="FindTargets", actions=["ec2:DescribeInstances"], resources=["*"])
        )
        self.template = fis.CfnExperimentTemplate(
            self,
            "Resource",
            description=f"Spot interruption drill of stack {tag_value}: notice, then interruption after {duration_before_interruption}",
            role_arn=self.role.role_arn,
            stop_conditions=[fis.CfnExperimentTemplate.ExperimentTemplateStopConditionProperty(source="none")],
            targets={
                "SpotInstances": fis.CfnExperimentTemplate.ExperimentTemplateTargetProperty(
                    resource_type="aws:ec2:spot-instance",
                    selection_mode=selection_mode,
                    resource_tags={STACK_TAG_KEY: tag_value},
                    filters=[fis.CfnExperimentTemplate.ExperimentTemplateTargetFilterProperty(path="State.Name", values=["running"])],
                )
            },
            actions={
                "InterruptSpotInstance": fis.CfnExperimentTemplate.ExperimentTemplateActionProperty(
                    action_id="aws:ec2:send-spot-instance-interruptions",
                    parameters={"durationBeforeInterruption": duration_before_interruption},
                    targets={"SpotInstances": "SpotInstances"},
                )
            },
            tags={STACK_TAG_KEY: tag_value, "Name": f"{tag_value}-spot-interruption-drill"},
        )
        self.experiment_template_id: str = self.template.ref
