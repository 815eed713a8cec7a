#!/usr/bin/env python3
"""CDK app: context (cdk.json or ``-c key=value``) -> validated settings -> the three stacks.

``SpotTraining`` (one spot node, spot_training.infra.stack) and ``DistributedTraining`` (a parameter-server
cluster with elastic spot workers, spot_training.infra.cluster_stack) and ``SpotSweep`` (parameter sweeps as
AWS Batch array jobs, spot_training.infra.sweep). No resources are defined here. A bad
context value fails ``cdk synth`` with a message naming the key, the value and what is allowed
(spot_training.infra.config, spot_training.infra.cluster_config).
"""

import aws_cdk as cdk

from spot_training.infra.cluster_config import ClusterSettings
from spot_training.infra.cluster_stack import DistributedTrainingStack
from spot_training.infra.config import StackSettings
from spot_training.infra.nag import apply_nag
from spot_training.infra.stack import SpotTrainingStack
from spot_training.infra.sweep import SpotSweepStack, SweepSettings

app = cdk.App()
settings = StackSettings.from_context(app.node.try_get_context)
cluster_settings = ClusterSettings.from_context(app.node.try_get_context)
SpotTrainingStack(app, settings=settings)
DistributedTrainingStack(app, settings=cluster_settings)
SpotSweepStack(app, settings=SweepSettings.from_context(app.node.try_get_context))
apply_nag(app)
app.synth()
