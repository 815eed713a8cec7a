"""Cluster nodes honour the node config's ``notice_poll_interval_s`` (it was once a fixed
5 s there while single nodes read the config)."""

from __future__ import annotations

from pathlib import Path

import spot_training.agent.cluster
import spot_training.agent.workspace
from spot_training.agent.config import parse_config


def _worker_config(root: Path, poll: float) -> dict:
    efs = root / "efs"
    return {
        "schema_version": 1, "region": "us-east-1", "stack_name": "DistributedTraining", "node_role": "worker",
        "volume": {"tags": {"spot-training:stack": "DistributedTraining", "spot-training:purpose": "data-volume"},
                   "device_name": "/dev/sdf", "mount_point": str(root / "dltraining")},
        "efs": {"file_system_id": "fs-0123abcd", "access_point_id": None, "mount_point": str(efs)},
        "training": {"framework": "mxnet", "python": "/usr/bin/python3", "command": ["{python}", "-m", "x"],
                     "user": "ubuntu", "dataset_dir": str(efs / "datasets"), "checkpoint_dir": str(efs / "checkpoints"),
                     "log_dir": str(efs / "logs"), "code": {"type": "asset", "path": str(root)}},
        "cleanup": {"cancel_fleet_on_success": True}, "imds_endpoint": None,
        "notice_poll_interval_s": poll,
        "cluster": {"state_dir": str(efs / "cluster"), "num_servers": 1, "min_workers": 1},
    }


def test_a_cluster_worker_polls_for_notices_at_the_configured_interval(tmp_path: Path, monkeypatch) -> None:
    seen: dict = {}

    class FakeWorkspace:
        def __init__(self, config, **_):
            self.config = config

        def prepare_code(self):
            return tmp_path

        def prepare_environment(self):
            return "/usr/bin/python3"

        def user(self):
            return None

        def trainer_environment(self):
            return {}

    class FakeAgent:
        leave_reason = None

        def __init__(self, settings, **kwargs):
            seen.update(kwargs)

        def request_stop(self):
            pass

        def run(self):
            return "completed"

    class FakeImds:
        def private_ipv4(self):
            return "10.0.0.5"

    monkeypatch.setattr(spot_training.agent.workspace, "Workspace", FakeWorkspace)
    monkeypatch.setattr(spot_training.agent.cluster, "NodeAgent", FakeAgent)
    monkeypatch.delenv("AWS_ENDPOINT_URL", raising=False)
    config = parse_config(_worker_config(tmp_path, 2.5))
    assert spot_training.agent.cluster.run_node(config, FakeImds(), instance_id="i-1", local_mode=True) == "completed"
    assert seen["monitor_interval_s"] == 2.5
