"""The cluster's shared state on EFS: the ``cluster`` settings, the plan and the files of every node.

Everything lives in one directory on EFS, ``cluster.state_dir`` (docs/contracts.md, "Cluster state on EFS")::

    <state_dir>/
      registrations/<node_id>.json   one per node, written atomically by the node's agent
      heartbeats/<node_id>.json      rewritten by each agent every cluster.heartbeat_interval_s
      plan.json                      the coordinator's plan (only the coordinator writes it; MXNet/TensorFlow)
      events.jsonl                   one JSON line per plan change (generation, state, reason, time)

Shared by the MXNet/TensorFlow agents (spot_training/agent/cluster_coordinator.py, spot_training/agent/ps_node.py) and the
PyTorch ones (spot_training/agent/torch_elastic.py). Every write is atomic (temp file beside the path,
fsync, rename, fsync of the directory: readers on other nodes see old or new, never half).

EFS is writable by every node's training user, and the agents run as root: every create, append, read
and unlink here goes through spot_training.agent.safepath (no symlink followed, no hard link, no FIFO),
and every record read is checked against :data:`SCHEMAS` (a wrongly typed file is logged and treated as
absent). Standard library only.
"""

from __future__ import annotations

import ipaddress
import json
import logging
import math
import os
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterable, Mapping

from spot_training.agent.errors import ConfigError
from spot_training.agent.safepath import (UnsafePathError, list_directory, open_directory, open_file, read_bytes, unlink,
                                          write_bytes_atomic)
from spot_training.contract import (CLUSTER_MEMBER_TAG, DEFAULT_CLUSTER_KILL_GRACE_S, DEFAULT_CLUSTER_STOP_TIMEOUT_S,
                            DEFAULT_MAX_WORKERS, DEFAULT_MIN_WORKERS, DEFAULT_SCHEDULER_PORT,
                            DEFAULT_SERVER_PORT, DEFAULT_TORCH_MAX_RESTARTS, DEFAULT_TORCH_NPROC_PER_NODE,
                            DEFAULT_TORCH_SHUTDOWN_TIMEOUT_S, DEFAULT_WORKER_PORT, MAX_SERVERS, MAX_TORCH_MAX_RESTARTS,
                            MAX_TORCH_SHUTDOWN_TIMEOUT_S, shown as _shown,
                            MAX_TORCH_NPROC_PER_NODE, MAX_WORKERS, SETTINGS, write_json_atomic)

__all__ = ["ClusterConfig", "ClusterState", "Plan", "make_plan", "settings_from_config", "read_json",
           "write_json_atomic", "write_state_json", "valid_record", "SCHEMAS", "RUNNING",
           "CHECKPOINT", "TEARDOWN", "WAITING", "COMPLETED", "PLAN_STATES",
           "CLUSTER_ROLES", "PORTS"]

#: TCP ports of the roles: the contract's range, the one the stack validates too.
PORTS = SETTINGS["port"]

log = logging.getLogger("spot_training.agent.cluster")

RUNNING, CHECKPOINT, TEARDOWN, WAITING, COMPLETED = "running", "checkpoint", "teardown", "waiting", "completed"
PLAN_STATES = (RUNNING, CHECKPOINT, TEARDOWN, WAITING, COMPLETED)
CLUSTER_ROLES = ("scheduler", "server", "worker")

# ---- settings -------------------------------------------------------------------------------------
@dataclass(frozen=True)
class ClusterConfig:
    """The node config's ``cluster`` section (docs/contracts.md), named like the agent's other sections
    (:class:`~spot_training.agent.config.AgentConfig`'s ``*Config``); the stack's side, the ``cluster_*``
    context keys, is ``spot_training.infra.ClusterSettings``.

    state_dir: the EFS directory for registrations, heartbeats and the plan (absolute).
    num_servers: parameter servers per generation (>= 1). min_workers: fewest workers to train with
    (>= 1, default 1). scheduler_port / server_port / worker_port: each node's fixed framework port
    (defaults 9000/9001/9002: ps-lite's ``DMLC_PS_ROOT_PORT``/``PORT``, TensorFlow's gRPC ports).
    heartbeat_interval_s (default 1), heartbeat_timeout_s (default 15): a member whose heartbeat is
    older is dead. debounce_s (default 5): joins wait until membership is stable this long.
    stop_timeout_s (default 120): bound on the checkpoint and teardown phases. kill_grace_s
    (default 5): SIGTERM -> SIGKILL in teardown. member_tag: instance tag whose removal means leave.

    PyTorch (TorchElastic, spot_training/agent/torch_elastic.py): ``num_servers`` is 0; ``scheduler_port`` is the
    c10d rendezvous port on the coordinator; max_workers (default 8) is torchrun's upper ``--nnodes``;
    torch_max_restarts (default 100), torch_shutdown_timeout_s (default 90), torch_nproc_per_node
    (default 1) are torchrun's ``--max-restarts``, ``--shutdown-timeout`` and ``--nproc-per-node``.
    """

    state_dir: Path
    num_servers: int
    min_workers: int = DEFAULT_MIN_WORKERS
    scheduler_port: int = DEFAULT_SCHEDULER_PORT
    server_port: int = DEFAULT_SERVER_PORT
    worker_port: int = DEFAULT_WORKER_PORT
    heartbeat_interval_s: float = 1.0
    heartbeat_timeout_s: float = 15.0
    debounce_s: float = 5.0
    stop_timeout_s: float = DEFAULT_CLUSTER_STOP_TIMEOUT_S
    kill_grace_s: float = DEFAULT_CLUSTER_KILL_GRACE_S
    member_tag: str = CLUSTER_MEMBER_TAG
    max_workers: int = DEFAULT_MAX_WORKERS
    torch_max_restarts: int = DEFAULT_TORCH_MAX_RESTARTS
    torch_shutdown_timeout_s: float = float(DEFAULT_TORCH_SHUTDOWN_TIMEOUT_S)
    torch_nproc_per_node: int = DEFAULT_TORCH_NPROC_PER_NODE

    def port_for(self, role: str) -> int:
        """The fixed port of a node with ``role``."""
        return {"scheduler": self.scheduler_port, "server": self.server_port, "worker": self.worker_port}[role]


#: EC2 tag keys: 1-128 characters, not starting with 'aws:' (EC2 User Guide, "Tag restrictions").
_TAG_KEY = re.compile(r"(?!aws:)[^\x00-\x1f]{1,128}", re.IGNORECASE)


def settings_from_config(section: Mapping[str, Any] | None, *, framework: str | None = None) -> ClusterConfig:
    """Validate the ``cluster`` section of the node config.

    Every problem is reported in one ConfigError (exit 78) naming ``cluster.<key>``, the value and what
    is allowed.

    Args:
        section: the ``cluster`` object of the config's extensions (None when absent).
        framework: ``training.framework``; ``pytorch`` allows ``num_servers`` 0 (TorchElastic, no
            parameter servers); every other framework needs 1..``MAX_SERVERS`` (64).

    Returns:
        the validated settings.

    Raises:
        ConfigError: the section is missing, not an object, or has unknown keys or bad values.
    """
    if not isinstance(section, Mapping):
        raise ConfigError(f"cluster: got {_shown(section)}; a cluster node (node_role scheduler/server/worker) needs a "
                          "'cluster' object with at least state_dir and num_servers")
    problems: list[str] = []
    known = set(ClusterConfig.__dataclass_fields__)
    for key in section:
        if key not in known:
            shown = key if isinstance(key, str) and len(key) <= 80 and key.isprintable() else _shown(key)
            problems.append(f"cluster.{shown}: unknown key; allowed: {sorted(known)}")
    values: dict[str, Any] = {}
    state_dir = section.get("state_dir")
    if not isinstance(state_dir, str) or not state_dir.startswith("/") or len(state_dir) > 4096 or "\0" in state_dir:
        problems.append(f"cluster.state_dir: got {_shown(state_dir)}; expected an absolute path on EFS (at most 4096 "
                        "characters, no NUL), e.g. '/mnt/efs/cluster'")
    else:
        values["state_dir"] = Path(state_dir)
    for key, minimum, maximum in (("num_servers", 0 if framework == "pytorch" else 1, MAX_SERVERS),
                                  ("min_workers", 1, MAX_WORKERS), ("max_workers", 1, MAX_WORKERS),
                                  ("scheduler_port", PORTS.minimum, PORTS.maximum),
                                  ("server_port", PORTS.minimum, PORTS.maximum), ("worker_port", PORTS.minimum, PORTS.maximum),
                                  ("torch_max_restarts", 0, MAX_TORCH_MAX_RESTARTS),
                                  ("torch_nproc_per_node", 1, MAX_TORCH_NPROC_PER_NODE)):
        if key not in section and key != "num_servers":
            continue
        value = section.get(key)
        if isinstance(value, bool) or not isinstance(value, int) or not minimum <= value <= maximum:
            problems.append(f"cluster.{key}: got {_shown(value)}; expected an integer {minimum}..{maximum}")
        else:
            values[key] = value
    # Finite, bounded and, for intervals and timeouts, > 0: inf, NaN or 1e308 seconds would never time out,
    # 10**60 overflows float(), an interval of 0 s makes the agent loop busy and a timeout of 0 s declares
    # every member dead; debounce and kill grace may be 0 (join at once, SIGKILL at once).
    for key, maximum, positive in (("heartbeat_interval_s", 60.0, True), ("heartbeat_timeout_s", 3600.0, True),
                                   ("debounce_s", 3600.0, False), ("stop_timeout_s", 3600.0, True),
                                   ("kill_grace_s", 600.0, False),
                                   ("torch_shutdown_timeout_s", float(MAX_TORCH_SHUTDOWN_TIMEOUT_S), True)):
        if key not in section:
            continue
        value = section[key]
        if (isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 <= value <= maximum
                or not math.isfinite(value) or (positive and value == 0)):
            lower = "above 0" if positive else "from 0"
            problems.append(f"cluster.{key}: got {_shown(value)}; expected a number of seconds {lower} to {maximum:g}")
        else:
            values[key] = float(value)
    if "member_tag" in section:
        if (not isinstance(section["member_tag"], str) or not _TAG_KEY.fullmatch(section["member_tag"])):
            problems.append(f"cluster.member_tag: got {_shown(section['member_tag'])}; expected an EC2 tag key "
                            "(1-128 characters, no 'aws:' prefix)")
        else:
            values["member_tag"] = section["member_tag"]
    if not problems:
        settings = ClusterConfig(**values)
        if settings.min_workers > settings.max_workers:
            problems.append(f"cluster.min_workers: got {settings.min_workers}; expected at most max_workers ({settings.max_workers})")
        elif settings.heartbeat_timeout_s <= 2 * settings.heartbeat_interval_s:
            problems.append(f"cluster.heartbeat_timeout_s: got {settings.heartbeat_timeout_s}; expected more than twice "
                            f"heartbeat_interval_s ({settings.heartbeat_interval_s}) so one late write is not a death")
        else:
            return settings
    raise ConfigError(problems=problems)



# ---- files on EFS ---------------------------------------------------------------------------------
#: Largest state file an agent reads (bytes); a registration or plan is well under 64 KiB.
MAX_STATE_FILE_BYTES = 1 << 20


def read_json(path: Path) -> dict | None:
    """The JSON object in ``path``, or None when the file is missing or is no JSON object (logged).

    The file lives on EFS, which every node's training user can write: it is read without following a
    link planted there, never blocks on a FIFO and is at most :data:`MAX_STATE_FILE_BYTES`
    (spot_training.agent.safepath); anything else is logged and treated as absent.
    """
    try:
        data = read_bytes(path, limit=MAX_STATE_FILE_BYTES)
        if data is None:
            return None
        value = json.loads(data.decode("utf-8"), parse_constant=_no_constant)
    except (UnsafePathError, OSError, ValueError, RecursionError) as exc:
        # Never half-written (atomic replace); a file that does not parse was put there by hand.
        log.warning("ignoring unreadable cluster state file", extra={"path": str(path), "error": str(exc)[:200]})
        return None
    if not isinstance(value, dict):
        log.warning("ignoring cluster state file that is no JSON object", extra={"path": str(path)})
        return None
    return value


def _no_constant(name: str) -> Any:
    raise ValueError(f"{name} is not a number the cluster state holds")


def write_state_json(path: Path, payload: Mapping[str, Any]) -> None:
    """Write a state file atomically without following a link the training user planted on EFS.

    The contract's ``write_json_atomic`` format (indented, sorted keys), through
    :mod:`spot_training.agent.safepath`.

    Args:
        path: the state file.
        payload: a JSON-serializable mapping.

    Raises:
        OSError: the file cannot be written, or a path component is a symlink.
    """
    write_bytes_atomic(path, (json.dumps(payload, indent=1, sort_keys=True) + "\n").encode("utf-8"))


# ---- typed records: what a state file must hold to be used ----------------------------------------
# The files live on EFS, writable by every node's training user: a record of the wrong shape is logged
# and ignored (treated as absent), never a crash, and never an address outside the cluster's members.
_NODE_ID = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,127}")


def _is_int(value: Any, low: int = 0, high: int = 2 ** 63 - 1) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and low <= value <= high


def _is_time(value: Any) -> bool:
    return (isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
            and 0 <= value < 1e12)


def _is_node_id(value: Any) -> bool:
    return isinstance(value, str) and _NODE_ID.fullmatch(value) is not None


def _is_host(value: Any) -> bool:
    if not isinstance(value, str) or not value.isascii():
        return False
    try:
        ipaddress.IPv4Address(value)
    except ValueError:
        return False
    return True


def _is_port(value: Any) -> bool:
    return _is_int(value, PORTS.minimum, PORTS.maximum)


def _optional_int(value: Any) -> bool:
    return value is None or _is_int(value, -(2 ** 31), 2 ** 31)


#: Field -> check of every record kind; a record must hold each field (extra fields are ignored).
SCHEMAS: Mapping[str, Mapping[str, Callable[[Any], bool]]] = {
    "registration": {"node_id": _is_node_id, "role": lambda v: v in CLUSTER_ROLES, "host": _is_host,
                     "port": _is_port, "data_ready": lambda v: isinstance(v, bool),
                     "leaving": lambda v: isinstance(v, bool), "registered_at": _is_time},
    "heartbeat": {"node_id": _is_node_id, "time": _is_time, "generation": _is_int,
                  "proc": lambda v: v in ("running", "exited", "none"), "returncode": _optional_int,
                  "pid": _optional_int},
    "rendezvous": {"host": _is_host, "port": _is_port, "epoch": _is_int, "node_id": _is_node_id, "since": _is_time},
    "report": {"node_id": _is_node_id, "epoch": _is_int, "returncode": _optional_int, "time": _is_time},
    "member": {"node_id": _is_node_id, "host": _is_host, "port": _is_port},
    "event": {"time": _is_time, "generation": _is_int, "state": lambda v: v in PLAN_STATES},
}


def valid_record(kind: str, data: Any, *, path: Any = None) -> bool:
    """True when ``data`` is a dict holding every field of ``SCHEMAS[kind]`` with a valid value.

    Otherwise the first bad field is logged (with ``path``) and False returned.

    Args:
        kind: a key of :data:`SCHEMAS` (``"registration"``, ``"heartbeat"``, ``"member"``, ``"event"``).
        data: the parsed JSON record.
        path: the file it came from, for the log (default None).

    Returns:
        whether the record may be used.
    """
    if not isinstance(data, Mapping):
        log.warning("ignoring cluster state record that is no object", extra={"kind": kind, "path": str(path)})
        return False
    for key, check in SCHEMAS[kind].items():
        try:
            ok = key in data and bool(check(data[key]))
        except TypeError:  # an unhashable value compared against a tuple
            ok = False
        if not ok:
            log.warning("ignoring cluster state record with a bad field",
                        extra={"kind": kind, "path": str(path), "field": key, "value": repr(data.get(key))[:80]})
            return False
    return True


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
        """Parse ``plan.json``'s content.

        Raises:
            ValueError: not a valid plan (a field of the wrong type, a member without a node id, IPv4
                host and port, a worker without a rank).
        """
        members = [data.get("scheduler")]
        for key in ("servers", "workers"):
            if not isinstance(data.get(key), list) or len(data[key]) > MAX_WORKERS + MAX_SERVERS:
                raise ValueError(f"plan.{key}: expected a list of members")
            members.extend(data[key])
        if not (_is_int(data.get("generation")) and data.get("state") in PLAN_STATES
                and isinstance(data.get("framework"), str) and _is_time(data.get("since"))
                and isinstance(data.get("reason", ""), str)
                and all(valid_record("member", m) for m in members)
                and all(_is_int(w.get("rank"), 0, MAX_WORKERS) for w in data["workers"])):
            raise ValueError("plan.json: a field is missing or of the wrong type")
        return cls(generation=int(data["generation"]), state=str(data["state"]), framework=str(data["framework"]),
                   scheduler=dict(data["scheduler"]), servers=tuple(data["servers"]), workers=tuple(data["workers"]),
                   since=float(data["since"]), reason=str(data.get("reason", "")))

    def with_state(self, state: str, *, since: float, reason: str) -> "Plan":
        """A copy in another state.

        Args:
            state: one of :data:`PLAN_STATES`.
            since: when the state began, seconds since the epoch.
            reason: why, in words (shown by status).

        Returns:
            the new plan (same generation and members).
        """
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
    """A ``running`` plan with worker ranks in the numeric ``host:port`` order.

    Members are registration dicts (``node_id``, ``host``, ``port``); ranks follow the order in which
    ps-lite's scheduler numbers workers.

    Args:
        generation: the plan's generation number, >= 0.
        framework: ``training.framework``.
        scheduler: the scheduler's registration.
        servers: the parameter servers' registrations.
        workers: the workers' registrations.
        now: the plan's start, seconds since the epoch.
        reason: why this plan was made (shown by status).

    Returns:
        the plan, in state ``running``.

    Raises:
        ValueError: two members share one ``host:port``.
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
            os.close(open_directory(directory, create=True))

    # registrations
    def register(self, registration: Mapping[str, Any]) -> None:
        """Write ``registrations/<node_id>.json`` (node_id, role, instance_id, host, port, data_ready,
        leaving, registered_at)."""
        write_state_json(self.registrations_dir / f"{registration['node_id']}.json", registration)

    def deregister(self, node_id: str) -> None:
        """Remove a node's registration and heartbeat (missing is fine)."""
        unlink(self.registrations_dir / f"{node_id}.json")
        unlink(self.heartbeats_dir / f"{node_id}.json")

    def registrations(self) -> dict[str, dict]:
        """``{node_id: registration}`` of every registered node."""
        return self._read_all(self.registrations_dir, "registration")

    # heartbeats
    def heartbeat(self, beat: Mapping[str, Any]) -> None:
        """Write ``heartbeats/<node_id>.json`` (node_id, time, generation, proc, returncode, pid)."""
        write_state_json(self.heartbeats_dir / f"{beat['node_id']}.json", beat)

    def heartbeats(self) -> dict[str, dict]:
        """``{node_id: heartbeat}``."""
        return self._read_all(self.heartbeats_dir, "heartbeat")

    # plan
    def plan(self) -> Plan | None:
        """The current plan, or None before the first generation."""
        data = read_json(self.plan_path)
        if not data:
            return None
        try:
            return Plan.from_dict(data)
        except ValueError as exc:
            log.warning("ignoring invalid plan.json", extra={"path": str(self.plan_path), "error": str(exc)})
            return None

    def write_plan(self, plan: Plan) -> None:
        """Replace ``plan.json`` and append the change to ``events.jsonl``."""
        write_state_json(self.plan_path, plan.to_dict())
        line = json.dumps({"time": plan.since, "generation": plan.generation, "state": plan.state,
                           "reason": plan.reason, "workers": [w["node_id"] for w in plan.workers],
                           "servers": [s["node_id"] for s in plan.servers]}) + "\n"
        # Appended as root on EFS: never through a link the training user planted (safepath).
        fd = open_file(self.events_path, os.O_WRONLY | os.O_APPEND | os.O_CREAT)
        try:
            os.write(fd, line.encode("utf-8"))
        finally:
            os.close(fd)
        log.info("cluster plan", extra={"generation": plan.generation, "state": plan.state, "reason": plan.reason,
                                        "workers": len(plan.workers), "servers": len(plan.servers)})

    def events(self) -> list[dict]:
        """Every plan change so far, oldest first; lines that are no valid event are skipped (logged)."""
        try:
            data = read_bytes(self.events_path, limit=64 * MAX_STATE_FILE_BYTES)
        except (UnsafePathError, OSError) as exc:
            log.warning("ignoring unreadable events.jsonl", extra={"path": str(self.events_path), "error": str(exc)})
            return []
        out = []
        for line in (data or b"").decode("utf-8", errors="replace").splitlines():
            try:
                event = json.loads(line, parse_constant=_no_constant) if line.strip() else None
            except (ValueError, RecursionError):
                event = None
            if event is not None and valid_record("event", event, path=self.events_path):
                out.append(event)
        return out

    @staticmethod
    def _read_all(directory: Path, kind: str) -> dict[str, dict]:
        """``{node_id: record}`` of the valid ``kind`` records in ``directory`` whose file is named after
        their node id; other files are logged and ignored."""
        out = {}
        try:
            names = list_directory(directory)
        except (UnsafePathError, OSError) as exc:
            log.warning("ignoring unreadable cluster state directory", extra={"path": str(directory), "error": str(exc)})
            return {}
        for name in sorted(names):
            if not name.endswith(".json") or name.startswith("."):
                continue
            path = directory / name
            data = read_json(path)
            if data is not None and valid_record(kind, data, path=path) and f"{data['node_id']}.json" == name:
                out[data["node_id"]] = data
        return out
