"""Train deep-learning models on interruptible EC2 Spot capacity.

One namespaced package, so that a CDK app with packages of its own (``infra``, ``training``) can import it:

- :mod:`spot_training.contract`: what the layers share (tag keys, environment variables, file names, exit codes,
  settings and their one validator); standard library only.
- :mod:`spot_training.infra`: AWS CDK v2 constructs and stacks.
- :mod:`spot_training.agent`: the agent every node runs (standard library + boto3), ``python3 -m spot_training.agent``.
- :mod:`spot_training.training`: resumable training inside the user's process (Keras/TensorFlow, MXNet Gluon, PyTorch).
- :mod:`spot_training.local`: local mode (a moto server as AWS, an IMDS emulator, nodes as processes) and the
  ``spot-train`` command line.

Importing this package imports nothing else: the node agent runs without CDK, the trainer without boto3.
"""
