"""Stack-scoped tag keys and values shared by the constructs (docs/contracts.md, "Resource tags").

The node agents find the data volume by these tags and every IAM condition of ours tests them, so
they are API: changing one strands the volumes and snapshots that already carry the old tags. They
are defined once, in the contract between the layers (:mod:`spot_training.contract`); these are the names the
constructs have always imported.
"""

from __future__ import annotations

from spot_training.contract import (
    AGENT_BOOKKEEPING_TAG_KEYS,
    CLUSTER_MEMBER_TAG_VALUE,
)
from spot_training.contract import CLUSTER_MEMBER_TAG as CLUSTER_MEMBER_TAG_KEY
from spot_training.contract import DATA_VOLUME_PURPOSE as PURPOSE_DATA_VOLUME
from spot_training.contract import DEPLOYMENT_TAG as DEPLOYMENT_TAG_KEY
from spot_training.contract import MIGRATION_SNAPSHOT_PURPOSE as PURPOSE_MIGRATION_SNAPSHOT
from spot_training.contract import PURPOSE_TAG as PURPOSE_TAG_KEY
from spot_training.contract import STACK_TAG as STACK_TAG_KEY

__all__ = [
    "AGENT_BOOKKEEPING_TAG_KEYS", "CLUSTER_MEMBER_TAG_KEY", "CLUSTER_MEMBER_TAG_VALUE", "DEPLOYMENT_TAG_KEY", "PURPOSE_DATA_VOLUME",
    "PURPOSE_MIGRATION_SNAPSHOT", "PURPOSE_TAG_KEY", "STACK_TAG_KEY", "deployment_tag_value",
]


def deployment_tag_value() -> str:
    """The ``spot-training:deployment`` value of the current stack: a token for the UUID part of
    ``AWS::StackId`` (``arn:aws:cloudformation:<region>:<account>:stack/<name>/<uuid>``), resolved by
    CloudFormation at deploy time. Raises nothing."""
    import aws_cdk as cdk

    return cdk.Fn.select(2, cdk.Fn.split("/", cdk.Aws.STACK_ID))
