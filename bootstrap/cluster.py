"""Elastic membership of a parameter-server cluster: registrations, the plan, heartbeats, generations.

Neither MXNet 1.9.1 (no elastic kvstore) nor TensorFlow (the elastic parameter-server pull request was
closed) can add a worker address to a running job, so membership changes by *generations*
(docs/architecture.md, "Clusters run on the frameworks' own engines"). Everything lives in one directory on EFS,
``cluster.state_dir`` (docs/contracts.md, "Cluster state on EFS")::

    <state_dir>/
      registrations/<node_id>.json   one per node, written atomically by the node's agent
      heartbeats/<node_id>.json      rewritten by each agent every cluster.heartbeat_interval_s
      plan.json                      the coordinator's plan (only the coordinator writes it)
      events.jsonl                   one JSON line per plan change (generation, state, reason, time)

Roles: the ``scheduler`` node's agent is the coordinator (and runs the ps-lite scheduler or the
TensorFlow chief); ``server`` nodes run parameter servers; ``worker`` nodes train (spot).

A generation goes ``running`` -> (``checkpoint`` ->) ``teardown`` -> the next one ``running``:

- *Join* (a data-ready worker not in the plan, membership stable for ``debounce_s``) and *leave* (a
  worker whose registration says ``leaving``: spot interruption notice, member tag removed, agent
  stopped; no debounce; after a tag removal the agent then lowers its fleet's target capacity and
  terminates its instance, see :func:`leave_fleet`) go through ``checkpoint``: the checkpointing
  processes get SIGTERM (MXNet workers agree on a last step through the kvstore and rank 0 saves;
  the TensorFlow chief joins its coordinator and saves), then ``teardown``.
- *Failure* goes straight to ``teardown`` (a checkpoint cannot complete with a process gone: MXNet
  hangs silently): a member's heartbeat older than ``heartbeat_timeout_s`` (node gone), or a member's
  process exited inside a running generation (any MXNet process; TensorFlow chief or ps; a
  TensorFlow worker is restarted at the same address instead, which TensorFlow tolerates).
- ``teardown``: every agent SIGTERMs its process group and SIGKILLs it after ``kill_grace_s``; when
  every member's process is gone (or ``stop_timeout_s`` passed) the coordinator writes the next
  generation, whose trainers restore the newest checkpoint. Too few nodes: state ``waiting``.
- ``COMPLETED`` in the checkpoint directory: state ``completed``; every agent stops and exits 0; the
  workers' agents cancel their spot fleet (:func:`finish_node`).

Hand-rolled because no library does membership for ps-lite/TF clusters on a shared file system (etcd
or ZooKeeper would be one more service to run on spot capacity); it needs only atomic renames on EFS.
Standard library only; the clock, sleep and monitors are injected.
"""

from __future__ import annotations

import json
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
from bootstrap.errors import ConfigError
from spot_contract import CLUSTER_MEMBER_TAG, COMPLETED_FILE, SETTINGS, write_json_atomic

#: TCP ports of the roles: the contract's range, the one the stack validates too.
PORTS = SETTINGS["port"]

log = logging.getLogger("bootstrap.cluster")

__all__ = ["ClusterSettings", "ClusterState", "Coordinator", "NodeAgent", "MemberTagMonitor", "Plan",
           "make_plan", "settings_from_config", "leave_fleet", "finish_node", "RUNNING", "CHECKPOINT", "TEARDOWN", "WAITING", "COMPLETED"]

RUNNING, CHECKPOINT, TEARDOWN, WAITING, COMPLETED = "running", "checkpoint", "teardown", "waiting", "completed"
PLAN_STATES = (RUNNING, CHECKPOINT, TEARDOWN, WAITING, COMPLETED)
CLUSTER_ROLES = ("scheduler", "server", "worker")
#: Instance tag whose removal asks a worker to leave (the Dynamic Training article's mechanism).
DEFAULT_MEMBER_TAG = CLUSTER_MEMBER_TAG
MEMBER_TAG_REMOVED = "member-tag-removed"
#: ``NodeAgent.leave_reason`` of a worker whose IMDS answered 403 (it can no longer see notices).
IMDS_FORBIDDEN = "imds-forbidden"


# ---- settings -------------------------------------------------------------------------------------
@dataclass(frozen=True)
class ClusterSettings:
    """The config's ``cluster`` section (docs/contracts.md).

    state_dir: the EFS directory for registrations, heartbeats and the plan (absolute).
    num_servers: parameter servers per generation (>= 1). min_workers: fewest workers to train with
    (>= 1, default 1). scheduler_port / server_port / worker_port: each node's fixed framework port
    (defaults 9000/9001/9002: ps-lite's ``DMLC_PS_ROOT_PORT``/``PORT``, TensorFlow's gRPC ports).
    heartbeat_interval_s (default 1), heartbeat_timeout_s (default 15): a member whose heartbeat is
    older is dead. debounce_s (default 5): joins wait until membership is stable this long.
    stop_timeout_s (default 120): bound on the checkpoint and teardown phases. kill_grace_s
    (default 5): SIGTERM -> SIGKILL in teardown. member_tag: instance tag whose removal means leave.

    PyTorch (TorchElastic, bootstrap/torch_elastic.py): ``num_servers`` is 0; ``scheduler_port`` is the
    c10d rendezvous port on the coordinator; max_workers (default 8) is torchrun's upper ``--nnodes``;
    torch_max_restarts (default 100), torch_shutdown_timeout_s (default 90), torch_nproc_per_node
    (default 1) are torchrun's ``--max-restarts``, ``--shutdown-timeout`` and ``--nproc-per-node``.
    """

    state_dir: Path
    num_servers: int
    min_workers: int = 1
    scheduler_port: int = 9000
    server_port: int = 9001
    worker_port: int = 9002
    heartbeat_interval_s: float = 1.0
    heartbeat_timeout_s: float = 15.0
    debounce_s: float = 5.0
    stop_timeout_s: float = 120.0
    kill_grace_s: float = 5.0
    member_tag: str = DEFAULT_MEMBER_TAG
    max_workers: int = 8
    torch_max_restarts: int = 100
    torch_shutdown_timeout_s: float = 90.0
    torch_nproc_per_node: int = 1

    def port_for(self, role: str) -> int:
        """The fixed port of a node with ``role``."""
        return {"scheduler": self.scheduler_port, "server": self.server_port, "worker": self.worker_port}[role]


def settings_from_config(section: Mapping[str, Any] | None, *, framework: str | None = None) -> ClusterSettings:
    """Validate the ``cluster`` section (a dict); every problem is reported in one ConfigError (exit 78)
    naming ``cluster.<key>``, the value and what is allowed. ``framework`` ``pytorch`` allows
    ``num_servers`` 0 (TorchElastic, no parameter servers); every other framework needs 1..64."""
    if not isinstance(section, Mapping):
        raise ConfigError(f"cluster: got {section!r}; a cluster node (node_role scheduler/server/worker) needs a "
                          "'cluster' object with at least state_dir and num_servers")
    problems: list[str] = []
    known = set(ClusterSettings.__dataclass_fields__)
    for key in section:
        if key not in known:
            problems.append(f"cluster.{key}: unknown key; allowed: {sorted(known)}")
    values: dict[str, Any] = {}
    state_dir = section.get("state_dir")
    if not isinstance(state_dir, str) or not state_dir.startswith("/"):
        problems.append(f"cluster.state_dir: got {state_dir!r}; expected an absolute path on EFS, e.g. '/mnt/efs/cluster'")
    else:
        values["state_dir"] = Path(state_dir)
    for key, minimum, maximum in (("num_servers", 0 if framework == "pytorch" else 1, 64), ("min_workers", 1, 1024),
                                  ("scheduler_port", PORTS.minimum, PORTS.maximum),
                                  ("server_port", PORTS.minimum, PORTS.maximum), ("worker_port", PORTS.minimum, PORTS.maximum),
                                  ("max_workers", 1, 1024), ("torch_max_restarts", 0, 10000), ("torch_nproc_per_node", 1, 64)):
        if key not in section and key != "num_servers":
            continue
        value = section.get(key)
        if isinstance(value, bool) or not isinstance(value, int) or not minimum <= value <= maximum:
            problems.append(f"cluster.{key}: got {value!r}; expected an integer {minimum}..{maximum}")
        else:
            values[key] = value
    for key in ("heartbeat_interval_s", "heartbeat_timeout_s", "debounce_s", "stop_timeout_s", "kill_grace_s",
                "torch_shutdown_timeout_s"):
        if key not in section:
            continue
        value = section[key]
        if isinstance(value, bool) or not isinstance(value, (int, float)) or value < 0:
            problems.append(f"cluster.{key}: got {value!r}; expected a number of seconds >= 0")
        else:
            values[key] = float(value)
    if "member_tag" in section:
        if not isinstance(section["member_tag"], str) or not section["member_tag"]:
            problems.append(f"cluster.member_tag: got {section['member_tag']!r}; expected a tag key")
        else:
            values["member_tag"] = section["member_tag"]
    if not problems:
        settings = ClusterSettings(**values)
        if settings.min_workers > settings.max_workers:
            problems.append(f"cluster.min_workers: got {settings.min_workers}; expected at most max_workers ({settings.max_workers})")
        elif settings.heartbeat_timeout_s <= 2 * settings.heartbeat_interval_s:
            problems.append(f"cluster.heartbeat_timeout_s: got {settings.heartbeat_timeout_s}; expected more than twice "
                            f"heartbeat_interval_s ({settings.heartbeat_interval_s}) so one late write is not a death")
        else:
            return settings
    raise ConfigError(problems=problems)


# ---- files on EFS ---------------------------------------------------------------------------------
# write_json_atomic (temp file beside the path, fsync, os.replace, fsync of the directory: readers on
# other nodes see old or new, never half) is the contract's.


def _read_json(path: Path) -> dict | None:
    try:
        with open(path, encoding="utf-8") as handle:
            return json.load(handle)
    except FileNotFoundError:
        return None
    except ValueError:
        # Never half-written (atomic replace); a file that does not parse was put there by hand.
        log.warning("ignoring unreadable cluster state file", extra={"path": str(path)})
        return None


@dataclass(frozen=True)
class Plan:
    """One generation of the cluster.

    generation: 1, 2, ... state: one of ``PLAN_STATES``. framework: ``mxnet``/``tensorflow``.
    scheduler: ``{"node_id", "host", "port"}``; servers: list of the same; workers: the same plus
    ``rank`` (0-based; ps-lite sorts workers by host:port, so ranks follow that order).
    since: wall-clock seconds when the state was entered. reason: why (for people and tests).
    """

    generation: int
    state: str
    framework: str
    scheduler: Mapping[str, Any]
    servers: tuple[Mapping[str, Any], ...]
    workers: tuple[Mapping[str, Any], ...]
    since: float
    reason: str = ""

    def to_dict(self) -> dict[str, Any]:
        """The JSON form written to ``plan.json``."""
        return {"generation": self.generation, "state": self.state, "framework": self.framework,
                "scheduler": dict(self.scheduler), "servers": [dict(s) for s in self.servers],
                "workers": [dict(w) for w in self.workers], "since": self.since, "reason": self.reason}

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> "Plan":
        """Parse ``plan.json``'s content."""
        return cls(generation=int(data["generation"]), state=str(data["state"]), framework=str(data["framework"]),
                   scheduler=dict(data["scheduler"]), servers=tuple(data["servers"]), workers=tuple(data["workers"]),
                   since=float(data["since"]), reason=str(data.get("reason", "")))

    def with_state(self, state: str, *, since: float, reason: str) -> "Plan":
        """A copy in another state."""
        return Plan(self.generation, state, self.framework, self.scheduler, self.servers, self.workers, since, reason)

    def members(self) -> dict[str, str]:
        """``{node_id: role}`` of every node in the plan."""
        out = {self.scheduler["node_id"]: "scheduler"}
        out.update({s["node_id"]: "server" for s in self.servers})
        out.update({w["node_id"]: "worker" for w in self.workers})
        return out

    def membership(self) -> tuple[tuple[str, ...], tuple[str, ...]]:
        """(server node ids, worker node ids): what a change of membership compares."""
        return tuple(s["node_id"] for s in self.servers), tuple(sorted(w["node_id"] for w in self.workers))


def _address_key(member: Mapping[str, Any]) -> tuple:
    return (tuple(int(p) if p.isdigit() else p for p in str(member["host"]).split(".")), int(member["port"]))


def make_plan(*, generation: int, framework: str, scheduler: Mapping[str, Any], servers: Iterable[Mapping[str, Any]],
              workers: Iterable[Mapping[str, Any]], now: float, reason: str) -> Plan:
    """A ``running`` plan. Members are registration dicts (``node_id``, ``host``, ``port``); worker ranks
    follow the numeric ``host:port`` order, the order in which ps-lite's scheduler numbers workers.

    Raises ValueError when two members share one ``host:port``.
    """
    pick = lambda r: {"node_id": r["node_id"], "host": r["host"], "port": int(r["port"])}  # noqa: E731
    servers = [pick(s) for s in servers]
    workers = sorted((pick(w) for w in workers), key=_address_key)
    addresses = [(m["host"], m["port"]) for m in [pick(scheduler), *servers, *workers]]
    if len(set(addresses)) != len(addresses):
        raise ValueError(f"two cluster members share one host:port in {addresses}; every node needs its own address")
    for rank, worker in enumerate(workers):
        worker["rank"] = rank
    return Plan(generation, RUNNING, framework, pick(scheduler), tuple(servers), tuple(workers), now, reason)


class ClusterState:
    """The files under ``state_dir`` (see the module docstring); every write is atomic."""

    def __init__(self, state_dir: str | os.PathLike) -> None:
        self.root = Path(state_dir)
        self.registrations_dir = self.root / "registrations"
        self.heartbeats_dir = self.root / "heartbeats"
        self.plan_path = self.root / "plan.json"
        self.events_path = self.root / "events.jsonl"
        for directory in (self.registrations_dir, self.heartbeats_dir):
            directory.mkdir(parents=True, exist_ok=True)

    # registrations
    def register(self, registration: Mapping[str, Any]) -> None:
        """Write ``registrations/<node_id>.json`` (node_id, role, instance_id, host, port, data_ready,
        leaving, registered_at)."""
        write_json_atomic(self.registrations_dir / f"{registration['node_id']}.json", registration)

    def deregister(self, node_id: str) -> None:
        """Remove a node's registration and heartbeat (missing is fine)."""
        (self.registrations_dir / f"{node_id}.json").unlink(missing_ok=True)
        (self.heartbeats_dir / f"{node_id}.json").unlink(missing_ok=True)

    def registrations(self) -> dict[str, dict]:
        """``{node_id: registration}`` of every registered node."""
        return self._read_all(self.registrations_dir)

    # heartbeats
    def heartbeat(self, beat: Mapping[str, Any]) -> None:
        """Write ``heartbeats/<node_id>.json`` (node_id, time, generation, proc, returncode, pid)."""
        write_json_atomic(self.heartbeats_dir / f"{beat['node_id']}.json", beat)

    def heartbeats(self) -> dict[str, dict]:
        """``{node_id: heartbeat}``."""
        return self._read_all(self.heartbeats_dir)

    # plan
    def plan(self) -> Plan | None:
        """The current plan, or None before the first generation."""
        data = _read_json(self.plan_path)
        return Plan.from_dict(data) if data else None

    def write_plan(self, plan: Plan) -> None:
        """Replace ``plan.json`` and append the change to ``events.jsonl``."""
        write_json_atomic(self.plan_path, plan.to_dict())
        with open(self.events_path, "a", encoding="utf-8") as handle:
            handle.write(json.dumps({"time": plan.since, "generation": plan.generation, "state": plan.state,
                                     "reason": plan.reason, "workers": [w["node_id"] for w in plan.workers],
                                     "servers": [s["node_id"] for s in plan.servers]}) + "\n")
        log.info("cluster plan", extra={"generation": plan.generation, "state": plan.state, "reason": plan.reason,
                                        "workers": len(plan.workers), "servers": len(plan.servers)})

    def events(self) -> list[dict]:
        """Every plan change so far, oldest first."""
        try:
            with open(self.events_path, encoding="utf-8") as handle:
                return [json.loads(line) for line in handle if line.strip()]
        except FileNotFoundError:
            return []

    @staticmethod
    def _read_all(directory: Path) -> dict[str, dict]:
        out = {}
        for path in directory.glob("*.json"):
            data = _read_json(path)
            if data and "node_id" in data:
                out[data["node_id"]] = data
        return out


# ---- the coordinator ------------------------------------------------------------------------------
class Coordinator:
    """Keeps the plan; runs inside the scheduler node's agent, one :meth:`tick` per agent loop.

    Args:
        state: the :class:`ClusterState`. settings: :class:`ClusterSettings`. framework: ``mxnet`` or
        ``tensorflow``. node_id: the scheduler node itself (always the plan's scheduler).
        completed: returns True once the trainer wrote ``COMPLETED``. clock: wall-clock seconds
        (heartbeats from other nodes carry wall time).
    """

    def __init__(self, state: ClusterState, settings: ClusterSettings, *, framework: str, node_id: str,
                 completed: Callable[[], bool], clock: Callable[[], float] = time.time) -> None:
        self.state, self.settings, self.framework, self.node_id = state, settings, framework, node_id
        self.completed, self.clock = completed, clock
        self._desired: tuple | None = None
        self._desired_since = 0.0

    def _alive(self, node_id: str, regs: Mapping[str, dict], beats: Mapping[str, dict], now: float) -> bool:
        beat = beats.get(node_id)
        if beat is not None:
            return now - float(beat["time"]) <= self.settings.heartbeat_timeout_s
        reg = regs.get(node_id)
        return reg is not None and now - float(reg["registered_at"]) <= self.settings.heartbeat_timeout_s

    def _process_failed(self, plan: Plan, node_id: str, role: str, beat: Mapping[str, Any] | None) -> bool:
        if beat is None or beat.get("generation") != plan.generation or beat.get("proc") != "exited":
            return False
        if self.framework == "tensorflow" and role == "worker":
            return False  # its agent restarts it at the same address; TensorFlow tolerates that
        return True

    def tick(self) -> Plan | None:
        """Look at registrations, heartbeats and the plan once; write the next plan if it changes.
        Returns the current plan."""
        now = self.clock()
        regs, beats = self.state.registrations(), self.state.heartbeats()
        for node_id in list(regs):
            if node_id != self.node_id and not self._alive(node_id, regs, beats, now):
                log.warning("cluster node declared dead: no heartbeat", extra={
                    "node_id": node_id, "timeout_s": self.settings.heartbeat_timeout_s})
                self.state.deregister(node_id)
                regs.pop(node_id)
        me = regs.get(self.node_id)
        servers = sorted((r for r in regs.values() if r["role"] == "server"),
                         key=lambda r: (r["registered_at"], r["node_id"]))[: self.settings.num_servers]
        workers = [r for r in regs.values() if r["role"] == "worker" and r.get("data_ready") and not r.get("leaving")]
        desired = (tuple(s["node_id"] for s in servers), tuple(sorted(w["node_id"] for w in workers)))
        if desired != self._desired:
            self._desired, self._desired_since = desired, now
        stable = now - self._desired_since >= self.settings.debounce_s
        enough = me is not None and len(servers) == self.settings.num_servers and len(workers) >= self.settings.min_workers
        plan = self.state.plan()

        def next_generation(reason: str) -> Plan:
            new = make_plan(generation=(plan.generation if plan else 0) + 1, framework=self.framework, scheduler=me,
                            servers=servers, workers=workers, now=now, reason=reason)
            self.state.write_plan(new)
            return new

        if plan is not None and plan.state == COMPLETED:
            return plan
        if self.completed() and (plan is None or plan.state != COMPLETED):
            base = plan or make_plan(generation=0, framework=self.framework, scheduler=me or {"node_id": self.node_id,
                                     "host": "", "port": 0}, servers=[], workers=[], now=now, reason="")
            done = base.with_state(COMPLETED, since=now, reason="COMPLETED written by the trainer")
            self.state.write_plan(done)
            return done
        if plan is None or plan.state == WAITING:
            if enough and stable:
                return next_generation("first generation" if plan is None else "enough nodes registered")
            return plan
        members = plan.members()
        if plan.state == RUNNING:
            gone = [n for n in members if n not in regs]
            failed = [n for n, role in members.items() if self._process_failed(plan, n, role, beats.get(n))]
            if gone or failed:
                why = (f"node(s) gone: {sorted(gone)}" if gone else "") + \
                      ("; " if gone and failed else "") + (f"process exited on {sorted(failed)}" if failed else "")
                return self._set(plan, TEARDOWN, now, why)
            leaving = [n for n, r in regs.items() if r.get("leaving") and n in members]
            if leaving:
                return self._set(plan, CHECKPOINT, now, f"leaving: {sorted(leaving)}")
            if desired != plan.membership() and stable and enough:
                joined = sorted(set(desired[1]) - set(plan.membership()[1]))
                return self._set(plan, CHECKPOINT, now, f"membership changed (joined: {joined})")
            return plan
        if plan.state == CHECKPOINT:
            savers = [n for n, role in members.items()
                      if role == ("worker" if self.framework == "mxnet" else "scheduler")]
            done = all(n not in regs or beats.get(n, {}).get("proc") != "running" for n in savers)
            if done or now - plan.since > self.settings.stop_timeout_s:
                return self._set(plan, TEARDOWN, now, "checkpoint written" if done else
                                 f"checkpoint phase timed out after {self.settings.stop_timeout_s} s")
            return plan
        if plan.state == TEARDOWN:
            done = all(n not in regs or beats.get(n, {}).get("proc") != "running"
                       or beats[n].get("generation") != plan.generation for n in members)
            if done or now - plan.since > self.settings.stop_timeout_s:
                if enough:
                    return next_generation(f"after generation {plan.generation}: {plan.reason}")
                return self._set(plan, WAITING, now, f"waiting for nodes ({len(servers)}/{self.settings.num_servers} "
                                                     f"servers, {len(workers)} workers)")
        return plan

    def _set(self, plan: Plan, state: str, now: float, reason: str) -> Plan:
        new = plan.with_state(state, since=now, reason=reason)
        self.state.write_plan(new)
        return new


# ---- monitors -------------------------------------------------------------------------------------
class MemberTagMonitor:
    """A worker leaves when its membership tag is removed (as in the Dynamic Training article).

    Polls the instance tags in metadata (``InstanceMetadataTags=enabled`` on the launch template; no
    IAM needed). Only a tag seen once and then gone counts: an instance that never exposed it is
    left alone. ``poll()`` returns an event (kind ``member-tag-removed``) or None.
    """

    def __init__(self, imds: Any, key: str = DEFAULT_MEMBER_TAG) -> None:
        self.imds, self.key = imds, key
        self._seen = False

    def poll(self):
        from bootstrap.interruption import Event

        tags = self.imds.tags()
        if tags is None:
            return None
        if self.key in tags:
            self._seen = True
            return None
        if self._seen:
            return Event(kind=MEMBER_TAG_REMOVED, id=f"{MEMBER_TAG_REMOVED}:{self.key}", detail={"tag": self.key})
        return None


def poll_leave_reason(monitors: Iterable[Any]) -> str | None:
    """Poll a cluster worker's monitors (spot interruption notice, member tag) once; return why the
    worker leaves (the first event's kind, or :data:`IMDS_FORBIDDEN` when IMDS answered 403: it can no
    longer see notices, so it leaves through a checkpoint like a noticed worker and ``run_node`` hands
    the instance back to the fleet), or None. A notice is logged as the publisher's
    ``spot_interruption_notice`` event (bootstrap/publish.py). Shared by :class:`NodeAgent` and
    ``bootstrap.torch_elastic.TorchWorker``."""
    from bootstrap.imds import ImdsForbiddenError

    for monitor in monitors:
        try:
            event = monitor.poll()
        except ImdsForbiddenError as exc:
            log.error("IMDS answered 403: leaving the cluster, this node can no longer see spot "
                      "interruption notices", extra={"event": "node_unusable", "error": str(exc)})
            return IMDS_FORBIDDEN
        if event is not None:
            if event.kind == "spot-interruption":
                log.warning("spot interruption notice: leaving the cluster", extra={
                    "event": "spot_interruption_notice", "event_id": event.id})
            log.info("worker leaving the cluster", extra={"kind": event.kind, "event_id": event.id})
            return event.kind
    return None


# ---- the node agent -------------------------------------------------------------------------------
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


def leave_fleet(*, ec2: Any, instance_id: str, stack_name: str) -> str | None:
    """After a worker left because its member tag was removed: lower its spot fleet's target capacity by
    one (``ExcessCapacityTerminationPolicy=noTermination``, so the fleet picks no other victim), then
    terminate this instance. Without the lower target a ``maintain`` fleet would launch a replacement.

    Only a fleet tagged ``spot-training:stack`` = ``stack_name`` is touched (as bootstrap.cleanup).
    Returns the fleet request id, or None when no fleet of ours holds the instance (then nothing is
    changed; the instance is left running for whoever launched it). Raises botocore's ClientError.
    """
    from bootstrap.cleanup import _fleet_requests, find_fleet_request_id
    from bootstrap.config import STACK_TAG

    fleet_id = find_fleet_request_id(ec2, instance_id)
    fleets = _fleet_requests(ec2, [fleet_id]) if fleet_id else []
    tags = {t["Key"]: t["Value"] for t in (fleets[0].get("Tags", []) if fleets else [])}
    if not fleets or tags.get(STACK_TAG) != stack_name:
        log.warning("no spot fleet of this stack holds the instance; leaving capacity and instance alone",
                    extra={"instance_id": instance_id, "fleet_request_id": fleet_id})
        return None
    target = int(fleets[0]["SpotFleetRequestConfig"]["TargetCapacity"])
    ec2.modify_spot_fleet_request(SpotFleetRequestId=fleet_id, TargetCapacity=max(0, target - 1),
                                  ExcessCapacityTerminationPolicy="noTermination")
    ec2.terminate_instances(InstanceIds=[instance_id])
    log.info("left the spot fleet: target capacity lowered and this instance terminated",
             extra={"fleet_request_id": fleet_id, "target_capacity": max(0, target - 1)})
    return fleet_id


def run_node(config: Any, imds: Any, *, instance_id: str, local_mode: bool,
             on_environment_ready: Callable[[], None] | None = None) -> str:
    """Run this node as a cluster member (``node_role`` scheduler/server/worker); the CLI's entry.

    Reads the private address from IMDS (``local-ipv4``), the ``cluster`` section from the config's
    extensions, and watches spot interruption notices and the member tag on workers. Local mode
    (``local_mode``): a missing training user runs as the current user, and ``SPOT_TRAINING_NETNS``
    names the network namespace of the node's processes. ``on_environment_ready`` is called once the
    code and the trainer's environment are ready (the boot succeeded: the CLI clears the failed-boot
    count). Returns the :meth:`NodeAgent.run` outcome. Raises ConfigError (exit 78) for a bad
    ``cluster`` section.
    """
    from bootstrap.interruption import SpotInterruptionMonitor
    from bootstrap.supervisor import Supervisor

    settings = settings_from_config(config.extensions.get("cluster"), framework=config.training.framework)
    if config.training.framework == "pytorch" and config.node_role == "server":
        raise ConfigError(f"node_role: got 'server' with training.framework 'pytorch'; a PyTorch cluster has no "
                          "parameter servers (node_role 'scheduler' runs the rendezvous, 'worker' runs torchrun)")
    supervisor = Supervisor(config, is_mounted=lambda: True, run_as_current_user_if_missing=local_mode)
    workdir = supervisor.prepare_code()
    python = supervisor.prepare_environment()  # once on EFS; every later node reuses it
    if on_environment_ready is not None:
        on_environment_ready()
    account = supervisor._account()
    user = (account.pw_uid, account.pw_gid, os.getgrouplist(account.pw_name, account.pw_gid)) if account else None
    for directory in (config.training.checkpoint_dir, config.training.log_dir):
        directory.mkdir(parents=True, exist_ok=True)
    netns = os.environ.get(launch.NETNS_ENV) if local_mode else None
    monitors = [SpotInterruptionMonitor(imds), MemberTagMonitor(imds, settings.member_tag)]
    if config.training.framework == "pytorch":
        # TorchElastic does membership (bootstrap/torch_elastic.py); no generations, no servers.
        from bootstrap import torch_elastic

        common = dict(node_id=instance_id, host=imds.private_ipv4(), python=python,
                      environ=supervisor.trainer_environment(), workdir=workdir,
                      checkpoint_dir=config.training.checkpoint_dir, log_dir=config.training.log_dir, netns=netns,
                      preexec_user=user)
        if config.node_role == "scheduler":
            agent = torch_elastic.TorchCoordinator(settings, **common)
        else:
            agent = torch_elastic.TorchWorker(settings, training_argv=config.training.argv(python),
                                              run_id_prefix=config.stack_name, dataset_dir=config.training.dataset_dir,
                                              monitors=monitors, monitor_interval_s=config.notice_poll_interval_s,
                                              **common)
    else:
        agent = NodeAgent(settings, framework=config.training.framework, role=config.node_role, node_id=instance_id,
                          host=imds.private_ipv4(), training_argv=config.training.argv(python),
                          python=python, environ=supervisor.trainer_environment(), workdir=workdir,
                          checkpoint_dir=config.training.checkpoint_dir, dataset_dir=config.training.dataset_dir,
                          log_dir=config.training.log_dir, monitors=monitors,
                          monitor_interval_s=config.notice_poll_interval_s, netns=netns, preexec_user=user)
    previous = {sig: signal.signal(sig, lambda *_: agent.request_stop()) for sig in (signal.SIGTERM, signal.SIGINT)}
    try:
        outcome = agent.run()
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
    log.info("cluster node done", extra={"outcome": outcome, "role": config.node_role})
    if agent.leave_reason == IMDS_FORBIDDEN:
        from bootstrap.errors import NodeUnusableError

        # The CLI powers the instance off (terminate behaviour: the fleet replaces it) and exits 69.
        raise NodeUnusableError("IMDS answered 403 during training; this worker left the cluster through a "
                                "checkpoint and hands itself back to the fleet")
    # Local mode has an EC2 API only when a moto server is named (AWS_ENDPOINT_URL).
    if not local_mode or os.environ.get("AWS_ENDPOINT_URL"):
        from bootstrap.cleanup import ec2_client

        finish_node(outcome, role=config.node_role, leave_reason=agent.leave_reason,
                    cancel_fleet_on_success=config.cleanup.cancel_fleet_on_success,
                    ec2_factory=lambda: ec2_client(config.region), instance_id=instance_id, stack_name=config.stack_name)
    return outcome


def finish_node(outcome: str, *, role: str, leave_reason: str | None, cancel_fleet_on_success: bool,
                ec2_factory: Callable[[], Any], instance_id: str, stack_name: str) -> str | None:
    """What a cluster node does with EC2 after :meth:`NodeAgent.run` returned ``outcome``.

    - ``"completed"`` on a worker with ``cleanup.cancel_fleet_on_success`` (what the DistributedTraining
      stack writes for workers): cancel the workers' spot fleet with its instances through
      :func:`bootstrap.cleanup.cancel_own_fleet` (docs/architecture.md, "The user's story", step 4; only a fleet tagged with our stack;
      idempotent, so every worker may try and the first one wins). Scheduler and servers run in
      on-demand Auto Scaling groups, not a fleet: their agents have stopped their processes and exit 0,
      the instances stay (idle, billed on demand) until ``cdk destroy``.
    - ``"left"`` after the member tag was removed: :func:`leave_fleet`.
    - anything else: nothing.

    Args:
        ec2_factory: returns a boto3 EC2 client (called only when EC2 is needed).
    Returns the fleet request id acted on, or None. Raises botocore's ClientError, or
    bootstrap.errors.TemporaryError when EC2 refuses the cancellation.
    """
    if outcome == "completed" and role == "worker" and cancel_fleet_on_success:
        from bootstrap.cleanup import cancel_own_fleet

        return cancel_own_fleet(ec2=ec2_factory(), instance_id=instance_id, stack_name=stack_name)
    if outcome == "left" and leave_reason == MEMBER_TAG_REMOVED:
        return leave_fleet(ec2=ec2_factory(), instance_id=instance_id, stack_name=stack_name)
    return None
