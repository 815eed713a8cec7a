"""AWS CDK constructs and stacks for deep-learning training on EC2 Spot capacity.

``from spot_training.infra import TrainingJob, SpotTrainingFleet, TrainingVolume, ...`` (see docs/infra.md). Exports load
lazily (PEP 562), so ``from spot_training.infra.userdata import extract_config`` does not start aws-cdk-lib.
"""

from __future__ import annotations

import importlib
from typing import Any

_EXPORTS = {
    "AllocationStrategy": "fleet",
    "SpotTrainingFleet": "fleet",
    "DEFAULT_INSTANCE_TYPES": "fleet",
    "SpotInterruptionDrill": "fis",
    "TrainingVolume": "volume",
    "SharedFileSystem": "filesystem",
    "TrainingNodeRole": "roles",
    "SpotFleetRole": "roles",
    "BootstrapAsset": "asset",
    "DataCleanup": "cleanup",
    "SpotTrainingStack": "stack",
    "TrainingJob": "job",
    "ParameterServerCluster": "cluster",
    "ClusterPorts": "cluster",
    "Framework": "cluster",
    "DistributedTrainingStack": "cluster_stack",
    "ClusterSettings": "cluster_config",
    "CLUSTER_CONTEXT_KEYS": "cluster_config",
    "StackSettings": "config",
    "CONTEXT_KEYS": "config",
    "extract_config": "userdata",
    "node_config": "userdata",
    "apply_nag": "nag",
    "STACK_TAG_KEY": "tags",
    "PURPOSE_TAG_KEY": "tags",
    "CLUSTER_MEMBER_TAG_KEY": "tags",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'infra' has no attribute {name!r}")
    return getattr(importlib.import_module(f".{module}", __name__), name)


def __dir__() -> list[str]:
    return __all__
