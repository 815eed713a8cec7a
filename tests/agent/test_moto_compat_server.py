"""spot_training.local.moto_server: a real server process on loopback, started, answering, stopped by PID."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import boto3
import pytest

from spot_training.local.moto_server import MotoServer

REPO = Path(__file__).resolve().parents[2]


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    # A zombie still answers kill(0); it is gone for our purposes once it is not running.
    try:
        state = Path(f"/proc/{pid}/stat").read_text().split()[2]
    except OSError:
        return False
    return state != "Z"


def _ec2(endpoint: str):
    return boto3.client("ec2", region_name="us-east-1", endpoint_url=endpoint,
                        aws_access_key_id="testing", aws_secret_access_key="testing")


@pytest.mark.integration
def test_context_manager_serves_on_loopback_keeps_a_log_and_stops_by_pid(tmp_path):
    with MotoServer(tmp_path / "moto") as server:
        assert server.endpoint_url.startswith("http://127.0.0.1:")
        pid = server.pid
        ec2 = _ec2(server.endpoint_url)
        volume_id = ec2.create_volume(AvailabilityZone="us-east-1a", Size=1)["VolumeId"]
        assert (server.volumes_dir / volume_id).is_dir()  # compat data plane active
        server.reset()
        assert ec2.describe_volumes()["Volumes"] == []
    assert not _alive(pid)
    assert (tmp_path / "moto" / "moto_server.log").stat().st_size > 0


@pytest.mark.integration
def test_command_line_prints_the_endpoint_and_stops_on_sigterm(tmp_path):
    process = subprocess.Popen([sys.executable, "-m", "spot_training.local.moto_server", "--work-dir", str(tmp_path / "w")],
                               cwd=REPO, stdout=subprocess.PIPE, text=True)
    try:
        info = json.loads(process.stdout.readline())
        assert _ec2(info["endpoint_url"]).describe_volumes()["Volumes"] == []
        server_pid = info["pid"]
        process.send_signal(signal.SIGTERM)
        assert process.wait(timeout=30) == 0
        deadline = time.monotonic() + 10
        while _alive(server_pid) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not _alive(server_pid)
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()


def test_fails_on_a_non_loopback_host(tmp_path):
    with pytest.raises(ValueError, match="loopback.*'0.0.0.0'"):
        MotoServer(tmp_path, host="0.0.0.0")
