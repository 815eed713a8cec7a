"""What every cluster node's agent does, whatever the framework: register, heartbeat, wait for its
data, watch for a reason to leave, and run its one framework process.

:class:`ClusterMember` is the base of the MXNet/TensorFlow agent (spot_training/agent/ps_node.py) and of the
PyTorch ones (spot_training/agent/torch_elastic.py). Registrations and heartbeats are the files of
spot_training/agent/cluster_state.py; the process runs through spot_training/agent/process_group.py's :class:`ProcessGroup`,
the same way as the single-node trainer. Standard library only.
"""

from __future__ import annotations

import json
import logging
import os
from pathlib import Path
from typing import Any, Callable, Iterable, Mapping

from spot_training.agent.cluster_state import ClusterConfig, ClusterState
from spot_training.agent.imds import ImdsError
from spot_training.agent.interruption import (DEFAULT_MARGIN_S, IMDS_FORBIDDEN, REBALANCE_RECOMMENDATION,
                                              SPOT_INTERRUPTION, poll_events, stop_wait_s)
from spot_training.agent.safepath import open_directory, write_bytes_atomic
from spot_training.agent.process_group import ProcessGroup
from spot_training.contract import COMPLETED_FILE, ENV_CHECKPOINT_REQUEST_FILE

log = logging.getLogger("spot_training.agent.cluster")

__all__ = ["ClusterMember"]


class ClusterMember:
    """Shared state and steps of a cluster node's agent.

    Args:
        settings: the validated ``cluster`` section (:class:`ClusterConfig`).
        role: ``scheduler``, ``server`` or ``worker``.
        node_id: the instance id.
        host: the private IPv4 address.
        python: the training interpreter.
        environ: the base environment of the processes.
        workdir: where processes start (the training code).
        checkpoint_dir: from the config; ``COMPLETED`` is looked for here.
        dataset_dir: from the config; a worker is data-ready when it has an entry (None: always ready).
        log_dir: from the config; the processes' logs go here.
        monitors: objects with ``poll() -> Event | None`` polled every ``monitor_interval_s`` seconds on
            workers (:meth:`_poll_monitors`).
        monitor_interval_s: seconds between monitor polls.
        netns: local mode only: run the processes inside this network namespace (None: no namespace).
        preexec_user: ``(uid, gid, groups)`` to drop privileges to, or None.
        clock: wall-clock seconds (heartbeats are compared across nodes).
        sleep: sleeps the given seconds.
        port: the address's port (default: the role's, :meth:`ClusterConfig.port_for`).
    """

    def __init__(self, settings: ClusterConfig, *, role: str, node_id: str, host: str, python: str,
                 environ: Mapping[str, str], workdir: Path, checkpoint_dir: Path, dataset_dir: Path | None,
                 log_dir: Path, monitors: Iterable[Any], monitor_interval_s: float, netns: str | None,
                 preexec_user: tuple[int, int, list[int]] | None, clock: Callable[[], float],
                 sleep: Callable[[float], None], port: int | None = None) -> None:
        self.settings, self.role, self.node_id, self.host = settings, role, node_id, host
        self.port = port if port is not None else settings.port_for(role)
        self.python, self.environ, self.workdir = python, dict(environ), workdir
        self.checkpoint_dir, self.dataset_dir, self.log_dir = checkpoint_dir, dataset_dir, log_dir
        self.monitors, self.monitor_interval_s, self.netns = list(monitors), monitor_interval_s, netns
        self.preexec_user, self.clock, self.sleep = preexec_user, clock, sleep
        self.state = ClusterState(settings.state_dir)
        self.leaving = False
        self.leave_reason: str | None = None  # the event kind that made this worker leave
        self.stop_requested = False
        self.registered_at = clock()
        self.data_ready = False
        self._last_monitor = float("-inf")
        self._seen: set[str] = set()
        self.leave_event: Any = None  # the event that made this worker leave (its deadline bounds the wait)

    def request_stop(self) -> None:
        """From a signal handler (the agent got SIGTERM): a worker leaves, other roles stop. Sets a flag."""
        self.stop_requested = True

    def completed(self) -> bool:
        """True when the trainer wrote ``COMPLETED`` into the (shared) checkpoint directory."""
        return (self.checkpoint_dir / COMPLETED_FILE).exists()

    def _data_is_ready(self) -> bool:
        if self.dataset_dir is None:
            return True
        try:
            return self.dataset_dir.is_dir() and any(self.dataset_dir.iterdir())
        except OSError:
            return False

    def _register(self) -> None:
        self.state.register({"node_id": self.node_id, "instance_id": self.node_id, "role": self.role,
                             "host": self.host, "port": self.port, "data_ready": self.data_ready,
                             "leaving": self.leaving, "registered_at": self.registered_at})

    def _beat(self, *, generation: int, process: ProcessGroup | None, returncode: int | None) -> None:
        """Write this node's heartbeat: ``proc`` is ``running`` while ``process`` runs, ``exited`` once
        one exited with ``returncode``, else ``none``."""
        proc = "running" if process is not None else ("exited" if returncode is not None else "none")
        self.state.heartbeat({"node_id": self.node_id, "time": self.clock(), "generation": generation, "proc": proc,
                              "returncode": None if process is not None else returncode,
                              "pid": process.pid if process is not None else None, "leaving": self.leaving})

    def _watch(self) -> None:
        """One pass over the leave conditions of a worker: its data became ready (re-register), a
        monitor's event (at most every ``monitor_interval_s``), the agent stopped."""
        if not self.data_ready and self._data_is_ready():
            self.data_ready = True
            self._register()
        self._poll_monitors()
        if self.role == "worker" and self.stop_requested and not self.leaving:
            self._leave("agent-stopped")

    def _poll_monitors(self) -> None:
        """A worker polls its monitors at most every ``monitor_interval_s`` through the single node's
        pipeline (:func:`spot_training.agent.interruption.poll_events`: a transient IMDS error is retried
        next round, never raised out of the agent loop). A spot notice or the member tag removed means
        leave (the notice's deadline bounds the wait for the trainer); IMDS answering 403 means leave
        (this node can no longer see notices); a rebalance recommendation asks the trainer for a
        checkpoint and keeps training."""
        now = self.clock()
        if self.role != "worker" or self.leaving or now - self._last_monitor < self.monitor_interval_s:
            return
        self._last_monitor = now
        try:
            events = poll_events(self.monitors, self._seen)
        except ImdsError as exc:
            log.error("IMDS answered 403: leaving the cluster, this node can no longer see spot "
                      "interruption notices", extra={"event": "node_unusable", "error": str(exc)})
            self._leave(IMDS_FORBIDDEN)
            return
        for event in events:
            if event.kind == REBALANCE_RECOMMENDATION:
                self._request_checkpoint(event)
                continue
            if event.kind == SPOT_INTERRUPTION:
                log.warning("spot interruption notice: leaving the cluster", extra={
                    "event": "spot_interruption_notice", "event_id": event.id, **event.detail})
            log.info("worker leaving the cluster", extra={"kind": event.kind, "event_id": event.id})
            self._leave(event.kind, event)
            return

    def _request_checkpoint(self, event: Any) -> None:
        """Ask the trainer for an extra checkpoint the contract's way for cluster trainers: the request
        file (docs/contracts.md, "Signals and files"; torchrun does not forward SIGUSR1)."""
        path = self.environ.get(ENV_CHECKPOINT_REQUEST_FILE)
        if not path:
            return
        owner = None if self.preexec_user is None else self.preexec_user[:2]
        try:
            write_bytes_atomic(path, json.dumps({"reason": event.kind, "time": self.clock()}).encode(), owner=owner)
        except OSError as exc:
            log.warning("could not ask the trainer for a checkpoint", extra={"path": path, "error": str(exc)})
            return
        log.info("rebalance recommendation: asked the trainer for an extra checkpoint",
                 extra={"event": "rebalance_recommendation", "event_id": event.id})

    def _leave(self, reason: str, event: Any = None) -> None:
        self.leave_reason, self.leaving, self.leave_event = reason, True, event
        self._register()

    def leave_wait_s(self, default_s: float) -> float:
        """Seconds to wait for the framework process after leaving: until the notice's deadline minus
        the agent's margin (:func:`spot_training.agent.interruption.stop_wait_s`), else ``default_s``."""
        return stop_wait_s(self.leave_event, now=self.clock(), margin_s=DEFAULT_MARGIN_S, default_s=default_s)

    def _start_process(self, argv: list[str], log_name: str, env: Mapping[str, str], *,
                       netns: str | None) -> ProcessGroup:
        """Start ``argv`` in a process group of its own as ``preexec_user``, output appended to
        ``<log_dir>/<log_name>`` (spot_training/agent/supervisor.py's :class:`ProcessGroup`)."""
        # The log directory is on EFS (training-user writable): created without following planted links.
        os.close(open_directory(self.log_dir, create=True))
        return ProcessGroup.start(argv, cwd=self.workdir, env=env, user=self.preexec_user, netns=netns,
                                  log_path=self.log_dir / log_name, clock=self.clock)

    def _loop(self, step: Callable[[], str | None]) -> str:
        """Call ``step`` every ``heartbeat_interval_s / 2`` seconds (at most 0.5 s) until it returns an outcome."""
        interval = min(0.5, self.settings.heartbeat_interval_s / 2)
        while True:
            outcome = step()
            if outcome is not None:
                return outcome
            self.sleep(interval)
