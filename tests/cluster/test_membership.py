"""spot_training.agent.cluster_coordinator: the coordinator's generations with a fake clock over real files (tmp dir = EFS)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from spot_training.agent.cluster_coordinator import Coordinator
from spot_training.agent.cluster_state import (CHECKPOINT, COMPLETED, RUNNING, TEARDOWN, WAITING, ClusterConfig, ClusterState,
                                     settings_from_config)
from spot_training.agent.interruption import MemberTagMonitor
from spot_training.agent.errors import ConfigError


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


class World:
    """Registrations and heartbeats written the way the agents write them."""

    def __init__(self, root: Path, framework: str = "mxnet") -> None:
        self.clock = Clock()
        self.settings = ClusterConfig(state_dir=root, num_servers=2, heartbeat_timeout_s=10.0, debounce_s=3.0,
                                        stop_timeout_s=60.0)
        self.state = ClusterState(root)
        self.done = False
        self.coord = Coordinator(self.state, self.settings, framework=framework, node_id="i-sched",
                                 completed=lambda: self.done, clock=self.clock)
        self.nodes: dict[str, dict] = {}

    def add(self, node_id: str, role: str, host: str, *, data_ready: bool = True) -> None:
        reg = {"node_id": node_id, "instance_id": node_id, "role": role, "host": host, "port": 9000,
               "data_ready": data_ready, "leaving": False, "registered_at": self.clock.now}
        self.nodes[node_id] = reg
        self.state.register(reg)
        self.beat(node_id)

    def beat(self, node_id: str, *, proc: str = "none", generation: int = 0) -> None:
        self.state.heartbeat({"node_id": node_id, "time": self.clock.now, "generation": generation, "proc": proc,
                              "returncode": 0 if proc == "exited" else None, "pid": None})

    def beat_all(self, proc: str, generation: int, *, only=None, skip=()) -> None:
        for node_id in only or self.nodes:
            if node_id not in skip:
                self.beat(node_id, proc=proc, generation=generation)

    def tick(self, advance: float = 0.0):
        self.clock.now += advance
        return self.coord.tick()


@pytest.fixture
def world(tmp_path) -> World:
    w = World(tmp_path)
    w.add("i-sched", "scheduler", "10.0.0.2")
    w.add("i-p1", "server", "10.0.0.3")
    w.add("i-p2", "server", "10.0.0.4")
    w.add("i-w1", "worker", "10.0.0.5")
    w.add("i-w2", "worker", "10.0.0.6")
    return w


def _start(world: World):
    world.tick()
    plan = world.tick(3.0)
    assert plan.generation == 1
    return plan


def _running(world: World, generation: int) -> None:
    world.beat_all("running", generation)


def test_first_generation_waits_for_debounce_then_plans_every_ready_node(world):
    assert world.tick() is None
    plan = world.tick(3.0)
    assert (plan.generation, plan.state) == (1, RUNNING)
    assert plan.membership() == (("i-p1", "i-p2"), ("i-w1", "i-w2"))
    assert json.loads((world.state.root / "plan.json").read_text())["generation"] == 1


def test_worker_without_its_data_is_not_planned(tmp_path):
    w = World(tmp_path)
    w.add("i-sched", "scheduler", "10.0.0.2")
    w.add("i-p1", "server", "10.0.0.3")
    w.add("i-p2", "server", "10.0.0.4")
    w.add("i-w1", "worker", "10.0.0.5", data_ready=False)
    assert w.tick(5.0) is None
    w.add("i-w1", "worker", "10.0.0.5", data_ready=True)
    w.tick()
    assert w.tick(3.0).membership()[1] == ("i-w1",)


def test_join_checkpoints_then_tears_down_then_starts_the_next_generation(world):
    _start(world)
    _running(world, 1)
    world.add("i-w3", "worker", "10.0.0.7")
    assert world.tick(1.0).state == RUNNING  # debounce: not yet
    plan = world.tick(3.0)
    assert plan.state == CHECKPOINT and "i-w3" in plan.reason
    assert world.tick(1.0).state == CHECKPOINT  # workers (the savers in MXNet) still running
    world.beat_all("exited", 1, only=["i-w1", "i-w2"])
    assert world.tick(1.0).state == TEARDOWN
    world.beat_all("none", 1)
    plan = world.tick(1.0)
    assert (plan.generation, plan.state) == (2, RUNNING)
    assert plan.membership()[1] == ("i-w1", "i-w2", "i-w3")
    assert [e["state"] for e in world.state.events()] == [RUNNING, CHECKPOINT, TEARDOWN, RUNNING]


def test_leaving_worker_is_dropped_without_debounce(world):
    _start(world)
    _running(world, 1)
    world.nodes["i-w2"]["leaving"] = True
    world.state.register(world.nodes["i-w2"])
    assert world.tick(0.5).state == CHECKPOINT
    world.beat_all("exited", 1)
    assert world.tick(0.5).state == TEARDOWN
    plan = world.tick(0.5)
    assert (plan.generation, plan.membership()[1]) == (2, ("i-w1",))


def test_silent_worker_is_declared_dead_and_the_generation_torn_down(world):
    _start(world)
    _running(world, 1)
    world.clock.now += 11.0
    world.beat_all("running", 1, skip=["i-w2"])
    plan = world.tick()
    assert plan.state == TEARDOWN and "i-w2" in plan.reason
    assert "i-w2" not in world.state.registrations()


def test_exited_mxnet_process_tears_down_but_a_tensorflow_worker_may_restart(tmp_path, world):
    _start(world)
    _running(world, 1)
    world.beat("i-w1", proc="exited", generation=1)
    assert world.tick().state == TEARDOWN

    tf = World(tmp_path / "tf", framework="tensorflow")
    for node_id, role, host in world_nodes():
        tf.add(node_id, role, host)
    _start(tf)
    _running(tf, 1)
    tf.beat("i-w1", proc="exited", generation=1)
    assert tf.tick().state == RUNNING
    tf.beat("i-p1", proc="exited", generation=1)
    assert tf.tick().state == TEARDOWN


def world_nodes():
    return [("i-sched", "scheduler", "10.0.0.2"), ("i-p1", "server", "10.0.0.3"), ("i-p2", "server", "10.0.0.4"),
            ("i-w1", "worker", "10.0.0.5")]


def test_lost_server_waits_for_a_replacement(world):
    _start(world)
    _running(world, 1)
    world.clock.now += 11.0
    world.beat_all("running", 1, skip=["i-p1"])
    assert world.tick().state == TEARDOWN
    world.beat_all("none", 1)
    assert world.tick(1.0).state == WAITING
    world.add("i-p3", "server", "10.0.0.8")
    world.tick()
    plan = world.tick(3.0)
    assert (plan.generation, plan.state, plan.membership()[0]) == (2, RUNNING, ("i-p2", "i-p3"))


def test_teardown_is_bounded_by_stop_timeout(world):
    _start(world)
    _running(world, 1)
    world.beat("i-w1", proc="exited", generation=1)
    assert world.tick().state == TEARDOWN
    world.clock.now += 30.0
    world.beat_all("running", 1, skip=["i-w1"])  # hung processes that ignore SIGTERM
    assert world.tick().state == TEARDOWN
    world.clock.now += 31.0
    world.beat_all("running", 1, skip=["i-w1"])
    assert world.tick().generation == 2


def test_completed_training_ends_the_cluster(world):
    _start(world)
    world.done = True
    plan = world.tick()
    assert plan.state == COMPLETED
    assert world.tick(100.0).state == COMPLETED


def test_settings_name_every_bad_value():
    with pytest.raises(ConfigError) as err:
        settings_from_config({"state_dir": "efs/cluster", "num_servers": 0, "debounce_s": -1, "prot": 1})
    text = str(err.value)
    for expected in ("cluster.state_dir: got 'efs/cluster'", "cluster.num_servers: got 0",
                     "cluster.debounce_s: got -1", "cluster.prot: unknown key"):
        assert expected in text
    with pytest.raises(ConfigError, match="heartbeat_timeout_s: got 1.5"):
        settings_from_config({"state_dir": "/efs", "num_servers": 1, "heartbeat_timeout_s": 1.5})
    assert settings_from_config({"state_dir": "/efs", "num_servers": 2}).port_for("worker") == 9002


class FakeImds:
    def __init__(self, tags):
        self.tag_values = tags

    def tags(self):
        return self.tag_values


def test_member_tag_removal_is_a_leave_only_after_the_tag_was_seen():
    imds = FakeImds({})
    monitor = MemberTagMonitor(imds)
    assert monitor.poll() is None  # never tagged: not ours to judge
    imds.tag_values = {"spot-training:cluster-member": "true"}
    assert monitor.poll() is None
    imds.tag_values = {}
    event = monitor.poll()
    assert event is not None and event.kind == "member-tag-removed"
    assert MemberTagMonitor(FakeImds(None)).poll() is None  # tags not exposed in metadata


@pytest.mark.integration
def test_agent_with_a_bad_cluster_section_exits_78_and_registers_nothing(tmp_path):
    import os
    import subprocess
    import sys

    from spot_training.local.imds_emulator import ImdsEmulator

    repo = Path(__file__).resolve().parents[2]
    state_dir = tmp_path / "efs" / "cluster"
    with ImdsEmulator(instance_id="i-0bad", availability_zone="us-east-1a", local_ipv4="10.0.0.5") as imds:
        config = {
            "schema_version": 1, "region": "us-east-1", "stack_name": "DistributedTraining", "node_role": "worker",
            "volume": {"tags": {"spot-training:stack": "DistributedTraining", "spot-training:purpose": "data-volume"},
                       "device_name": "/dev/sdf", "mount_point": str(tmp_path / "mnt"), "fs_type": "xfs",
                       "keep_snapshots": 2},
            "efs": None,
            "training": {"framework": "mxnet", "python": sys.executable, "command": ["{python}", "-c", "pass"],
                         "user": "ubuntu", "dataset_dir": str(tmp_path / "data"),
                         "checkpoint_dir": str(tmp_path / "ckpt"), "log_dir": str(tmp_path / "logs"),
                         "code": {"type": "asset", "path": str(repo)}},
            "cleanup": {"cancel_fleet_on_success": False}, "imds_endpoint": imds.endpoint,
            "cluster": {"state_dir": str(state_dir), "num_servers": 0, "worker_port": 70000},
        }
        path = tmp_path / "config.json"
        path.write_text(json.dumps(config))
        done = subprocess.run([sys.executable, "-m", "spot_training.agent", "run", "--config", str(path)], cwd=repo,
                              env=dict(os.environ, PYTHONPATH=str(repo), SPOT_TRAINING_BLOCKDEV_DIR=str(tmp_path / "b")),
                              capture_output=True, text=True, timeout=60)
    assert done.returncode == 78, done.stderr
    assert "cluster.num_servers: got 0" in done.stderr and "cluster.worker_port: got 70000" in done.stderr
    assert not state_dir.exists()


class LoopStopped(Exception):
    pass


def _stop_loop(seconds: float) -> None:
    raise LoopStopped()


def test_agent_restarted_inside_a_running_generation_reports_its_process_lost(world, tmp_path):
    from spot_training.agent.ps_node import NodeAgent

    _start(world)
    _running(world, 1)
    agent = NodeAgent(world.settings, framework="mxnet", role="worker", node_id="i-w1", host="10.0.0.5",
                      training_argv=["true"], python="python3", environ={}, workdir=tmp_path,
                      checkpoint_dir=tmp_path / "ckpt", dataset_dir=tmp_path, log_dir=tmp_path / "logs",
                      clock=world.clock, sleep=_stop_loop)
    with pytest.raises(LoopStopped):
        agent.run()  # one pass of the loop, then the fake sleep stops it
    beat = world.state.heartbeats()["i-w1"]
    assert (beat["generation"], beat["proc"], beat["returncode"]) == (1, "exited", -1)
    assert agent.running is None  # it did not join the running ps-lite job
    assert world.tick().state == TEARDOWN


def test_a_worker_whose_imds_turns_403_leaves_through_a_checkpoint_and_is_handed_back(world, tmp_path):
    """On cluster workers, IMDS answering 403 means no more interruption notices. The
    worker leaves like a noticed one (the coordinator checkpoints without it) instead of exiting 78."""
    from spot_training.agent.interruption import IMDS_FORBIDDEN
    from spot_training.agent.ps_node import NodeAgent
    from spot_training.agent.imds import ImdsForbiddenError

    class Forbidden:
        def poll(self):
            raise ImdsForbiddenError("IMDS answered 403 Forbidden for GET /latest/meta-data/spot/instance-action")

    _start(world)
    _running(world, 1)
    agent = NodeAgent(world.settings, framework="mxnet", role="worker", node_id="i-w1", host="10.0.0.5",
                      training_argv=["true"], python="python3", environ={}, workdir=tmp_path,
                      checkpoint_dir=tmp_path / "ckpt", dataset_dir=tmp_path, log_dir=tmp_path / "logs",
                      monitors=[Forbidden()], clock=world.clock, sleep=_stop_loop)
    agent._poll_monitors()
    assert agent.leaving is True and agent.leave_reason == IMDS_FORBIDDEN
    assert world.state.registrations()["i-w1"]["leaving"] is True
    plan = world.tick()
    assert plan.state == CHECKPOINT  # a leave goes through a checkpoint, as for a notice


@pytest.mark.integration
def test_mxnet_worker_whose_trainer_exits_78_gives_up_instead_of_tearing_generations_down(world, tmp_path):
    """The contract's restart policy on a parameter-server node: a checkpoint of another job (78) would
    stop every new generation the same way, so the worker leaves and exits 78."""
    import sys

    from spot_training.agent.errors import CheckpointMismatchError
    from spot_training.agent.launch import ProcessSpec
    from spot_training.agent.process_group import ProcessGroup
    from spot_training.agent.ps_node import NodeAgent, _Running

    agent = NodeAgent(world.settings, framework="mxnet", role="worker", node_id="i-w1", host="10.0.0.5",
                      training_argv=["true"], python="python3", environ={}, workdir=tmp_path,
                      checkpoint_dir=tmp_path / "ckpt", dataset_dir=tmp_path, log_dir=tmp_path / "logs",
                      clock=world.clock, sleep=_stop_loop)
    process = ProcessGroup.start([sys.executable, "-c", "raise SystemExit(78)"], cwd=tmp_path, env={})
    process.proc.wait()
    agent.running = _Running(process, 1, ProcessSpec(["train"], {}, "worker", checkpoints=True))
    with pytest.raises(CheckpointMismatchError) as info:
        agent._reap()
    assert info.value.exit_code == 78 and agent.leaving and agent.leave_reason == "trainer-exit-78"
