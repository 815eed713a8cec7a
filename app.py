#!/usr/bin/env python3
"""CDK app: context (cdk.json or ``-c key=value``) -> validated settings -> the three stacks.

``SpotTraining`` (one spot node, spot_training.infra.stack) and ``DistributedTraining`` (a parameter-server
cluster with elastic spot workers, spot_training.infra.cluster_stack) and ``SpotSweep`` (parameter sweeps as
AWS Batch array jobs, spot_training.infra.sweep). No resources are defined here. A bad or unknown
context value fails ``cdk synth`` with a message naming the key, the value and what is allowed
(spot_training.infra.config, spot_training.infra.cluster_config).
"""

import os

# jsii prints a Node.js version banner as raw bytes on every synth unless told not to (read at its start).
os.environ.setdefault("JSII_SILENCE_WARNING_DEPRECATED_NODE_VERSION", "1")
os.environ.setdefault("JSII_SILENCE_WARNING_UNTESTED_NODE_VERSION", "1")
os.environ.setdefault("JSII_SILENCE_WARNING_END_OF_LIFE_NODE_VERSION", "14,16,18,20")  # as spot_training/cli.py

import aws_cdk as cdk  # noqa: E402

from spot_training.infra.cluster_config import ClusterSettings  # noqa: E402
from spot_training.infra.cluster_stack import DistributedTrainingStack  # noqa: E402
from spot_training.infra.config import StackSettings, check_context_keys  # noqa: E402
from spot_training.infra.nag import apply_nag  # noqa: E402
from spot_training.infra.stack import SpotTrainingStack  # noqa: E402
from spot_training.infra.sweep import SpotSweepStack, SweepSettings  # noqa: E402

app = cdk.App()
# A misspelled key (-c max_workrs=3) fails synth naming the nearest known one instead of being ignored.
check_context_keys(app.node.get_all_context(),
                   StackSettings.context_keys + ClusterSettings.context_keys + SweepSettings.context_keys)
settings = StackSettings.from_context(app.node.try_get_context)
cluster_settings = ClusterSettings.from_context(app.node.try_get_context)
SpotTrainingStack(app, settings=settings)
DistributedTrainingStack(app, settings=cluster_settings)
SpotSweepStack(app, settings=SweepSettings.from_context(app.node.try_get_context))
apply_nag(app)
app.synth()
