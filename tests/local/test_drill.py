"""The drill end to end: real CDK CLI against the moto server, the real agent and trainer, one spot
interruption whose replacement lands in the other AZ (the volume moves through a snapshot), destroy,
orphan check. Asserts every report field the issue lists, and that nothing it started survives.

Slow (a few minutes on 2 cores): TensorFlow runs in the trainer subprocesses only.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

REPO_ROOT = Path(__file__).resolve().parents[2]


def _processes_mentioning(text: str) -> list[str]:
    """Command lines of live processes that mention ``text`` (the drill's unique work dir is in every
    command it starts: moto server --ebs-dir, agent --config, trainer --save-final-weights, cdk --output)."""
    found = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                cmdline = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
                state = (entry / "stat").read_text().rsplit(")", 1)[1].split()[0]
            except OSError:
                continue
            if text in cmdline and state != "Z":
                found.append(f"{entry.name}: {cmdline}")
    return found


def run_drill_cli(work: Path, *args: str, timeout: float, env: dict[str, str] | None = None,
                  ) -> tuple[subprocess.CompletedProcess[str], dict]:
    """Run ``spot-train local drill --work-dir WORK ARGS...`` through the console script's entry point
    (as ``make demo`` does) with no ``AWS_*`` variables of this shell, and read its report.

    Args:
        work: the drill's work dir (``report.json`` lands there).
        *args: the drill's other arguments.
        timeout: seconds the drill may take.
        env: extra environment variables for the drill.

    Returns:
        ``(completed, report)``: the finished process (stdout/stderr captured as text) and the parsed
        ``report.json``; the caller asserts the exit status with what it wants to see on failure.

    Raises:
        AssertionError: the drill wrote no report (the message carries its output's tails).
    """
    run_env = {k: v for k, v in os.environ.items() if not k.startswith("AWS_")} | (env or {})
    completed = subprocess.run(
        [sys.executable, "-c", "import sys; from spot_training.cli import main; sys.exit(main())",
         "local", "drill", "--work-dir", str(work), *args],
        cwd=REPO_ROOT, env=run_env, capture_output=True, text=True, timeout=timeout,
    )
    report_path = work / "report.json"
    assert report_path.exists(), completed.stdout[-3000:] + completed.stderr[-3000:]
    return completed, json.loads(report_path.read_text())


@pytest.mark.slow
@pytest.mark.timeout(1200)
def test_single_node_drill_survives_an_interruption_with_an_az_move(tmp_path):
    work = tmp_path / "drill"
    # Shorter than `make demo`: 12 epochs, one interruption.
    completed, report = run_drill_cli(work, "--interruptions", "1", "--az-moves", "1", "--epochs", "12",
                                      timeout=1100, env={"PYTHONUNBUFFERED": "1"})
    assert completed.returncode == 0, (report.get("error"), completed.stdout[-3000:])

    assert report["passed"] is True
    assert report["completed"] is True
    assert report["steps_total"] == 12 * (1437 // 32)
    assert report["steps_executed"] == report["steps_total"]
    assert report["lost_steps"] == 0
    assert report["interruptions"] == 1
    assert report["az_moves"] == 1
    [event] = report["interruption_events"]
    assert event["from_az"] != event["to_az"]
    assert event["volume_moved"] is True and event["volume_id_after"] != event["volume_id_before"]
    assert event["resumed_at_step"] == event["checkpoint_step"] + 1
    assert event["step_at_notice"] <= event["checkpoint_step"] < report["steps_total"]
    assert 0 <= event["notice_to_checkpoint_s"] < 120
    assert 0 < event["boot_to_resume_s"] < 300
    assert 0.8 < report["test_accuracy"] <= 1.0
    assert report["test_accuracy"] == report["baseline_test_accuracy"]
    assert report["matches_uninterrupted_baseline"] is True
    assert report["orphans_after_destroy"] == []
    assert report["wall_s"] > 0
    # Read back from the local AWS through spot-train status / cost's code, before destroy.
    assert "read_back_error" not in report, report.get("read_back_error")
    [aws_event] = report["aws_interruptions"]
    assert aws_event["instance_id"] == event["instance_id"]
    assert aws_event["replacement_instance_id"] == event["replacement_instance_id"]
    assert aws_event["volume_moved"] is True and aws_event["resumed_at_step"] == event["resumed_at_step"]
    assert aws_event["checkpoint_step"] == event["checkpoint_step"]
    assert 0 <= aws_event["notice_to_checkpoint_s"] < 120 and 0 < aws_event["boot_to_resume_s"] < 300
    assert report["aws_status"]["training"]["step"] == report["steps_total"]
    assert report["aws_status"]["training"]["completed"] is True
    cost = report["cost"]
    assert {r["instance_type"] for r in cost["rows"]} == {"g5.xlarge"} and sum(r["instances"] for r in cost["rows"]) == 2
    assert cost["on_demand_source"] == {"g5.xlarge": "given"} and cost["spot_cost_usd"] > 0
    assert report["savings_pct"] == pytest.approx((1 - cost["spot_cost_usd"] / cost["on_demand_cost_usd"]) * 100)
    assert "Read back from the local AWS" in completed.stdout and "savings" in completed.stdout
    assert (work / "training.png").stat().st_size > 10_000
    assert (work / "results" / "training_log.csv").exists()
    # The report table went to the terminal, and the live display showed the events.
    assert "Drill report" in completed.stdout and "spot interruption #1" in completed.stdout
    assert "MOVED to" in completed.stdout
    # Every node ran the launch template's own user data, and the trainer's environment was built once
    # on the data volume and reused by the replacement (docs/localmode.md, "The boot script").
    logs = [p.read_text(errors="replace") for p in sorted((work / "nodes").glob("*/agent.log"))]
    assert len(logs) == 2 and all("spot-training boot: step start-agent ok" in log for log in logs)
    assert sum(log.count('"message": "environment built"') for log in logs) == 1
    assert sum(log.count('"message": "environment reused"') for log in logs) == 1
    # Nothing it started is still running (moto server, agents, trainers, baseline, CDK CLI).
    assert _processes_mentioning(str(work)) == []


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_local_up_status_down_leaves_nothing(tmp_path):
    work = tmp_path / "local"
    env = {k: v for k, v in os.environ.items() if not k.startswith("AWS_")}

    def spot_train(*args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run([sys.executable, "-c", "import sys; from spot_training.cli import main; sys.exit(main())", *args],
                              cwd=REPO_ROOT, env=env, capture_output=True, text=True, timeout=800)

    up = spot_train("local", "up", "--work-dir", str(work))
    state = json.loads((work / "state.json").read_text())
    try:
        assert up.returncode == 0, up.stdout[-2000:] + up.stderr[-2000:]
        # The live local stack through the same code as a deployed one (spot_training.ops.operations).
        status = spot_train("status", "--work-dir", str(work), "--json")
        assert status.returncode == 0, status.stderr
        live = json.loads(status.stdout)
        assert live["stack_status"] == "CREATE_COMPLETE"
        assert live["fleet"]["state"] == "active" and live["fleet"]["id"] == state["fleet_request_id"]
        assert [i["state"] for i in live["instances"]] == ["running"]
        assert [v["availability_zone"] for v in live["data_volume"]] == ["us-east-1a"]
        assert len(live["alarms"]) == 4  # the stack's alarms exist in the local AWS (spot_training.local.cfn_compat)
        # `local up` started the node the fleet asks for (the node keeper), and it trains until `local down`.
        [instance] = live["instances"]
        agent_log = work / "nodes" / instance["instance_id"] / "agent.log"
        assert agent_log.exists(), (work / "keeper.log").read_text(errors="replace")[-2000:]
        deadline = time.monotonic() + 180
        while '"training started"' not in agent_log.read_text(errors="replace") and time.monotonic() < deadline:
            time.sleep(1)
        assert '"training started"' in agent_log.read_text(errors="replace"), agent_log.read_text(errors="replace")[-3000:]
        assert os.path.exists(f"/proc/{state['keeper_pid']}")
    finally:
        down = spot_train("local", "down", "--work-dir", str(work))
    assert down.returncode == 0, down.stdout[-2000:] + down.stderr[-2000:]
    assert "orphans: []" in down.stdout
    assert not (work / "state.json").exists()
    keeper_events = [json.loads(line)["event"] for line in (work / "keeper-events.jsonl").read_text().splitlines()]
    assert keeper_events[0] == "keeper-started" and "node-started" in keeper_events and keeper_events[-1] == "keeper-stopped"
    assert _processes_mentioning(str(work)) == []
