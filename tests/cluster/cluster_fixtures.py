"""The fixtures the cluster story tests share (test_cluster_tf.py and test_cluster_torch.py here,
tests/mxnet/test_cluster_mxnet.py in the MXNet process): import them into the test module.
Kept apart from cluster_harness.py, which bench/bench_elastic.py imports without pytest."""

from __future__ import annotations

import pytest
from cluster_harness import Network


@pytest.fixture(scope="module")
def network():
    """The nodes' network (namespaces on a bridge; loopback fallback), closed after the module."""
    net = Network()
    yield net
    net.close()
