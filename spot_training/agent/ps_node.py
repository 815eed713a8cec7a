"""One node of an MXNet or TensorFlow parameter-server cluster: registers, heartbeats, follows the plan
(spot_training/agent/cluster_coordinator.py) and supervises its framework process (spot_training/agent/launch.py builds it;
spot_training/agent/supervisor.py's :class:`ProcessGroup` runs it). Standard library only.
"""

from __future__ import annotations

import logging
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterable, Mapping

from spot_training.agent import launch
from spot_training.agent.cluster_coordinator import Coordinator
from spot_training.agent.cluster_member import ClusterMember
from spot_training.agent.cluster_state import CHECKPOINT, CLUSTER_ROLES, COMPLETED, RUNNING, TEARDOWN, WAITING, ClusterConfig, Plan
from spot_training.agent.errors import give_up_error
from spot_training.agent.process_group import ProcessGroup
from spot_training.contract import TRAINER_GIVE_UP, trainer_exit_decision

log = logging.getLogger("spot_training.agent.cluster")

__all__ = ["NodeAgent"]


@dataclass
class _Running:
    process: ProcessGroup
    generation: int
    spec: launch.ProcessSpec


class NodeAgent(ClusterMember):
    """Runs one cluster node: registers, heartbeats, follows the plan, supervises its framework process.

    Args:
        settings: as :class:`spot_training.agent.cluster_member.ClusterMember`.
        framework: ``mxnet`` or ``tensorflow``.
        role: ``scheduler``, ``server`` or ``worker``.
        node_id: as ClusterMember (the instance id).
        host: as ClusterMember (the private IPv4 address).
        training_argv: the training command (placeholders replaced).
        python: as ClusterMember (the training interpreter).
        environ: as ClusterMember.
        workdir: as ClusterMember.
        checkpoint_dir: as ClusterMember.
        dataset_dir: as ClusterMember.
        log_dir: as ClusterMember.
        monitors: as ClusterMember (default none).
        monitor_interval_s: seconds between monitor polls (default 5; spot interruption and member
            tag on AWS).
        netns: as ClusterMember (default None).
        preexec_user: as ClusterMember (default None).
        port: as ClusterMember (default: the role's).
        clock: as ClusterMember (default ``time.time``).
        sleep: as ClusterMember (default ``time.sleep``).

    :meth:`run` returns ``"completed"`` (the trainer wrote COMPLETED) or ``"left"`` (this worker left).
    """

    def __init__(self, settings: ClusterConfig, *, framework: str, role: str, node_id: str, host: str,
                 training_argv: list[str], python: str, environ: Mapping[str, str], workdir: Path,
                 checkpoint_dir: Path, dataset_dir: Path, log_dir: Path, monitors: Iterable[Any] = (),
                 monitor_interval_s: float = 5.0, netns: str | None = None,
                 preexec_user: tuple[int, int, list[int]] | None = None, port: int | None = None,
                 clock: Callable[[], float] = time.time, sleep: Callable[[float], None] = time.sleep) -> None:
        if role not in CLUSTER_ROLES:
            raise ValueError(f"role must be one of {CLUSTER_ROLES}, got {role!r}")
        if framework not in ("mxnet", "tensorflow"):
            raise ValueError(f"framework must be 'mxnet' or 'tensorflow', got {framework!r}")
        super().__init__(settings, role=role, node_id=node_id, host=host, python=python, environ=environ,
                         workdir=workdir, checkpoint_dir=checkpoint_dir, dataset_dir=dataset_dir, log_dir=log_dir,
                         monitors=monitors, monitor_interval_s=monitor_interval_s, netns=netns,
                         preexec_user=preexec_user, clock=clock, sleep=sleep, port=port)
        self.framework, self.training_argv = framework, list(training_argv)
        self.coordinator = Coordinator(self.state, settings, framework=framework, node_id=node_id,
                                       completed=self.completed, clock=clock) if role == "scheduler" else None
        self.running: _Running | None = None
        self.started_generation = 0
        self.last_exit: tuple[int, int] | None = None  # (generation, returncode)
        self.tf_worker_restarts = 0

    def _heartbeat(self) -> None:
        self._beat(generation=self.started_generation, process=self.running.process if self.running else None,
                   returncode=self.last_exit[1] if self.last_exit is not None else None)

    # processes
    def _launcher(self, spec_port: int) -> list[str]:
        prefix = ["ip", "netns", "exec", self.netns] if self.netns else []
        return [*prefix, sys.executable, str(Path(launch.__file__).resolve()), "exec",
                "--check-port", f"{self.host}:{spec_port}", "--"]

    def _start(self, plan: Plan) -> None:
        spec = launch.process_for(plan.to_dict(), self.node_id, framework=self.framework,
                                  training_argv=self.training_argv, python=self.python,
                                  launcher=self._launcher(self.port))
        env = dict(self.environ)
        env.update(spec.env)
        # The launcher already enters the namespace (it checks the port there first).
        process = self._start_process(spec.argv, f"{self.role}-{self.node_id}.log", env, netns=None)
        self.running = _Running(process, plan.generation, spec)
        self.started_generation = plan.generation
        self.last_exit = None
        log.info("cluster process started", extra={"generation": plan.generation, "role": spec.role,
                                                    "pid": process.pid, "argv": spec.argv})

    def _reap(self) -> None:
        if self.running is None:
            return
        code = self.running.process.poll()
        if code is None:
            return
        self.last_exit = (self.running.generation, code)
        log.info("cluster process exited", extra={"generation": self.running.generation, "returncode": code,
                                                  "role": self.role})
        run, self.running = self.running, None
        if run.spec.checkpoints and run.process.term_sent is None \
                and trainer_exit_decision(code) == TRAINER_GIVE_UP:
            # The contract's restart policy: the trainer's own exit (not a stop the agent asked for) that
            # every new generation would repeat (full or unusable checkpoint storage, another job's
            # checkpoint). Leave the cluster and exit with it instead of tearing generations down forever.
            self.leaving, self.leave_reason = True, f"trainer-exit-{code}"
            self.state.deregister(self.node_id)
            raise give_up_error(code, self.checkpoint_dir)

    def step(self) -> str | None:
        """One pass of the agent loop; returns ``"completed"``/``"left"``/``"stopped"`` when done, else None."""
        self._watch()
        if self.coordinator is not None:
            self.coordinator.tick()
        self._reap()
        plan = self.state.plan()
        in_plan = plan is not None and self.node_id in plan.members()
        result = None
        if plan is not None and plan.state == COMPLETED:
            result = "completed"
        elif self.stop_requested and self.role != "worker":
            result = "stopped"
        if self.running is not None:
            run = self.running
            if result is not None or plan is None or plan.generation != run.generation or not in_plan \
                    or plan.state in (TEARDOWN, WAITING):
                run.process.stop(kill_after=self.settings.kill_grace_s)
            elif plan.state == CHECKPOINT and run.spec.checkpoints:
                # The contract's stop: SIGTERM to the trainer's leader only (its data-loading workers
                # must not die under the save); teardown SIGKILLs the group if it is still running.
                run.process.stop(kill_after=None, group=False)
        elif result is None and plan is not None and plan.state == RUNNING and in_plan and not self.leaving:
            restart_tf_worker = (self.framework == "tensorflow" and self.role == "worker"
                                 and self.last_exit is not None and self.last_exit[0] == plan.generation)
            if plan.generation > self.started_generation or restart_tf_worker:
                if restart_tf_worker:
                    self.tf_worker_restarts += 1
                    log.warning("TensorFlow worker exited inside the generation; restarting it at the same address",
                                extra={"generation": plan.generation, "returncode": self.last_exit[1]})
                self._start(plan)
        if result is None and self.leaving and self.running is None and not (in_plan and plan.state == RUNNING):
            if plan is None or not in_plan or plan.state in (RUNNING, WAITING, COMPLETED):
                result = "left"
        self._heartbeat()
        if result is not None and self.running is None:
            if self.role == "worker" or result == "left":
                self.state.deregister(self.node_id)
            return result
        return None

    def run(self) -> str:
        """Register, then loop every ``heartbeat_interval_s / 2`` seconds (at most 0.5 s) until done;
        returns the outcome of :meth:`step`. The process group is always stopped before returning."""
        self.data_ready = self.role != "worker" or self._data_is_ready()
        plan = self.state.plan()
        if plan is not None and plan.state == RUNNING and self.node_id in plan.members():
            # This agent restarted (systemd) inside a running generation: its process is gone with it.
            # Report that as an exit so the coordinator tears an MXNet generation down (ps-lite cannot take
            # a node back) and a TensorFlow worker is restarted at its address, instead of hanging.
            self.started_generation = plan.generation
            self.last_exit = (plan.generation, -1)
            log.warning("agent restarted inside running generation %d; reporting its process as exited",
                        plan.generation)
        self._register()
        try:
            return self._loop(self.step)
        finally:
            if self.running is not None:
                self.running.process.kill_and_wait()
                self.running = None
