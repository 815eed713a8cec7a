#!/usr/bin/env python3
"""CDK app: context (cdk.json or ``-c key=value``) -> validated settings -> the SpotTraining stack.

No resources are defined here. A bad context value fails ``cdk synth`` with a message naming the
key, the value and what is allowed (infra.config).
"""

import aws_cdk as cdk

from infra.config import StackSettings
from infra.nag import apply_nag
from infra.stack import SpotTrainingStack

app = cdk.App()
settings = StackSettings.from_context(app.node.try_get_context)
SpotTrainingStack(app, settings=settings)
apply_nag(app)
app.synth()
