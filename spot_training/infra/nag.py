"""cdk-nag (``AwsSolutionsChecks``) for our stacks.

The acknowledgements themselves live on the constructs (:mod:`spot_training.infra.acknowledgements`:
each construct attaches its own, with reasons, so a consumer's own ``AwsSolutionsChecks`` over an app
holding them reports nothing unexplained). cdk-nag v2 (``NagSuppressions``) is pinned in
requirements.txt; v3 replaced the API with ``Validations.of(x).acknowledge``. Each acknowledgement
names exactly the finding it covers (``applies_to``), so a new wildcard still fails synth.
"""

from __future__ import annotations

import aws_cdk as cdk
import cdk_nag
import constructs

from .acknowledgements import NAG
from .cluster import ParameterServerCluster
from .cleanup import DataCleanup
from .cluster_stack import DistributedTrainingStack
from .fis import SpotInterruptionDrill
from .roles import SpotFleetRole, TrainingNodeRole
from .stack import SpotTrainingStack

_TYPES = {t.__name__: t for t in (TrainingNodeRole, SpotFleetRole, DataCleanup, SpotInterruptionDrill, ParameterServerCluster)}
#: (construct type, rule id, applies_to, reason): the table of :data:`acknowledgements.NAG`, for callers
#: of the first version.
ACKNOWLEDGEMENTS: tuple[tuple[type, str, list[object], str], ...] = tuple(
    (_TYPES[kind], ack.rule, list(ack.applies_to), ack.reason) for kind, acks in NAG.items() for ack in acks
)


def apply_nag(scope: cdk.App | cdk.Stack, *, verbose: bool = True) -> None:
    """Run ``AwsSolutionsChecks`` on ``scope`` at synth time and acknowledge our known findings.

    Unacknowledged findings become error annotations, which fail ``cdk synth``.

    Args:
        scope: the app or stack to check.
        verbose: cdk-nag's verbose messages (the rule's explanation; default True).
    """
    cdk.Aspects.of(scope).add(cdk_nag.AwsSolutionsChecks(verbose=verbose))
    acknowledge(scope)


#: Only when the user turned flow logs off (``-c vpc_flow_logs=false``, e.g. local mode on moto).
FLOW_LOGS_OFF_REASON = (
    "VPC flow logs were turned off on purpose with the vpc_flow_logs context key; they are on by default."
)


def acknowledge(scope: constructs.IConstruct) -> None:
    """Acknowledge the findings that depend on a user's choice under ``scope`` (VPC flow logs turned off).

    The constructs' own acknowledgements need no call: each attaches them itself.
    """
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
