"""A seeded fuzz of node-config values (in-process, a few thousand cases, about a second): every value
of every numeric key, the ``cluster`` section included, is either accepted within its documented
range or refused with a ConfigError (exit 78) whose message names the key; never another exception
(OverflowError, RecursionError, TypeError), never a hang. The contract's check() gets the same
values as context text (``cdk synth -c key=VALUE``)."""

from __future__ import annotations

import copy
import math
import random

import pytest

from spot_training import contract
from spot_training.agent.config import parse_config
from spot_training.agent.errors import ConfigError

SEED = 24
CASES = 3000


def _base() -> dict:
    efs = "/mnt/efs"
    return {
        "schema_version": 1, "region": "us-east-1", "stack_name": "DistributedTraining", "node_role": "worker",
        "volume": {"tags": {"spot-training:stack": "DistributedTraining", "spot-training:purpose": "data-volume"},
                   "device_name": "/dev/sdf", "mount_point": "/dltraining", "keep_snapshots": 2,
                   "snapshot_interval_s": 0},
        "efs": {"file_system_id": "fs-0123abcd", "access_point_id": None, "mount_point": efs},
        "training": {"framework": "pytorch", "python": "/usr/bin/python3", "command": ["{python}", "-m", "x"],
                     "user": "ubuntu", "dataset_dir": f"{efs}/datasets", "checkpoint_dir": f"{efs}/checkpoints",
                     "log_dir": f"{efs}/logs", "code": {"type": "asset", "path": "/opt/code"}},
        "cleanup": {"cancel_fleet_on_success": True}, "imds_endpoint": None, "notice_poll_interval_s": 5,
        "cluster": {"state_dir": f"{efs}/cluster", "num_servers": 0, "min_workers": 1},
    }


#: Key path -> inclusive documented range (None: not numeric, only must be refused cleanly or kept).
KEYS = {
    ("notice_poll_interval_s",): (0.5, 60.0),
    ("volume", "keep_snapshots"): (1, 100),
    ("volume", "snapshot_interval_s"): (0, 7 * 86400),
    ("cluster", "num_servers"): (0, contract.MAX_SERVERS),
    ("cluster", "min_workers"): (1, contract.MAX_WORKERS),
    ("cluster", "max_workers"): (1, contract.MAX_WORKERS),
    ("cluster", "scheduler_port"): (1024, 65535),
    ("cluster", "worker_port"): (1024, 65535),
    ("cluster", "heartbeat_interval_s"): (0, 60),
    ("cluster", "heartbeat_timeout_s"): (0, 3600),
    ("cluster", "debounce_s"): (0, 3600),
    ("cluster", "stop_timeout_s"): (0, 3600),
    ("cluster", "kill_grace_s"): (0, 600),
    ("cluster", "torch_max_restarts"): (0, contract.MAX_TORCH_MAX_RESTARTS),
    ("cluster", "torch_shutdown_timeout_s"): (0, contract.MAX_TORCH_SHUTDOWN_TIMEOUT_S),
    ("cluster", "torch_nproc_per_node"): (1, contract.MAX_TORCH_NPROC_PER_NODE),
    ("cluster", "member_tag"): None,
    ("cluster", "state_dir"): None,
}


def _deep(depth: int):
    value: object = 1
    for _ in range(depth):
        value = [value]
    return value


def _value(rng: random.Random):
    pool = [
        lambda: rng.randint(-10, 10 ** rng.randint(0, 6)), lambda: rng.uniform(-1e3, 1e5),
        lambda: 10 ** rng.randint(10, 400), lambda: -(10 ** rng.randint(10, 60)), lambda: 10 ** 5000,
        lambda: float("inf"), lambda: float("-inf"), lambda: float("nan"), lambda: 1e308, lambda: 5e-324,
        lambda: True, lambda: False, lambda: None, lambda: [], lambda: {}, lambda: [1], lambda: {"a": 1},
        lambda: _deep(rng.randint(2, 30)), lambda: "７０００", lambda: "7000", lambda: "1_000", lambda: "1e3",
        lambda: "x" * rng.choice([1, 100, 100_000]), lambda: "9" * 5000, lambda: "\x00", lambda: "aws:tag",
        lambda: "/mnt/efs/" + "a" * rng.choice([1, 5000]), lambda: rng.random(),
    ]
    return rng.choice(pool)()


def _in_range(value, bounds) -> bool:
    low, high = bounds
    return (not isinstance(value, bool) and isinstance(value, (int, float)) and math.isfinite(value)
            and low <= value <= high)


def test_node_config_values_are_accepted_in_range_or_refused_naming_the_key():
    rng = random.Random(SEED)
    accepted = refused = 0
    for _ in range(CASES):
        path = rng.choice(list(KEYS))
        value = _value(rng)
        data = _base()
        section = data
        for part in path[:-1]:
            section = section[part]
        section[path[-1]] = copy.deepcopy(value)
        name = ".".join(path)
        try:
            parse_config(data)
        except ConfigError as exc:
            assert name in str(exc), (name, repr(value)[:80], str(exc)[:300])
            refused += 1
            continue
        # Accepted: only a value within the documented range (or a valid string for string keys).
        bounds = KEYS[path]
        if bounds is not None:
            assert _in_range(value, bounds), (name, repr(value)[:80])
        else:
            assert isinstance(value, str) and len(value) <= 4096, (name, repr(value)[:80])
        accepted += 1
    assert accepted > 50 and refused > 50  # the fuzz exercised both outcomes


@pytest.mark.parametrize("name", sorted(contract.SETTINGS))
def test_contract_check_refuses_cleanly_naming_the_key(name):
    rng = random.Random(f"{SEED}-{name}")
    setting = contract.SETTINGS[name]
    assert setting.maximum is not None  # upper bounds everywhere
    for _ in range(300):
        value = _value(rng)
        for candidate in (value, str(value) if not isinstance(value, int) or abs(value) < 10 ** 100 else value):
            try:
                result = contract.check(name, candidate, label=f"context key {name!r}")
            except contract.SettingError as exc:
                assert f"context key {name!r}" in str(exc)
                continue
            assert setting.minimum <= result <= setting.maximum and math.isfinite(result)
            if isinstance(candidate, str):
                assert candidate.strip().isascii()


def test_full_width_digits_and_overlong_text_are_refused():
    for text in ("７０００", "٣", "1_000", "9" * 5000, "inf", "nan", "0x10"):
        with pytest.raises(contract.SettingError, match="keep_snapshots"):
            contract.check("keep_snapshots", text)
    assert contract.check("keep_snapshots", " 7 ") == 7
