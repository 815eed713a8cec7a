"""Your own script, end to end in local mode: ``spot-train local drill --training-command`` run from a
project directory outside the repository. The directory reaches the nodes as the stack's code asset
(the boot script's fetch-code/unpack-code steps, as on AWS), the script imports spot_training.training
there, is interrupted once after its first checkpoint, resumes on the replacement and ends with the
contract's completion (exit 0 and COMPLETED); cdk destroy leaves nothing.

Slow: a real cdk bootstrap/deploy/destroy (most of its time).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.local.test_drill import _processes_mentioning

#: A user's trainer: framework-free, checkpoints with spot_training.training every 20 steps and on SIGTERM.
MY_TRAIN = '''
import argparse, json, os, sys, time
from spot_training.training import CheckpointStore, NoticeHandler
from helpers.numbers import STEPS_PER_EPOCH

parser = argparse.ArgumentParser()
parser.add_argument("--epochs", type=int, required=True)
args = parser.parse_args()
store = CheckpointStore(os.environ["SPOT_TRAINING_CHECKPOINT_DIR"], framework="numpy")
state = {"step": 0, "total": 0}
found = store.restore(lambda ckpt: state.update(json.loads((ckpt.path / "state.json").read_text())))
print("my_train: start at step", state["step"], "resumed" if found else "fresh", flush=True)


def save():
    data = dict(state)
    store.save(lambda d: (d / "state.json").write_text(json.dumps(data)), step=data["step"], epoch=data["step"] // STEPS_PER_EPOCH)


steps = args.epochs * STEPS_PER_EPOCH
with NoticeHandler() as notices:
    while state["step"] < steps:
        time.sleep(0.05)
        state["step"] += 1
        state["total"] += state["step"]
        if state["step"] % 20 == 0 or notices.consume_checkpoint_request():
            save()
        if notices.stop_requested:
            save()
            sys.exit(0)
save()
store.mark_complete(step=state["step"], epoch=state["step"] // STEPS_PER_EPOCH)
print("my_train: done", json.dumps(state), flush=True)
'''


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_own_script_outside_the_repository_trains_through_an_interruption(tmp_path: Path) -> None:
    project = tmp_path / "my-project"
    (project / "helpers").mkdir(parents=True)
    (project / "my_train.py").write_text(MY_TRAIN)
    (project / "helpers" / "__init__.py").write_text("")
    (project / "helpers" / "numbers.py").write_text("STEPS_PER_EPOCH = 150\n")
    env = {k: v for k, v in os.environ.items() if not k.startswith("AWS_")}
    env.update(PYTHONUNBUFFERED="1", PYTHONPATH=str(Path(__file__).resolve().parents[2]))
    # From the project directory: --code-dir defaults to it, and the drill's work dir (out/demo) lies
    # inside it, so the asset must leave the drill's own files out.
    done = subprocess.run(
        [sys.executable, "-c", "import sys; from spot_training.cli import main; sys.exit(main())", "local", "drill",
         "--training-command", "python my_train.py --epochs 2", "--az-moves", "0"],
        cwd=project, env=env, capture_output=True, text=True, timeout=850)
    work = project / "out" / "demo"
    report_path = work / "report.json"
    assert report_path.exists(), done.stdout[-3000:] + done.stderr[-3000:]
    report = json.loads(report_path.read_text())
    assert done.returncode == 0, (report.get("error"), done.stdout[-3000:], done.stderr[-2000:])
    assert report["passed"] is True and report["completed"] is True
    assert report["training_command"] == "python my_train.py --epochs 2"
    assert report["code_dir"] == str(project.resolve())
    assert report["steps_total"] == 300 and report["agent_exit_status"] == 0
    assert report["interruptions"] == 1 and report["orphans_after_destroy"] == []
    [event] = report["interruption_events"]
    assert 0 < event["checkpoint_step"] < event["resumed_at_step"] <= 300
    assert "checked" in done.stdout and "COMPLETED" in done.stdout

    logs = [p.read_text(errors="replace") for p in sorted((work / "nodes").glob("*/agent.log"))]
    assert len(logs) == 2
    # The code came through the stack's code asset, unpacked by each node's own boot script ...
    assert all("spot-training boot: step unpack-code ok" in log for log in logs)
    for node in (work / "nodes").iterdir():
        unpacked = node / "root" / "opt" / "spot-training" / "user-code"
        assert (unpacked / "my_train.py").read_text() == MY_TRAIN and (unpacked / "helpers" / "numbers.py").exists()
        assert not (unpacked / "out").exists()  # the drill's own work dir was left out of the asset
    # ... and the script ran there, fresh on the first node and resumed on the replacement.
    assert "my_train: start at step 0 fresh" in logs[0] or "my_train: start at step 0 fresh" in logs[1]
    assert sum("resumed" in log and "my_train: start at step" in log for log in logs) == 1
    assert any('my_train: done {"step": 300, "total": 45150}' in log for log in logs)
    assert _processes_mentioning(str(work)) == []
