"""spot_training.local.cluster_drill's pieces without a cluster: options, the loopback port offset of a cluster node,
membership counting, the pass rule, the CLI's --cluster option errors."""

from __future__ import annotations

import json
import re
import sys

import pytest

from spot_training.cli import main
from spot_training.agent.config import load_config, with_port_offset, with_root
from spot_training.agent.errors import ConfigError
from spot_training.infra.userdata import node_config
from spot_training.local.cluster_drill import ClusterDrillOptions, cluster_passed, membership_changes, world_size_changes, \
    world_size_generations
from spot_training.local.drill import REPO_ROOT

DEPLOYED = {
    "schema_version": 1, "region": "us-east-1", "stack_name": "DistributedTraining", "node_role": "worker",
    "volume": {"mount_point": "/dltraining"},
    "efs": {"file_system_id": "fs-1", "access_point_id": "fsap-1", "mount_point": "/mnt/efs"},
    "training": {"python": "/usr/bin/python3", "command": ["{python}", "-m", "spot_training.training.distributed.mxnet_dist"],
                 "dataset_dir": "/mnt/efs/datasets", "checkpoint_dir": "/mnt/efs/checkpoints", "log_dir": "/mnt/efs/logs",
                 "code": {"type": "asset", "path": "/opt/spot-training/code"}},
    "cluster": {"state_dir": "/mnt/efs/cluster", "num_servers": 1, "scheduler_port": 9000, "server_port": 9001,
                "worker_port": 9002},
    "imds_endpoint": None,
}


def test_the_port_offset_moves_only_the_cluster_ports_as_the_agent_loads_the_config(tmp_path):
    # Loopback fallback (no network namespaces): each node's agent gets SPOT_TRAINING_PORT_OFFSET and
    # listens on ports of its own; the config the user data wrote stays as deployed.
    config = json.loads(json.dumps(with_port_offset(with_root(DEPLOYED, tmp_path / "root"), "20")))
    assert [config["cluster"][k] for k in ("scheduler_port", "server_port", "worker_port")] == [9020, 9021, 9022]
    assert config["cluster"]["state_dir"] == f"{tmp_path}/root/mnt/efs/cluster"
    assert config["efs"] == {**DEPLOYED["efs"], "mount_point": f"{tmp_path}/root/mnt/efs"}
    assert DEPLOYED["cluster"]["worker_port"] == 9002  # the input is not changed
    assert with_port_offset(DEPLOYED, None) is DEPLOYED and with_port_offset(DEPLOYED, "") is DEPLOYED
    # The agent's own loading: a config as the stack writes it (spot_training.infra.userdata.node_config).
    path = tmp_path / "config.json"
    path.write_text(json.dumps(node_config(
        region="us-east-1", stack_name="DistributedTraining",
        volume_tags={"spot-training:stack": "DistributedTraining", "spot-training:purpose": "data-volume"},
        framework="mxnet", python="/usr/bin/python3", command=["{python}", "-m", "spot_training.training.distributed.mxnet_dist"],
        node_role="worker", data_root="/mnt/efs", cluster=DEPLOYED["cluster"],
        efs={"file_system_id": "fs-0123abcd", "access_point_id": "fsap-0123abcd", "mount_point": "/mnt/efs"})))
    loaded = load_config(path, root=tmp_path / "root", port_offset="30")
    cluster = loaded.extensions["cluster"]
    assert cluster["worker_port"] == 9032 and cluster["state_dir"] == f"{tmp_path}/root/mnt/efs/cluster"
    assert loaded.efs.mount_point == tmp_path / "root" / "mnt" / "efs"


@pytest.mark.parametrize("bad", ["x", "-1", "10001", "1.5"])
def test_a_bad_port_offset_is_a_config_error_naming_the_variable(bad):
    with pytest.raises(ConfigError, match=f"SPOT_TRAINING_PORT_OFFSET='{re.escape(bad)}': expected an integer 0..10000"):
        with_port_offset(DEPLOYED, bad)


def test_membership_changes_count_workers_between_running_generations():
    events = [
        {"generation": 1, "state": "running", "workers": ["a", "b"]},
        {"generation": 1, "state": "checkpoint", "workers": ["a", "b"]},
        {"generation": 2, "state": "running", "workers": ["a", "b", "c"]},
        {"generation": 3, "state": "running", "workers": ["b", "c"]},
        {"generation": 4, "state": "running", "workers": ["b", "c", "d"]},
        {"generation": 4, "state": "completed", "workers": ["b", "c", "d"]},
    ]
    assert membership_changes(events) == (2, 1, 4)
    assert membership_changes([]) == (0, 0, 0)


def _report(**changes):
    report = {"completed": True, "error": None, "steps_total": 800, "steps_executed": 800, "distinct_steps": 800,
              "lost_steps": 0, "joins": 2, "leaves": 1, "max_workers_seen": 3, "fleet_cancelled_on_completion": True,
              "orphans_after_destroy": [], "aws_interruptions": [{"instance_id": "i-1"}], "cost": {"rows": []},
              "read_back_error": None}
    report.update(changes)
    return report


@pytest.mark.parametrize("changes", [
    {"completed": False}, {"steps_total": 799}, {"steps_executed": 801, "lost_steps": 1}, {"distinct_steps": 799},
    {"joins": 0}, {"leaves": 0}, {"max_workers_seen": 2}, {"fleet_cancelled_on_completion": False},
    {"orphans_after_destroy": ["instance i-1 (running)"]}, {"orphans_after_destroy": None}, {"error": "boom"},
    {"read_back_error": "OperationsError: boom"}, {"cost": None}, {"aws_interruptions": []},
])
def test_cluster_drill_fails_on_any_shortfall(changes):
    options = ClusterDrillOptions()
    assert cluster_passed(_report(), options) is True
    assert cluster_passed(_report(**changes), options) is False


@pytest.mark.parametrize(("changes", "message"), [
    ({"steps": 0}, r"steps must be an integer >= 1, got 0"),
    ({"workers": True}, r"workers must be an integer >= 1, got True"),
    ({"workers": 8}, r"workers must be at most 7"),
    ({"join_after_steps": 900}, r"join_after_steps must be below steps=800, got 900"),
    ({"stack": "9x"}, r"stack must be a CloudFormation stack name"),
    ({"timeout_s": float("nan")}, r"timeout_s must be > 0 seconds, got nan"),
    ({"min_step_seconds": -0.1}, r"min_step_seconds must be >= 0 seconds, got -0.1"),
    # The cost read-back needs a price for every worker type that runs (the drills share the check).
    ({"on_demand_prices": {"g5.xlarge": 1.0, "g4dn.xlarge": True}}, r"on_demand_prices must give a positive USD/hour"),
])
def test_fails_when_cluster_drill_options_are_bad(changes, message):
    with pytest.raises(ValueError, match=message):
        ClusterDrillOptions(**changes).validate()


def test_cli_cluster_drill_rejects_bad_options_before_starting_anything(tmp_path, capsys):
    assert main(["local", "drill", "--cluster", "--steps", "0", "--work-dir", str(tmp_path / "w")]) == 2
    assert "steps must be an integer >= 1, got 0" in capsys.readouterr().err
    assert not (tmp_path / "w").exists()


@pytest.mark.integration  # the framework commands live in infra.config, which starts jsii's Node.js
def test_the_deployed_trainer_command_carries_the_step_count():
    options = ClusterDrillOptions(steps=123)
    assert options.trainer_command()[:5] == ["{python}", "-m", "spot_training.training.distributed.mxnet_dist", "--steps", "123"]
    context = options.context()
    assert context["cluster_framework"] == "mxnet" and context["cluster_training_requirements"] == "[]"
    assert context["cluster_workers"] == "2"


@pytest.mark.integration  # the framework commands live in infra.config, which starts jsii's Node.js
def test_pytorch_cluster_drill_deploys_torchelastic_with_its_own_interpreter():
    options = ClusterDrillOptions(framework="pytorch", steps=321)
    assert options.trainer_command()[:5] == ["{python}", "-m", "spot_training.training.distributed.torch_ddp", "--steps", "321"]
    context = options.context()
    assert context["cluster_framework"] == "pytorch"
    assert context["cluster_training_python"] == str(REPO_ROOT / ".venv-torch" / "bin" / "python")
    assert options.settings.group_roles == ("scheduler",)  # no parameter-server group for PyTorch
    assert context["cluster_min_workers"] == "2"  # torchrun starts with both workers, not the first one up
    # The default stays MXNet on this interpreter, with its scheduler and servers.
    default = ClusterDrillOptions()
    assert default.framework == "mxnet" and default.context()["cluster_training_python"] == sys.executable
    assert default.settings.group_roles == ("scheduler", "server") and "cluster_min_workers" not in default.context()


def test_cluster_drill_refuses_an_unknown_framework_and_a_missing_environment(monkeypatch, tmp_path):
    import spot_training.local.drill as drill

    with pytest.raises(ValueError, match="framework must be one of mxnet, pytorch, got 'tensorflow'"):
        ClusterDrillOptions(framework="tensorflow").validate()
    monkeypatch.setitem(drill.DRILL_FRAMEWORKS, "pytorch",
                        drill.DrillFramework(str(tmp_path / "absent" / "python"), "--save-final-weights", "x"))
    with pytest.raises(ValueError, match=r"framework 'pytorch' trains with .*absent/python, which does not exist"):
        ClusterDrillOptions(framework="pytorch").validate()


def _row(step, num_workers, rank="0"):
    return {"step": str(step), "generation": "0", "rank": rank, "num_workers": str(num_workers), "loss": "1.0",
            "learning_rate": "0.1", "wall_time": f"{1000 + step}.0", "node": "pid-1"}


def test_pytorch_generations_are_numbered_where_the_world_size_changes():
    # 2 workers, a third joins, one leaves, the replacement joins; rank 1's rows and a same-size
    # restart (step 5 after step 4 at 3 ranks) begin nothing.
    rows = [_row(1, 2), _row(1, 2, rank="1"), _row(2, 2), _row(3, 3), _row(3, 3, rank="2"), _row(4, 3), _row(5, 3),
            _row(6, 2), _row(7, 3)]
    generations = world_size_generations(rows)
    assert [(g["generation"], g["num_workers"], [int(r["step"]) for r in g["rows"]]) for g in generations] == [
        (1, 2, [1, 2]), (2, 3, [3, 4, 5]), (3, 2, [6]), (4, 3, [7])]
    assert {r["generation"] for r in generations[1]["rows"]} == {"2"}
    assert world_size_changes(generations) == (2, 1, 4)
    assert world_size_changes(world_size_generations([])) == (0, 0, 0)
