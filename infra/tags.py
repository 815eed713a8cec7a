"""Stack-scoped tag keys and values shared by the constructs (docs/contracts.md, "Resource tags").

The node agents find the data volume by these tags and every IAM condition of ours tests them, so
they are API: changing one strands the volumes and snapshots that already carry the old tags.
"""

from __future__ import annotations

#: Tag key carried by every resource the stack or its agents create; value: the stack name.
STACK_TAG_KEY = "spot-training:stack"
#: Tag key that says what a volume or snapshot is for.
PURPOSE_TAG_KEY = "spot-training:purpose"
#: ``spot-training:purpose`` value on the data volume and on every moved copy of it.
PURPOSE_DATA_VOLUME = "data-volume"
#: ``spot-training:purpose`` value on the snapshots the agent takes to move the volume.
PURPOSE_MIGRATION_SNAPSHOT = "migration-snapshot"
#: The agent's bookkeeping tags on the data volume, its copies and snapshots (docs/contracts.md, the
#: second table of "Resource tags"): the only tags a node may delete (infra.roles).
AGENT_BOOKKEEPING_TAG_KEYS: tuple[str, ...] = (
    "spot-training:lease",
    "spot-training:source-volume",
    "spot-training:source-snapshot",
    "spot-training:move-state",
    "spot-training:created-by",
    "spot-training:failed-boots",
)
#: Tag on every cluster worker instance; removing it asks the worker to leave (the Dynamic Training
#: article's mechanism; ``cluster.member_tag`` in the node config, docs/contracts.md).
CLUSTER_MEMBER_TAG_KEY = "spot-training:cluster-member"
#: Its value (the agent tests only that the key is present).
CLUSTER_MEMBER_TAG_VALUE = "true"
