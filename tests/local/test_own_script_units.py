"""Units of "your own script" in local mode and of the live stack's node keeper, in-process:
``--training-command`` options and checks, the context that ships the code directory, the resume
signal of a trainer that logs no steps, and stopping by PID only what is ours."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

import pytest

from spot_training import cli
from spot_training.local.drill import DrillOptions, passed, user_code_context
from spot_training.local.injector import _committed_after
from spot_training.training import CheckpointStore

REPO_ROOT = Path(__file__).resolve().parents[2]


def _own(tmp_path: Path, **kwargs) -> DrillOptions:
    (tmp_path / "my_train.py").write_text("print(1)\n")
    return DrillOptions(**{"work_dir": tmp_path / "w", "training_command": "python my_train.py", "code_dir": tmp_path,
                           "baseline": False, **kwargs})


def test_a_leading_python_is_the_nodes_interpreter_and_the_rest_is_shell_split(tmp_path: Path) -> None:
    assert _own(tmp_path, training_command="python3 my_train.py --name 'a b'").user_command == [
        "{python}", "my_train.py", "--name", "a b"]
    assert _own(tmp_path, training_command="bash run.sh").user_command == ["bash", "run.sh"]
    assert DrillOptions().user_command is None
    _own(tmp_path).validate()


@pytest.mark.parametrize(("kwargs", "message"), [
    ({"training_command": "python 'unclosed"}, "no shell-style command"),
    ({"training_command": "  "}, "must be a command"),
    ({"code_dir": Path("/no/such/dir")}, "is not a directory"),
    ({"code_dir": REPO_ROOT}, "this library's checkout"),
    ({"baseline": True}, "needs the example's final weights"),
])
def test_bad_own_script_options_name_the_option(tmp_path: Path, kwargs: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        _own(tmp_path, **kwargs).validate()


def test_code_dir_alone_is_refused(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(ValueError, match="only with training_command"):
        DrillOptions(code_dir=tmp_path).validate()
    assert cli.main(["local", "drill", "--code-dir", str(tmp_path), "--work-dir", str(tmp_path / "w")]) == 2
    assert "--code-dir is used only with --training-command" in capsys.readouterr().err
    assert not (tmp_path / "w").exists()


@pytest.mark.integration  # imports aws_cdk: jsii starts Node.js (tests/tier_guard.py)
def test_the_drills_work_dir_inside_the_code_dir_is_left_out_of_the_asset(tmp_path: Path) -> None:
    context = user_code_context(tmp_path, tmp_path / "out" / "demo")
    assert context["code_dir"] == str(tmp_path.resolve())
    exclude = json.loads(context["code_exclude"])
    assert exclude[-1] == "/out/demo" and ".git" in exclude
    assert "/out/demo" not in json.loads(user_code_context(tmp_path / "a", tmp_path / "b")["code_exclude"])


def test_a_foreign_script_passes_on_the_contracts_completion(tmp_path: Path) -> None:
    options = _own(tmp_path, interruptions=1, az_moves=0)
    report = {"completed": True, "lost_steps": None, "error": None, "interruptions": 1, "az_moves": 0,
              "matches_uninterrupted_baseline": False, "orphans_after_destroy": []}
    assert passed(report, options)
    assert not passed({**report, "completed": False}, options)
    assert not passed({**report, "interruptions": 0}, options)
    assert not passed({**report, "orphans_after_destroy": ["vol-1"]}, options)
    assert not passed(report, DrillOptions(interruptions=1, az_moves=0, baseline=False))  # the example needs lost_steps == 0


def test_the_report_of_a_foreign_script_shows_what_was_checked() -> None:
    text = cli.format_report({"passed": True, "completed": True, "training_command": "python my_train.py",
                              "code_dir": "/p", "agent_exit_status": 0, "checks": ["the trainer ended with COMPLETED"],
                              "lost_steps": None, "steps_total": 300})
    assert "training_command" in text and "python my_train.py" in text and "checked" in text
    assert "lost_steps" not in text and "matches_uninterrupted_baseline" not in text


def test_a_trainer_without_a_step_log_resumed_when_it_commits_past_the_checkpoint(tmp_path: Path) -> None:
    store = CheckpointStore(tmp_path, framework="numpy")
    store.save(lambda d: (d / "s").write_text("1"), step=20, epoch=0)
    booted = time.time()
    assert _committed_after(tmp_path, 20, booted - 60) is None  # not past the checkpoint
    assert _committed_after(tmp_path, 10, booted + 60) is None  # committed before the boot
    assert _committed_after(tmp_path, 10, booted - 60)["step"] == 20
    store.mark_complete(step=30, epoch=0)
    assert _committed_after(tmp_path, 20, booted - 60)["step"] == 30


@pytest.mark.integration  # runs git / a real process
def test_stop_pid_stops_only_a_process_that_is_ours(tmp_path: Path) -> None:
    marker = str(tmp_path / "marker-arg")
    process = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)", marker], start_new_session=True)
    try:
        time.sleep(0.2)
        cli._stop_pid(process.pid, "someone-else's-state.json")
        assert process.poll() is None  # a PID that does not mention our state is left alone
        cli._stop_pid(process.pid, marker, timeout_s=10)
        assert process.poll() is not None
    finally:
        if process.poll() is None:
            process.kill()
        process.wait()


class _Keeper:
    def __init__(self, returncode: int | None) -> None:
        self.returncode = returncode

    def poll(self) -> int | None:
        return self.returncode


def test_local_up_waits_for_the_keepers_first_node_or_says_why_not(tmp_path: Path) -> None:
    from spot_training.local.keeper import EVENTS_FILE

    events = tmp_path / EVENTS_FILE
    with pytest.raises(RuntimeError, match="the node keeper exited 1; see .*keeper.log"):
        cli.wait_for_nodes(tmp_path, _Keeper(1), timeout_s=5)
    with pytest.raises(RuntimeError, match="started no node within 1 s"):
        cli.wait_for_nodes(tmp_path, _Keeper(None), timeout_s=1)
    events.write_text(json.dumps({"event": "error", "message": "reading stack S failed: gone"}) + "\n")
    with pytest.raises(RuntimeError, match="reading stack S failed: gone"):
        cli.wait_for_nodes(tmp_path, _Keeper(None), timeout_s=5)
    events.write_text("".join(json.dumps(e) + "\n" for e in (
        {"event": "keeper-started"}, {"event": "node-started", "instance_id": "i-1", "availability_zone": "us-east-1a",
                                      "pid": 7})))
    [started] = cli.wait_for_nodes(tmp_path, _Keeper(None), timeout_s=5)
    assert started["instance_id"] == "i-1" and cli.ProgressDisplay.describe(started).startswith("node i-1")
