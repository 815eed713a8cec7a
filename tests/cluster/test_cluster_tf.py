"""An elastic TensorFlow ``ParameterServerStrategy`` cluster on one machine: real agents, the chief
(``ClusterCoordinator`` custom loop), 2 ps tasks and 2-3 worker tasks as real processes, each node in its
own network namespace (cluster_harness.py), EFS as a shared directory, the 8x8 digits.

One cluster runs through the story in order (each test needs the one before): train; a third worker
joins (new generation from the chief's checkpoint); a worker leaves on a spot notice; a worker's process
is SIGKILLed and training carries on inside the generation (its agent restarts it at the same address,
TensorFlow lets it rejoin); a parameter server's node is SIGKILLed, a replacement node registers and
training resumes from the checkpoint; training completes at exactly the total step.
"""

from __future__ import annotations

import pytest
from cluster_fixtures import network  # noqa: F401 - a fixture
from cluster_harness import Cluster

TOTAL_STEPS = 600
SAVE_EVERY = 20
HEARTBEAT_TIMEOUT_S = 10.0
RESTART_BUDGET_S = 150.0  # six TensorFlow imports on 2 shared cores

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def cluster(tmp_path_factory, network):
    c = Cluster.digits_story(tmp_path_factory, network, framework="tensorflow",
                             trainer_module="spot_training.training.distributed.tf_pss", steps=TOTAL_STEPS,
                             save_every=SAVE_EVERY, min_step_seconds=0.05, heartbeat_timeout_s=HEARTBEAT_TIMEOUT_S,
                             debounce_s=2.0, kill_grace_s=3.0, base_port=9100)
    yield c
    c.close()


def test_two_ps_and_two_workers_train(cluster):
    assert cluster.start_parameter_servers(restart_s=RESTART_BUDGET_S) == 1


def test_third_worker_joins_and_training_continues_from_the_checkpoint(cluster):
    cluster.add_node("worker")
    gen = cluster.wait_for(lambda: cluster.running_generation(generation_above=1, workers=3), RESTART_BUDGET_S,
                           "a generation with 3 workers")
    assert any(e["state"] == "checkpoint" and "joined" in e["reason"] for e in cluster.events())
    cluster.wait_for_steps(gen, 20, RESTART_BUDGET_S)
    first, last_before = cluster.resumed_after(gen, gen - 1)
    assert first == last_before + 1  # the chief joined, saved at that step and exited 0
    assert {r["num_workers"] for r in cluster.steps_in_generation(gen)} == {"3"}


def test_worker_leaves_on_a_spot_notice_and_training_continues_without_it(cluster):
    plan = cluster.plan()
    leaver = next(n for n in cluster.nodes if n.instance_id == plan.workers[1]["node_id"])
    leaver.imds.post_spot_interruption()
    cluster.assert_left_cleanly(leaver, before=plan.generation, workers=2, restart_s=RESTART_BUDGET_S, why="leaving")


def test_sigkilled_worker_process_and_training_carries_on_in_the_same_generation(cluster):
    plan = cluster.plan()
    victim = next(n for n in cluster.nodes if n.instance_id == plan.workers[0]["node_id"])
    cluster.wait_for_steps(plan.generation, 10, RESTART_BUDGET_S)
    killed_pid = cluster.kill_process(victim)
    at_kill = cluster.max_step()
    _progress_after = lambda: cluster.max_step() >= at_kill + 40  # noqa: E731
    cluster.wait_for(_progress_after, RESTART_BUDGET_S, "40 more steps after the worker was killed")
    assert cluster.plan().generation == plan.generation and cluster.plan().state == "running"
    cluster.wait_for(lambda: cluster.process_pid(victim) not in (None, killed_pid), 60,
                     "the agent to restart the worker at the same address")
    assert "restarting it at the same address" in victim.log_path.read_text()


def test_sigkilled_ps_node_is_replaced_and_training_resumes_from_the_checkpoint(cluster):
    cluster.replace_killed_server(notice_s=HEARTBEAT_TIMEOUT_S + 30, restart_s=RESTART_BUDGET_S, save_every=SAVE_EVERY)


def test_training_completes_at_the_exact_step_with_test_accuracy(cluster):
    cluster.assert_completed(total_steps=TOTAL_STEPS, timeout=400, label="TensorFlow")
