"""The volume step through the agent's real command line (``python -m spot_training.agent attach-volume``), with
identity from the IMDSv2 emulator and EC2 from the moto server: the exit codes systemd sees."""

from __future__ import annotations

import json
import os
import subprocess
import sys

from storage_helpers import REPO, aws_state, config_dict, create_data_volume, data_volumes, run_instance

from spot_training.local.imds_emulator import ImdsEmulator
from spot_training.local.moto_compat import volume_dir


def _attach_volume(moto_server, tmp_path, ec2, instance_id):
    with ImdsEmulator.from_moto(ec2, instance_id) as imds:
        config = config_dict(tmp_path)
        config["imds_endpoint"] = imds.endpoint
        path = tmp_path / "config.json"
        path.write_text(json.dumps(config))
        env = {**os.environ, "SPOT_TRAINING_BLOCKDEV_DIR": str(moto_server.volumes_dir), "PYTHONPATH": str(REPO)}
        return subprocess.run([sys.executable, "-m", "spot_training.agent", "attach-volume", "--config", str(path)],
                              cwd=REPO, env=env, capture_output=True, text=True, timeout=120)


def test_attach_volume_command_moves_and_mounts(ec2, moto_server, tmp_path):
    old_id = create_data_volume(ec2, "us-east-1a")
    (volume_dir(moto_server.ebs_dir, old_id) / "dataset.bin").write_bytes(b"\x00\x01\x02")
    instance_id = run_instance(ec2, "us-east-1c")

    result = _attach_volume(moto_server, tmp_path, ec2, instance_id)

    assert result.returncode == 0, result.stderr + result.stdout
    mount_point = json.loads(result.stdout.strip().splitlines()[-1])["mount_point"]
    assert (tmp_path / "dltraining").samefile(mount_point)
    assert (tmp_path / "dltraining" / "dataset.bin").read_bytes() == b"\x00\x01\x02"
    [volume] = data_volumes(ec2)
    assert volume["AvailabilityZone"] == "us-east-1c"


def test_no_volume_with_the_tags_exits_78_naming_the_tags_and_touches_nothing(ec2, moto_server, tmp_path):
    create_data_volume(ec2, "us-east-1a", stack="SomeoneElse")
    instance_id = run_instance(ec2, "us-east-1a")
    before = aws_state(ec2)

    result = _attach_volume(moto_server, tmp_path, ec2, instance_id)

    assert result.returncode == 78, result.stderr
    assert "no EBS volume" in result.stderr and "'spot-training:stack': 'SpotTraining'" in result.stderr
    assert aws_state(ec2) == before
    assert not (tmp_path / "dltraining").exists()
