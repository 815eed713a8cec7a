"""A PyTorch cluster under torchrun (TorchElastic, c10d rendezvous) in the notice phase drill.

Each trial runs a two-node cluster on 127.0.0.1 as the agents run it: the coordinator's rendezvous
store (``python -m spot_training.training.distributed.torch_rendezvous``) and, per node, the worker agent's
torchrun command (:func:`spot_training.agent.torch_elastic.torchrun_argv`, ``--nnodes=1:MAX``,
``--nproc-per-node=1``) running spot_training/training/distributed/torch_ddp.py, each started with
:class:`spot_training.agent.process_group.ProcessGroup` (a session of its own); both nodes share one checkpoint
directory (EFS on AWS), each has its own log directory. On one machine every node's address matches
the store's, so ``is_host=false`` is added to ``--rdzv-conf`` (the nodes are the store's clients, as
on AWS, instead of trying to host it first).

The notice goes to one node as its cluster agent relays a spot interruption notice
(``TorchWorker._stop_and_wait``: SIGTERM to that node's torchrun only, which forwards it to its rank;
SIGKILL to it and its ranks once the budget has passed), at a random time inside one phase:

* ``startup``: 0-3 s after the notified node's torchrun started its rank (torch imports, rendezvous,
  process group, restore), before the first step; the node is drawn at random;
* ``step/peer``: after 3-15 steps at world size 2, to the node whose rank is not 0;
* ``step/rank0``: the same, to the node of rank 0 (the rank that writes checkpoints);
* ``write``: a checkpoint after every step (written synchronously by rank 0), to rank 0's node.

Figures: ``exit`` (the notified rank's status from its log line "exiting N"; goal 0), ``ran`` (the
highest step any rank logged before the notified torchrun exited), ``saved`` (the newest
checkpoint then), ``lost`` = ran - saved (goal 0), ``committed``, ``notice_to_committed_s`` (the
newest manifest's wall time minus the time SIGTERM was sent; 0 when it was committed before, None
when not committed), ``resumed_at`` (the step the remaining node's restarted group started from;
goal = saved), ``torchrun_exit`` (the notified torchrun's status: 1 by design, it re-raises the
signal) and ``leave_s`` (SIGTERM to the end of the notified torchrun). ``bitwise`` is None: a group
that changes its world size sums its gradients in another order (docs/training-pytorch.md).
"""

from __future__ import annotations

import csv
import os
import random
import re
import socket
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from spot_training.agent.cluster_state import ClusterConfig  # noqa: E402
from spot_training.agent.process_group import ProcessGroup, descendants  # noqa: E402
from spot_training.agent.torch_elastic import torchrun_argv  # noqa: E402
from spot_training.contract import TORCHRUN_ENV  # noqa: E402
from spot_training.training.store import CheckpointStore  # noqa: E402

PYTHON = "torch"
PHASES = ("startup", "step/peer", "step/rank0", "write")
TRAINER = REPO / "spot_training" / "training" / "distributed" / "torch_ddp.py"
#: The agent's notice budget after its margin (docs/contracts.md): SIGKILL after this many seconds.
NOTICE_BUDGET_S = 110.0
TOTAL_STEPS = 400
STEP_SECONDS = 0.1
NODES = ("n1", "n2")
#: Seconds to wait for a cluster event (the store listening, steps at world size 2, the resume).
WAIT_S = 240.0
_STOP_LINE = re.compile(r"stop requested \(([^)]*)\)[^\n]*?exiting (\d+)")
_STARTING = re.compile(r"rank 0 of \d+ \(restart \d+\) starting at step (\d+)")


def interpreter() -> str:
    """The interpreter with PyTorch: the repository's ``.venv-torch``, else the running one."""
    venv = REPO / ".venv-torch" / "bin" / "python"
    return str(venv) if venv.exists() else sys.executable


def prepare(tmp: Path) -> dict:
    """Write the digits; no reference run (the resize makes the result not bitwise comparable).

    Returns:
        The context of :func:`trial`: ``python``, ``data_dir``, ``total_steps``, ``budget_s``
        (``$BENCH_NOTICE_BUDGET_S`` or 110).
    """
    from spot_training.training.examples.prepare_data import prepare_digits

    data_dir = Path(tmp) / "data"
    prepare_digits(data_dir)
    return {"python": interpreter(), "data_dir": data_dir, "total_steps": TOTAL_STEPS,
            "budget_s": float(os.environ.get("BENCH_NOTICE_BUDGET_S", NOTICE_BUDGET_S))}


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _rows(root: Path, name: str = "steps-*.csv") -> list[dict]:
    rows = []
    for path in root.glob(f"*/logs/{name}"):
        try:
            with open(path, newline="") as f:
                rows.extend(dict(r, node=path.parts[-3]) for r in csv.DictReader(f))
        except FileNotFoundError:
            pass
    return sorted(rows, key=lambda r: float(r["wall_time"]))


def _text(path: Path) -> str:
    try:
        return path.read_text(errors="replace")
    except FileNotFoundError:
        return ""


class _Cluster:
    """The store and the nodes of one trial (every process a :class:`ProcessGroup`)."""

    def __init__(self, root: Path, ctx: dict, *, save_every: int) -> None:
        self.root, self.ctx, self.save_every = root, ctx, save_every
        self.port = _free_port()
        self.groups: dict[str, ProcessGroup] = {}
        self.settings = ClusterConfig(state_dir=root / "state", num_servers=0, min_workers=1, max_workers=len(NODES))

    def env(self, node: str) -> dict[str, str]:
        env = {k: v for k, v in os.environ.items() if not k.startswith(("SPOT_TRAINING_", "TORCHELASTIC_"))}
        env.update(SPOT_TRAINING_DATA_DIR=str(self.ctx["data_dir"]), SPOT_TRAINING_NODE_ID=node,
                   SPOT_TRAINING_CHECKPOINT_DIR=str(self.root / "efs" / "checkpoints"),
                   SPOT_TRAINING_LOG_DIR=str(self.root / node / "logs"), OMP_NUM_THREADS="1",
                   PYTHONPATH=str(REPO), **TORCHRUN_ENV)
        return env

    def start_store(self) -> None:
        argv = [self.ctx["python"], "-m", "spot_training.training.distributed.torch_rendezvous", "--host", "127.0.0.1",
                "--port", str(self.port)]
        self.groups["store"] = ProcessGroup.start(argv, cwd=REPO, env=self.env("store"), log_path=self.root / "store.log")
        self.wait("the store listening", lambda: "listening on" in _text(self.root / "store.log"), 120)

    def start_node(self, node: str) -> None:
        (self.root / node).mkdir(parents=True, exist_ok=True)
        training = [self.ctx["python"], str(TRAINER), "--steps", str(self.ctx["total_steps"]),
                    "--save-every-steps", str(self.save_every), "--min-step-seconds", str(STEP_SECONDS)]
        argv = [a.replace("--rdzv-conf=", "--rdzv-conf=is_host=false,") if a.startswith("--rdzv-conf=") else a
                for a in torchrun_argv(python=self.ctx["python"], settings=self.settings,
                                       endpoint=f"127.0.0.1:{self.port}", run_id="drill-1", local_addr="127.0.0.1",
                                       training_argv=training)]
        self.groups[node] = ProcessGroup.start(argv, cwd=REPO, env=self.env(node), log_path=self.log(node))

    def log(self, node: str) -> Path:
        return self.root / node / "torchrun.log"

    def wait(self, what: str, predicate, timeout: float = WAIT_S) -> None:
        deadline = time.monotonic() + timeout
        while not predicate():
            if time.monotonic() > deadline:
                raise TimeoutError(f"timed out waiting for {what} in {self.root}")
            for name, group in self.groups.items():  # a process the trial stopped may exit non-zero
                if group.poll() not in (None, 0) and group.term_sent is None:
                    raise RuntimeError(f"{name} exited {group.poll()} while waiting for {what}: "
                                       f"{_text(self.log(name))[-3000:]}")
            time.sleep(0.02)

    def rank0_node(self) -> str | None:
        rows = _rows(self.root, "training_log.csv")
        return rows[-1]["node"] if rows else None

    def close(self) -> None:
        """SIGTERM every torchrun and the store, wait a little, then SIGKILL them and their ranks."""
        for group in self.groups.values():
            group.stop(kill_after=None, group=False)
        deadline = time.monotonic() + 20
        while any(g.poll() is None for g in self.groups.values()) and time.monotonic() < deadline:
            time.sleep(0.1)
        for group in self.groups.values():
            group.kill_and_wait()  # its ranks too (each in a session of its own)


def trial(root: Path, ctx: dict, *, phase: str, rng: random.Random) -> dict:
    """A two-node cluster, one notice to one node in ``phase``, until the other node resumed.

    Implements :meth:`bench.notice.common.FrontEnd.trial` (``ctx``: data, reference run, ``budget_s``).

    Returns:
        ``phase``, ``exit``, ``ran``, ``saved``, ``lost``, ``committed``, ``notice_to_committed_s``,
        ``worker_killed`` (the notified torchrun needed SIGKILL), ``bitwise`` (None), ``node``
        (``rank0``/``peer``/``?``), ``resumed_at``, ``torchrun_exit``, ``leave_s`` (module docstring).

    Raises:
        ValueError: ``phase`` is not one of :data:`PHASES`.
        TimeoutError, RuntimeError: the cluster did not reach the phase (a node failed).
    """
    if phase not in PHASES:
        raise ValueError(f"phase must be one of {PHASES}. Received: phase={phase!r}")
    root = Path(root)
    root.mkdir(parents=True, exist_ok=True)
    budget = float(ctx["budget_s"])
    cluster = _Cluster(root, ctx, save_every=1 if phase == "write" else 25)
    try:
        cluster.start_store()
        for node in NODES:
            cluster.start_node(node)
        if phase == "startup":
            leaver = rng.choice(NODES)
            # Once torchrun started its rank (torch imports, rendezvous, process group, restore follow).
            cluster.wait("the rank started", lambda: bool(descendants(cluster.groups[leaver].pid)))
            until = time.monotonic() + rng.uniform(0.0, 3.0)
            cluster.wait("the notice time", lambda: time.monotonic() >= until or bool(_rows(root)))
        else:
            target = rng.randint(3, 15)
            cluster.wait("steps at world size 2",
                         lambda: sum(r["num_workers"] == "2" for r in _rows(root, "training_log.csv")) >= target)
            rank0 = cluster.rank0_node()
            leaver = rank0 if phase in ("step/rank0", "write") else next(n for n in NODES if n != rank0)
        before = _rows(root)
        role = "?" if not before else ("rank0" if leaver == cluster.rank0_node() else "peer")
        group = cluster.groups[leaver]
        sent, sent_clock = time.time(), time.monotonic()
        group.stop(kill_after=None, group=False)  # the cluster agent's relay: its torchrun only
        while group.poll() is None and time.monotonic() - sent_clock < budget:
            time.sleep(0.01)
        killed = group.poll() is None
        if killed:
            group.kill_and_wait()
        left, leave_s = time.time(), time.monotonic() - sent_clock
        latest = CheckpointStore(root / "efs" / "checkpoints", framework="pytorch").latest()
        ran = max((int(r["step"]) for r in _rows(root) if float(r["wall_time"]) <= left), default=0)
        saved = latest.step if latest is not None else 0
        committed = saved == ran
        committed_s = max(0.0, latest.manifest["wall_time"] - sent) if latest is not None and committed else None
        stops = _STOP_LINE.findall(_text(cluster.log(leaver)))
        own = [int(code) for why, code in stops if why.startswith("signal")]
        status = own[-1] if own else (None if stops else group.poll())
        if "before the first step" in _text(cluster.log(leaver)) and not own:
            status = 0
        survivor = next(n for n in NODES if n != leaver)
        starts_before = len(_STARTING.findall(_text(cluster.log(survivor))))
        resumed_at = None
        try:
            cluster.wait("the remaining node's group to restart",
                         lambda: len(_STARTING.findall(_text(cluster.log(survivor)))) > starts_before
                         or any(float(r["wall_time"]) > left for r in _rows(root, "training_log.csv")), 180)
            found = _STARTING.findall(_text(cluster.log(survivor)))
            resumed_at = int(found[-1]) if len(found) > starts_before else None
        except (TimeoutError, RuntimeError):
            pass
    finally:
        cluster.close()
    return {"phase": phase, "exit": status, "ran": ran, "saved": saved, "lost": ran - saved, "committed": committed,
            "notice_to_committed_s": committed_s, "worker_killed": killed, "bitwise": None, "node": role,
            "resumed_at": resumed_at, "torchrun_exit": group.poll(), "leave_s": round(leave_s, 3)}
