"""``python -m spot_training.agent`` as a real subprocess against the moto server and the IMDS emulator."""

from __future__ import annotations

import copy
import json
import logging
import os
import subprocess
import sys
from pathlib import Path

import boto3
import pytest

from spot_training.agent.errors import ExitCode
from spot_training.local.imds_emulator import ImdsEmulator
from test_supervisor import base_config

REPO = Path(__file__).resolve().parents[2]
STACK = "SpotTraining"
STACK_TAGS = [{"Key": "spot-training:stack", "Value": STACK}, {"Key": "spot-training:purpose", "Value": "data-volume"}]


def agent(command: str, config_path: Path, *, timeout: float = 120, env: dict | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "spot_training.agent", command, "--config", str(config_path)], cwd=REPO,
                          env=dict(os.environ, PYTHONPATH=str(REPO), **(env or {})), capture_output=True, text=True,
                          timeout=timeout)


def aws_state(ec2) -> dict:
    """Everything the agent could create, change or delete, as moto reports it."""
    return {
        "volumes": ec2.describe_volumes()["Volumes"],
        "snapshots": ec2.describe_snapshots(OwnerIds=["self"])["Snapshots"],
        "instances": ec2.describe_instances()["Reservations"],
        "fleets": ec2.describe_spot_fleet_requests()["SpotFleetRequestConfigs"],
        "tags": ec2.describe_tags()["Tags"],
    }


def our_fleet(ec2, stack: str = STACK) -> tuple[str, str]:
    ec2.create_launch_template(LaunchTemplateName=f"lt-{stack}", LaunchTemplateData={
        "ImageId": "ami-12c6146b", "InstanceType": "p3.2xlarge", "MetadataOptions": {"HttpTokens": "required"}})
    fleet_id = ec2.request_spot_fleet(SpotFleetRequestConfig={
        "IamFleetRole": "arn:aws:iam::123456789012:role/fleet", "TargetCapacity": 1, "Type": "maintain",
        "AllocationStrategy": "priceCapacityOptimized",
        "LaunchTemplateConfigs": [{"LaunchTemplateSpecification": {"LaunchTemplateName": f"lt-{stack}",
                                                                   "Version": "$Latest"}}],
        "TagSpecifications": [{"ResourceType": "spot-fleet-request",
                               "Tags": [{"Key": "spot-training:stack", "Value": stack}]}]})["SpotFleetRequestId"]
    instance_id = ec2.describe_spot_fleet_instances(SpotFleetRequestId=fleet_id)["ActiveInstances"][0]["InstanceId"]
    return fleet_id, instance_id


@pytest.fixture
def node(ec2, tmp_path):
    """A fleet instance of our stack, its data volume in moto, an IMDS emulator for it, a valid config."""
    fleet_id, instance_id = our_fleet(ec2)
    az = ec2.describe_instances(InstanceIds=[instance_id])["Reservations"][0]["Instances"][0]["Placement"]["AvailabilityZone"]
    ec2.create_volume(AvailabilityZone=az, Size=10, VolumeType="gp3", Encrypted=True,
                      TagSpecifications=[{"ResourceType": "volume", "Tags": STACK_TAGS}])
    with ImdsEmulator.from_moto(ec2, instance_id) as imds:
        config = base_config(tmp_path)
        config["imds_endpoint"] = imds.endpoint
        yield {"fleet_id": fleet_id, "instance_id": instance_id, "imds": imds, "config": config, "dir": tmp_path}


def _write(path: Path, config) -> Path:
    path.write_text(config if isinstance(config, str) else json.dumps(config))
    return path


def _without(config: dict, *keys: str) -> dict:
    config = copy.deepcopy(config)
    section = config
    for key in keys[:-1]:
        section = section[key]
    del section[keys[-1]]
    return config


def _with(config: dict, value, *keys: str) -> dict:
    config = copy.deepcopy(config)
    section = config
    for key in keys[:-1]:
        section = section[key]
    section[keys[-1]] = value
    return config


BAD_CONFIGS = {
    "missing training": (lambda c: _without(c, "training"), r"training: missing; expected a value"),
    "missing volume tags": (lambda c: _without(c, "volume", "tags"), r"volume.tags: missing"),
    "wrong type keep_snapshots": (lambda c: _with(c, "two", "volume", "keep_snapshots"),
                                  r'volume.keep_snapshots: got "two"; expected an integer from 1 to 100'),
    "bool is not an int": (lambda c: _with(c, True, "schema_version"), r"schema_version: got true"),
    "command not a list": (lambda c: _with(c, "python train.py", "training", "command"),
                           r'training.command: got "python train.py"; expected a non-empty list'),
    "unknown region": (lambda c: _with(c, "mars-east-1", "region"),
                       r'region: got "mars-east-1"; expected an AWS region known to botocore'),
    "relative mount point": (lambda c: _with(c, "dltraining", "volume", "mount_point"),
                             r'volume.mount_point: got "dltraining"; expected an absolute path'),
    "relative checkpoint dir": (lambda c: _with(c, "../ckpt", "training", "checkpoint_dir"),
                                r'training.checkpoint_dir: got "../ckpt"; expected an absolute path'),
    "unknown framework": (lambda c: _with(c, "jax", "training", "framework"),
                          r"training.framework: got \"jax\"; expected one of 'tensorflow', 'mxnet', 'pytorch'"),
    "another stack's volume tags": (lambda c: _with(c, "Other", "volume", "tags", "spot-training:stack"),
                                    r"volume.tags.spot-training:stack: got \"Other\"; expected the stack name"),
    "typo in a key": (lambda c: _with(c, "/x", "volume", "mount_pont"), r"volume.mount_pont: got \"/x\"; expected no such key"),
    "not json": (lambda c: '{"schema_version": 1,', r"is not valid JSON: .* line 1 column"),
    # each of these exited 1 (a traceback) or was accepted
    "deeply nested JSON": (lambda c: "[" * 200_000 + "]" * 200_000, r"is not valid JSON: nested too deeply"),
    "5000-digit integer": (lambda c: json.dumps(c).replace('"keep_snapshots": 2', '"keep_snapshots": ' + "9" * 5000),
                           r"is not valid JSON: .*integer"),
    "keep_snapshots 10**30": (lambda c: _with(c, 10**30, "volume", "keep_snapshots"),
                              r"volume.keep_snapshots: got 1000000000000000000000000000000; expected an integer from 1 to 100"),
    "mount point /": (lambda c: _with(c, "/", "volume", "mount_point"), r'volume.mount_point: got "/"; expected a directory'),
    "checkpoints on the root disk": (lambda c: _with(c, "/var/lib/checkpoints", "training", "checkpoint_dir"),
                                     r'training.checkpoint_dir: got "/var/lib/checkpoints"; expected a directory under '
                                     r"the data volume's mount point"),
    "git url is an option": (lambda c: _with(c, {"type": "git", "url": "--upload-pack=id", "ref": "v1"}, "training", "code"),
                             r'training.code.url: got "--upload-pack=id"'),
}


def agent_in_process(command: str, config_path: Path, capsys) -> subprocess.CompletedProcess:
    """``main([command, "--config", path])`` in this process, as the CompletedProcess :func:`agent` returns:
    the bad-config matrix checks messages that the parser gives, without a 6 s interpreter start per case
    (two cases still run as real processes: :data:`SUBPROCESS_CASES`)."""
    from spot_training.agent.cli import main
    from spot_training.agent.logs import LOGGER_NAME

    logger = logging.getLogger(LOGGER_NAME)
    handlers = list(logger.handlers)
    try:
        code = main([command, "--config", str(config_path)])
    finally:
        for handler in list(logger.handlers):
            if handler not in handlers:
                logger.removeHandler(handler)
    captured = capsys.readouterr()
    return subprocess.CompletedProcess([command], int(code), captured.out, captured.err)


#: The bad-config cases that also run as a real ``python -m spot_training.agent`` process.
SUBPROCESS_CASES = ("not json", "checkpoints on the root disk")


@pytest.mark.parametrize("case", list(BAD_CONFIGS))
def test_bad_config_exits_78_naming_the_problem_and_touches_nothing(case, ec2, node, capsys):
    make, message = BAD_CONFIGS[case]
    path = _write(node["dir"] / "config.json", make(node["config"]))
    before = aws_state(ec2)
    result = agent("run", path) if case in SUBPROCESS_CASES else agent_in_process("run", path, capsys)
    assert result.returncode == ExitCode.CONFIG, result.stderr
    assert __import__("re").search(message, result.stderr), result.stderr
    assert aws_state(ec2) == before
    assert node["imds"].stats["requests"] == []  # not even IMDS was asked
    # The JSON log line on stdout carries the same message and the exit code.
    last = json.loads(result.stdout.strip().splitlines()[-1])
    assert last["level"] == "ERROR" and last["exit_code"] == 78


@pytest.mark.integration
def test_missing_config_file_exits_78(tmp_path):
    result = agent("run", tmp_path / "nope.json")
    assert result.returncode == ExitCode.CONFIG
    assert "nope.json' does not exist; pass --config" in result.stderr


def test_every_problem_is_reported_at_once(ec2, node):
    config = _with(_with(node["config"], "mars-east-1", "region"), "rel/path", "training", "log_dir")
    result = agent("check-config", _write(node["dir"] / "config.json", config))
    assert result.returncode == ExitCode.CONFIG
    assert 'region: got "mars-east-1"' in result.stderr and 'training.log_dir: got "rel/path"' in result.stderr


def test_region_that_is_not_the_instances_exits_78_before_touching_aws(ec2, node):
    path = _write(node["dir"] / "config.json", _with(node["config"], "us-west-2", "region"))
    before = aws_state(ec2)
    result = agent("run", path)
    assert result.returncode == ExitCode.CONFIG, result.stderr
    assert "region: got 'us-west-2' but this instance runs in 'us-east-1'" in result.stderr
    assert aws_state(ec2) == before


def test_check_config_prints_a_summary(node):
    result = agent("check-config", _write(node["dir"] / "config.json", node["config"]))
    assert result.returncode == 0, result.stderr
    summary = json.loads(result.stdout.strip().splitlines()[-1])
    assert summary["config"] == "valid" and summary["command"] == [sys.executable, "trainer.py"]


def test_imds_403_exits_78(ec2, node):
    node["imds"].set_fail_mode(status=403)
    before = aws_state(ec2)
    result = agent("cleanup", _write(node["dir"] / "config.json", node["config"]))
    assert result.returncode == ExitCode.CONFIG
    assert "403 Forbidden" in result.stderr
    assert aws_state(ec2) == before


def test_imds_unreachable_exits_75(node):
    config = _with(node["config"], "http://127.0.0.1:9", "imds_endpoint")
    result = agent("cleanup", _write(node["dir"] / "config.json", config), timeout=60)
    assert result.returncode == ExitCode.TEMPFAIL
    assert "did not answer" in result.stderr


def test_cleanup_command_cancels_our_fleet(ec2, node):
    other_fleet, _ = our_fleet(ec2, stack="Other")
    result = agent("cleanup", _write(node["dir"] / "config.json", node["config"]))
    assert result.returncode == 0, result.stderr
    assert json.loads(result.stdout.strip().splitlines()[-1]) == {"cancelled_fleet_request_id": node["fleet_id"]}
    fleets = {f["SpotFleetRequestId"] for f in ec2.describe_spot_fleet_requests()["SpotFleetRequestConfigs"]}
    assert fleets == {other_fleet}
    state = ec2.describe_instances(InstanceIds=[node["instance_id"]])["Reservations"][0]["Instances"][0]["State"]["Name"]
    assert state == "terminated"


# ---- supervise: a real agent process, a real trainer process, notices over HTTP ----------------------
import signal  # noqa: E402
import time  # noqa: E402

from spot_training.agent.blockdev import DirectoryBlockDevices  # noqa: E402
from test_supervisor import events  # noqa: E402


def _mounted_volume(root: Path) -> dict:
    """A directory volume "mounted" (symlinked) at the config's mount point, as the storage half leaves it."""
    volumes = root / "ebs" / "volumes"
    (volumes / "vol-0123456789abcdef0").mkdir(parents=True)
    DirectoryBlockDevices(volumes).mount(str(volumes / "vol-0123456789abcdef0"), str(root / "dltraining"), "xfs")
    return {"SPOT_TRAINING_BLOCKDEV_DIR": str(volumes)}


def _start_agent(command: str, config_path: Path, env: dict) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "spot_training.agent", command, "--config", str(config_path)], cwd=REPO,
                            env=dict(os.environ, PYTHONPATH=str(REPO), **env), stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)


def _wait_for(predicate, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, "condition not reached in time"
        time.sleep(0.05)


def _agent_acted_on(command: str, node: dict, env: dict, act, config: dict | None = None):
    """Start the agent's ``command`` on ``node``'s config (or ``config``), wait until the trainer has
    started (its first event, then 0.5 s: it installs its SIGTERM handler right after "start"), call
    ``act(proc)``, and collect the agent's output (60 s; killed if anything fails). Returns
    (exit code, stdout, stderr, what ``act`` returned)."""
    proc = _start_agent(command, _write(node["dir"] / "config.json", config or node["config"]), env)
    try:
        _wait_for(lambda: events(node["dir"]))
        time.sleep(0.5)
        acted = act(proc)
        out, err = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    return proc.returncode, out, err, acted


def test_supervise_runs_training_to_completion_on_the_mounted_volume(node):
    env = _mounted_volume(node["dir"]) | {"FAKE_STEPS": "5"}
    result = agent("supervise", _write(node["dir"] / "config.json", node["config"]), env=env)
    assert result.returncode == 0, result.stderr
    assert json.loads(result.stdout.strip().splitlines()[-1]) == {"outcome": "completed"}
    assert [e[0] for e in events(node["dir"])] == ["start", "completed"]
    # The trainer wrote onto the volume, and the agent logged there too.
    volume = node["dir"] / "ebs" / "volumes" / "vol-0123456789abcdef0"
    assert (volume / "checkpoints" / "COMPLETED").is_file()
    log_lines = [json.loads(line) for line in (volume / "logs" / "agent.jsonl").read_text().splitlines()]
    assert any(line["message"] == "training completed" for line in log_lines)


def test_supervise_refuses_to_train_when_the_volume_is_not_mounted(node):
    env = {"SPOT_TRAINING_BLOCKDEV_DIR": str(node["dir"] / "ebs" / "volumes")}
    result = agent("supervise", _write(node["dir"] / "config.json", node["config"]), env=env)
    assert result.returncode == ExitCode.TEMPFAIL
    assert "not mounted" in result.stderr and "refusing to start training on the root disk" in result.stderr
    assert events(node["dir"]) == []


def test_spot_notice_stops_the_trainer_through_the_agent(node):
    def notice(proc) -> float:
        notice_at = time.monotonic()
        node["imds"].post_spot_interruption()  # two minutes from now, as AWS does
        return notice_at

    code, out, err, notice_at = _agent_acted_on("supervise", node, _mounted_volume(node["dir"]), notice)
    assert code == 0, err
    assert time.monotonic() - notice_at < 5 + 5  # seen within one 5 s poll, acted on at once
    assert json.loads(out.strip().splitlines()[-1]) == {"outcome": "interrupted"}
    assert [e[0] for e in events(node["dir"])] == ["start", "sigterm-checkpoint"]
    logged = [json.loads(line) for line in out.splitlines() if line.startswith("{\"time\"")]
    assert any(line["message"] == "trainer exited after the interruption notice" and line["exit_status"] == 0
               for line in logged)


def test_sigterm_to_the_agent_stops_the_trainer_cleanly(node):
    code, out, err, _ = _agent_acted_on("supervise", node, _mounted_volume(node["dir"]),
                                        lambda proc: proc.send_signal(signal.SIGTERM))
    assert code == 0, err
    assert json.loads(out.strip().splitlines()[-1]) == {"outcome": "stopped"}
    assert [e[0] for e in events(node["dir"])] == ["start", "sigterm-checkpoint"]


# ---- run: the whole node lifecycle against the moto server, the emulator and directory volumes -------
def _instance(ec2, instance_id: str) -> dict:
    return ec2.describe_instances(InstanceIds=[instance_id])["Reservations"][0]["Instances"][0]


def _data_volume(ec2) -> dict:
    volumes = ec2.describe_volumes(Filters=[{"Name": "tag:spot-training:stack", "Values": [STACK]},
                                            {"Name": "tag:spot-training:purpose", "Values": ["data-volume"]}])["Volumes"]
    assert len(volumes) == 1
    return volumes[0]


def test_run_attaches_the_volume_trains_to_completion_and_cancels_the_fleet(ec2, moto_server, node):
    env = {"SPOT_TRAINING_BLOCKDEV_DIR": str(moto_server.volumes_dir), "FAKE_STEPS": "5"}
    result = agent("run", _write(node["dir"] / "config.json", node["config"]), env=env)
    assert result.returncode == 0, result.stderr
    volume = _data_volume(ec2)
    # The trainer wrote onto the data volume (the moto server's data plane), not onto the root disk,
    # and so did the agent's log once the volume was mounted.
    volume_dir = moto_server.volumes_dir / volume["VolumeId"]
    assert (volume_dir / "checkpoints" / "COMPLETED").is_file()
    on_volume = [json.loads(line) for line in (volume_dir / "logs" / "agent.jsonl").read_text().splitlines()]
    assert any(line.get("event") == "volume_attached" or line["message"] == "data volume mounted" for line in on_volume)
    assert any(line["message"] == "training completed" for line in on_volume)
    # Terminating the instance (the fleet's cancellation) released the volume for the next job.
    assert volume["State"] == "available"
    assert [e[0] for e in events(node["dir"])] == ["start", "completed"]
    assert ec2.describe_spot_fleet_requests()["SpotFleetRequestConfigs"] == []  # ours, cancelled
    assert _instance(ec2, node["instance_id"])["State"]["Name"] == "terminated"
    messages = [json.loads(line)["message"] for line in result.stdout.splitlines() if line.startswith('{"time"')]
    assert messages.index("training started") < messages.index("training completed") < messages.index(
        "cancelled the spot fleet request and its instances (training completed)")


def test_run_after_completion_goes_straight_to_cleanup(ec2, moto_server, node):
    env = {"SPOT_TRAINING_BLOCKDEV_DIR": str(moto_server.volumes_dir)}
    volume_dir = moto_server.volumes_dir / _data_volume(ec2)["VolumeId"]
    (volume_dir / "checkpoints").mkdir(parents=True)
    (volume_dir / "checkpoints" / "COMPLETED").write_text('{"step": 5, "epoch": 1, "wall_time": 0}')
    result = agent("run", _write(node["dir"] / "config.json", node["config"]), env=env)
    assert result.returncode == 0, result.stderr
    assert events(node["dir"]) == []  # the trainer never started
    assert ec2.describe_spot_fleet_requests()["SpotFleetRequestConfigs"] == []


def test_run_without_a_tagged_volume_exits_78_and_touches_nothing(ec2, moto_server, node):
    ec2.delete_volume(VolumeId=_data_volume(ec2)["VolumeId"])
    # A volume of another stack and an untagged one with the right Name are not ours to take.
    ec2.create_volume(AvailabilityZone="us-east-1a", Size=10, TagSpecifications=[{"ResourceType": "volume", "Tags": [
        {"Key": "spot-training:stack", "Value": "Other"}, {"Key": "spot-training:purpose", "Value": "data-volume"}]}])
    ec2.create_volume(AvailabilityZone="us-east-1a", Size=10, TagSpecifications=[{"ResourceType": "volume", "Tags": [
        {"Key": "Name", "Value": "spot-training-data"}]}])
    before = aws_state(ec2)
    env = {"SPOT_TRAINING_BLOCKDEV_DIR": str(moto_server.volumes_dir)}
    result = agent("run", _write(node["dir"] / "config.json", node["config"]), env=env)
    assert result.returncode == ExitCode.CONFIG, result.stderr
    assert "no EBS volume in region us-east-1 carries the tags" in result.stderr
    assert aws_state(ec2) == before
    assert events(node["dir"]) == []


def test_run_interrupted_by_a_notice_does_not_clean_up(ec2, moto_server, node):
    env = {"SPOT_TRAINING_BLOCKDEV_DIR": str(moto_server.volumes_dir)}
    code, _out, err, posted = _agent_acted_on("run", node, env, lambda proc: urllib_request_post(
        node["imds"].endpoint + "/control/spot/instance-action", {"action": "terminate"}))
    assert posted["action"] == "terminate"
    assert code == 0, err
    assert [e[0] for e in events(node["dir"])] == ["start", "sigterm-checkpoint"]
    fleets = ec2.describe_spot_fleet_requests()["SpotFleetRequestConfigs"]
    assert [f["SpotFleetRequestId"] for f in fleets] == [node["fleet_id"]]  # left for the fleet to replace us
    assert _data_volume(ec2)["Attachments"][0]["InstanceId"] == node["instance_id"]


def urllib_request_post(url: str, body: dict) -> dict:
    import urllib.request

    req = urllib.request.Request(url, method="POST", data=json.dumps(body).encode())
    with urllib.request.urlopen(req, timeout=5) as resp:
        return json.loads(resp.read())


def test_run_with_efs_in_local_mode_uses_a_shared_directory(ec2, moto_server, node):
    config = copy.deepcopy(node["config"])
    config["efs"] = {"file_system_id": "fs-0123abcd", "access_point_id": None, "mount_point": str(node["dir"] / "efs")}
    env = {"SPOT_TRAINING_BLOCKDEV_DIR": str(moto_server.volumes_dir), "FAKE_STEPS": "2"}
    result = agent("run", _write(node["dir"] / "config.json", config), env=env)
    assert result.returncode == 0, result.stderr
    assert (node["dir"] / "efs").is_dir()
    assert [e[0] for e in events(node["dir"])] == ["start", "completed"]


def test_run_with_efs_on_a_node_without_efs_utils_exits_78_before_touching_anything(ec2, moto_server, node):
    """Not local mode (no SPOT_TRAINING_BLOCKDEV_DIR) and no mount.efs on the PATH: no anonymous NFS
    fallback; the agent stops with 78 (systemd does not restart it) before it attaches the volume."""
    config = copy.deepcopy(node["config"])
    config["efs"] = {"file_system_id": "fs-0123abcd", "access_point_id": "fsap-0123456789abcdef0",
                     "mount_point": str(node["dir"] / "efs")}
    empty_bin = node["dir"] / "bin"
    empty_bin.mkdir()
    before = aws_state(ec2)
    result = agent("run", _write(node["dir"] / "config.json", config), env={"PATH": str(empty_bin)})
    assert result.returncode == ExitCode.CONFIG, result.stderr
    assert "mount.efs (amazon-efs-utils) is not installed" in result.stderr
    assert "no anonymous NFS fallback" in result.stderr
    assert aws_state(ec2) == before
    assert not (node["dir"] / "efs").exists() and events(node["dir"]) == []


def test_imds_403_during_training_checkpoints_and_hands_the_node_back_to_the_fleet(node):
    """IMDS starts answering 403 while training runs: the node can no longer see
    interruption notices. The agent stops the trainer the contract's way (it checkpoints), logs why,
    powers the instance off (the launch template makes that a termination, so the spot fleet launches a
    replacement) and exits 69, which systemd does not restart: no idle instance keeps billing."""
    marker = node["dir"] / "powered-off"
    env = _mounted_volume(node["dir"]) | {
        "SPOT_TRAINING_POWEROFF_COMMAND": f"{sys.executable} -c \"open('{marker}', 'w').write('off')\""}
    config = _with(node["config"], 0.5, "notice_poll_interval_s")
    code, out, err, _ = _agent_acted_on("supervise", node, env, lambda proc: node["imds"].set_fail_mode(status=403),
                                        config=config)
    assert code == ExitCode.UNAVAILABLE == 69, err
    assert marker.read_text() == "off"
    assert [e[0] for e in events(node["dir"])] == ["start", "sigterm-checkpoint"]
    logged = [json.loads(line) for line in out.splitlines() if line.startswith("{\"time\"")]
    assert any(line.get("event") == "node_unusable" and "403" in line["message"] for line in logged)


def test_imds_403_in_local_mode_without_a_poweroff_command_only_exits_69(node):
    config = _with(node["config"], 0.5, "notice_poll_interval_s")
    code, out, err, _ = _agent_acted_on("supervise", node, _mounted_volume(node["dir"]),
                                        lambda proc: node["imds"].set_fail_mode(status=403), config=config)
    assert code == 69, err
    assert "not powering off" in err + out


# ---- boot failures (docs/agent.md, "Boot failures") -------------------------------------------------
STANDINS = REPO / "spot_training" / "local" / "standins"


def _boot_failed_script(tmp_path: Path) -> Path:
    from spot_training.infra.userdata import boot_failed_script

    script = tmp_path / "boot-failed"
    script.write_text(boot_failed_script(region="us-east-1", stack_name=STACK,
                                         volume_tags={t["Key"]: t["Value"] for t in STACK_TAGS}))
    script.chmod(0o755)
    return script


def test_boot_failed_script_final_reports_counts_cancels_the_fleet_and_shuts_down(ec2, node, tmp_path):
    """The user data's boot-failure script, for real: bash, the AWS CLI against moto, IMDS emulator."""
    root = tmp_path / "root"
    env = dict(os.environ, SPOT_TRAINING_ROOT=str(root), SPOT_TRAINING_CONSOLE=str(tmp_path / "console.log"),
               AWS_EC2_METADATA_SERVICE_ENDPOINT=node["imds"].endpoint,
               PATH=f"{STANDINS}{os.pathsep}{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}")
    done = subprocess.run([str(_boot_failed_script(tmp_path)), "trainer", "it crashed 6 times, more than max_restarts=5",
                           "final"], env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 1, done.stderr  # it ends the boot: never 0
    console = (tmp_path / "console.log").read_text()
    assert "spot-training: boot failed at step 'trainer': it crashed 6 times, more than max_restarts=5" in console
    assert "giving up (failed boots in a row: 1 of at most 3; mode final)" in console
    assert (root / "run" / "local-init" / "shutdown").read_text().startswith("shutdown -h now")
    tags = {t["Key"]: t["Value"] for t in ec2.describe_tags(
        Filters=[{"Name": "resource-id", "Values": [node["instance_id"]]}])["Tags"]}
    assert tags["spot-training:boot-error"].startswith("trainer: it crashed 6 times")
    (volume,) = ec2.describe_volumes(Filters=[{"Name": "tag:spot-training:stack", "Values": [STACK]}])["Volumes"]
    assert {t["Key"]: t["Value"] for t in volume["Tags"]}["spot-training:failed-boots"] == "1"
    # moto forgets a cancelled request; EC2 shows it as cancelled for a while: either way, not active.
    fleets = ec2.describe_spot_fleet_requests()["SpotFleetRequestConfigs"]
    assert not [f for f in fleets if f["SpotFleetRequestId"] == node["fleet_id"]
                and not f["SpotFleetRequestState"].startswith("cancelled")]


def test_boot_failed_script_counts_and_only_shuts_down_below_the_bound(ec2, node, tmp_path):
    env = dict(os.environ, SPOT_TRAINING_ROOT=str(tmp_path / "root"), SPOT_TRAINING_CONSOLE=str(tmp_path / "console.log"),
               AWS_EC2_METADATA_SERVICE_ENDPOINT=node["imds"].endpoint,
               PATH=f"{STANDINS}{os.pathsep}{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}")
    subprocess.run([str(_boot_failed_script(tmp_path)), "environment", "pip failed"], env=env, timeout=300,
                   capture_output=True)
    (fleet,) = ec2.describe_spot_fleet_requests(SpotFleetRequestIds=[node["fleet_id"]])["SpotFleetRequestConfigs"]
    assert fleet["SpotFleetRequestState"] == "active"
    assert "giving up" not in (tmp_path / "console.log").read_text()
    assert (tmp_path / "root" / "run" / "local-init" / "shutdown").exists()


def _cluster_boot_env(tmp_path: Path, imds) -> dict:
    return dict(os.environ, SPOT_TRAINING_ROOT=str(tmp_path / "root"), SPOT_TRAINING_CONSOLE=str(tmp_path / "console.log"),
                AWS_EC2_METADATA_SERVICE_ENDPOINT=imds.endpoint,
                PATH=f"{STANDINS}{os.pathsep}{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}")


def test_boot_failed_script_bounds_a_cluster_worker_through_its_fleet_request(ec2, tmp_path):
    """A cluster worker has no data volume: its failed boots are counted on its spot fleet request (which
    outlives the instance), and the bound cancels that fleet (no endless loop of paid boots)."""
    fleet_id, instance_id = our_fleet(ec2)
    script = _boot_failed_script(tmp_path)  # the cluster's volume tags match no volume
    with ImdsEmulator.from_moto(ec2, instance_id) as imds:
        env = _cluster_boot_env(tmp_path, imds)
        for attempt in (1, 2):
            subprocess.run([str(script), "environment", "pip failed"], env=env, timeout=300, capture_output=True)
            tags = {t["Key"]: t["Value"] for t in ec2.describe_tags(
                Filters=[{"Name": "resource-id", "Values": [fleet_id]}])["Tags"]}
            assert tags["spot-training:failed-boots"] == str(attempt)
            (fleet,) = ec2.describe_spot_fleet_requests(SpotFleetRequestIds=[fleet_id])["SpotFleetRequestConfigs"]
            assert fleet["SpotFleetRequestState"] == "active"
        subprocess.run([str(script), "environment", "pip failed"], env=env, timeout=300, capture_output=True)
    assert "giving up (failed boots in a row: 3 of at most 3; mode count): cancelling this instance's spot fleet" in (
        tmp_path / "console.log").read_text()
    assert not [f for f in ec2.describe_spot_fleet_requests()["SpotFleetRequestConfigs"]
                if f["SpotFleetRequestId"] == fleet_id and not f["SpotFleetRequestState"].startswith("cancelled")]


def test_boot_failed_script_bounds_a_scheduler_through_its_auto_scaling_group(ec2, moto_server, tmp_path):
    """A scheduler or server runs in an Auto Scaling group: its failed boots are counted on the group;
    the bound suspends the group's launches and cancels the stack's worker fleet (workers cannot train
    without their scheduler)."""
    autoscaling = boto3.client("autoscaling", region_name="us-east-1", endpoint_url=moto_server.endpoint_url,
                               aws_access_key_id="testing", aws_secret_access_key="testing")
    worker_fleet, _ = our_fleet(ec2)
    ec2.create_launch_template(LaunchTemplateName="lt-scheduler", LaunchTemplateData={
        "ImageId": "ami-12c6146b", "InstanceType": "m5.large", "MetadataOptions": {"HttpTokens": "required"}})
    autoscaling.create_auto_scaling_group(
        AutoScalingGroupName="SchedulerGroup", MinSize=1, MaxSize=1, DesiredCapacity=1,
        AvailabilityZones=["us-east-1a"], LaunchTemplate={"LaunchTemplateName": "lt-scheduler", "Version": "$Latest"},
        Tags=[{"Key": "spot-training:stack", "Value": STACK, "PropagateAtLaunch": True,
               "ResourceId": "SchedulerGroup", "ResourceType": "auto-scaling-group"}])
    (group,) = autoscaling.describe_auto_scaling_groups(AutoScalingGroupNames=["SchedulerGroup"])["AutoScalingGroups"]
    instance_id = group["Instances"][0]["InstanceId"]
    script = _boot_failed_script(tmp_path)

    def count() -> str | None:
        tags = autoscaling.describe_tags(Filters=[{"Name": "auto-scaling-group", "Values": ["SchedulerGroup"]}])["Tags"]
        return {t["Key"]: t["Value"] for t in tags}.get("spot-training:failed-boots")

    with ImdsEmulator.from_moto(ec2, instance_id) as imds:
        env = _cluster_boot_env(tmp_path, imds)
        subprocess.run([str(script), "fetch-agent", "failed 5 attempts"], env=env, timeout=300, capture_output=True)
        assert count() == "1"
        (group,) = autoscaling.describe_auto_scaling_groups(AutoScalingGroupNames=["SchedulerGroup"])["AutoScalingGroups"]
        assert group["SuspendedProcesses"] == []
        subprocess.run([str(script), "config", "bad config", "final"], env=env, timeout=300, capture_output=True)
    assert count() == "2"
    (group,) = autoscaling.describe_auto_scaling_groups(AutoScalingGroupNames=["SchedulerGroup"])["AutoScalingGroups"]
    assert [p["ProcessName"] for p in group["SuspendedProcesses"]] == ["Launch"]
    assert "suspending launches of Auto Scaling group SchedulerGroup" in (tmp_path / "console.log").read_text()
    assert not [f for f in ec2.describe_spot_fleet_requests()["SpotFleetRequestConfigs"]
                if f["SpotFleetRequestId"] == worker_fleet and not f["SpotFleetRequestState"].startswith("cancelled")]
    tags = {t["Key"]: t["Value"] for t in ec2.describe_tags(
        Filters=[{"Name": "resource-id", "Values": [instance_id]}])["Tags"]}
    assert tags["spot-training:boot-error"] == "config: bad config"


def test_a_cluster_nodes_successful_boot_clears_the_count_on_its_fleet_or_group(ec2, moto_server):
    """What the boot-failure script counted on a worker's fleet request or a scheduler's Auto Scaling
    group is cleared once a boot succeeds, so only failed boots IN A ROW reach the bound."""
    from types import SimpleNamespace

    from spot_training.agent.cli import Identity, _reset_failed_boots

    autoscaling = boto3.client("autoscaling", region_name="us-east-1", endpoint_url=moto_server.endpoint_url,
                               aws_access_key_id="testing", aws_secret_access_key="testing")
    fleet_id, worker = our_fleet(ec2)
    ec2.create_tags(Resources=[fleet_id], Tags=[{"Key": "spot-training:failed-boots", "Value": "2"}])
    ec2.create_launch_template(LaunchTemplateName="lt-server", LaunchTemplateData={"ImageId": "ami-12c6146b"})
    autoscaling.create_auto_scaling_group(
        AutoScalingGroupName="ServerGroup", MinSize=1, MaxSize=1, AvailabilityZones=["us-east-1a"],
        LaunchTemplate={"LaunchTemplateName": "lt-server", "Version": "$Latest"},
        Tags=[{"Key": "spot-training:failed-boots", "Value": "1", "PropagateAtLaunch": False,
               "ResourceId": "ServerGroup", "ResourceType": "auto-scaling-group"}])
    server = autoscaling.describe_auto_scaling_groups()["AutoScalingGroups"][0]["Instances"][0]["InstanceId"]
    for role, instance in (("worker", worker), ("server", server)):
        _reset_failed_boots(SimpleNamespace(node_role=role, region="us-east-1"), ec2,
                            Identity(instance_id=instance, availability_zone="us-east-1a", region="us-east-1"),
                            autoscaling=autoscaling)
    assert not ec2.describe_tags(Filters=[{"Name": "resource-id", "Values": [fleet_id]},
                                          {"Name": "key", "Values": ["spot-training:failed-boots"]}])["Tags"]
    assert not autoscaling.describe_tags(Filters=[{"Name": "key", "Values": ["spot-training:failed-boots"]}])["Tags"]


@pytest.mark.parametrize("error,step,mode", [
    ("EnvironmentBuildFailed", "environment", "count"),
    ("TrainerFailedError", "trainer", "final"),
    ("ConfigError", "config", "final"),
    ("TemporaryError", None, None),
])
@pytest.mark.integration
def test_run_reports_boot_failures_through_the_units_script_and_exits_69(tmp_path, monkeypatch, error, step, mode):
    """A failed boot step of ``run`` calls $SPOT_TRAINING_ON_BOOT_FAILURE and exits 69 (no systemd restart);
    an error worth a retry (75) does not."""
    from spot_training.agent import cli, errors, supervisor

    record = tmp_path / "calls"
    script = tmp_path / "fake-boot-failed"
    script.write_text(f"#!/bin/bash\nprintf '%s|' \"$@\" >> {record}\n")
    script.chmod(0o755)
    monkeypatch.setenv(cli.ENV_ON_BOOT_FAILURE, str(script))
    exc = getattr(supervisor, error, None) or getattr(errors, error)
    exc = exc("something broke")
    step_found = cli._boot_step(exc)
    assert step_found == step
    code = cli._fail(exc, exc.exit_code, boot_step=step_found)
    if step is None:
        assert code == ExitCode.TEMPFAIL and not record.exists()
    else:
        assert code == ExitCode.UNAVAILABLE == 69
        assert record.read_text() == f"{step}|something broke|{mode}|"


def test_without_the_units_script_a_failure_keeps_its_exit_code(monkeypatch):
    from spot_training.agent import cli
    from spot_training.agent.supervisor import TrainerFailedError

    monkeypatch.delenv(cli.ENV_ON_BOOT_FAILURE, raising=False)
    assert cli._fail(TrainerFailedError("x"), ExitCode.TEMPFAIL, boot_step="trainer") == ExitCode.TEMPFAIL
