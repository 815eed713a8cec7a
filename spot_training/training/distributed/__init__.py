"""Parameter-server training on a cluster whose membership changes by generations (docs/cluster.md).

- :mod:`spot_training.training.distributed.mxnet_dist`: MXNet ``dist_sync`` Gluon trainer (``update_on_kvstore=False``,
  rank 0 checkpoints through :mod:`spot_training.training.mxnet_adapter`), the worker command of an MXNet cluster.
- :mod:`spot_training.training.distributed.tf_pss`: TensorFlow ``ParameterServerStrategy`` + ``ClusterCoordinator``
  custom loop with its own step variable (the chief checkpoints), the chief command of a TF cluster.
- :mod:`spot_training.training.distributed.tf_server`: the ps/worker process of a TF cluster (a ``tf.distribute.Server``).
- :mod:`spot_training.training.distributed.lr`: linear learning-rate scaling with warm-up by worker count.
- :mod:`spot_training.training.distributed.common`: what both trainers share (arguments, data shards, step log).

Importing this package imports no framework (MXNet and TensorFlow never share a process).
"""
