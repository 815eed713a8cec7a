#!/usr/bin/env python3
"""CDK app: context (cdk.json or ``-c key=value``) -> validated settings -> the two stacks.

``SpotTraining`` (one spot node, spot_training.infra.stack) and ``DistributedTraining`` (a parameter-server
cluster with elastic spot workers, spot_training.infra.cluster_stack). No resources are defined here. A bad or unknown
context value fails ``cdk synth`` with a message naming the key, the value and what is allowed
(spot_training.infra.config, spot_training.infra.cluster_config).
"""

import aws_cdk as cdk

from spot_training.infra.cluster_config import ClusterSettings
from spot_training.infra.cluster_stack import DistributedTrainingStack
from spot_training.infra.config import StackSettings, check_context_keys
from spot_training.infra.nag import apply_nag
from spot_training.infra.stack import SpotTrainingStack

app = cdk.App()
# A misspelled key (-c max_workrs=3) fails synth naming the nearest known one instead of being ignored.
check_context_keys(app.node.get_all_context(), StackSettings.context_keys + ClusterSettings.context_keys)
settings = StackSettings.from_context(app.node.try_get_context)
cluster_settings = ClusterSettings.from_context(app.node.try_get_context)
SpotTrainingStack(app, settings=settings)
DistributedTrainingStack(app, settings=cluster_settings)
apply_nag(app)
app.synth()
