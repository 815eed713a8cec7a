"""Node config validation: every problem named with its key path, value and what is allowed."""

from __future__ import annotations

import copy
import json
from pathlib import Path

import pytest

from spot_training.agent.config import AgentConfig, load_config, parse_config
from spot_training.agent.errors import ConfigError, ExitCode

# The example of docs/contracts.md, verbatim.
CONTRACT_EXAMPLE = json.loads(r'''{
  "schema_version": 1,
  "region": "us-east-1",
  "stack_name": "SpotTraining",
  "node_role": "single",
  "volume": {
    "tags": {"spot-training:stack": "SpotTraining", "spot-training:purpose": "data-volume"},
    "device_name": "/dev/sdf",
    "mount_point": "/dltraining",
    "fs_type": "xfs",
    "keep_snapshots": 2,
    "snapshot_interval_s": 3600,
    "initialization_rate_mibps": 300
  },
  "efs": null,
  "training": {
    "framework": "tensorflow",
    "python": "/opt/conda/envs/tensorflow/bin/python",
    "command": ["{python}", "spot_training/training/examples/keras_resnet.py"],
    "user": "ubuntu",
    "dataset_dir": "/dltraining/datasets",
    "checkpoint_dir": "/dltraining/checkpoints",
    "log_dir": "/dltraining/logs",
    "code": {"type": "asset", "path": "/opt/spot-training/code"}
  },
  "cleanup": {"cancel_fleet_on_success": true},
  "imds_endpoint": null
}''')


def _problems(data) -> tuple[str, ...]:
    with pytest.raises(ConfigError) as info:
        parse_config(data)
    assert info.value.exit_code == ExitCode.CONFIG
    return info.value.problems


def _set(path: str, value):
    data = copy.deepcopy(CONTRACT_EXAMPLE)
    *parents, last = path.split(".")
    section = data
    for key in parents:
        section = section[key]
    if value is _DELETE:
        del section[last]
    else:
        section[last] = value
    return data


_DELETE = object()


def test_the_contract_example_is_valid():
    config = parse_config(CONTRACT_EXAMPLE)
    assert isinstance(config, AgentConfig)
    assert config.volume.mount_point == Path("/dltraining") and config.volume.keep_snapshots == 2
    assert (config.volume.snapshot_interval_s, config.volume.initialization_rate_mibps) == (3600, 300)
    assert config.training.argv() == ["/opt/conda/envs/tensorflow/bin/python", "spot_training/training/examples/keras_resnet.py"]
    assert config.training.code.type == "asset" and config.training.code.path == Path("/opt/spot-training/code")
    assert config.efs is None and config.imds_endpoint is None and config.cleanup.cancel_fleet_on_success is True
    with pytest.raises(AttributeError):
        config.region = "eu-west-1"  # frozen
    with pytest.raises(TypeError):
        config.volume.tags["x"] = "y"  # read-only mapping


def test_defaults_for_optional_keys():
    data = _set("volume.fs_type", _DELETE)
    del data["volume"]["keep_snapshots"], data["cleanup"], data["efs"], data["imds_endpoint"]
    del data["training"]["dataset_dir"], data["training"]["log_dir"]
    config = parse_config(data)
    assert (config.volume.fs_type, config.volume.keep_snapshots) == ("xfs", 2)
    assert config.cleanup.cancel_fleet_on_success is True
    assert config.training.dataset_dir == Path("/dltraining/datasets")
    assert config.training.log_dir == Path("/dltraining/logs")
    assert config.notice_poll_interval_s == 5.0  # AWS's recommended polling interval


def test_notice_poll_interval_is_read():
    assert parse_config(_set("notice_poll_interval_s", 1)).notice_poll_interval_s == 1.0


@pytest.mark.parametrize("path,value,expected", [
    ("region", "mars-east-1", 'region: got "mars-east-1"; expected an AWS region known to botocore'),
    ("region", 7, "region: got 7"),
    ("stack_name", "1bad name", 'stack_name: got "1bad name"; expected a CloudFormation stack name'),
    ("node_role", "boss", "node_role: got \"boss\"; expected one of 'single', 'scheduler', 'server', 'worker'"),
    ("schema_version", 2, "schema_version: got 2; expected 1"),
    ("schema_version", True, "schema_version: got true; expected an integer >= 1"),
    ("volume.keep_snapshots", 0, "volume.keep_snapshots: got 0; expected an integer from 1 to 100"),
    ("volume.keep_snapshots", 2.5, "volume.keep_snapshots: got 2.5"),
    ("volume.device_name", "/dev/nvme1n1", 'volume.device_name: got "/dev/nvme1n1"; expected an EBS device name'),
    ("volume.mount_point", "dltraining", 'volume.mount_point: got "dltraining"; expected an absolute path'),
    ("volume.fs_type", "ntfs", "volume.fs_type: got \"ntfs\"; expected one of 'xfs', 'ext4'"),
    ("volume.tags", {}, "volume.tags: got {}; expected a non-empty object"),
    ("volume.tags", {"Name": "data"}, "expected a map that includes 'spot-training:stack'"),
    ("training.framework", "jax", "training.framework: got \"jax\"; expected one of 'tensorflow', 'mxnet', 'pytorch'"),
    ("training.python", "python3", 'training.python: got "python3"; expected an absolute path'),
    ("training.command", [], "training.command: got []; expected a non-empty list of strings"),
    ("training.command", ["{python}", 3], "training.command[1]: got 3; expected a non-empty string"),
    ("training.user", "Robert'); DROP", "training.user: got"),
    ("training.checkpoint_dir", "/dltraining/../etc", "expected an absolute path without '..' components"),
    ("training.code", {"type": "svn"}, "training.code.type: got \"svn\"; expected one of 'asset', 'git'"),
    ("training.code", {"type": "git", "url": "https://example.com/r.git"}, "training.code.ref: missing"),
    ("training.code", {"type": "git", "url": "https://example.com/r.git", "ref": "main~1"}, "training.code.ref: got \"main~1\""),
    ("training.code", {"type": "asset", "path": "code"}, 'training.code.path: got "code"; expected an absolute path'),
    ("efs", {"file_system_id": "vol-1", "mount_point": "/mnt/efs"}, 'efs.file_system_id: got "vol-1"'),
    ("efs", "fs-12345678", 'efs: got "fs-12345678"; expected null or an object'),
    ("cleanup", {"cancel_fleet_on_success": "yes"}, 'cleanup.cancel_fleet_on_success: got "yes"; expected true or false'),
    ("imds_endpoint", "169.254.169.254", 'imds_endpoint: got "169.254.169.254"; expected null or an http(s) URL'),
    ("notice_poll_interval_s", 0, "notice_poll_interval_s: got 0; expected a number of seconds from 0.5 to 60"),
    ("notice_poll_interval_s", True, "notice_poll_interval_s: got true; expected a number of seconds"),
    ("notice_poll_interval_s", "5", 'notice_poll_interval_s: got "5"; expected a number of seconds'),
    ("training", _DELETE, "training: missing; expected a value (required key)"),
    ("volume.device_name", _DELETE, "volume.device_name: missing"),
    ("colour", "blue", 'colour: got "blue"; expected no such key'),
    # option injection into git, absurd sizes, system paths, checkpoints on the root disk
    ("training.code", {"type": "git", "url": "--upload-pack=touch /tmp/x", "ref": "v1"},
     'training.code.url: got "--upload-pack=touch /tmp/x"; expected a git URL'),
    ("training.code", {"type": "git", "url": "https://example.com/r.git", "ref": "--orphan"},
     'training.code.ref: got "--orphan"; expected a pinned commit or tag'),
    ("volume.keep_snapshots", 10**30, "volume.keep_snapshots: got 1000000000000000000000000000000; expected an "
     "integer from 1 to 100"),
    ("volume.keep_snapshots", 101, "volume.keep_snapshots: got 101; expected an integer from 1 to 100"),
    ("volume.mount_point", "/", 'volume.mount_point: got "/"; expected a directory of its own'),
    ("volume.mount_point", "/etc", 'volume.mount_point: got "/etc"; expected a directory of its own'),
    ("volume.mount_point", "/usr/local/data", 'volume.mount_point: got "/usr/local/data"; expected a directory'),
    ("training.checkpoint_dir", "/var/lib/checkpoints", 'training.checkpoint_dir: got "/var/lib/checkpoints"; '
     "expected a directory under the data volume's mount point '/dltraining'"),
    ("training.checkpoint_dir", "/dltraining", "training.checkpoint_dir: got \"/dltraining\"; expected a directory "
     "under the data volume's mount point"),
])
def test_each_bad_value_is_named(path, value, expected):
    problems = _problems(_set(path, value))
    assert any(expected in p for p in problems), problems


def test_volume_tags_must_scope_to_this_stack():
    problems = _problems(_set("volume.tags", {"spot-training:stack": "Other", "spot-training:purpose": "data-volume"}))
    assert problems == ('volume.tags.spot-training:stack: got "Other"; expected the stack name \'SpotTraining\' '
                        "(stack_name), so the agent never takes another stack's volume",)


def test_all_problems_are_reported_together():
    data = _set("region", "nowhere-1")
    data["training"]["framework"] = "caffe"
    data["volume"]["mount_point"] = "rel"
    problems = _problems(data)
    assert len(problems) == 3
    message = str(ConfigError(problems=problems))
    assert "region" in message and "training.framework" in message and "volume.mount_point" in message


def test_pytorch_runs_on_single_nodes_and_on_cluster_nodes():
    # Issue 11: PyTorch clusters run on TorchElastic (spot_training/agent/torch_elastic.py).
    config = parse_config(_set("training.framework", "pytorch"))
    assert config.training.framework == "pytorch"
    for role in ("scheduler", "worker"):
        data = _set("training.framework", "pytorch")
        data["node_role"] = role
        data["cluster"] = {"state_dir": "/mnt/efs/cluster", "num_servers": 0}
        assert parse_config(data).training.framework == "pytorch"


def test_root_must_be_an_object():
    assert _problems([1, 2]) == ("<root>: got [1, 2]; expected an object",)


def test_valid_efs_git_and_endpoint():
    data = _set("efs", {"file_system_id": "fs-0123abcd", "access_point_id": "fsap-0123abcd4567", "mount_point": "/mnt/efs"})
    data["training"]["code"] = {"type": "git", "url": "https://github.com/example/repo.git", "ref": "v1.2.0"}
    data["imds_endpoint"] = "http://127.0.0.1:1338/"
    data["region"] = "cn-north-1"  # other partitions are known regions too
    data["cluster"] = {"generation": 0}
    config = parse_config(data)
    assert config.efs.file_system_id == "fs-0123abcd" and config.efs.mount_point == Path("/mnt/efs")
    assert (config.training.code.url, config.training.code.ref) == ("https://github.com/example/repo.git", "v1.2.0")
    assert config.imds_endpoint == "http://127.0.0.1:1338"
    assert dict(config.extensions) == {"cluster": {"generation": 0}}


def test_load_config_file_errors(tmp_path):
    with pytest.raises(ConfigError, match="does not exist; pass --config"):
        load_config(tmp_path / "missing.json")
    bad = tmp_path / "bad.json"
    bad.write_text('{"region": "us-east-1",\n  oops}')
    with pytest.raises(ConfigError, match=r"is not valid JSON: .* at line 2 column 3"):
        load_config(bad)
    good = tmp_path / "good.json"
    good.write_text(json.dumps(CONTRACT_EXAMPLE))
    assert load_config(good).stack_name == "SpotTraining"


def test_checkpoint_dir_on_efs_is_allowed():
    data = _set("efs", {"file_system_id": "fs-0123abcd", "mount_point": "/mnt/efs"})
    data["training"]["checkpoint_dir"] = "/mnt/efs/checkpoints"
    assert parse_config(data).training.checkpoint_dir == Path("/mnt/efs/checkpoints")


@pytest.mark.parametrize("text,expected", [
    ("[" * 200_000 + "]" * 200_000, "nested too deeply"),
    ('{"schema_version": ' + "9" * 5000 + "}", "integer"),
])
def test_pathological_json_is_a_config_error(tmp_path, text, expected):
    path = tmp_path / "config.json"
    path.write_text(text)
    with pytest.raises(ConfigError, match=expected) as info:
        load_config(path)
    assert info.value.exit_code == ExitCode.CONFIG
