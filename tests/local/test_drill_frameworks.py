"""`spot-train local drill --framework pytorch|mxnet` end to end, with every check `make demo` makes:
deployed with `-c framework=...` (so the nodes run the command the stack derives from the framework),
3 spot interruptions of which one moves the data volume to the other AZ, training completed with no
step lost, the final state bitwise equal to an uninterrupted baseline run, nothing orphaned after
`cdk destroy`, and nothing the drill started still running.

Slow (2-4 minutes each on 2 cores). PyTorch trains with `.venv-torch/bin/python` (its own
environment: TensorFlow, MXNet and PyTorch never share a process), MXNet with `.venv/bin/python`.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from test_drill import _processes_mentioning

from spot_training.local.drill import DRILL_FRAMEWORKS, DrillOptions

REPO_ROOT = Path(__file__).resolve().parents[2]
DEFAULT = DrillOptions()


def _run_drill(work: Path, framework: str) -> tuple[subprocess.CompletedProcess[str], dict]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("AWS_")}
    env["PYTHONUNBUFFERED"] = "1"
    # Through the console script's entry point, as `make demo` runs it, with make demo's defaults.
    completed = subprocess.run(
        [sys.executable, "-c", "import sys; from spot_training.cli import main; sys.exit(main())",
         "local", "drill", "--work-dir", str(work), "--framework", framework],
        cwd=REPO_ROOT, env=env, capture_output=True, text=True, timeout=1700,
    )
    report_path = work / "report.json"
    assert report_path.exists(), completed.stdout[-3000:] + completed.stderr[-3000:]
    return completed, json.loads(report_path.read_text())


def _assert_every_demo_check(completed: subprocess.CompletedProcess[str], report: dict, work: Path,
                             framework: str, script: str) -> None:
    assert completed.returncode == 0, (report.get("error"), completed.stdout[-3000:])
    assert report["passed"] is True
    assert report["framework"] == framework
    assert report["completed"] is True
    assert report["steps_total"] == DEFAULT.epochs * (1437 // 32)
    assert report["steps_executed"] == report["steps_total"]
    assert report["lost_steps"] == 0
    assert report["interruptions"] == DEFAULT.interruptions == 3
    assert report["az_moves"] == DEFAULT.az_moves == 1
    events = report["interruption_events"]
    assert [e["volume_moved"] for e in events].count(True) == 1
    for event in events:
        assert event["resumed_at_step"] == event["checkpoint_step"] + 1
        assert event["step_at_notice"] <= event["checkpoint_step"] < report["steps_total"]
        assert 0 <= event["notice_to_checkpoint_s"] < 120
    assert 0.8 < report["test_accuracy"] <= 1.0
    assert report["test_accuracy"] == report["baseline_test_accuracy"]
    assert report["matches_uninterrupted_baseline"] is True
    assert report["orphans_after_destroy"] == []
    # The stack deployed the framework's command; the nodes ran it with the framework's interpreter.
    python = DrillOptions(framework=framework).trainer_python
    # Each node's user data wrote the config where a real node keeps it (under the node's root).
    configs = sorted((work / "nodes").glob("i-*/root/etc/spot-training/config.json"))
    assert len(configs) == 4, configs  # the first node and 3 replacements
    for path in configs:
        training = json.loads(path.read_text())["training"]
        assert training["framework"] == framework
        assert training["command"][:2] == ["{python}", script]
        assert training["python"] == python
    assert f"framework                       {framework}" in completed.stdout
    assert _processes_mentioning(str(work)) == []


@pytest.mark.slow
@pytest.mark.timeout(1800)
def test_pytorch_drill_passes_every_demo_check(tmp_path: Path) -> None:
    python = REPO_ROOT / DRILL_FRAMEWORKS["pytorch"].python
    assert python.is_file(), f"{python} is missing: the PyTorch environment .venv-torch/ is made by `make setup`"
    work = tmp_path / "drill-pytorch"
    completed, report = _run_drill(work, "pytorch")
    _assert_every_demo_check(completed, report, work, "pytorch", "spot_training/training/examples/torch_resnet.py")


@pytest.mark.slow
@pytest.mark.timeout(1800)
def test_mxnet_drill_passes_every_demo_check(tmp_path: Path) -> None:
    work = tmp_path / "drill-mxnet"
    completed, report = _run_drill(work, "mxnet")
    _assert_every_demo_check(completed, report, work, "mxnet", "spot_training/training/examples/gluon_resnet.py")
