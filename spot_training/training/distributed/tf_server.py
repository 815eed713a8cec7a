"""A TensorFlow parameter-server cluster's ``ps`` or ``worker`` task: one ``tf.distribute.Server`` that joins.

    TF_CONFIG='{"cluster": {...}, "task": {"type": "ps", "index": 0}}' python -m spot_training.training.distributed.tf_server

Started by the node agent (spot_training/agent/launch.py) with the plan's ``TF_CONFIG``. Threads: intra-op 1
(fastest on small nodes), inter-op left to TensorFlow (``inter_op_parallelism_threads=1`` on a ps task
hangs the cluster; docs/architecture.md, "Framework facts that shaped the code"). The gRPC server listens on all interfaces: on AWS
the security group admits only cluster members; in tests each node has its own network namespace.
SIGTERM ends it (the default action): the variables on a ps task are lost, and the next generation
restores them from the chief's checkpoint.
"""

from __future__ import annotations

import logging
import os
import sys


def main() -> int:
    """Start this node's ``tf.distribute.Server`` for the ``TF_CONFIG`` task and serve until the process ends.

    Returns:
        78 when ``TF_CONFIG``'s task type is not ``ps`` or ``worker``; otherwise it does not return
        (``server.join()``) until the process is signalled.
    """
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    import tensorflow as tf

    resolver = tf.distribute.cluster_resolver.TFConfigClusterResolver()
    if resolver.task_type not in ("ps", "worker"):
        print(f"tf_server: TF_CONFIG task type must be 'ps' or 'worker', got {resolver.task_type!r}", file=sys.stderr)
        return 78
    config = tf.compat.v1.ConfigProto(intra_op_parallelism_threads=1)
    server = tf.distribute.Server(resolver.cluster_spec(), job_name=resolver.task_type, task_index=resolver.task_id,
                                  protocol=resolver.rpc_layer or "grpc", config=config, start=True)
    logging.getLogger("training.tf_server").info("%s %d serving at %s", resolver.task_type, resolver.task_id,
                                                 server.target)
    server.join()
    return 0


if __name__ == "__main__":
    sys.exit(main())
