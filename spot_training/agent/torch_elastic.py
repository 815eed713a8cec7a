"""PyTorch clusters on TorchElastic: the coordinator's rendezvous store and each worker's ``torchrun``.

PyTorch can change its membership while it runs (``torchrun --nnodes=MIN:MAX`` with the c10d
rendezvous restarts every worker group when a node joins or is lost), so, unlike MXNet and TensorFlow
(spot_training/agent/cluster_coordinator.py), there are no generations: TorchElastic does membership, these agents only keep
its rendezvous reachable and its torchruns running (docs/architecture.md, docs/contracts.md "Cluster
state on EFS", docs/cluster.md).

- **Coordinator** (``scheduler`` role, on-demand Auto Scaling group): runs and supervises ONE process,
  ``python -m spot_training.training.distributed.torch_rendezvous --host 0.0.0.0 --port <scheduler_port>`` (a
  TCPStore server; no spot worker ever hosts the rendezvous). It publishes ``rendezvous.json`` in
  ``cluster.state_dir``: ``{"host", "port", "epoch", "node_id", "since"}``. ``epoch`` (1, 2, ...) only
  grows: it is bumped whenever the coordinator (re)starts its store (a replacement node reads the old
  value) and when a worker reports that its torchrun ended on its own in the current epoch (restarts
  exhausted or a closed rendezvous: torchrun closes a run id for good when it gives up). The run id is
  ``<stack>-<epoch>``, so a closed id is never reused. After ``COMPLETED`` it waits until no live
  worker is registered (at most ``stop_timeout_s``), stops the store and returns ``"completed"``.
- **Worker** (spot fleet): waits for its data and ``rendezvous.json``, then runs
  ``python -m torch.distributed.run --nnodes=MIN:MAX --nproc-per-node=N --rdzv-backend=c10d
  --rdzv-endpoint=HOST:PORT --rdzv-id=<stack>-<epoch> --max-restarts=R --shutdown-timeout=G
  --local-addr=<private IPv4> --rdzv-conf=last_call_timeout=L --no-python <training command>`` in its
  own process group and supervises it:

  * exit with ``COMPLETED`` in the checkpoint directory: ``"completed"`` (then spot_training.agent.fleet_actions.finish_node);
  * an exit the contract's restart policy gives up on (74 checkpoint storage, 78 checkpoint
    mismatch; ``spot_training.contract.TRAINER_EXIT_POLICY``): deregister and raise the agent error
    carrying that status (the agent exits with it and systemd does not restart it);
  * any other exit: relaunch after :data:`RELAUNCH_BACKOFF_S`, re-reading the address and epoch; an
    exit the agent did not ask for is reported in ``rendezvous-reports/<node_id>.json``
    (``{"node_id", "epoch", "returncode", "time"}``) so the coordinator moves to a new epoch;
  * the published epoch or address changed under a running torchrun (a replaced coordinator):
    SIGTERM it (the job agrees on one checkpoint at the next step), relaunch under the new epoch;
  * a spot interruption notice, the member tag removed, or the agent stopped: SIGTERM to ITS torchrun
    only (torchrun forwards it to its ranks; the trainer's ranks all stop at the same step, rank 0
    saves, and the other nodes' torchruns restart without this one), wait for it to exit (until the
    notice's deadline minus the agent's margin; without a deadline ``torch_shutdown_timeout_s`` +
    ``kill_grace_s``), then SIGKILL its group, and return ``"left"``.

Registrations and heartbeats use the same files as the other frameworks (:class:`ClusterState`;
the heartbeat's ``generation`` is the epoch, ``pid`` the torchrun's or the store's). Standard library only.
"""

from __future__ import annotations

import json
import logging
import os
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterable, Mapping

from spot_training import contract
from spot_training.agent.cluster_member import ClusterMember
from spot_training.agent.cluster_state import ClusterConfig, read_json, valid_record, write_json_atomic, write_state_json
from spot_training.agent.errors import give_up_error
from spot_training.agent.process_group import ProcessGroup
from spot_training.agent.safepath import UnsafePathError, list_directory, open_directory, unlink
from spot_training.contract import ENV_NODE_ID, TRAINER_GIVE_UP, trainer_exit_decision

log = logging.getLogger("spot_training.agent.torch_elastic")

__all__ = ["RendezvousState", "TorchCoordinator", "TorchWorker", "torchrun_argv", "RELAUNCH_BACKOFF_S",
           "RENDEZVOUS_FILE", "REPORTS_DIR", "STORE_MODULE"]

RENDEZVOUS_FILE = "rendezvous.json"
REPORTS_DIR = "rendezvous-reports"
#: The module the coordinator runs as its rendezvous store process (the training side of the rendezvous).
STORE_MODULE = "spot_training.training.distributed.torch_rendezvous"
#: Seconds between a torchrun's exit and its relaunch (or a store's restart): long enough not to spin
#: on a coordinator that is not up yet, short next to torchrun's own rendezvous timeouts.
RELAUNCH_BACKOFF_S = 2.0
#: Set in torchrun's environment. With the rendezvous store shared with the workers (torch's default
#: since 2.4), an agent that was rank 0 in an earlier round keeps its bootstrap store info and does not
#: publish ``MASTER_ADDR`` for the next round, so a node joining a running job waits for it until the
#: store timeout (60 s) and the round fails (torch/distributed/elastic/rendezvous/dynamic_rendezvous.py,
#: ``next_rendezvous``; seen here on every scale-up). Opting out rebuilds it every round.
TORCHRUN_ENV = dict(contract.TORCHRUN_ENV)
#: torchrun's ``last_call_timeout`` (seconds a rendezvous waits for more nodes once it has MIN):
#: torchrun's default of 30 s would hold every join and leave that long.
LAST_CALL_TIMEOUT_S = 3


def torchrun_argv(*, python: str, settings: ClusterConfig, endpoint: str, run_id: str, local_addr: str,
                  training_argv: list[str]) -> list[str]:
    """The worker's torchrun command (``python -m torch.distributed.run``, i.e. ``torchrun``).

    ``--no-python`` runs ``training_argv`` as given (it starts with the interpreter), so any training
    command works. Flag names from ``torchrun --help`` (torch 2.5..2.11): ``--nnodes``,
    ``--nproc-per-node``, ``--rdzv-backend``, ``--rdzv-endpoint``, ``--rdzv-id``, ``--rdzv-conf``,
    ``--max-restarts``, ``--shutdown-timeout``, ``--local-addr``, ``--no-python``.

    Args:
        python: the training interpreter (runs ``-m torch.distributed.run``).
        settings: the ``cluster`` section (worker bounds, processes per node, restarts, shutdown timeout).
        endpoint: the coordinator's rendezvous store, ``host:port``.
        run_id: the rendezvous id (new for every rendezvous epoch).
        local_addr: this node's address for torchrun (``--local-addr``).
        training_argv: the training command, starting with the interpreter.

    Returns:
        the argv list.
    """
    return [python, "-m", "torch.distributed.run",
            f"--nnodes={settings.min_workers}:{settings.max_workers}",
            f"--nproc-per-node={settings.torch_nproc_per_node}",
            "--rdzv-backend=c10d", f"--rdzv-endpoint={endpoint}", f"--rdzv-id={run_id}",
            f"--rdzv-conf=last_call_timeout={LAST_CALL_TIMEOUT_S}",
            f"--max-restarts={settings.torch_max_restarts}",
            f"--shutdown-timeout={int(round(settings.torch_shutdown_timeout_s))}",
            f"--local-addr={local_addr}", "--no-python", *training_argv]


class RendezvousState:
    """``rendezvous.json`` and ``rendezvous-reports/`` under ``state_dir`` (atomic writes)."""

    def __init__(self, state_dir: str | os.PathLike) -> None:
        self.root = Path(state_dir)
        self.path = self.root / RENDEZVOUS_FILE
        self.reports_dir = self.root / REPORTS_DIR
        os.close(open_directory(self.reports_dir, create=True))

    def read(self) -> dict | None:
        """The published rendezvous, or None before the first coordinator published one or when the
        file is no valid rendezvous record (``cluster_state.SCHEMAS``; logged)."""
        data = read_json(self.path)
        return data if data is not None and valid_record("rendezvous", data, path=self.path) else None

    def publish(self, *, host: str, port: int, epoch: int, node_id: str, since: float) -> None:
        """Write ``rendezvous.json`` (atomic, never through a planted link).

        Args:
            host: the coordinator's address.
            port: its rendezvous store's TCP port.
            epoch: the rendezvous epoch (each gives torchrun a new run id).
            node_id: the coordinator's node id.
            since: when it was published, epoch seconds.
        """
        write_state_json(self.path, {"host": host, "port": int(port), "epoch": int(epoch), "node_id": node_id,
                                      "since": since})

    def report(self, node_id: str, epoch: int, returncode: int, now: float) -> None:
        """Record that a worker's torchrun ended on its own in ``epoch`` (``rendezvous-reports/<node_id>.json``).

        Args:
            node_id: the worker.
            epoch: the rendezvous epoch its torchrun ran in.
            returncode: torchrun's exit status.
            now: epoch seconds.
        """
        write_state_json(self.reports_dir / f"{node_id}.json",
                          {"node_id": node_id, "epoch": int(epoch), "returncode": int(returncode), "time": now})

    def _report_names(self) -> list[str]:
        try:
            return [n for n in list_directory(self.reports_dir) if n.endswith(".json") and not n.startswith(".")]
        except (UnsafePathError, OSError) as exc:
            log.warning("ignoring unreadable reports directory", extra={"path": str(self.reports_dir),
                                                                        "error": str(exc)})
            return []

    def reports(self) -> list[dict]:
        """The valid report records (``cluster_state.SCHEMAS``); others are logged and ignored."""
        out = []
        for name in sorted(self._report_names()):
            path = self.reports_dir / name
            data = read_json(path)
            if data is not None and valid_record("report", data, path=path):
                out.append(data)
        return out

    def clear_reports(self) -> None:
        """Remove every report (entries of the reports directory itself, never through a link)."""
        for name in self._report_names():
            unlink(self.reports_dir / name)


@dataclass
class _Proc:
    process: ProcessGroup
    epoch: int
    endpoint: str
    asked: bool = False  # the agent asked it to stop (its exit is no failure to report)

    @property
    def proc(self) -> subprocess.Popen:
        """The Popen of the process."""
        return self.process.proc


class _Base(ClusterMember):
    """What both roles share beyond :class:`ClusterMember`: the rendezvous files and one process run
    under an epoch."""

    def __init__(self, settings: ClusterConfig, **kwargs: Any) -> None:
        super().__init__(settings, role=self.role, **kwargs)
        self.rdzv = RendezvousState(settings.state_dir)
        self.running: _Proc | None = None
        self.last_exit: int | None = None
        self.epoch = 0

    def _heartbeat(self) -> None:
        self._beat(generation=self.epoch, process=self.running.process if self.running else None,
                   returncode=self.last_exit)

    def _popen(self, argv: list[str], epoch: int, endpoint: str, log_name: str,
               extra_env: Mapping[str, str] | None = None) -> None:
        env = dict(self.environ)
        env.update(extra_env or {})
        if self.netns and "GLOO_SOCKET_IFNAME" not in env:
            interface = _interface_of(self.netns, self.host)
            if interface:  # in a namespace the hostname resolves to loopback: name gloo's interface
                env["GLOO_SOCKET_IFNAME"] = interface
        process = self._start_process(argv, log_name, env, netns=self.netns)
        self.running = _Proc(process, epoch, endpoint)
        self.last_exit = None
        log.info("process started", extra={"role": self.role, "pid": process.pid, "epoch": epoch, "argv": argv})

    def _reap(self) -> _Proc | None:
        run = self.running
        if run is None:
            return None
        code = run.process.poll()
        if code is None:
            return None
        self.last_exit = code
        self.running = None
        log.info("process exited", extra={"role": self.role, "returncode": code, "epoch": run.epoch})
        return run

    def _terminate(self) -> None:
        """SIGTERM to the process itself (torchrun forwards it to its ranks), once."""
        if self.running is not None and self.running.process.term_sent is None:
            self.running.asked = True
            self.running.process.stop(kill_after=None, group=False)

    def _stop_and_wait(self, grace_s: float) -> None:
        """SIGTERM, wait up to ``grace_s`` for the exit, then SIGKILL the process and everything under
        it (torchrun starts each rank in a session of its own, so its group alone would orphan them)."""
        self._terminate()
        deadline = self.clock() + grace_s
        while self.running is not None and self._reap() is None:
            process = self.running.process
            if self.clock() >= deadline:
                log.warning("process did not stop after SIGTERM; SIGKILL", extra={"pid": process.pid})
                process.kill_and_wait()
                self._reap()
                break
            self._heartbeat()
            self.sleep(0.2)

    def _cleanup(self) -> None:
        if self.running is not None:
            self.running.process.kill_and_wait()
            self._reap()


def _interface_of(netns: str, address: str) -> str | None:
    """The interface holding ``address`` inside ``netns`` (``ip -n NS -o -4 addr show``), or None."""
    try:
        out = subprocess.run(["ip", "-n", netns, "-o", "-4", "addr", "show"], capture_output=True, text=True,
                             timeout=10, check=False).stdout
    except (OSError, subprocess.SubprocessError):
        return None
    for line in out.splitlines():
        parts = line.split()
        if len(parts) >= 4 and parts[3].split("/")[0] == address:
            return parts[1]
    return None


class TorchCoordinator(_Base):
    """The coordinator of a PyTorch cluster (see the module docstring).

    It runs the rendezvous store process and publishes its address; :meth:`run` returns
    ``"completed"`` or ``"stopped"`` (agent stopped).

    Args:
        settings: the ``cluster`` section.
        node_id: this node's id.
        host: this node's private address (published in the rendezvous).
        python: the training interpreter (runs the store module).
        environ: the base environment of the store process.
        workdir: where the store process starts.
        checkpoint_dir: ``COMPLETED`` is looked for here.
        log_dir: the store's log goes here.
        netns: local mode only: the network namespace (None: none).
        preexec_user: ``(uid, gid, groups)`` to drop privileges to, or None.
        bind_host: the address the store listens on (default ``0.0.0.0``; the security group admits
            only cluster members).
        clock: wall-clock seconds.
        sleep: sleeps the given seconds.
    """

    role = "scheduler"

    def __init__(self, settings: ClusterConfig, *, node_id: str, host: str, python: str, environ: Mapping[str, str],
                 workdir: Path, checkpoint_dir: Path, log_dir: Path, netns: str | None = None,
                 preexec_user: tuple[int, int, list[int]] | None = None, bind_host: str = "0.0.0.0",
                 clock: Callable[[], float] = time.time, sleep: Callable[[float], None] = time.sleep) -> None:
        super().__init__(settings, node_id=node_id, host=host, python=python, environ=environ, workdir=workdir,
                         checkpoint_dir=checkpoint_dir, dataset_dir=None, log_dir=log_dir, monitors=(),
                         monitor_interval_s=0.0, netns=netns, preexec_user=preexec_user, clock=clock, sleep=sleep)
        self.data_ready = True
        self.bind_host = bind_host
        self._next_start = float("-inf")
        self._completed_since: float | None = None

    def _publish(self, epoch: int) -> None:
        self.epoch = epoch
        self.rdzv.clear_reports()
        self.rdzv.publish(host=self.host, port=self.settings.scheduler_port, epoch=epoch, node_id=self.node_id,
                          since=self.clock())
        log.info("rendezvous published", extra={"epoch": epoch, "host": self.host,
                                                "port": self.settings.scheduler_port})

    def _start_store(self) -> None:
        previous = self.rdzv.read() or {}
        epoch = max(int(previous.get("epoch", 0)), self.epoch) + 1
        argv = [self.python, "-m", STORE_MODULE, "--host", self.bind_host, "--port", str(self.settings.scheduler_port)]
        self._popen(argv, epoch, f"{self.host}:{self.settings.scheduler_port}", f"rendezvous-{self.node_id}.log")
        self._publish(epoch)

    def _live_workers(self, now: float) -> list[str]:
        beats = self.state.heartbeats()
        return [n for n, r in self.state.registrations().items() if r.get("role") == "worker"
                and now - float(beats.get(n, {}).get("time", r.get("registered_at", 0))) <= self.settings.heartbeat_timeout_s]

    def step(self) -> str | None:
        """One round: reap or restart the store, publish a new epoch after a torchrun ended on its own, beat.

        Returns:
            ``"completed"`` or ``"stopped"`` when the loop should end, else None.
        """
        now = self.clock()
        exited = self._reap()
        if exited is not None and not self.stop_requested:
            log.warning("rendezvous store exited; restarting it under a new epoch",
                        extra={"returncode": self.last_exit})
            self._next_start = now + RELAUNCH_BACKOFF_S
        if self.stop_requested:
            return "stopped"
        if self.completed():
            self._completed_since = self._completed_since or now
            if not self._live_workers(now) or now - self._completed_since > self.settings.stop_timeout_s:
                return "completed"
        elif self.running is None and now >= self._next_start:
            self._start_store()
        elif self.running is not None and any(int(r.get("epoch", -1)) == self.epoch for r in self.rdzv.reports()):
            # A torchrun ended on its own in this epoch (restarts exhausted / rendezvous closed): a new run id.
            self._publish(self.epoch + 1)
        self._heartbeat()
        return None

    def run(self) -> str:
        """Register, loop over :meth:`step` until it ends, stop the store and clean up.

        Returns:
            ``"completed"`` or ``"stopped"``.
        """
        self._register()
        try:
            outcome = self._loop(self.step)
            self._stop_and_wait(self.settings.kill_grace_s)
            self._heartbeat()
            return outcome
        finally:
            self._cleanup()


class TorchWorker(_Base):
    """A worker of a PyTorch cluster (see the module docstring).

    :meth:`run` returns ``"completed"`` or ``"left"``; ``leave_reason`` names the event kind
    (``member-tag-removed``, ``agent-stopped``, ...).

    Args:
        settings: the ``cluster`` section.
        node_id: this node's id.
        host: this node's private address (torchrun's ``--local-addr``).
        python: the training interpreter.
        training_argv: the training command, starting with the interpreter.
        run_id_prefix: torchrun's rendezvous id is ``<prefix>-<epoch>``.
        environ: the base environment of torchrun.
        workdir: where torchrun starts (the training code).
        checkpoint_dir: ``COMPLETED`` is looked for here.
        dataset_dir: the worker is data-ready when it has an entry.
        log_dir: torchrun's log goes here.
        monitors: interruption and member-tag monitors, polled every ``monitor_interval_s`` seconds.
        monitor_interval_s: seconds between monitor polls (default 5).
        netns: local mode only: the network namespace (None: none).
        preexec_user: ``(uid, gid, groups)`` to drop privileges to, or None.
        clock: wall-clock seconds.
        sleep: sleeps the given seconds.
    """

    role = "worker"

    def __init__(self, settings: ClusterConfig, *, node_id: str, host: str, python: str, training_argv: list[str],
                 run_id_prefix: str, environ: Mapping[str, str], workdir: Path, checkpoint_dir: Path,
                 dataset_dir: Path, log_dir: Path, monitors: Iterable[Any] = (), monitor_interval_s: float = 5.0,
                 netns: str | None = None, preexec_user: tuple[int, int, list[int]] | None = None,
                 clock: Callable[[], float] = time.time, sleep: Callable[[float], None] = time.sleep) -> None:
        super().__init__(settings, node_id=node_id, host=host, python=python, environ=environ, workdir=workdir,
                         checkpoint_dir=checkpoint_dir, dataset_dir=dataset_dir, log_dir=log_dir, monitors=monitors,
                         monitor_interval_s=monitor_interval_s, netns=netns, preexec_user=preexec_user, clock=clock,
                         sleep=sleep)
        self.training_argv, self.run_id_prefix = list(training_argv), run_id_prefix
        self._next_start = float("-inf")
        self.launches = 0

    def _launch(self, rdzv: Mapping[str, Any]) -> None:
        endpoint = f"{rdzv['host']}:{int(rdzv['port'])}"
        epoch = int(rdzv["epoch"])
        argv = torchrun_argv(python=self.python, settings=self.settings, endpoint=endpoint,
                             run_id=f"{self.run_id_prefix}-{epoch}", local_addr=self.host,
                             training_argv=self.training_argv)
        self.epoch = epoch
        self.launches += 1
        # The node id names each trainer's step log (steps-<node_id>.csv, docs/cluster.md), as the
        # MXNet/TF agents' launch environment does.
        self._popen(argv, epoch, endpoint, f"torchrun-{self.node_id}.log",
                    extra_env={**TORCHRUN_ENV, ENV_NODE_ID: self.node_id})

    def _rendezvous(self) -> dict | None:
        """The published rendezvous when its endpoint is the address of the registered coordinator
        that published it; otherwise None (logged): a file on EFS never sends torchrun elsewhere."""
        rdzv = self.rdzv.read()
        if rdzv is None:
            return None
        member = self.state.registrations().get(rdzv["node_id"])
        if member is None or member["role"] != "scheduler" or (member["host"], member["port"]) != (rdzv["host"],
                                                                                               rdzv["port"]):
            log.warning("ignoring a rendezvous that is not a registered coordinator's address",
                        extra={"node_id": rdzv["node_id"], "host": rdzv["host"], "port": rdzv["port"]})
            return None
        return rdzv

    def step(self) -> str | None:
        """One round: watch the monitors, reap torchrun, relaunch or leave, follow the rendezvous, beat.

        Returns:
            ``"completed"`` or ``"left"`` when the loop should end, else None.

        Raises:
            AgentError: torchrun exited with a status the contract's restart policy gives up on (74 or 78;
                :func:`~spot_training.agent.errors.give_up_error`).
        """
        now = self.clock()
        self._watch()
        exited = self._reap()
        if exited is not None:
            if self.completed():
                return "completed"
            if not exited.asked and not self.leaving:
                if trainer_exit_decision(self.last_exit) == TRAINER_GIVE_UP:
                    # The contract's restart policy: a relaunch would fail the same way (full or
                    # unusable checkpoint storage, a checkpoint of another job); leave and exit with it.
                    self.leaving, self.leave_reason = True, f"trainer-exit-{self.last_exit}"
                    self.state.deregister(self.node_id)
                    raise give_up_error(self.last_exit, self.checkpoint_dir)
                self.rdzv.report(self.node_id, exited.epoch, self.last_exit, now)
            self._next_start = now + RELAUNCH_BACKOFF_S
        if self.leaving:
            # SIGTERM only our torchrun; the job agrees on one checkpoint; wait, then leave.
            self._stop_and_wait(self.leave_wait_s(self.settings.torch_shutdown_timeout_s + self.settings.kill_grace_s))
            return "completed" if self.completed() else "left"
        rdzv = self._rendezvous()
        if self.running is not None:
            if rdzv and (int(rdzv["epoch"]) != self.running.epoch
                         or f"{rdzv['host']}:{int(rdzv['port'])}" != self.running.endpoint):
                log.info("rendezvous moved to a new epoch; restarting torchrun",
                         extra={"from": self.running.epoch, "to": rdzv["epoch"]})
                self._terminate()
        elif self.completed():
            return "completed"
        elif self.data_ready and rdzv and now >= self._next_start:
            self._launch(rdzv)
        self._heartbeat()
        return None

    def run(self) -> str:
        """Register (data-ready when the dataset is there), loop over :meth:`step`, deregister and clean up.

        Returns:
            ``"completed"`` or ``"left"``.

        Raises:
            AgentError: as :meth:`step`.
        """
        self.data_ready = self._data_is_ready()
        self._register()
        try:
            outcome = self._loop(self.step)
            self._heartbeat()
            self.state.deregister(self.node_id)
            return outcome
        finally:
            self._cleanup()


def describe(rdzv: Mapping[str, Any] | None) -> str:
    """One line for logs and the drill: ``epoch N at HOST:PORT`` or ``not published``."""
    return "not published" if not rdzv else f"epoch {rdzv['epoch']} at {rdzv['host']}:{rdzv['port']}"


if __name__ == "__main__":  # pragma: no cover - debugging aid: print the published rendezvous
    import sys

    print(json.dumps(RendezvousState(sys.argv[1]).read()))
