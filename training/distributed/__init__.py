"""Parameter-server training on a cluster whose membership changes by generations (docs/cluster.md).

- :mod:`training.distributed.mxnet_dist`: MXNet ``dist_sync`` Gluon trainer (``update_on_kvstore=False``,
  rank 0 checkpoints through :mod:`training.mxnet_adapter`), the worker command of an MXNet cluster.
- :mod:`training.distributed.tf_pss`: TensorFlow ``ParameterServerStrategy`` + ``ClusterCoordinator``
  custom loop with its own step variable (the chief checkpoints), the chief command of a TF cluster.
- :mod:`training.distributed.tf_server`: the ps/worker process of a TF cluster (a ``tf.distribute.Server``).
- :mod:`training.distributed.lr`: linear learning-rate scaling with warm-up by worker count.
- :mod:`training.distributed.common`: what both trainers share (arguments, data shards, step log).

Importing this package imports no framework (MXNet and TensorFlow never share a process).
"""
