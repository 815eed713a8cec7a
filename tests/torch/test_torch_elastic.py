"""PyTorch clusters on TorchElastic (the training side): the coordinator's rendezvous store
(spot_training/training/distributed/torch_rendezvous.py) and torchrun "nodes" running spot_training/training/distributed/torch_ddp.py,
as real processes on 127.0.0.1 killed with real signals.

Each node is its own ``torchrun --nnodes=1:3 --nproc-per-node=1`` (own process group, own log
directory) and a client of the store (``is_host=false``, as a spot worker whose hostname is not the
coordinator's); all nodes share one checkpoint directory, as they share EFS on AWS. Network
namespaces are not needed at this layer (the stack's local drill runs nodes in them).
"""

from __future__ import annotations

import csv
import json
import os
import re
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import pytest
from job_helpers import child_pids  # tests/ (on sys.path: tests/torch/conftest.py)

from spot_training.training.core import EXIT_PEER_STOPPED, stop_exit_code
from spot_training.training.distributed.lr import scaled_learning_rate
from spot_training.training.distributed.torch_ddp import TORCHRUN_ENV, DataPosition, rank_indices, stream_indices
from spot_training.training.store import CheckpointStore

REPO = Path(__file__).resolve().parents[2]
TORCHRUN = Path(sys.executable).with_name("torchrun")
TRAINER = REPO / "spot_training" / "training" / "distributed" / "torch_ddp.py"
STEPS = 150
SAVE_EVERY = 10
#: Each step lasts at least this long (seconds), so that joins and signals land mid-training.
STEP_SECONDS = 0.15


# ----------------------------------------------------------------------------- fast unit tests
def _run_positions(plan: list[tuple[int, int]], *, n: int, batch: int, seed: int = 0) -> list[int]:
    """Every index every rank takes for ``plan`` = [(steps, world_size), ...], the position carried
    across each resize as the trainer carries it (examples consumed)."""
    taken, samples = [], 0
    for steps, world in plan:
        for _ in range(steps):
            for r in range(world):
                taken.extend(rank_indices(samples, global_batch=batch, rank=r, world_size=world, n=n, seed=seed))
            samples += batch
    return taken


def test_data_position_skips_and_repeats_nothing_across_resizes() -> None:
    n, batch = 97, 16  # batches straddle epoch boundaries, shards of unequal size at W=3
    taken = _run_positions([(7, 2), (11, 3), (9, 2)], n=n, batch=batch)
    assert len(taken) == 27 * batch
    full, rest = divmod(len(taken), n)
    for e in range(full):  # every epoch: each example exactly once
        assert sorted(taken[e * n:(e + 1) * n]) == list(range(n))
    assert len(set(taken[full * n:])) == rest  # the unfinished epoch repeats nothing
    # The same examples in the same order as one process would take them.
    assert taken == _run_positions([(27, 1)], n=n, batch=batch)
    assert stream_indices(0, n, n=n, seed=0).tolist() != list(range(n))  # shuffled


def test_rank_shards_partition_the_global_batch() -> None:
    shards = [rank_indices(40, global_batch=10, rank=r, world_size=3, n=50, seed=1) for r in range(3)]
    assert [len(s) for s in shards] == [4, 3, 3]
    assert np.concatenate(shards).tolist() == stream_indices(40, 10, n=50, seed=1).tolist()
    with pytest.raises(ValueError, match="rank"):
        rank_indices(0, global_batch=10, rank=3, world_size=3, n=50, seed=1)


def test_learning_rate_warm_up_restarts_when_the_world_size_changes() -> None:
    pos = DataPosition()
    pos.begin_group(0, 2)  # fresh start at W=2: warm up from step 0
    assert (pos.warmup_start, pos.world_size) == (0, 2)
    saved = pos.state_dict()
    resumed = DataPosition()
    resumed.load_state_dict(saved)
    resumed.begin_group(40, 2)  # same world size after a restart: no new warm-up
    assert resumed.warmup_start == 0
    resumed.begin_group(60, 3)  # a node joined: warm up again from step 60
    assert resumed.state_dict()["warmup_start"] == 60
    lr = [scaled_learning_rate(0.1, num_workers=3, step=s, warmup_steps=10, warmup_start_step=resumed.warmup_start)
          for s in (60, 69, 70)]
    assert lr[0] < lr[1] == pytest.approx(0.3) == lr[2]


def test_peer_stopped_rank_exit_code_rule() -> None:
    elastic = {"TORCHELASTIC_RUN_ID": "job-1", "TORCHELASTIC_MAX_RESTARTS": "5"}
    assert stop_exit_code(False, elastic) == EXIT_PEER_STOPPED != 0
    assert stop_exit_code(True, elastic) == 0  # got SIGTERM itself: its torchrun is going away
    assert stop_exit_code(False, {**elastic, "TORCHELASTIC_MAX_RESTARTS": "0"}) == 0  # --standalone default
    assert stop_exit_code(False, {}) == 0  # a single process (not torchrun)
    assert stop_exit_code(True, {}) == 0


@pytest.mark.integration
def test_rendezvous_store_refuses_a_port_in_use_and_exits_0_on_sigterm(tmp_path) -> None:
    port = _free_port()
    store = _start_store(tmp_path / "store.log", port)
    try:
        busy = subprocess.run([sys.executable, "-m", "spot_training.training.distributed.torch_rendezvous", "--host", "127.0.0.1",
                               "--port", str(port)], cwd=REPO, capture_output=True, text=True, timeout=120)
        assert busy.returncode == 78, busy.stderr
        assert f"cannot listen on 127.0.0.1:{port}" in busy.stderr
        bad = subprocess.run([sys.executable, "-m", "spot_training.training.distributed.torch_rendezvous", "--port", "70000"],
                             cwd=REPO, capture_output=True, text=True, timeout=120)
        assert bad.returncode == 78 and "--port=70000" in bad.stderr, bad.stderr
    finally:
        store.send_signal(signal.SIGTERM)
        assert store.wait(timeout=30) == 0


# ----------------------------------------------------------------------------- the cluster harness
def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _start_store(log: Path, port: int) -> subprocess.Popen:
    out = open(log, "ab")
    proc = subprocess.Popen([sys.executable, "-m", "spot_training.training.distributed.torch_rendezvous", "--host", "127.0.0.1",
                             "--port", str(port)], cwd=REPO, stdout=out, stderr=out, start_new_session=True)
    deadline = time.monotonic() + 120
    while b"listening on" not in log.read_bytes():
        assert proc.poll() is None, log.read_text()
        assert time.monotonic() < deadline, "the store did not start listening"
        time.sleep(0.2)
    return proc


@dataclass
class Cluster:
    root: Path
    data_dir: Path
    port: int = field(default_factory=_free_port)
    store: subprocess.Popen | None = None
    nodes: dict = field(default_factory=dict)  # name -> Popen of its torchrun
    started: list = field(default_factory=list)

    @property
    def checkpoint_dir(self) -> Path:
        return self.root / "efs" / "checkpoints"

    def start_store(self) -> None:
        self.store = _start_store(self.root / "store.log", self.port)
        self.started.append(self.store)

    def start_node(self, name: str, rdzv_id: str) -> subprocess.Popen:
        node_dir = self.root / name
        node_dir.mkdir(parents=True, exist_ok=True)
        env = {k: v for k, v in os.environ.items() if not k.startswith(("SPOT_TRAINING_", "TORCHELASTIC_"))}
        env.update(SPOT_TRAINING_DATA_DIR=str(self.data_dir), SPOT_TRAINING_CHECKPOINT_DIR=str(self.checkpoint_dir),
                   SPOT_TRAINING_LOG_DIR=str(node_dir / "logs"), SPOT_TRAINING_NODE_ID=name,
                   SPOT_TRAINING_CHECKPOINT_REQUEST_FILE=str(node_dir / "checkpoint-request"),
                   OMP_NUM_THREADS="1", PYTHONPATH=str(REPO), **TORCHRUN_ENV)
        cmd = [str(TORCHRUN), "--nnodes=1:3", "--nproc-per-node=1", "--rdzv-backend=c10d",
               f"--rdzv-endpoint=127.0.0.1:{self.port}", f"--rdzv-id={rdzv_id}", "--max-restarts=100",
               "--monitor-interval=0.5", "--shutdown-timeout=60",
               "--rdzv-conf=is_host=false,last_call_timeout=2,join_timeout=120,keep_alive_interval=1,keep_alive_max_attempt=3",
               str(TRAINER), "--steps", str(STEPS), "--save-every-steps", str(SAVE_EVERY),
               "--min-step-seconds", str(STEP_SECONDS), "--learning-rate", "0.1"]
        with open(node_dir / f"torchrun-{rdzv_id}.log", "wb") as out:
            proc = subprocess.Popen(cmd, env=env, cwd=REPO, stdout=out, stderr=out, start_new_session=True)
        proc.log_path = Path(out.name)
        self.nodes[name] = proc
        self.started.append(proc)
        return proc

    def rows(self) -> list[dict]:
        """Every training_log.csv row of every node (rank 0 writes; rank 0 moves between nodes), by time."""
        rows = []
        for path in self.root.glob("*/logs/training_log.csv"):
            with open(path, newline="") as f:
                rows.extend(csv.DictReader(f))
        return sorted(rows, key=lambda r: float(r["wall_time"]))

    def steps(self) -> list[int]:
        return [int(r["step"]) for r in self.rows()]

    def wait_for(self, what, predicate, timeout: float = 240) -> None:
        deadline = time.monotonic() + timeout
        while not predicate():
            for name, proc in self.nodes.items():
                if proc.poll() is not None and proc.returncode != 0:
                    pytest.fail(f"node {name} torchrun exited {proc.returncode} while waiting for {what}:\n"
                                + self.logs())
            if time.monotonic() > deadline:
                pytest.fail(f"timed out waiting for {what}; steps so far {self.steps()[-5:]}\n" + self.logs())
            time.sleep(0.2)

    def logs(self, full: bool = False) -> str:
        parts = []
        for path in sorted(self.root.glob("*/torchrun-*.log")):
            text = path.read_text(errors="replace")
            parts.append(f"--- {path.relative_to(self.root)}\n" + (text if full else text[-3000:]))
        return "\n".join(parts)

    def result(self) -> dict:
        found = [json.loads(p.read_text()) for p in self.root.glob("*/logs/result.json")]
        assert len(found) == 1, found
        return found[0]

    def kill_node(self, name: str) -> None:
        """SIGKILL the node's torchrun and its workers (the instance is gone: no notice)."""
        proc = self.nodes.pop(name)
        workers = child_pids(proc.pid)
        os.killpg(proc.pid, signal.SIGKILL)
        for w in workers:
            try:
                os.killpg(w, signal.SIGKILL)  # torchrun starts each worker in its own session
            except ProcessLookupError:
                pass
        proc.wait()

    def kill_leftovers(self) -> None:
        for proc in self.started:
            if proc.poll() is None:
                for w in child_pids(proc.pid):
                    try:
                        os.killpg(w, signal.SIGKILL)
                    except ProcessLookupError:
                        pass
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()


@pytest.fixture
def cluster(tmp_path, digits_dir):
    c = Cluster(root=tmp_path, data_dir=digits_dir)
    try:
        yield c
    finally:
        c.kill_leftovers()


def _latest_step(cluster: Cluster) -> int:
    ckpt = CheckpointStore(cluster.checkpoint_dir, framework="pytorch").latest()
    return ckpt.step if ckpt is not None else 0


def _assert_finished(cluster: Cluster) -> None:
    # Every group restored the data position with its step: examples consumed = step x global batch (64).
    starts = re.findall(r"starting at step (\d+) of \d+, (\d+) examples consumed", cluster.logs(full=True))
    assert len(starts) >= 4 and all(int(e) == int(s) * 64 for s, e in starts), starts
    completed = json.loads((cluster.checkpoint_dir / "COMPLETED").read_text())
    assert completed["step"] == STEPS
    result = cluster.result()
    assert result["step"] == STEPS
    assert result["test_accuracy"] >= 0.9, result


# ----------------------------------------------------------------------------- the story, in real processes
@pytest.mark.slow
def test_two_nodes_train_a_third_joins_one_leaves_with_notice_and_no_step_is_lost(cluster):
    cluster.start_store()
    cluster.start_node("n1", "run-1")
    cluster.start_node("n2", "run-1")
    cluster.wait_for("2 nodes training", lambda: any(r["num_workers"] == "2" for r in cluster.rows()))
    cluster.start_node("n3", "run-1")
    cluster.wait_for("world size 3", lambda: any(r["num_workers"] == "3" for r in cluster.rows()))
    joined_at = next(int(r["step"]) for r in cluster.rows() if r["num_workers"] == "3")
    cluster.wait_for("steps at world size 3", lambda: cluster.steps()[-1] >= joined_at + 5)

    # Leave with notice: SIGTERM to n3's torchrun only (what its agent does on a spot interruption notice).
    leaver = cluster.nodes["n3"]
    leaver.send_signal(signal.SIGTERM)
    leaver.wait(timeout=120)  # torchrun re-raises the signal as SignalException: exit 1, by design
    del cluster.nodes["n3"]  # gone (its agent leaves the fleet)
    left_at = _latest_step(cluster)
    # Its worker got the SIGTERM itself, saved the agreed step (rank 0 wrote it) and exited 0.
    assert f"stop requested (signal 15): checkpoint at step {left_at} written, exiting 0" in \
        leaver.log_path.read_text(errors="replace"), cluster.logs()
    cluster.wait_for("training at world size 2 after the leave",
                     lambda: any(r["num_workers"] == "2" and int(r["step"]) > left_at for r in cluster.rows()))
    after = next(int(r["step"]) for r in cluster.rows() if r["num_workers"] == "2" and int(r["step"]) > left_at)
    assert after == left_at + 1, f"resumed at {after - 1}, the agreed checkpoint was {left_at}"

    for name in ("n1", "n2"):
        assert cluster.nodes[name].wait(timeout=300) == 0, cluster.logs()
    steps = cluster.steps()
    # 0 steps lost and none trained twice: every step exactly once, across join and leave.
    assert steps == list(range(1, STEPS + 1)), [s for s in steps if steps.count(s) > 1][:10]
    sizes = [int(r["num_workers"]) for r in cluster.rows()]
    assert sizes[0] in (1, 2) and 3 in sizes and sizes[-1] == 2
    _assert_finished(cluster)


@pytest.mark.slow
def test_sigkilled_node_and_sigkilled_store_resume_from_the_newest_checkpoint(cluster):
    cluster.start_store()
    cluster.start_node("n1", "run-1")
    cluster.start_node("n2", "run-1")
    cluster.wait_for("2 nodes training", lambda: sum(r["num_workers"] == "2" for r in cluster.rows()) >= 25)

    # A node lost without notice: the survivor resumes from the newest checkpoint.
    killed_after = cluster.steps()[-1]
    cluster.kill_node("n2")
    newest = _latest_step(cluster)
    assert killed_after - SAVE_EVERY <= newest <= killed_after + 1
    cluster.wait_for("training at world size 1",
                     lambda: any(r["num_workers"] == "1" for r in cluster.rows()))
    resumed = next(int(r["step"]) for r in cluster.rows() if r["num_workers"] == "1") - 1
    assert newest <= resumed, (resumed, newest)  # the newest checkpoint (or one the survivor committed after)
    last_before_kill = max(int(r["step"]) for r in cluster.rows() if r["num_workers"] == "2")
    assert last_before_kill - resumed <= SAVE_EVERY, (last_before_kill, resumed)
    cluster.start_node("n2", "run-1")  # its replacement joins the same rendezvous
    cluster.wait_for("2 nodes again", lambda: cluster.rows()[-1]["num_workers"] == "2")
    cluster.wait_for("a few steps at world size 2", lambda: cluster.steps()[-1] >= int(
        next(r["step"] for r in reversed(cluster.rows()) if r["num_workers"] == "1")) + 5)

    # The coordinator's store lost: every torchrun fails; the store comes back (same port, as the
    # replacement coordinator would publish), the agents relaunch torchrun with a new rendezvous id.
    before = cluster.steps()[-1]
    os.killpg(cluster.store.pid, signal.SIGKILL)
    cluster.store.wait()
    for name in ("n1", "n2"):
        assert cluster.nodes[name].wait(timeout=180) != 0, cluster.logs()  # RendezvousConnectionError
    assert not (cluster.checkpoint_dir / "COMPLETED").exists()
    newest = _latest_step(cluster)  # nothing runs now: this is what the relaunched nodes must restore
    assert before - SAVE_EVERY <= newest
    relaunched = time.time()
    cluster.start_store()
    for name in ("n1", "n2"):
        cluster.start_node(name, "run-2")
    cluster.wait_for("training after the store came back",
                     lambda: any(int(r["step"]) == newest + 1 for r in cluster.rows()[-40:]))
    for name in ("n1", "n2"):
        assert cluster.nodes[name].wait(timeout=300) == 0, cluster.logs()
    steps = cluster.steps()
    assert steps[-1] == STEPS
    after = [int(r["step"]) for r in cluster.rows() if float(r["wall_time"]) > relaunched]
    assert after == list(range(newest + 1, STEPS + 1)), after[:5]
    # Re-trained steps only after the SIGKILLs, at most one save interval each time.
    duplicates = len(steps) - len(set(steps))
    assert duplicates <= 2 * SAVE_EVERY, duplicates
    assert sorted(set(steps)) == list(range(1, STEPS + 1))
    _assert_finished(cluster)
