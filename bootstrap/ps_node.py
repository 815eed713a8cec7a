"""One node of an MXNet or TensorFlow parameter-server cluster: registers, heartbeats, follows the plan
(bootstrap/cluster_coordinator.py) and supervises its framework process (bootstrap/launch.py builds it).
Standard library only.
"""

from __future__ import annotations

import logging
import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterable, Mapping

from bootstrap import launch
from bootstrap.cluster_coordinator import Coordinator
from bootstrap.cluster_state import (CHECKPOINT, CLUSTER_ROLES, COMPLETED, RUNNING, TEARDOWN, WAITING, ClusterSettings,
                                     ClusterState, Plan)
from bootstrap.interruption import poll_leave_reason
from spot_contract import COMPLETED_FILE

log = logging.getLogger("bootstrap.cluster")

__all__ = ["NodeAgent"]


@dataclass
class _Running:
    proc: subprocess.Popen
    generation: int
    spec: launch.ProcessSpec
    started: float
    term_sent: float | None = None
    killed: bool = False
    log_file: Any = field(default=None, repr=False)


class NodeAgent:
    """Runs one cluster node: registers, heartbeats, follows the plan, supervises its framework process.

    Args:
        settings: :class:`ClusterSettings`. framework: ``mxnet``/``tensorflow``. role: ``scheduler``,
        ``server`` or ``worker``. node_id: the instance id. host: the private IPv4 address.
        training_argv: the training command (placeholders replaced). python: the training interpreter.
        environ: the base environment of the processes (the single-node ``SPOT_TRAINING_*`` included).
        workdir: where processes start (the training code). checkpoint_dir, dataset_dir, log_dir: from
        the config; ``COMPLETED`` is looked for in checkpoint_dir, a worker is data-ready when
        dataset_dir has an entry. monitors: objects with ``poll() -> Event | None`` polled every
        ``monitor_interval_s`` (default 5 s; spot interruption and member tag on AWS); any event means
        leave. netns: local mode only, run the processes inside this network namespace.
        preexec_user: ``(uid, gid, groups)`` to drop privileges to, or None. clock, sleep: injectable.

    :meth:`run` returns ``"completed"`` (the trainer wrote COMPLETED) or ``"left"`` (this worker left).
    """

    def __init__(self, settings: ClusterSettings, *, framework: str, role: str, node_id: str, host: str,
                 training_argv: list[str], python: str, environ: Mapping[str, str], workdir: Path,
                 checkpoint_dir: Path, dataset_dir: Path, log_dir: Path, monitors: Iterable[Any] = (),
                 monitor_interval_s: float = 5.0, netns: str | None = None,
                 preexec_user: tuple[int, int, list[int]] | None = None, port: int | None = None,
                 clock: Callable[[], float] = time.time, sleep: Callable[[float], None] = time.sleep) -> None:
        if role not in CLUSTER_ROLES:
            raise ValueError(f"role must be one of {CLUSTER_ROLES}, got {role!r}")
        if framework not in ("mxnet", "tensorflow"):
            raise ValueError(f"framework must be 'mxnet' or 'tensorflow', got {framework!r}")
        self.settings, self.framework, self.role, self.node_id, self.host = settings, framework, role, node_id, host
        self.port = port if port is not None else settings.port_for(role)
        self.training_argv, self.python, self.environ = list(training_argv), python, dict(environ)
        self.workdir, self.checkpoint_dir, self.dataset_dir, self.log_dir = workdir, checkpoint_dir, dataset_dir, log_dir
        self.monitors, self.monitor_interval_s, self.netns = list(monitors), monitor_interval_s, netns
        self.preexec_user, self.clock, self.sleep = preexec_user, clock, sleep
        self.state = ClusterState(settings.state_dir)
        self.coordinator = Coordinator(self.state, settings, framework=framework, node_id=node_id,
                                       completed=self.completed, clock=clock) if role == "scheduler" else None
        self.leaving = False
        self.leave_reason: str | None = None  # the event kind that made this worker leave
        self.stop_requested = False
        self.running: _Running | None = None
        self.started_generation = 0
        self.last_exit: tuple[int, int] | None = None  # (generation, returncode)
        self.registered_at = clock()
        self.data_ready = False
        self._last_monitor = float("-inf")
        self.tf_worker_restarts = 0

    # files
    def completed(self) -> bool:
        """True when the trainer wrote ``COMPLETED`` into the (shared) checkpoint directory."""
        return (self.checkpoint_dir / COMPLETED_FILE).exists()

    def _data_is_ready(self) -> bool:
        try:
            return self.dataset_dir.is_dir() and any(self.dataset_dir.iterdir())
        except OSError:
            return False

    def _register(self) -> None:
        self.state.register({"node_id": self.node_id, "instance_id": self.node_id, "role": self.role,
                             "host": self.host, "port": self.port, "data_ready": self.data_ready,
                             "leaving": self.leaving, "registered_at": self.registered_at})

    def _heartbeat(self) -> None:
        proc = "none"
        generation = self.started_generation
        returncode = None
        if self.running is not None:
            proc = "running"
        elif self.last_exit is not None:
            proc, returncode = "exited", self.last_exit[1]
        self.state.heartbeat({"node_id": self.node_id, "time": self.clock(), "generation": generation, "proc": proc,
                              "returncode": returncode, "pid": self.running.proc.pid if self.running else None,
                              "leaving": self.leaving})

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
        self.log_dir.mkdir(parents=True, exist_ok=True)
        log_file = open(self.log_dir / f"{self.role}-{self.node_id}.log", "ab")
        kwargs: dict[str, Any] = {}
        if self.preexec_user is not None:
            uid, gid, groups = self.preexec_user
            kwargs = {"user": uid, "group": gid, "extra_groups": groups}
        proc = subprocess.Popen(spec.argv, cwd=self.workdir, env=env, start_new_session=True,
                                stdin=subprocess.DEVNULL, stdout=log_file, stderr=subprocess.STDOUT, **kwargs)
        self.running = _Running(proc, plan.generation, spec, self.clock(), log_file=log_file)
        self.started_generation = plan.generation
        self.last_exit = None
        log.info("cluster process started", extra={"generation": plan.generation, "role": spec.role,
                                                    "pid": proc.pid, "argv": spec.argv})

    def _signal(self, sig: int) -> None:
        try:
            os.killpg(self.running.proc.pid, sig)
        except ProcessLookupError:
            pass

    def _reap(self) -> None:
        if self.running is None:
            return
        code = self.running.proc.poll()
        if code is None:
            return
        self.last_exit = (self.running.generation, code)
        log.info("cluster process exited", extra={"generation": self.running.generation, "returncode": code,
                                                  "role": self.role})
        self.running.log_file.close()
        self.running = None

    def _stop(self, *, kill_after: float | None) -> None:
        """SIGTERM once; SIGKILL the group ``kill_after`` seconds later (None: never)."""
        run = self.running
        now = self.clock()
        if run.term_sent is None:
            run.term_sent = now
            self._signal(signal.SIGTERM)
        elif kill_after is not None and not run.killed and now - run.term_sent >= kill_after:
            run.killed = True
            log.warning("cluster process did not stop after SIGTERM; SIGKILL", extra={"pid": run.proc.pid})
            self._signal(signal.SIGKILL)

    def _poll_monitors(self) -> None:
        now = self.clock()
        if self.role != "worker" or self.leaving or now - self._last_monitor < self.monitor_interval_s:
            return
        self._last_monitor = now
        reason = poll_leave_reason(self.monitors)
        if reason is not None:
            self.leave_reason = reason
            self.leaving = True
            self._register()

    def request_stop(self) -> None:
        """From a signal handler (the agent got SIGTERM): a worker leaves, other roles stop. Sets a flag."""
        self.stop_requested = True

    def step(self) -> str | None:
        """One pass of the agent loop; returns ``"completed"``/``"left"``/``"stopped"`` when done, else None."""
        if not self.data_ready and self._data_is_ready():
            self.data_ready = True
            self._register()
        self._poll_monitors()
        if self.stop_requested and self.role == "worker" and not self.leaving:
            self.leave_reason = "agent-stopped"
            self.leaving = True
            self._register()
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
                self._stop(kill_after=self.settings.kill_grace_s)
            elif plan.state == CHECKPOINT and run.spec.checkpoints:
                self._stop(kill_after=None)
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
        interval = min(0.5, self.settings.heartbeat_interval_s / 2)
        try:
            while True:
                outcome = self.step()
                if outcome is not None:
                    return outcome
                self.sleep(interval)
        finally:
            if self.running is not None:
                self._signal(signal.SIGKILL)
                self.running.proc.wait()
                self.running.log_file.close()
                self.running = None
