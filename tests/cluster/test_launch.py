"""spot_training.agent.launch: the DMLC_* environment, TF_CONFIG, the process of each role and the port check."""

from __future__ import annotations

import json
import socket
import subprocess
import sys

import pytest

from spot_training.agent import launch
from spot_training.agent.cluster_state import make_plan

SCHED = {"node_id": "i-s", "host": "10.0.0.2", "port": 9000}
SERVERS = [{"node_id": "i-p1", "host": "10.0.0.3", "port": 9001}, {"node_id": "i-p2", "host": "10.0.0.4", "port": 9001}]
WORKERS = [{"node_id": "i-w10", "host": "10.0.0.10", "port": 9002}, {"node_id": "i-w9", "host": "10.0.0.9", "port": 9002}]


@pytest.fixture
def plan() -> dict:
    return make_plan(generation=3, framework="mxnet", scheduler=SCHED, servers=SERVERS, workers=WORKERS, now=0.0,
                     reason="test").to_dict()


def test_worker_ranks_follow_numeric_address_order_like_ps_lite(plan):
    assert [(w["node_id"], w["rank"]) for w in plan["workers"]] == [("i-w9", 0), ("i-w10", 1)]


def test_dmlc_environment_of_a_worker(plan):
    assert launch.dmlc_environment(plan, "i-w10") == {
        "DMLC_ROLE": "worker", "DMLC_PS_ROOT_URI": "10.0.0.2", "DMLC_PS_ROOT_PORT": "9000", "DMLC_NUM_SERVER": "2",
        "DMLC_NUM_WORKER": "2", "DMLC_NODE_HOST": "10.0.0.10", "PORT": "9002", "PS_VERBOSE": "0"}


def test_dmlc_roles_of_scheduler_and_server(plan):
    assert launch.dmlc_environment(plan, "i-s")["DMLC_ROLE"] == "scheduler"
    server = launch.dmlc_environment(plan, "i-p2")
    assert (server["DMLC_ROLE"], server["DMLC_NODE_HOST"], server["PORT"]) == ("server", "10.0.0.4", "9001")


def test_tf_config_chief_ps_and_worker_indices(plan):
    chief = launch.tf_config(plan, "i-s")
    assert chief == {"cluster": {"chief": ["10.0.0.2:9000"], "ps": ["10.0.0.3:9001", "10.0.0.4:9001"],
                                 "worker": ["10.0.0.9:9002", "10.0.0.10:9002"]}, "task": {"type": "chief", "index": 0}}
    assert launch.tf_config(plan, "i-p2")["task"] == {"type": "ps", "index": 1}
    assert launch.tf_config(plan, "i-w10")["task"] == {"type": "worker", "index": 1}


def test_process_for_mxnet_runs_the_trainer_only_on_workers(plan):
    worker = launch.process_for(plan, "i-w9", framework="mxnet", training_argv=["py", "train.py"], python="py")
    server = launch.process_for(plan, "i-p1", framework="mxnet", training_argv=["py", "train.py"], python="py",
                                launcher=["wrap", "--"])
    assert worker.argv == ["py", "train.py"] and worker.checkpoints
    assert worker.env["SPOT_TRAINING_WORKER_RANK"] == "0" and worker.env["SPOT_TRAINING_GENERATION"] == "3"
    assert server.argv == ["wrap", "--", "py", "-c", "import mxnet"] and not server.checkpoints


def test_process_for_tensorflow_runs_the_trainer_on_the_chief(plan):
    chief = launch.process_for(plan, "i-s", framework="tensorflow", training_argv=["py", "train.py"], python="py")
    ps = launch.process_for(plan, "i-p1", framework="tensorflow", training_argv=["py", "train.py"], python="py")
    assert chief.argv == ["py", "train.py"] and chief.checkpoints
    assert json.loads(chief.env["TF_CONFIG"])["task"] == {"type": "chief", "index": 0}
    assert ps.argv == ["py", "-m", "spot_training.training.distributed.tf_server"] and not ps.checkpoints


def test_fails_when_node_is_not_in_the_plan_or_framework_unknown(plan):
    with pytest.raises(KeyError, match="i-nope"):
        launch.dmlc_environment(plan, "i-nope")
    with pytest.raises(ValueError, match="framework must be 'mxnet' or 'tensorflow', got 'torch'"):
        launch.process_for(plan, "i-s", framework="torch", training_argv=[], python="py")


def test_fails_when_two_members_share_an_address():
    with pytest.raises(ValueError, match="share one host:port"):
        make_plan(generation=1, framework="mxnet", scheduler=SCHED, servers=SERVERS,
                  workers=[dict(WORKERS[0], node_id="a"), dict(WORKERS[0], node_id="b")], now=0.0, reason="")


@pytest.mark.integration
def test_taken_port_is_refused_before_the_framework_starts():
    holder = socket.socket()
    holder.bind(("127.0.0.1", 0))
    holder.listen()
    port = holder.getsockname()[1]
    try:
        with pytest.raises(OSError, match=f"port {port} on 127.0.0.1 is not free"):
            launch.check_port_free("127.0.0.1", port)
        done = subprocess.run([sys.executable, launch.__file__, "exec", "--check-port", f"127.0.0.1:{port}", "--",
                               sys.executable, "-c", "print('ran')"], capture_output=True, text=True, timeout=30)
        assert done.returncode == 75 and "ran" not in done.stdout and "silently binds a random one" in done.stderr
    finally:
        holder.close()
    done = subprocess.run([sys.executable, launch.__file__, "exec", "--check-port", f"127.0.0.1:{port}", "--",
                           sys.executable, "-c", "print('ran')"], capture_output=True, text=True, timeout=30)
    assert done.returncode == 0 and done.stdout.strip() == "ran"
