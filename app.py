#!/usr/bin/env python3
"""CDK app: context (cdk.json or ``-c key=value``) -> validated settings -> the two stacks.

``SpotTraining`` (one spot node, infra.stack) and ``DistributedTraining`` (a parameter-server
cluster with elastic spot workers, infra.cluster_stack). No resources are defined here. A bad
context value fails ``cdk synth`` with a message naming the key, the value and what is allowed
(infra.config, infra.cluster_config).
"""

import aws_cdk as cdk

from infra.cluster_config import ClusterSettings
from infra.cluster_stack import DistributedTrainingStack
from infra.config import StackSettings
from infra.nag import apply_nag
from infra.stack import SpotTrainingStack

app = cdk.App()
settings = StackSettings.from_context(app.node.try_get_context)
cluster_settings = ClusterSettings.from_context(app.node.try_get_context)
SpotTrainingStack(app, settings=settings)
DistributedTrainingStack(app, settings=cluster_settings)
apply_nag(app)
app.synth()
