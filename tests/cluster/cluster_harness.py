"""A parameter-server cluster on one machine: every node a real agent process (``python -m spot_training.agent run``),
every node's framework process in its own network namespace with its own address.

- EFS is a shared temporary directory (dataset, checkpoints, logs, cluster state).
- Each node has its own IMDS emulator (spot_training.local.imds_emulator) giving its instance id, its private
  address and its tags; a spot interruption is posted there.
- Network: a bridge and one namespace + veth pair per node in a private /24 we create
  (10.213.X.0/24, X random so that parallel runs do not meet), all removed on teardown even after a
  failure. Without ``ip netns`` (no root, no iproute2), or with ``SPOT_TRAINING_TEST_LOOPBACK=1``,
  the nodes fall back to loopback addresses with distinct ports, and the harness says so on stdout.

Imports neither TensorFlow nor MXNet (used by tests/cluster and tests/mxnet alike).
"""

from __future__ import annotations

import csv
import json
import os
import random
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

from spot_training.agent.cluster_state import ClusterState
from spot_training.local.imds_emulator import ImdsEmulator
from spot_training.local.netns import Network  # noqa: F401 - shared with local mode's cluster drill; the stories import it from here

REPO = Path(__file__).resolve().parents[2]
MEMBER_TAG = "spot-training:cluster-member"


@dataclass
class Node:
    """One emulated instance: its IMDS emulator, config and agent process."""

    name: str
    role: str
    instance_id: str
    address: str
    netns: str | None
    imds: ImdsEmulator
    config_path: Path
    log_path: Path
    agent: subprocess.Popen | None = None
    started_at: float = 0.0
    extra: dict = field(default_factory=dict)

    def alive(self) -> bool:
        return self.agent is not None and self.agent.poll() is None


class Cluster:
    """Nodes of one cluster sharing ``root`` as EFS. ``trainer_args`` go to the training command."""

    def __init__(self, root: Path, network: Network, *, framework: str, data_dir: Path, trainer_module: str,
                 trainer_args: list[str], num_servers: int = 2, min_workers: int = 1,
                 heartbeat_timeout_s: float = 8.0, debounce_s: float = 2.0, stop_timeout_s: float = 60.0,
                 kill_grace_s: float = 3.0, base_port: int = 9000) -> None:
        self.root, self.network, self.framework = root, network, framework
        self.efs = root / "efs"
        self.data_dir = data_dir
        self.checkpoint_dir = self.efs / "checkpoints"
        self.log_dir = self.efs / "logs"
        self.state_dir = self.efs / "cluster"
        for d in (self.checkpoint_dir, self.log_dir, self.state_dir):
            d.mkdir(parents=True, exist_ok=True)
        self.trainer_module, self.trainer_args = trainer_module, trainer_args
        self.cluster_section = {"state_dir": str(self.state_dir), "num_servers": num_servers,
                                "min_workers": min_workers, "heartbeat_interval_s": 1.0,
                                "heartbeat_timeout_s": heartbeat_timeout_s, "debounce_s": debounce_s,
                                "stop_timeout_s": stop_timeout_s, "kill_grace_s": kill_grace_s}
        self.base_port = base_port
        self.nodes: list[Node] = []
        self.state = ClusterState(self.state_dir)

    @classmethod
    def digits_story(cls, tmp_path_factory, network: Network, *, framework: str, trainer_module: str, steps: int,
                     save_every: int, min_step_seconds: float, data_dir: Path | None = None, **settings) -> "Cluster":
        """A cluster for a story module: ``trainer_module`` trains ``steps`` steps of batch 64 on the
        8x8 digits (prepared here unless ``data_dir``), a checkpoint every ``save_every`` steps, each
        step at least ``min_step_seconds`` long. ``settings``: the other constructor arguments."""
        from spot_training.training.examples.prepare_data import prepare_digits

        if data_dir is None:
            data_dir = tmp_path_factory.mktemp(f"{framework}-digits")
            prepare_digits(data_dir)
        return cls(tmp_path_factory.mktemp(f"{framework}-cluster"), network, framework=framework, data_dir=data_dir,
                   trainer_module=trainer_module, trainer_args=["--steps", str(steps), "--batch-size", "64",
                                                                "--save-every-steps", str(save_every),
                                                                "--min-step-seconds", str(min_step_seconds)],
                   **settings)

    # ---- nodes ----------------------------------------------------------------------------------
    def add_node(self, role: str, *, start: bool = True) -> Node:
        index = len(self.nodes) + 1
        netns, address, offset = self.network.add(f"{role}{index}")
        instance_id = f"i-{role[:3]}{index:02d}{random.randint(0, 0xffffff):06x}"
        tags = {MEMBER_TAG: "true"} if role == "worker" else {}
        imds = ImdsEmulator(instance_id=instance_id, availability_zone="us-east-1a", local_ipv4=address,
                            tags=tags).start()
        node_dir = self.root / "nodes" / instance_id
        node_dir.mkdir(parents=True)
        section = dict(self.cluster_section)
        section.update({"scheduler_port": self.base_port + offset, "server_port": self.base_port + 1 + offset,
                        "worker_port": self.base_port + 2 + offset})
        config = {
            "schema_version": 1, "region": "us-east-1", "stack_name": "DistributedTraining", "node_role": role,
            "volume": {"tags": {"spot-training:stack": "DistributedTraining", "spot-training:purpose": "data-volume"},
                       "device_name": "/dev/sdf", "mount_point": str(node_dir / "dltraining"), "fs_type": "xfs",
                       "keep_snapshots": 2},
            "efs": None,
            "training": {"framework": self.framework, "python": sys.executable,
                         "command": ["{python}", "-m", self.trainer_module, *self.trainer_args],
                         "user": "ubuntu", "dataset_dir": str(self.data_dir),
                         "checkpoint_dir": str(self.checkpoint_dir), "log_dir": str(self.log_dir),
                         "code": {"type": "asset", "path": str(REPO)}},
            "cleanup": {"cancel_fleet_on_success": False}, "imds_endpoint": imds.endpoint,
            "cluster": section,
        }
        config_path = node_dir / "config.json"
        config_path.write_text(json.dumps(config))
        node = Node(f"{role}{index}", role, instance_id, address, netns, imds, config_path, node_dir / "agent.log")
        self.nodes.append(node)
        if start:
            self.start(node)
        return node

    def start(self, node: Node) -> None:
        env = dict(os.environ, PYTHONPATH=str(REPO), PYTHONUNBUFFERED="1", TF_CPP_MIN_LOG_LEVEL="2",
                   SPOT_TRAINING_BLOCKDEV_DIR=str(node.config_path.parent / "blockdev"))
        env.pop("AWS_ENDPOINT_URL", None)  # no EC2 API here: a leaving worker has no fleet to lower
        if node.netns:
            env["SPOT_TRAINING_NETNS"] = node.netns
        log = open(node.log_path, "ab")
        node.started_at = time.time()
        node.agent = subprocess.Popen([sys.executable, "-m", "spot_training.agent", "run", "--config", str(node.config_path)],
                                      cwd=REPO, env=env, stdout=log, stderr=subprocess.STDOUT,
                                      start_new_session=True)
        log.close()

    def process_pid(self, node: Node) -> int | None:
        """PID of the framework process the node's agent runs now (from its heartbeat)."""
        beat = self.state.heartbeats().get(node.instance_id)
        return beat.get("pid") if beat else None

    def kill_process(self, node: Node, sig: int = signal.SIGKILL) -> int:
        """Send ``sig`` to the node's framework process group (the agent lives on); returns the pid."""
        pid = self.process_pid(node)
        assert pid, f"{node.name} runs no framework process now: {self.state.heartbeats().get(node.instance_id)}"
        os.killpg(pid, sig)
        return pid

    def kill_node(self, node: Node) -> None:
        """The instance is gone: SIGKILL the agent and its framework process group, nothing else."""
        pid = self.process_pid(node)
        node.extra["killed"] = True
        os.killpg(node.agent.pid, signal.SIGKILL)
        node.agent.wait(timeout=10)
        if pid:
            try:
                os.killpg(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass

    def close(self) -> None:
        """Stop every agent and framework process we started (by PID), then the emulators."""
        for node in self.nodes:
            if node.agent is not None and node.agent.poll() is None:
                pid = self.process_pid(node)
                for target in (node.agent.pid, pid):
                    if target:
                        try:
                            os.killpg(target, signal.SIGKILL)
                        except (ProcessLookupError, PermissionError):
                            pass
                node.agent.wait(timeout=10)
            node.imds.stop()

    # ---- observation ----------------------------------------------------------------------------
    def plan(self):
        return self.state.plan()

    def events(self) -> list[dict]:
        return self.state.events()

    def steps(self, node: Node | None = None) -> list[dict]:
        """Rows of the step logs (all nodes, or one), sorted by wall time."""
        paths = [self.log_dir / f"steps-{node.instance_id}.csv"] if node else sorted(self.log_dir.glob("steps-*.csv"))
        rows = []
        for path in paths:
            if path.exists():
                with open(path, newline="") as handle:
                    for row in csv.DictReader(handle):
                        row["node"] = path.stem[len("steps-"):]
                        rows.append(row)
        return sorted(rows, key=lambda r: float(r["wall_time"]))

    def max_step(self) -> int:
        return max((int(r["step"]) for r in self.steps()), default=0)

    def result(self) -> dict | None:
        path = self.log_dir / "result.json"
        return json.loads(path.read_text()) if path.exists() else None

    def checkpoint_steps(self) -> list[int]:
        return sorted(int(p.name.split("-")[1]) for p in self.checkpoint_dir.glob("ckpt-*"))

    def diagnostics(self) -> str:
        """Plan, events and the tail of every log, for assertion messages."""
        return "\n".join([f"plan: {self.plan()}", f"events: {json.dumps(self.events(), indent=0)}", self.log_tails(15)])

    def log_tails(self, lines: int) -> str:
        """The last ``lines`` lines of every trainer log and every node's agent log."""
        parts = []
        for path in sorted(self.log_dir.glob("*.log")) + [n.log_path for n in self.nodes]:
            if path.exists():
                parts.append(f"--- {path.name}\n" + "\n".join(path.read_text(errors="replace").splitlines()[-lines:]))
        return "\n".join(parts)

    def wait_for(self, predicate: Callable[[], object], timeout: float, what: str) -> object:
        deadline = time.time() + timeout
        while time.time() < deadline:
            value = predicate()
            if value:
                return value
            time.sleep(0.25)
        raise AssertionError(f"timed out after {timeout} s waiting for {what}\n{self.diagnostics()}")

    def running_generation(self, *, generation_above: int = 0, workers: int | None = None) -> int:
        plan = self.plan()
        if plan is None or plan.state != "running" or plan.generation <= generation_above:
            return 0
        if workers is not None and len(plan.workers) != workers:
            return 0
        return plan.generation

    def steps_in_generation(self, generation: int) -> list[dict]:
        return [r for r in self.steps() if int(r["generation"]) == generation]

    def step_range(self, generation: int) -> tuple[int, int]:
        """(first, last) step logged in ``generation``; ValueError when it logged none."""
        steps = [int(r["step"]) for r in self.steps_in_generation(generation)]
        return min(steps), max(steps)

    def resumed_after(self, generation: int, before: int) -> tuple[int, int]:
        """(first step logged in ``generation``, last step logged in generation ``before``)."""
        return self.step_range(generation)[0], self.step_range(before)[1]

    def start_parameter_servers(self, *, restart_s: float) -> int:
        """Start the scheduler, two servers and two workers; wait up to ``restart_s`` seconds for
        generation 1 with both workers, then for 40 steps in it. Returns the generation (1)."""
        for role in ("scheduler", "server", "server", "worker", "worker"):
            self.add_node(role)
        gen = self.wait_for(lambda: self.running_generation(workers=2), restart_s, "generation 1")
        self.wait_for_steps(1, 40, restart_s)
        return gen

    def assert_left_cleanly(self, leaver: Node, *, before: int, workers: int, restart_s: float, why: str) -> int:
        """After ``leaver`` was told to leave (``why``, for messages): wait ``restart_s`` seconds for a
        generation after ``before`` with ``workers`` workers, ``leaver`` not among them, and 10 steps in
        it; assert it started at the step after the last one of ``before`` (a checkpoint at the agreed
        stop step, nothing lost) and that the leaver's agent exits 0 within 30 s. Returns the generation."""
        gen = self.wait_for(lambda: self.running_generation(generation_above=before, workers=workers), restart_s,
                            f"a generation without the {why} worker")
        assert leaver.instance_id not in {w["node_id"] for w in self.plan().workers}
        self.wait_for_steps(gen, 10, restart_s)
        first, last_before = self.resumed_after(gen, before)
        assert first == last_before + 1
        self.wait_for(lambda: not leaver.alive(), 30, f"the {why} worker's agent to exit")
        assert leaver.agent.returncode == 0
        return gen

    def replace_killed_server(self, *, notice_s: float, restart_s: float, save_every: int) -> None:
        """SIGKILL the first parameter server's node (steps of the running generation first) and
        wait ``notice_s`` seconds for the coordinator to notice; start a replacement server node,
        as the servers' Auto Scaling group does, and wait ``restart_s`` seconds for a generation
        with it and its steps. Asserts training resumed from the newest checkpoint: no step
        skipped, at most ``save_every`` steps redone."""
        plan = self.plan()
        victim = next(n for n in self.nodes if n.instance_id == plan.servers[0]["node_id"])
        self.wait_for_steps(plan.generation, 15, restart_s)
        self.kill_node(victim)
        self.wait_for(lambda: self.plan().state in ("teardown", "waiting"), notice_s,
                      "the coordinator to notice the lost parameter server")
        replacement = self.add_node("server")
        gen = self.wait_for(lambda: self.running_generation(generation_above=plan.generation), restart_s,
                            "a generation with the replacement server")
        assert replacement.instance_id in {s["node_id"] for s in self.plan().servers}
        self.wait_for_steps(gen, 5, restart_s)
        first, last_before = self.resumed_after(gen, plan.generation)
        assert first - 1 <= last_before and last_before - (first - 1) <= save_every

    def assert_completed(self, *, total_steps: int, timeout: float, label: str) -> None:
        """Wait ``timeout`` seconds for the plan to complete; assert the result is at exactly
        ``total_steps``, every step ran once, the held-out accuracy is >= 0.9, and every agent
        not killed by a test exited 0. Prints the accuracy under ``label``."""
        self.wait_for(lambda: self.plan().state == "completed", timeout, "training to complete")
        result = self.result()
        assert result is not None, self.diagnostics()
        assert result["step"] == total_steps
        assert max(self.checkpoint_steps()) == total_steps
        assert {int(r["step"]) for r in self.steps()} == set(range(1, total_steps + 1))  # none beyond the total
        print(f"{label} cluster: {total_steps} steps over {self.plan().generation} generations, "
              f"held-out digits accuracy {result['test_accuracy']:.4f}")
        assert result["test_accuracy"] >= 0.9
        self.wait_for(lambda: not any(n.alive() for n in self.nodes), 60, "every agent to exit")
        survivors = [n for n in self.nodes if not n.extra.get("killed")]
        assert {n.name: n.agent.returncode for n in survivors} == {n.name: 0 for n in survivors}

    def wait_for_steps(self, generation: int, steps: int, timeout: float) -> None:
        """Wait up to ``timeout`` seconds until ``generation`` logged a span of ``steps`` steps
        (last - first >= steps); AssertionError with the diagnostics otherwise."""
        def enough():
            rows = self.steps_in_generation(generation)
            return rows and max(int(r["step"]) for r in rows) - min(int(r["step"]) for r in rows) >= steps
        self.wait_for(enough, timeout, f"{steps} steps in generation {generation}")
