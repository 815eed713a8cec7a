"""localmode.cluster_drill's pieces without a cluster: options, the local config of a cluster node,
membership counting, the pass rule, the CLI's --cluster option errors."""

from __future__ import annotations

import sys

import pytest

from localmode.cli import main
from localmode.cluster_drill import ClusterDrillOptions, cluster_passed, local_cluster_config, membership_changes, \
    world_size_changes, world_size_generations
from localmode.drill import REPO_ROOT
from localmode.nodes import NodeError

DEPLOYED = {
    "schema_version": 1, "region": "us-east-1", "stack_name": "DistributedTraining", "node_role": "worker",
    "volume": {"mount_point": "/dltraining"},
    "efs": {"file_system_id": "fs-1", "access_point_id": "fsap-1", "mount_point": "/mnt/efs"},
    "training": {"python": "/usr/bin/python3", "command": ["{python}", "-m", "training.distributed.mxnet_dist"],
                 "dataset_dir": "/mnt/efs/datasets", "checkpoint_dir": "/mnt/efs/checkpoints", "log_dir": "/mnt/efs/logs",
                 "code": {"type": "asset", "path": "/opt/spot-training/code"}},
    "cluster": {"state_dir": "/mnt/efs/cluster", "num_servers": 1, "scheduler_port": 9000, "server_port": 9001,
                "worker_port": 9002},
    "imds_endpoint": None,
}


def test_local_cluster_config_shares_one_efs_dir_and_keeps_the_deployed_config(tmp_path):
    config = local_cluster_config(DEPLOYED, efs_dir=tmp_path / "efs", code_dir=tmp_path / "code",
                                  imds_endpoint="http://127.0.0.1:1234", python="/venv/python", port_offset=20)
    efs = str(tmp_path / "efs")
    assert config["efs"]["mount_point"] == efs and config["cluster"]["state_dir"] == f"{efs}/cluster"
    assert config["training"]["checkpoint_dir"] == f"{efs}/checkpoints"
    assert config["training"]["python"] == "/venv/python"
    assert config["training"]["code"] == {"type": "asset", "path": str(tmp_path / "code")}
    assert config["imds_endpoint"] == "http://127.0.0.1:1234"
    assert [config["cluster"][k] for k in ("scheduler_port", "server_port", "worker_port")] == [9020, 9021, 9022]
    assert config["efs"]["access_point_id"] == "fsap-1"
    assert DEPLOYED["training"]["checkpoint_dir"] == "/mnt/efs/checkpoints"  # the input is not changed


def test_fails_when_the_launch_template_config_is_not_a_cluster_nodes(tmp_path):
    with pytest.raises(NodeError, match="lacks a cluster or training section"):
        local_cluster_config({**DEPLOYED, "cluster": None}, efs_dir=tmp_path, code_dir=tmp_path, imds_endpoint="http://x")


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
])
def test_fails_when_cluster_drill_options_are_bad(changes, message):
    with pytest.raises(ValueError, match=message):
        ClusterDrillOptions(**changes).validate()


def test_cli_cluster_drill_rejects_bad_options_before_starting_anything(tmp_path, capsys):
    assert main(["local", "drill", "--cluster", "--steps", "0", "--work-dir", str(tmp_path / "w")]) == 2
    assert "steps must be an integer >= 1, got 0" in capsys.readouterr().err
    assert not (tmp_path / "w").exists()


def test_the_deployed_trainer_command_carries_the_step_count():
    options = ClusterDrillOptions(steps=123)
    assert options.trainer_command()[:5] == ["{python}", "-m", "training.distributed.mxnet_dist", "--steps", "123"]
    context = options.context()
    assert context["cluster_framework"] == "mxnet" and context["cluster_training_requirements"] == "[]"
    assert context["cluster_workers"] == "2"


def test_pytorch_cluster_drill_deploys_torchelastic_with_its_own_interpreter():
    options = ClusterDrillOptions(framework="pytorch", steps=321)
    assert options.trainer_command()[:5] == ["{python}", "-m", "training.distributed.torch_ddp", "--steps", "321"]
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
    import localmode.drill as drill

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
