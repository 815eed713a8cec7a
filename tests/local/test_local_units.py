"""Local mode's pieces that need no deployed stack: AZ plans, options, display, orphans.

No TensorFlow or MXNet here; the moto server is the session server of tests/conftest.py.
"""

from __future__ import annotations

import io
import json
from pathlib import Path

import boto3
import pytest
from botocore.config import Config

from spot_training.cli import ProgressDisplay, format_report, main
from spot_training.local.deploy import cli_env, find_orphans, local_context
from spot_training.local.drill import DrillOptions, az_plan, passed, weights_match
from spot_training.local.injector import latest_checkpoint, read_training_log

def test_az_plan_moves_as_asked():
    zones = ["us-east-1a", "us-east-1b"]
    assert az_plan(DrillOptions(interruptions=3, az_moves=1), zones, "us-east-1a") == ["us-east-1a", "us-east-1b", "us-east-1b"]
    assert az_plan(DrillOptions(interruptions=1, az_moves=1), zones, "us-east-1a") == ["us-east-1b"]
    assert az_plan(DrillOptions(interruptions=2, az_moves=0), zones, "us-east-1b") == ["us-east-1b", "us-east-1b"]
    assert az_plan(DrillOptions(interruptions=3, az_moves=3), zones, "us-east-1a") == ["us-east-1b", "us-east-1a", "us-east-1b"]
    for moves in range(4):
        plan = az_plan(DrillOptions(interruptions=3, az_moves=moves), zones, "us-east-1a")
        changes = sum(1 for before, after in zip(["us-east-1a", *plan], plan) if before != after)
        assert changes == moves
    seeded = az_plan(DrillOptions(interruptions=5, random_az=True, seed=7), zones, "us-east-1a")
    assert seeded == az_plan(DrillOptions(interruptions=5, random_az=True, seed=7), zones, "us-east-1a")
    assert set(seeded) <= set(zones)


@pytest.mark.parametrize("field, value, message", [
    ("interruptions", -1, "interruptions must be an integer >= 0, got -1"),
    ("interruptions", True, "interruptions must be an integer >= 0, got True"),
    ("epochs", 0, "epochs must be an integer >= 1, got 0"),
    ("az_moves", 4, r"az_moves must be <= interruptions \(3\), got 4"),
    ("timeout_s", 0, "timeout_s must be > 0 seconds, got 0"),
    ("stack", "no spaces", "stack must be a CloudFormation stack name"),
])
def test_fails_when_drill_options_are_bad(field, value, message):
    options = DrillOptions(**{field: value})
    with pytest.raises(ValueError, match=message):
        options.validate()


def test_cli_exits_2_on_bad_drill_options(capsys, tmp_path):
    assert main(["local", "drill", "--interruptions", "-2", "--work-dir", str(tmp_path / "w")]) == 2
    assert "interruptions must be an integer >= 0, got -2" in capsys.readouterr().err
    assert not (tmp_path / "w").exists()  # nothing started


def _report(**overrides):
    report = {"completed": True, "steps_total": 1320, "steps_executed": 1320, "lost_steps": 0, "interruptions": 3,
              "az_moves": 1, "error": None, "matches_uninterrupted_baseline": True, "orphans_after_destroy": [],
              "test_accuracy": 0.98, "wall_s": 300.0, "phases_s": {"deploy": 20.0},
              "interruption_events": [{"index": 1, "instance_id": "i-1", "from_az": "us-east-1a", "to_az": "us-east-1b",
                                       "volume_moved": True, "step_at_notice": 330, "checkpoint_step": 400,
                                       "resumed_at_step": 401, "notice_to_checkpoint_s": 2.5, "boot_to_resume_s": 12.25}]}
    report.update(overrides)
    return report


def test_passed_needs_every_must_show_condition():
    options = DrillOptions()
    assert passed(_report(), options)
    assert not passed(_report(lost_steps=1), options)
    assert not passed(_report(completed=False), options)
    assert not passed(_report(matches_uninterrupted_baseline=False), options)
    assert not passed(_report(orphans_after_destroy=["volume vol-1 (available)"]), options)
    assert not passed(_report(orphans_after_destroy=None), options)
    assert not passed(_report(interruptions=2), options)
    assert not passed(_report(az_moves=0), options)
    assert not passed(_report(error="DrillError: x"), options)


def test_report_table_shows_fields_and_interruptions():
    text = format_report(_report())
    for needle in ("completed", "lost_steps", "matches_uninterrupted_baseline", "orphans_after_destroy",
                   "us-east-1a->us-east-1b", "moved", "12.25", "2.50"):
        assert needle in text


def test_progress_display_plain_and_tty():
    plain = io.StringIO()
    display = ProgressDisplay(plain, tty=False)
    for step in range(0, 1001, 50):
        display({"event": "progress", "step": step, "total": 1000, "loss": 1.0 / (step + 1), "t": step / 100})
    display({"event": "notice-posted", "index": 1, "instance_id": "i-1", "availability_zone": "us-east-1a", "step": 500, "t": 5})
    lines = plain.getvalue().splitlines()
    assert "\r" not in plain.getvalue()
    assert sum(" loss " in line for line in lines) == 11  # deciles 0..10: one line per tenth, not per step
    assert "spot interruption #1" in lines[-1]
    tty = io.StringIO()
    display = ProgressDisplay(tty, tty=True, width=10)
    display({"event": "progress", "step": 50, "total": 100, "loss": 0.5, "t": 1})
    display({"event": "resumed", "index": 1, "instance_id": "i-2", "availability_zone": "us-east-1b", "step": 51,
             "boot_to_resume_s": 9.0, "volume_moved": True, "volume_id": "vol-2", "t": 2})
    out = tty.getvalue()
    assert "[#####.....] step 50/100 loss 0.5000" in out
    assert "MOVED to us-east-1b" in out


def test_read_training_log_and_latest(tmp_path):
    log = tmp_path / "training_log.csv"
    log.write_text("step,epoch,loss,accuracy,wall_time\n1,0,2.5,0.1,100.0\n2,0,2.4,0.2,100.5\n3,0,2.")
    rows = read_training_log(log)
    assert [r["step"] for r in rows] == [1.0, 2.0]  # the torn last line is skipped
    assert read_training_log(tmp_path / "missing.csv") == []
    assert latest_checkpoint(tmp_path) is None
    (tmp_path / "LATEST").write_text(json.dumps({"step": 400, "path": "ckpt-000000000400"}))
    step, committed = latest_checkpoint(tmp_path)
    assert step == 400 and committed > 0


def test_weights_match_is_bitwise(tmp_path):
    import numpy as np

    np.savez(tmp_path / "a.npz", w=np.arange(6, dtype=np.float32), b=np.ones(2, dtype=np.float32))
    np.savez(tmp_path / "b.npz", w=np.arange(6, dtype=np.float32), b=np.ones(2, dtype=np.float32))
    np.savez(tmp_path / "c.npz", w=np.arange(6, dtype=np.float32) + np.float32(1e-7), b=np.ones(2, dtype=np.float32))
    np.savez(tmp_path / "d.npz", w=np.arange(6, dtype=np.float32))
    assert weights_match(tmp_path / "a.npz", tmp_path / "b.npz")
    assert not weights_match(tmp_path / "a.npz", tmp_path / "c.npz")
    assert not weights_match(tmp_path / "a.npz", tmp_path / "d.npz")


@pytest.mark.integration  # imports aws_cdk: jsii starts Node.js (tests/tier_guard.py)
def test_local_context_and_cli_env(tmp_path):
    context = local_context(training_command=["{python}", "x.py", "--epochs", "2"])
    assert context["account"] == "123456789012" and context["region"] == "us-east-1"
    assert context["availability_zones"] == "us-east-1a,us-east-1b"
    assert context["training_command"] == '["{python}", "x.py", "--epochs", "2"]'
    from spot_training.infra.config import StackSettings
    assert StackSettings.from_mapping({"training_command": context["training_command"]}).training_command == ("{python}", "x.py", "--epochs", "2")
    env = cli_env("http://127.0.0.1:5123", home=tmp_path)
    assert env["AWS_ENDPOINT_URL"] == "http://127.0.0.1:5123"
    assert env["AWS_ENDPOINT_URL_S3_FOR_CLOUDFORMATION"] == "http://localhost:5123"
    assert env["AWS_ACCESS_KEY_ID"] == "testing" and env["HOME"] == str(tmp_path)
    with pytest.raises(ValueError, match="endpoint_url must be http://127.0.0.1:PORT"):
        cli_env("https://ec2.us-east-1.amazonaws.com", home=tmp_path)


def test_find_orphans_sees_each_kind_and_ignores_others(moto_server):
    from spot_training.local.deploy import clients

    aws = clients(moto_server.endpoint_url)
    tags = [{"Key": "spot-training:stack", "Value": "Drill"}]
    other = [{"Key": "spot-training:stack", "Value": "SomeoneElse"}]
    assert find_orphans(aws, "Drill") == []
    volume = aws.ec2.create_volume(AvailabilityZone="us-east-1a", Size=1,
                                   TagSpecifications=[{"ResourceType": "volume", "Tags": tags}])["VolumeId"]
    aws.ec2.create_volume(AvailabilityZone="us-east-1a", Size=1, TagSpecifications=[{"ResourceType": "volume", "Tags": other}])
    snapshot = aws.ec2.create_snapshot(VolumeId=volume, TagSpecifications=[{"ResourceType": "snapshot", "Tags": tags}])["SnapshotId"]
    instance = aws.ec2.run_instances(ImageId="ami-0123456789abcdef0", MinCount=1, MaxCount=1,
                                     TagSpecifications=[{"ResourceType": "instance", "Tags": tags}])["Instances"][0]["InstanceId"]
    orphans = find_orphans(aws, "Drill")
    assert sorted(o.split()[0] for o in orphans) == ["instance", "snapshot", "volume"]
    assert any(instance in o for o in orphans) and any(snapshot in o for o in orphans) and any(volume in o for o in orphans)
    aws.ec2.terminate_instances(InstanceIds=[instance])
    aws.ec2.delete_snapshot(SnapshotId=snapshot)
    aws.ec2.delete_volume(VolumeId=volume)
    assert find_orphans(aws, "Drill") == []


def test_status_prints_the_last_drill_report(tmp_path, capsys):
    (tmp_path / "report.json").write_text(json.dumps(_report()))
    assert main(["status", "--work-dir", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert "Drill report" in out and "us-east-1a->us-east-1b" in out


def test_status_fails_when_there_is_nothing(tmp_path, capsys):
    assert main(["status", "--work-dir", str(tmp_path)]) == 1
    assert "nothing to report" in capsys.readouterr().err


def test_down_fails_when_nothing_is_up(tmp_path, capsys):
    assert main(["local", "down", "--work-dir", str(tmp_path)]) == 1
    assert "nothing is up" in capsys.readouterr().err


# ---- spot-train local drill --framework ----------------------------------------------------------


@pytest.mark.parametrize("framework, script, option", [
    ("tensorflow", "spot_training/training/examples/keras_resnet.py", "--save-final-weights"),
    ("mxnet", "spot_training/training/examples/gluon_resnet.py", "--save-final-params"),
    ("pytorch", "spot_training/training/examples/torch_resnet.py", "--save-final-weights"),
])
@pytest.mark.integration  # imports aws_cdk: jsii starts Node.js (tests/tier_guard.py)
def test_drill_runs_the_command_the_stack_derives_from_the_framework(framework, script, option):
    from spot_training.infra.config import StackSettings

    options = DrillOptions(framework=framework, epochs=3, seed=4)
    args = options.trainer_args()
    # The same script `-c framework=...` deploys by default, then the drill's options.
    assert ["{python}", args[0]] == list(StackSettings(framework=framework).training_command) == ["{python}", script]
    assert args[1:] == ["--epochs", "3", "--batch-size", "32", "--seed", "4", "--save-every-steps", "50",
                        option, "/dltraining/final_weights.npz"]


def test_drill_trainer_python_per_framework():
    import sys

    from spot_training.local.drill import REPO_ROOT

    assert DrillOptions().trainer_python == DrillOptions(framework="mxnet").trainer_python == sys.executable
    assert DrillOptions(framework="pytorch").trainer_python == str(REPO_ROOT / ".venv-torch" / "bin" / "python")


def test_drill_refuses_an_unknown_framework_and_a_missing_environment(monkeypatch, tmp_path):
    import spot_training.local.drill as drill

    with pytest.raises(ValueError, match="framework must be one of tensorflow, mxnet, pytorch, got 'jax'"):
        DrillOptions(framework="jax").validate()
    monkeypatch.setitem(drill.DRILL_FRAMEWORKS, "pytorch",
                        drill.DrillFramework(str(tmp_path / "absent" / "python"), "--save-final-weights", "x"))
    with pytest.raises(ValueError, match=r"framework 'pytorch' trains with .*absent/python, which does not exist; "
                                         r"`make setup` makes it"):
        DrillOptions(framework="pytorch").validate()


def test_cli_drill_framework_is_checked_before_anything_starts(capsys, tmp_path):
    with pytest.raises(SystemExit) as exit_info:
        main(["local", "drill", "--framework", "jax", "--work-dir", str(tmp_path / "w")])
    assert exit_info.value.code == 2
    assert "invalid choice: 'jax'" in capsys.readouterr().err
    # The cluster drill runs MXNet or PyTorch; TensorFlow's cluster has no drill.
    assert main(["local", "drill", "--cluster", "--framework", "tensorflow", "--work-dir", str(tmp_path / "c")]) == 2
    assert "framework must be one of mxnet, pytorch, got 'tensorflow'" in capsys.readouterr().err
    assert not (tmp_path / "w").exists() and not (tmp_path / "c").exists()


def test_report_table_names_the_framework():
    assert "framework                       pytorch" in format_report(_report(framework="pytorch"))
    assert "framework" not in format_report(_report())


def test_network_subnet_avoids_subnets_other_runs_hold(monkeypatch: pytest.MonkeyPatch) -> None:
    """A second local cluster (the MXNet test run beside the main one) must not pick a /24 that
    another run's bridge already routes: only X = 77 is free here, so it is the one chosen."""
    import subprocess

    from spot_training.local import netns

    listing = "\n".join(f"9: stc1h{x}    inet 10.213.{x}.1/24 scope global stc1h{x}" for x in range(1, 255) if x != 77)
    monkeypatch.setattr(netns.shutil, "which", lambda name: "/usr/sbin/ip")
    monkeypatch.setattr(netns, "_ip", lambda *args: subprocess.CompletedProcess(["ip", *args], 0, listing, ""))
    assert {netns._free_subnet() for _ in range(20)} == {77}
