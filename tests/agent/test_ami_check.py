"""spot_training.agent.ami_check: what the AMI lacks is a final boot error naming it and the fix."""

from __future__ import annotations

import json

import botocore
import pytest

from spot_training.agent import ami_check, cli
from spot_training.agent.config import parse_config
from spot_training.agent.errors import ConfigError, ExitCode
from spot_training.contract import ENV_ON_BOOT_FAILURE


def _config(*, rate=300, venv=False) -> dict:
    training = {"framework": "tensorflow", "python": "/usr/bin/python3", "command": ["{python}", "t.py"],
                "user": "ubuntu", "checkpoint_dir": "/dltraining/checkpoints", "code": {"type": "asset", "path": "/opt/code"}}
    if venv:
        training["venv"] = {"requirements": ["numpy"], "root": "/dltraining/envs"}
    volume = {"tags": {"spot-training:stack": "S", "spot-training:purpose": "data-volume"}, "device_name": "/dev/sdf",
              "mount_point": "/dltraining", "fs_type": "xfs", "keep_snapshots": 2}
    if rate is not None:
        volume["initialization_rate_mibps"] = rate
    return {"schema_version": 1, "region": "us-east-1", "stack_name": "S", "node_role": "single",
            "volume": volume, "training": training}


def test_every_missing_piece_is_named_with_its_fix():
    config = parse_config(_config(venv=True))
    with pytest.raises(ConfigError) as caught:
        ami_check.check_node(config, botocore_version="1.34.162", which=lambda name: None, venv_ok=lambda p: False)
    text = str(caught.value)
    for piece in ("botocore 1.34.162 is older than 1.38.10", "volume_initialization_rate_mibps=none",
                  "AWS CLI", "mkfs.xfs", "xfsprogs", "-m venv", "python3-venv"):
        assert piece in text, (piece, text)


def test_a_complete_ami_passes_and_no_rate_needs_no_new_botocore():
    ami_check.check_node(parse_config(_config(venv=True)), botocore_version="1.38.10", which=lambda n: f"/usr/bin/{n}",
                         venv_ok=lambda p: True)
    ami_check.check_node(parse_config(_config(rate=None)), botocore_version="1.31.0", which=lambda n: f"/usr/bin/{n}")


@pytest.mark.integration
def test_run_with_an_old_botocore_is_a_final_boot_error_not_a_restart_loop(tmp_path, monkeypatch):
    """``run`` ends with exit 69 (systemd does not restart it) after reporting boot step ``config``
    as final, before any EC2 call: no restart every 15 s."""
    path = tmp_path / "config.json"
    path.write_text(json.dumps(_config()))
    record = tmp_path / "calls"
    script = tmp_path / "fake-boot-failed"
    script.write_text(f"#!/bin/bash\nprintf '%s|' \"$@\" >> {record}\n")
    script.chmod(0o755)
    monkeypatch.setenv(ENV_ON_BOOT_FAILURE, str(script))
    monkeypatch.setenv(cli.BLOCKDEV_DIR_ENV, str(tmp_path / "volumes"))  # local mode: no IMDS on this machine
    monkeypatch.setattr(botocore, "__version__", "1.34.0")
    monkeypatch.setattr(cli, "_imds", lambda config: None)
    monkeypatch.setattr(cli, "_identity", lambda imds, config: cli.Identity("i-0123456789abcdef0", "us-east-1a", "us-east-1"))
    monkeypatch.setattr(cli, "_ec2", lambda config: pytest.fail("EC2 reached despite the old botocore"))
    monkeypatch.setattr(cli, "_start_publisher", lambda *a: pytest.fail("publisher started despite the old botocore"))
    assert cli.main(["run", "--config", str(path)]) == ExitCode.UNAVAILABLE == 69
    step, message, mode, _ = record.read_text().split("|")
    assert (step, mode) == ("config", "final")
    assert "botocore 1.34.0 is older than 1.38.10" in message
