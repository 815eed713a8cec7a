"""An elastic PyTorch cluster on TorchElastic on one machine: real agents
(``python -m spot_training.agent run``), the coordinator's c10d store (spot_training.training.distributed.torch_rendezvous),
``torchrun`` + the DDP digits trainer (spot_training.training.distributed.torch_ddp, gloo) on every worker, each node in
its own network namespace (cluster_harness.py), EFS as a shared directory.

One cluster runs through the story in order (each test needs the one before): 2 workers train; a third
joins (0 steps lost); one leaves on a spot notice (0 steps lost); one is SIGKILLed (resume from the newest
checkpoint, at most one save interval lost); the coordinator is SIGKILLed and a replacement node brings the
rendezvous back (the workers resume with no manual step); training completes at exactly the total step
and the held-out accuracy is reported.

The agents run on the test's interpreter (stdlib + boto3); the trainer and the store on .venv-torch's.
"""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path

import pytest
from cluster_fixtures import network  # noqa: F401 - a fixture
from torch_harness import TORCH_PYTHON, TorchCluster

TOTAL_STEPS = 500
SAVE_EVERY = 20
BUDGET_S = 180.0  # torch imports and worker-group restarts on 2 shared cores

pytestmark = pytest.mark.slow


def _first_change(rows: list[dict], since: int, world_size: int) -> tuple[dict, dict]:
    """(the last row before, the first row at ``world_size``) after row index ``since``."""
    for i in range(max(since, 1), len(rows)):
        if int(rows[i]["num_workers"]) == world_size and int(rows[i - 1]["num_workers"]) != world_size:
            return rows[i - 1], rows[i]
    raise AssertionError(f"no change to world size {world_size} after row {since}: {rows[since:][:5]}")


@pytest.fixture(scope="module")
def cluster(tmp_path_factory, network):
    if not TORCH_PYTHON.exists():
        pytest.fail(f"{TORCH_PYTHON} missing: run `make setup`")
    c = TorchCluster.digits_story(tmp_path_factory, network, framework="pytorch",
                                  trainer_module="spot_training.training.distributed.torch_ddp", steps=TOTAL_STEPS,
                                  save_every=SAVE_EVERY, min_step_seconds=0.05, num_servers=0, heartbeat_timeout_s=8.0,
                                  kill_grace_s=3.0, base_port=9300)
    c.cluster_section["num_servers"] = 0
    yield c
    c.close()


def test_two_workers_train(cluster):
    cluster.add_node("scheduler")
    cluster.add_node("worker")
    cluster.add_node("worker")
    cluster.wait_rows(lambda rows: sum(1 for r in rows if r["num_workers"] == "2") >= 20, "20 steps with 2 workers")
    assert cluster.rdzv()["epoch"] == 1


def test_third_worker_joins_and_no_step_is_lost(cluster):
    since = len(cluster.rows())
    cluster.add_node("worker")
    rows = cluster.wait_rows(lambda rows: sum(1 for r in rows[since:] if r["num_workers"] == "3") >= 10,
                             "10 steps with 3 workers")
    before, first = _first_change(rows, since, 3)
    assert int(first["step"]) == int(before["step"]) + 1, (before, first)


def test_worker_leaves_on_a_spot_notice_and_no_step_is_lost(cluster):
    since = len(cluster.rows())
    leaver = [n for n in cluster.nodes if n.role == "worker"][1]
    leaver.imds.post_spot_interruption()
    rows = cluster.wait_rows(lambda rows: sum(1 for r in rows[since:] if r["num_workers"] == "2") >= 10,
                             "10 steps with 2 workers after the notice")
    before, first = _first_change(rows, since, 2)
    assert int(first["step"]) == int(before["step"]) + 1, (before, first)
    cluster.wait_for(lambda: not leaver.alive(), 60, "the leaving worker's agent to exit")
    assert leaver.agent.returncode == 0
    assert leaver.instance_id not in cluster.state.registrations()


def test_worker_sigkilled_resumes_from_the_newest_checkpoint(cluster):
    since = len(cluster.rows())
    victim = [n for n in cluster.nodes if n.role == "worker" and n.alive()][0]
    cluster.kill_node(victim)
    rows = cluster.wait_rows(lambda rows: sum(1 for r in rows[since:] if r["num_workers"] == "1") >= 10,
                             "10 steps with 1 worker after the SIGKILL")
    before, first = _first_change(rows, since, 1)
    lost = int(before["step"]) + 1 - int(first["step"])
    assert 0 <= lost <= SAVE_EVERY, (before, first)


def test_coordinator_sigkilled_and_replaced_workers_resume(cluster):
    old = cluster.rdzv()
    coordinator = next(n for n in cluster.nodes if n.role == "scheduler")
    last_step = int(cluster.rows()[-1]["step"])
    cluster.kill_node(coordinator)
    killed_at = time.time()
    cluster.add_node("scheduler")  # what its Auto Scaling group does
    cluster.wait_for(lambda: (cluster.rdzv() or {}).get("epoch", 0) > old["epoch"], BUDGET_S, "a new epoch")
    assert cluster.rdzv()["host"] != old["host"]
    rows = cluster.wait_rows(lambda rows: sum(1 for r in rows if float(r["wall_time"]) > killed_at + 1) >= 10,
                             "10 steps after the coordinator came back")
    after = [r for r in rows if float(r["wall_time"]) > killed_at]
    resumed = next(i for i in range(1, len(after)) if int(after[i]["step"]) != int(after[i - 1]["step"]) + 1) \
        if any(int(after[i]["step"]) != int(after[i - 1]["step"]) + 1 for i in range(1, len(after))) else None
    if resumed is not None:  # the job restarted: from the newest checkpoint (or the agreed stop step)
        lost = int(after[resumed - 1]["step"]) + 1 - int(after[resumed]["step"])
        assert 0 <= lost <= SAVE_EVERY, after[resumed - 1: resumed + 1]
    assert max(int(r["step"]) for r in rows) > last_step


def test_training_completes_at_exactly_the_total_step_with_held_out_accuracy(cluster):
    cluster.wait_for(lambda: (cluster.checkpoint_dir / "COMPLETED").exists(), 3 * BUDGET_S, "COMPLETED")
    result = cluster.wait_for(lambda: cluster.result(), 30, "result.json")
    assert result["step"] == TOTAL_STEPS
    assert max(int(r["step"]) for r in cluster.rows()) == TOTAL_STEPS
    print(f"held-out accuracy: {result['test_accuracy']:.3f} (goal >= 0.9)", file=sys.stderr)
    assert result["test_accuracy"] >= 0.9
    for node in cluster.nodes:
        if node.alive():
            cluster.wait_for(lambda: not node.alive(), 60, f"{node.name}'s agent to finish")
            assert node.agent.returncode == 0
    assert os.environ.get("SPOT_TRAINING_TEST_LOOPBACK") or all(n.netns for n in cluster.nodes)
    assert Path(cluster.log_dir / "result.json").exists()
