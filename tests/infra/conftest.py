"""Fixtures for the CDK tests: synthesized stacks and a fresh stack per construct test.

Each synth of the full stack costs seconds on 2 cores, so each variant of the stack is synthesized
once per session; construct tests use ``stack``: a fresh, empty stack per test.
"""

from __future__ import annotations

import aws_cdk as cdk
import pytest
from infra_helpers import Synth, synth_cluster, synth_stack

from spot_training.infra.cluster_config import ClusterSettings
from spot_training.infra.config import StackSettings

#: An explicit account and region with three pinned Availability Zones (no lookups).
PINNED_ENVIRONMENT = {"account": "123456789012", "region": "eu-west-1",
                      "availability_zones": ["eu-west-1a", "eu-west-1b", "eu-west-1c"]}


@pytest.fixture(scope="session")
def default_synth(tmp_path_factory: pytest.TempPathFactory) -> Synth:
    """The stack with every default, synthesized once for the session."""
    return synth_stack(tmp_path_factory.mktemp("cdk-default"))


@pytest.fixture(scope="session")
def efs_synth(tmp_path_factory: pytest.TempPathFactory) -> Synth:
    """The stack with ``efs=True``, synthesized once for the session."""
    return synth_stack(tmp_path_factory.mktemp("cdk-efs"), StackSettings.from_mapping({"efs": True}))


@pytest.fixture(scope="session")
def pinned_synth(tmp_path_factory: pytest.TempPathFactory) -> Synth:
    """Explicit account/region, three pinned AZs and non-default capacity settings."""
    settings = StackSettings.from_mapping(
        {
            **PINNED_ENVIRONMENT,
            "instance_types": "g5.xlarge,g4dn.xlarge",
            "target_capacity": "2",
            "allocation_strategy": "capacityOptimized",
            "max_price": "0.9",
            "retain_data": "true",
            "framework": "mxnet",
            "code_git_url": "https://github.com/example/train.git",
            "code_git_ref": "v1.2.0",
            "imds_endpoint": "http://127.0.0.1:18080",
            "vpc_flow_logs": "false",
            "volume_kms_key_arn": "arn:aws:kms:eu-west-1:123456789012:key/1234abcd-12ab-34cd-56ef-1234567890ab",
        }
    )
    return synth_stack(tmp_path_factory.mktemp("cdk-pinned"), settings)


@pytest.fixture(scope="session")
def cluster_synth(tmp_path_factory: pytest.TempPathFactory) -> Synth:
    """The DistributedTraining stack with every default (MXNet), synthesized once for the session."""
    return synth_cluster(tmp_path_factory.mktemp("cdk-cluster"))


@pytest.fixture(scope="session")
def cluster_tf_synth(tmp_path_factory: pytest.TempPathFactory) -> Synth:
    """TensorFlow, pinned environment, 3 servers, 3 workers in 2..5, ports that are not contiguous,
    an own interpreter (so nothing is pip-installed), flow logs off."""
    settings = ClusterSettings.from_mapping(
        {
            **PINNED_ENVIRONMENT,
            "vpc_flow_logs": "false",
            "cluster_stack_name": "TfCluster",
            "cluster_framework": "tensorflow",
            "cluster_num_servers": "3",
            "cluster_workers": "3",
            "cluster_min_workers": "2",
            "cluster_max_workers": "5",
            "cluster_scheduler_instance_type": "m5.2xlarge",
            "cluster_server_instance_type": "c5.2xlarge",
            "cluster_worker_instance_types": "g5.xlarge,g4dn.xlarge",
            "cluster_scheduler_port": "7000",
            "cluster_server_port": "7100",
            "cluster_worker_port": "7101",
            "cluster_training_python": "/opt/tensorflow/bin/python",
            "max_price": "0.9",
        }
    )
    return synth_cluster(tmp_path_factory.mktemp("cdk-cluster-tf"), settings)


@pytest.fixture
def stack() -> cdk.Stack:
    """A fresh, empty stack (environment-agnostic) for construct tests."""
    return cdk.Stack(cdk.App(), "TestStack")
