"""An elastic MXNet ``dist_sync`` cluster on one machine: real agents (``python -m spot_training.agent run``), the
ps-lite scheduler, 2 servers and 2-3 workers as real processes, each node in its own network namespace
(tests/cluster/cluster_harness.py), EFS as a shared directory, the 8x8 digits.

One cluster runs through the whole story in order (each test is one chapter and needs the one before):
two servers + two workers train; a third worker joins and training continues from the checkpoint;
a worker leaves on a spot interruption notice, another when its member tag is removed (as in the
Dynamic Training article); a worker's process is SIGKILLed (MXNet hangs, so the
coordinator tears the generation down and restarts it within the timeout); a parameter server's
node is SIGKILLed (heartbeats stop; a replacement node, as the Auto Scaling group would start,
registers and training resumes from the checkpoint); training completes at exactly the total step.
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "cluster"))
from cluster_fixtures import network  # noqa: E402, F401 - a fixture
from cluster_harness import MEMBER_TAG, Cluster  # noqa: E402

TOTAL_STEPS = 700
SAVE_EVERY = 20
HEARTBEAT_TIMEOUT_S = 10.0
# Worst case to notice and restart a generation on this 2-core machine: heartbeat timeout, kill
# grace, and ~10 s of `import mxnet` per process when other jobs load the machine.
RESTART_BUDGET_S = 120.0

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def cluster(tmp_path_factory, digits_dir, network):
    c = Cluster.digits_story(tmp_path_factory, network, framework="mxnet", data_dir=digits_dir,
                             trainer_module="spot_training.training.distributed.mxnet_dist", steps=TOTAL_STEPS,
                             save_every=SAVE_EVERY, min_step_seconds=0.04, heartbeat_timeout_s=HEARTBEAT_TIMEOUT_S,
                             debounce_s=2.0, kill_grace_s=3.0)
    yield c
    c.close()


def test_two_servers_and_two_workers_train(cluster):
    assert cluster.start_parameter_servers(restart_s=RESTART_BUDGET_S) == 1
    plan = cluster.plan()
    assert len(plan.servers) == 2 and [w["rank"] for w in plan.workers] == [0, 1]
    rows = cluster.steps_in_generation(1)
    assert {r["node"] for r in rows} == {w["node_id"] for w in plan.workers}
    assert {r["num_workers"] for r in rows} == {"2"}


def test_third_worker_joins_and_training_continues_from_the_checkpoint(cluster):
    joiner = cluster.add_node("worker")
    gen = cluster.wait_for(lambda: cluster.running_generation(generation_above=1, workers=3), RESTART_BUDGET_S,
                           "a generation with 3 workers")
    assert any(e["state"] == "checkpoint" and "joined" in e["reason"] for e in cluster.events())
    cluster.wait_for_steps(gen, 20, RESTART_BUDGET_S)
    first, last_before = cluster.resumed_after(gen, gen - 1)
    # The workers stopped together at one step, rank 0 saved it, the new generation starts right after it.
    assert first == last_before + 1
    assert last_before in cluster.checkpoint_steps() or last_before < min(cluster.checkpoint_steps())
    assert joiner.instance_id in {r["node"] for r in cluster.steps_in_generation(gen)}
    print(f"join: generation {gen} resumed at step {first} with 3 workers")


def test_worker_leaves_on_a_spot_notice_and_training_continues_without_it(cluster):
    plan = cluster.plan()
    leaver = next(n for n in cluster.nodes if n.role == "worker" and n.instance_id == plan.workers[1]["node_id"])
    before = plan.generation
    leaver.imds.post_spot_interruption()
    noticed = time.time()
    gen = cluster.assert_left_cleanly(leaver, before=before, workers=2, restart_s=RESTART_BUDGET_S, why="leaving")
    rows = cluster.steps_in_generation(gen)
    print(f"leave: notice -> generation {gen} training {float(rows[0]['wall_time']) - noticed:.1f} s")


def test_worker_leaves_when_its_member_tag_is_removed(cluster):
    plan = cluster.plan()
    leaver = next(n for n in cluster.nodes if n.instance_id == plan.workers[-1]["node_id"])
    cluster.wait_for_steps(plan.generation, 10, RESTART_BUDGET_S)
    del leaver.imds.tags[MEMBER_TAG]  # what `aws ec2 delete-tags` does, seen through instance metadata tags
    cluster.assert_left_cleanly(leaver, before=plan.generation, workers=1, restart_s=RESTART_BUDGET_S, why="untagged")


def test_sigkilled_worker_process_restarts_the_generation_within_the_timeout(cluster):
    plan = cluster.plan()
    victim = next(n for n in cluster.nodes if n.instance_id == plan.workers[0]["node_id"])
    cluster.wait_for_steps(plan.generation, 15, RESTART_BUDGET_S)
    cluster.kill_process(victim)
    killed = time.time()
    gen = cluster.wait_for(lambda: cluster.running_generation(generation_above=plan.generation), RESTART_BUDGET_S,
                           "the generation to restart after a worker died")
    assert "exited" in cluster.plan().reason or "gone" in cluster.plan().reason
    cluster.wait_for_steps(gen, 10, RESTART_BUDGET_S)
    first, last_before = cluster.resumed_after(gen, plan.generation)
    # Resumed from the newest checkpoint: steps after it are redone, none skipped.
    assert first - 1 in cluster.checkpoint_steps() or first - 1 <= last_before
    assert first - 1 <= last_before and last_before - (first - 1) <= SAVE_EVERY
    print(f"kill worker: generation {gen} training {float(cluster.steps_in_generation(gen)[0]['wall_time']) - killed:.1f} s "
          f"after SIGKILL, resumed at step {first} (lost {last_before - first + 1} steps)")


def test_sigkilled_server_node_is_replaced_and_training_resumes_from_the_checkpoint(cluster):
    cluster.replace_killed_server(notice_s=HEARTBEAT_TIMEOUT_S + 15, restart_s=RESTART_BUDGET_S, save_every=SAVE_EVERY)


def test_training_completes_at_the_exact_step_with_test_accuracy(cluster):
    cluster.assert_completed(total_steps=TOTAL_STEPS, timeout=300, label="MXNet")
