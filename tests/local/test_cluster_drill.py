"""The cluster drill end to end, for MXNet and for PyTorch: the real CDK CLI deploys DistributedTraining
to the moto server; the on-demand Auto Scaling groups' instances (MXNet: scheduler and servers; PyTorch:
the coordinator serving TorchElastic's c10d rendezvous) and the worker fleet's instances boot by running
their own launch templates' user data, which starts the real agents in network namespaces, running MXNet
``dist_sync`` or ``torchrun``; 2 workers train, the fleet's target is raised and a third joins, one worker
gets a spot notice and leaves (the fleet's replacement joins), training completes at exactly the total
step, a worker cancels the fleet, the stack is destroyed and nothing is left. Also asserts that nothing
the drill started survives.

Slow (about 2-3 minutes each on 2 cores). The frameworks run in the node subprocesses only; this
process imports none. The agents run on this interpreter (.venv: boto3), PyTorch's trainer and
rendezvous store on ``.venv-torch/bin/python`` (``cluster_training_python``), so the PyTorch drill's
test lives here, not under tests/torch (whose pytest runs in .venv-torch, without boto3 or moto).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from spot_training.local.cluster_drill import ClusterDrillOptions, run_cluster_drill
from spot_training.local.drill import framework_python

STEPS = 800


def _processes_mentioning(text: str) -> list[str]:
    """Live processes whose command line or environment mentions ``text`` (the drill's work dir is in
    every agent's --config, and in every framework process's SPOT_TRAINING_* paths on the EFS dir)."""
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            state = (entry / "stat").read_text().rsplit(")", 1)[1].split()[0]
            seen = b" ".join((entry / name).read_bytes() for name in ("cmdline", "environ"))
        except OSError:
            continue
        if text.encode() in seen and state != "Z":
            found.append(f"{entry.name}: {(entry / 'cmdline').read_bytes()[:200]!r}")
    return found


@pytest.mark.slow
@pytest.mark.timeout(900)
@pytest.mark.parametrize("framework", ["mxnet", "pytorch"])
def test_cluster_drill_two_workers_a_third_joins_one_is_interrupted(tmp_path, framework):
    assert Path(framework_python(framework)).is_file(), f"{framework_python(framework)} is missing: `make setup` makes it"
    work = tmp_path / "cluster-drill"
    events = []
    # A floor of 0.08 s a step (64 s of training at least): the join must land before the last step on a
    # loaded 2-core machine too (CI once finished all 800 steps at 0.05 s before the third worker's first).
    report = run_cluster_drill(ClusterDrillOptions(work_dir=work, framework=framework, steps=STEPS, min_step_seconds=0.08),
                               on_event=events.append)

    assert report["error"] is None, report["error"]
    assert report["framework"] == framework
    assert report["completed"] is True
    # Exactly the total: every step ran once across 4 generations (2 -> 3 -> 2 -> 3 workers).
    assert report["steps_total"] == STEPS
    assert report["steps_executed"] == STEPS and report["distinct_steps"] == STEPS
    assert report["lost_steps"] == 0
    assert report["joins"] >= 2 and report["leaves"] == 1  # the third worker and the replacement; the interrupted one
    assert report["generations"] >= 4 and report["max_workers_seen"] == 3
    assert report["world_sizes"] == [2, 3, 2, 3]  # with the fleet: the join, the notice, the replacement
    assert 0 < report["join_s"] < 120 and 0 < report["leave_s"] < 120
    assert report["test_accuracy"] >= 0.9
    assert report["fleet_cancelled_on_completion"] is True  # a worker's agent cancelled it (docs/architecture.md, "The user's story", step 4)
    assert report["orphans_after_destroy"] == []
    # Read back through `spot-train status` and `cost` from the local AWS: the agents'
    # published progress, the notice in their logs, and what the cluster cost (on-demand scheduler and
    # servers, or PyTorch's coordinator, at the on-demand price, spot workers at the spot price history).
    assert report["aws_status"]["training"]["step"] == STEPS and report["aws_status"]["training"]["completed"] is True
    [notice] = report["aws_interruptions"]
    assert notice["instance_id"] == next(e["instance_id"] for e in events if e["event"] == "notice-posted")
    replacement = [e["instance_id"] for e in events if e["event"] == "node-started"][-1]  # the fleet's, after the notice
    assert notice["replacement_instance_id"] == replacement and notice["volume_moved"] is False
    cost = report["cost"]
    assert {r["lifecycle"] for r in cost["rows"]} == {"spot", "on-demand"}
    on_demand = {"mxnet": {"m5.large", "m5.xlarge"}, "pytorch": {"m5.large"}}[framework]  # no servers for PyTorch
    assert {r["instance_type"] for r in cost["rows"] if r["lifecycle"] == "on-demand"} == on_demand
    assert cost["cost_usd"] > cost["spot_cost_usd"] > 0
    assert report["savings_pct"] == pytest.approx((1 - cost["cost_usd"] / cost["on_demand_cost_usd"]) * 100)
    assert report["passed"] is True
    assert json.loads((work / "report.json").read_text())["steps_total"] == STEPS

    # The story happened in this order, on the real fleet and groups.
    kinds = [e["event"] for e in events if e["event"] != "progress"]
    for before, after in (("deployed", "capacity-raised"), ("capacity-raised", "joined"), ("joined", "notice-posted"),
                          ("notice-posted", "instance-terminated"), ("instance-terminated", "completed"),
                          ("completed", "destroyed")):
        assert kinds.index(before) < kinds.index(after), kinds
    roles = sorted(e["role"] for e in events if e["event"] == "node-started")
    # Every node booted as an instance does: its own role's launch template user data ran (the
    # stand-in init's log, each boot step ok) and started the agent's unit with the config that user
    # data wrote under the node root; the drill wrote no config of its own (docs/localmode.md, "The boot script").
    for started in (e for e in events if e["event"] == "node-started"):
        node_dir = work / "nodes" / started["instance_id"]
        log = (node_dir / "agent.log").read_text(errors="replace")
        assert "local-init: running the user data" in log and "local-init: user data exited with status 0" in log
        assert "spot-training boot: step start-agent ok" in log and "local-init: started spot-training-agent.service" in log
        written = json.loads((node_dir / "root" / "etc" / "spot-training" / "config.json").read_text())
        assert written["node_role"] == started["role"]
        assert not (node_dir / "config.json").exists()
        assert (node_dir / "root" / "mnt" / "efs").resolve() == (work / "efs").resolve()
    if framework == "mxnet":
        assert roles == ["scheduler", "server", "worker", "worker", "worker", "worker"]
        plan = [json.loads(line) for line in (work / "results" / "events.jsonl").read_text().splitlines()]
        assert [p["generation"] for p in plan if p["state"] == "running"] == [1, 2, 3, 4]
        assert [len(p["workers"]) for p in plan if p["state"] == "running"] == [2, 3, 2, 3]
        assert plan[-1]["state"] == "completed"
        assert report["rendezvous_epoch"] is None
    else:
        # No parameter servers; the coordinator published the rendezvous once and kept it (no
        # replacement, no torchrun gave up).
        assert roles == ["scheduler", "worker", "worker", "worker", "worker"]
        assert report["rendezvous_epoch"] == 1
        assert not (work / "results" / "events.jsonl").exists()  # TorchElastic keeps no plan
    assert _processes_mentioning(str(work)) == []
