"""The agent's CloudWatch publisher (spot_training.agent.publish) against the moto server over HTTP, real
trainer processes, and endpoints that refuse or swallow connections."""

from __future__ import annotations

import copy
import json
import logging
import socket
import threading
import time
from pathlib import Path

import boto3
import pytest
from botocore.config import Config

from spot_training.agent.config import MonitoringConfig, parse_config
from spot_training.agent.errors import ConfigError
from spot_training.agent.publish import Publisher, cloudwatch_clients
from test_supervisor import base_config, make_supervisor

NAMESPACE = "SpotTraining"
GROUP = "/spot-training/SpotTraining"
MONITORING = {"enabled": True, "log_group": GROUP, "namespace": NAMESPACE, "interval_s": 1}

# A trainer that honours docs/contracts.md the way spot_training/training/examples do: a training_log.csv row per
# step, progress.json with steps_total, LATEST after each checkpoint, COMPLETED at the end.
TRAINER = r'''
import csv, json, os, sys, time
from pathlib import Path
logs, ckpt = Path(os.environ["SPOT_TRAINING_LOG_DIR"]), Path(os.environ["SPOT_TRAINING_CHECKPOINT_DIR"])
steps = int(os.environ.get("FAKE_STEPS", "40"))
(logs / "progress.json").write_text(json.dumps({"steps_total": steps}))
with open(logs / "training_log.csv", "a", newline="") as f:
    w = csv.writer(f)
    if f.tell() == 0:
        w.writerow(["step", "epoch", "loss", "accuracy", "wall_time"])
    for step in range(1, steps + 1):
        time.sleep(float(os.environ.get("FAKE_STEP_S", "0.02")))
        w.writerow([step, 0, round(2.0 / step, 4), 0.5, time.time()]); f.flush()
        if step % 10 == 0:
            (ckpt / "LATEST").write_text(json.dumps({"checkpoint": f"ckpt-{step:012d}", "step": step}))
        print(f"trainer step {step}", flush=True)
(ckpt / "COMPLETED").write_text(json.dumps({"step": steps, "epoch": 1, "wall_time": time.time()}))
print("done: %d steps, test accuracy 0.5" % steps, flush=True)
'''


def _config(root: Path, monitoring: dict | None = MONITORING) -> dict:
    config = base_config(root)
    (root / "code" / "trainer.py").write_text(TRAINER)
    if monitoring is not None:
        config["monitoring"] = dict(monitoring)
    return config


def _client(service: str, endpoint_url: str):
    return boto3.client(service, region_name="us-east-1", endpoint_url=endpoint_url, aws_access_key_id="testing",
                        aws_secret_access_key="testing", config=Config(retries={"mode": "standard"}))


def _publisher(root: Path, logs, cloudwatch, **kwargs) -> Publisher:
    config = parse_config(_config(root))
    return Publisher(config.monitoring, stack_name="SpotTraining", instance_id="i-0123456789abcdef0",
                     instance_type="g5.xlarge", availability_zone="us-east-1a", log_dir=config.training.log_dir,
                     checkpoint_dir=config.training.checkpoint_dir, logs_client=logs, cloudwatch_client=cloudwatch,
                     **kwargs)


@pytest.fixture(autouse=True)
def _agent_log_level():
    """The agent's logger at INFO, as ``setup_logging`` leaves it in the agent."""
    logger = logging.getLogger("spot_training.agent")
    before = logger.level
    logger.setLevel(logging.INFO)
    yield
    logger.setLevel(before)


def _stream_messages(logs, stream: str = "i-0123456789abcdef0") -> list[dict]:
    events = logs.get_log_events(logGroupName=GROUP, logStreamName=stream, startFromHead=True)["events"]
    return [json.loads(e["message"]) for e in events]


def _statistic(cloudwatch, name: str, statistic: str = "Maximum") -> list[float]:
    now = time.time()
    points = cloudwatch.get_metric_statistics(
        Namespace=NAMESPACE, MetricName=name, Dimensions=[{"Name": "Stack", "Value": "SpotTraining"}],
        StartTime=now - 3600, EndTime=now + 60, Period=60, Statistics=[statistic])["Datapoints"]
    return [p[statistic] for p in sorted(points, key=lambda p: p["Timestamp"])]


# ---- config ---------------------------------------------------------------------------------------
def test_monitoring_section_is_parsed_with_its_default_interval(tmp_path):
    config = parse_config(_config(tmp_path, {"enabled": True, "log_group": GROUP, "namespace": NAMESPACE}))
    assert config.monitoring == MonitoringConfig(enabled=True, log_group=GROUP, namespace=NAMESPACE, interval_s=10.0)
    assert parse_config(_config(tmp_path, None)).monitoring is None


@pytest.mark.parametrize("section, problem", [
    ({"enabled": "yes", "log_group": GROUP, "namespace": NAMESPACE}, "monitoring.enabled: got \"yes\""),
    ({"enabled": True, "log_group": "no spaces", "namespace": NAMESPACE}, "monitoring.log_group: got \"no spaces\""),
    ({"enabled": True, "log_group": GROUP, "namespace": "AWS/EC2"}, "'AWS/' is reserved"),
    ({"enabled": True, "log_group": GROUP, "namespace": NAMESPACE, "interval_s": 0}, "monitoring.interval_s: got 0"),
    ({"enabled": True, "log_group": GROUP}, "monitoring.namespace: missing"),
    ({"enabled": True, "log_group": GROUP, "namespace": NAMESPACE, "endpoint": "x"}, "monitoring.endpoint: got"),
])
def test_bad_monitoring_section_is_a_config_error_naming_the_key(tmp_path, section, problem):
    with pytest.raises(ConfigError) as error:
        parse_config(_config(tmp_path, section))
    assert error.value.exit_code == 78
    assert problem in str(error.value)


# ---- publishing against the moto server ----------------------------------------------------------------
def test_agent_lines_trainer_lines_and_progress_metrics_reach_cloudwatch(moto_server, tmp_path):
    logs, cloudwatch = _client("logs", moto_server.endpoint_url), _client("cloudwatch", moto_server.endpoint_url)
    logs.create_log_group(logGroupName=GROUP)
    publisher = _publisher(tmp_path, logs, cloudwatch)
    agent_log = logging.getLogger("spot_training.agent.test_publish")
    logging.getLogger("spot_training.agent").addHandler(publisher.log_handler())
    try:
        supervisor = make_supervisor(tmp_path, config=_config(tmp_path), output=publisher.add_line)
        assert supervisor.run().value == "completed"
        agent_log.warning("spot interruption notice: stopping the trainer", extra={"event": "spot_interruption_notice"})
        agent_log.info("new volume attached", extra={"event": "copy_verified", "volume_id": "vol-1"})
        latest = tmp_path / "dltraining" / "checkpoints" / "LATEST"
        latest.write_text(json.dumps({"step": 30}))  # a cadence save lands first after the notice ...
        publisher.round()
        latest.write_text(json.dumps({"step": 40}))  # ... then the trainer's last one, before the node goes
        publisher.round(final=True)
    finally:
        logging.getLogger("spot_training.agent").removeHandler(publisher.log_handler())
    assert publisher.failures == 0 and publisher.dropped_lines == 0
    messages = _stream_messages(logs)
    trainer = [m["message"] for m in messages if m["logger"] == "trainer"]
    assert trainer[:2] == ["trainer step 1", "trainer step 2"] and trainer[-1] == "done: 40 steps, test accuracy 0.5"
    agent = [m for m in messages if m["logger"].startswith("spot_training.agent")]
    assert {"training started", "training completed", "new volume attached"} <= {m["message"] for m in agent}
    assert [m["checkpoint_step"] for m in agent if m.get("event") == "checkpoint_after_notice"] == [40]
    stamps = [e["timestamp"] for e in logs.get_log_events(logGroupName=GROUP, logStreamName="i-0123456789abcdef0",
                                                          startFromHead=True)["events"]]
    assert stamps == sorted(stamps)
    # The figures the trainer wrote are the figures CloudWatch holds.
    assert _statistic(cloudwatch, "GlobalStep")[-1] == 40
    assert _statistic(cloudwatch, "StepsTotal")[-1] == 40
    assert _statistic(cloudwatch, "Loss")[-1] == pytest.approx(0.05)
    assert _statistic(cloudwatch, "CheckpointStep")[-1] == 40
    assert sum(_statistic(cloudwatch, "StepsDone", "Sum")) == 40
    assert _statistic(cloudwatch, "Completed") == [1]
    assert sum(_statistic(cloudwatch, "InterruptionNotices", "Sum")) == 1
    assert sum(_statistic(cloudwatch, "VolumeMoves", "Sum")) == 1
    assert _statistic(cloudwatch, "NoticeToCheckpointSeconds")[-1] >= 0
    running = cloudwatch.list_metrics(Namespace=NAMESPACE, MetricName="RunningInstances")["Metrics"]
    assert {(d["Name"], d["Value"]) for d in running[0]["Dimensions"]} == {
        ("Stack", "SpotTraining"), ("InstanceType", "g5.xlarge"), ("AvailabilityZone", "us-east-1a")}


def test_a_checkpoint_after_the_notice_counts_even_when_the_coarse_file_clock_stamps_it_earlier(moto_server, tmp_path):
    """The kernel stamps mtimes from its coarse clock, up to a tick behind ``time.time()``: a trainer that
    commits 1 ms after the notice can leave an mtime before it. That commit is still the one after the
    notice; a LATEST left untouched since before the notice is not."""
    import os
    logs, cloudwatch = _client("logs", moto_server.endpoint_url), _client("cloudwatch", moto_server.endpoint_url)
    logs.create_log_group(logGroupName=GROUP)
    publisher = _publisher(tmp_path, logs, cloudwatch)
    latest = tmp_path / "dltraining" / "checkpoints" / "LATEST"
    latest.parent.mkdir(parents=True, exist_ok=True)
    latest.write_text(json.dumps({"step": 10}))
    os.utime(latest, (time.time() - 60, time.time() - 60))
    agent_log = logging.getLogger("spot_training.agent.test_publish")
    handler = publisher.log_handler()
    logging.getLogger("spot_training.agent").addHandler(handler)
    try:
        # 1. A notice with no new commit after it: no notice->checkpoint figure, even in the final round.
        agent_log.warning("spot interruption notice: stopping the trainer", extra={"event": "spot_interruption_notice"})
        publisher.round(final=True)
        # 2. A notice, then a commit whose mtime reads 4 ms before the notice.
        agent_log.warning("spot interruption notice: stopping the trainer", extra={"event": "spot_interruption_notice"})
        notice = publisher._notice_time
        latest.write_text(json.dumps({"step": 20}))
        os.utime(latest, (notice - 0.004, notice - 0.004))
        publisher.round(final=True)
    finally:
        logging.getLogger("spot_training.agent").removeHandler(handler)
    after = [m for m in _stream_messages(logs) if m.get("event") == "checkpoint_after_notice"]
    assert [m["checkpoint_step"] for m in after] == [20]
    assert after[0]["notice_to_checkpoint_s"] == 0.0


def test_missing_log_group_keeps_lines_bounded_and_sends_them_once_it_exists(moto_server, tmp_path):
    logs, cloudwatch = _client("logs", moto_server.endpoint_url), _client("cloudwatch", moto_server.endpoint_url)
    publisher = _publisher(tmp_path, logs, cloudwatch, max_buffered_lines=5)
    for n in range(8):
        publisher.add_line(f"line {n}")
    publisher.round()  # the group does not exist: logged, kept, never raised
    assert publisher.failures == 1 and publisher.dropped_lines == 3
    logs.create_log_group(logGroupName=GROUP)
    publisher.round()
    assert [m["message"] for m in _stream_messages(logs) if m["logger"] == "trainer"] == [f"line {n}" for n in range(3, 8)]


def _closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class _BlackHole:
    """A TCP server on loopback that accepts connections and never answers (a hung endpoint)."""

    def __init__(self) -> None:
        self.sock = socket.socket()
        self.sock.bind(("127.0.0.1", 0))
        self.sock.listen(64)
        self.accepted: list[socket.socket] = []
        self.port = self.sock.getsockname()[1]
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while True:
            try:
                conn, _ = self.sock.accept()
            except OSError:
                return
            self.accepted.append(conn)

    def close(self) -> None:
        self.sock.close()
        for conn in self.accepted:
            conn.close()


@pytest.mark.integration
@pytest.mark.parametrize("endpoint", ["closed", "hung"])
def test_unreachable_cloudwatch_neither_stops_nor_holds_up_training(tmp_path, monkeypatch, endpoint, capfd):
    hole = _BlackHole() if endpoint == "hung" else None
    port = hole.port if hole else _closed_port()
    for name, value in {"AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing",
                        "AWS_ENDPOINT_URL": f"http://127.0.0.1:{port}"}.items():
        monkeypatch.setenv(name, value)
    logs, cloudwatch = cloudwatch_clients("us-east-1")  # the agent's own clients: standard retries, timeouts
    publisher = _publisher(tmp_path, logs, cloudwatch, max_buffered_lines=20)
    publisher.monitoring = MonitoringConfig(enabled=True, log_group=GROUP, namespace=NAMESPACE, interval_s=1.0)
    logging.getLogger("spot_training.agent").addHandler(publisher.log_handler())
    publisher.start()
    try:
        supervisor = make_supervisor(tmp_path, config=_config(tmp_path), output=publisher.add_line,
                                     env={"FAKE_STEPS": "60", "FAKE_STEP_S": "0.05"})
        started = time.monotonic()
        outcome = supervisor.run()
        trained_s = time.monotonic() - started
        # Training completed and its output still reached the agent's stdout, line by line.
        assert outcome.value == "completed"
        assert (tmp_path / "dltraining" / "checkpoints" / "COMPLETED").is_file()
        out = capfd.readouterr().out
        assert "trainer step 60" in out and "done: 60 steps" in out
        if hole is not None:
            # The publisher's first call is still waiting for an answer (read timeout 10 s, 3 attempts)
            # while training is already over: the calls are not on the training path.
            assert hole.accepted and publisher.lines_sent == 0 and trained_s < 10
        else:
            deadline = time.monotonic() + 20
            while publisher.failures == 0 and time.monotonic() < deadline:
                time.sleep(0.1)
            assert publisher.failures >= 1  # refused, logged, retried next round
        assert publisher.dropped_lines > 0  # 60+ trainer lines into a buffer of 20: oldest dropped, counted
    finally:
        logging.getLogger("spot_training.agent").removeHandler(publisher.log_handler())
        publisher.close(timeout_s=0.1)
        if hole is not None:
            hole.close()


def test_run_command_publishes_under_the_instance_id_stream(ec2, moto_server, tmp_path):
    """``python -m spot_training.agent run`` with ``monitoring`` in the config: the stream of the instance holds
    the agent's lines from boot to cleanup and the trainer's output."""
    from spot_training.local.imds_emulator import ImdsEmulator
    from test_cli import STACK_TAGS, _write, agent, our_fleet

    fleet_id, instance_id = our_fleet(ec2)
    az = ec2.describe_instances(InstanceIds=[instance_id])["Reservations"][0]["Instances"][0]["Placement"]["AvailabilityZone"]
    ec2.create_volume(AvailabilityZone=az, Size=10, VolumeType="gp3", Encrypted=True,
                      TagSpecifications=[{"ResourceType": "volume", "Tags": STACK_TAGS}])
    logs, cloudwatch = _client("logs", moto_server.endpoint_url), _client("cloudwatch", moto_server.endpoint_url)
    logs.create_log_group(logGroupName=GROUP)
    with ImdsEmulator.from_moto(ec2, instance_id) as imds:
        config = copy.deepcopy(_config(tmp_path))
        config["imds_endpoint"] = imds.endpoint
        result = agent("run", _write(tmp_path / "config.json", config),
                       env={"SPOT_TRAINING_BLOCKDEV_DIR": str(moto_server.volumes_dir), "FAKE_STEPS": "20"})
    assert result.returncode == 0, result.stderr
    assert "trainer step 20" in result.stdout  # the journal still gets the trainer's output
    messages = _stream_messages(logs, instance_id)
    texts = [m["message"] for m in messages]
    assert "trainer step 20" in texts and "training completed" in texts
    assert texts.index("training completed") < texts.index("cancelled the spot fleet request and its instances (training completed)")
    assert _statistic(cloudwatch, "GlobalStep")[-1] == 20
    assert _statistic(cloudwatch, "Completed") == [1]


class _FakeAws:
    """Stands in for both clients in-process: records put_metric_data, accepts every log call."""

    def __init__(self) -> None:
        self.metrics: list[dict] = []

    def put_metric_data(self, Namespace, MetricData):  # noqa: N803 - boto3's keyword names
        self.metrics.extend(MetricData)
        return {}

    def __getattr__(self, name):
        return lambda **kwargs: {"nextSequenceToken": "0"}


def _steps_done(fake: _FakeAws) -> list[float]:
    values = [m["Value"] for m in fake.metrics if m["MetricName"] == "StepsDone"]
    fake.metrics.clear()
    return values


def _rows(log: Path, first: int, last: int, wall_time: float) -> None:
    new = not log.exists()
    with open(log, "a") as handle:
        if new:
            handle.write("step,epoch,loss,accuracy,wall_time\n")
        handle.writelines(f"{s},0,1.0,0.5,{wall_time}\n" for s in range(first, last + 1))


def test_the_hang_alarms_metric_waits_for_the_trainers_first_step_on_this_boot(tmp_path):
    """StepsDone <= 0 for alarm_no_progress_minutes raises the hang alarm; missing data does not. A node
    still preparing (a long dataset sync, an environment build) or a script that writes no training log
    puts none; once the trainer logged a step on this boot, a round without a step puts 0."""
    fake = _FakeAws()
    publisher = _publisher(tmp_path, fake, fake)
    log = publisher.log_dir / "training_log.csv"
    log.parent.mkdir(parents=True, exist_ok=True)
    publisher.round()
    assert _steps_done(fake) == []  # no training log yet: preparing, or a script without one
    _rows(log, 1, 30, wall_time=publisher.started - 600)  # the previous boot's rows (a resumed job)
    publisher.round()
    publisher.round()
    assert _steps_done(fake) == []
    _rows(log, 31, 35, wall_time=publisher.started + 1)  # the trainer's first steps on this boot
    publisher.round()
    assert _steps_done(fake) == [5]
    publisher.round()  # no step since: a hang starts to count
    assert _steps_done(fake) == [0]
    _rows(log, 36, 36, wall_time=publisher.started + 2)
    publisher.round()
    assert _steps_done(fake) == [1]
