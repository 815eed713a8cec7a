"""Settings validation in-process (no synth): the typed constructors check exactly as the context
path does, unknown context keys are refused with the nearest known key, ``training_command`` takes a
shell-style string or a list, and a seeded fuzz of context values never ends in a traceback."""

from __future__ import annotations

import dataclasses
import json
import random
import sys
from pathlib import Path
from typing import Any

import pytest

from spot_training.infra import preflight
from spot_training.infra.cluster import Framework
from spot_training.infra.cluster_config import CLUSTER_CONTEXT_KEYS, ClusterSettings
from spot_training.infra.config import CONTEXT_KEYS, StackSettings, check_context_keys

KNOWN = StackSettings.context_keys + ClusterSettings.context_keys


# ---- the typed constructor validates as the context path does ------------------------------------


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        ({"keep_snapshots": 0}, r"context key 'keep_snapshots': got 0; allowed: an integer from 1"),
        ({"target_capacity": -1}, r"'target_capacity': got -1"),
        ({"target_capacity": 10**9}, r"'target_capacity': got 1000000000; allowed: an integer \(instances\) from 0 to 10000"),
        ({"max_price": "７０００"}, r"'max_price': got '７０００'"),
        ({"instance_types": ("g5.xlarge", "g5.xlarge")}, r"'instance_types'.*distinct"),
        ({"volume_size_gib": True}, r"'volume_size_gib': got True"),
        ({"training_command": ()}, r"'training_command': got \[\]"),
        ({"training_user": "Root!"}, r"'training_user': got 'Root!'"),
        ({"code_git_url": "https://example.com/r.git"}, r"'code_git_ref'.*required when code_git_url is set"),
        ({"allocation_strategy": "cheapest"}, r"'allocation_strategy': got 'cheapest'"),
    ],
)
def test_stack_settings_constructor_refuses_what_the_context_refuses(fields: dict[str, Any], message: str) -> None:
    context = {k: (list(v) if isinstance(v, tuple) else v) for k, v in fields.items()}
    with pytest.raises(ValueError, match=message):
        StackSettings.from_mapping(context)
    with pytest.raises(ValueError, match=message):
        StackSettings(**fields)


def test_stack_settings_constructor_converts_as_the_context_does() -> None:
    typed = StackSettings(training_command="python my_train.py --epochs 2", target_capacity="2", max_price=0.5,
                          instance_types=["g5.xlarge"], retain_data="true")
    assert typed.training_command == ("python", "my_train.py", "--epochs", "2")
    assert (typed.target_capacity, typed.max_price, typed.instance_types, typed.retain_data) == (2, "0.5", ("g5.xlarge",), True)
    assert typed == StackSettings.from_mapping({"training_command": "python my_train.py --epochs 2", "target_capacity": "2",
                                                "max_price": 0.5, "instance_types": "g5.xlarge", "retain_data": "true"})
    assert StackSettings(volume_initialization_rate_mibps=None).volume_initialization_rate_mibps is None
    assert StackSettings() == StackSettings.from_mapping({})


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        ({"workers": 100}, r"'cluster_workers': got 100"),
        ({"min_workers": 0}, r"'cluster_min_workers': got 0"),
        ({"torch_shutdown_timeout_s": 10**60}, r"'cluster_torch_shutdown_timeout_s'"),
        ({"scheduler_instance_type": ["m5.large"]}, r"'cluster_scheduler_instance_type'"),
        ({"framework": "caffe"}, r"'cluster_framework': got 'caffe'"),
        ({"training_command": []}, r"'cluster_training_command': got \[\]"),
        ({"base": {"region": "us-east-1"}}, r"base must be a StackSettings"),
    ],
)
def test_cluster_settings_constructor_refuses_what_the_context_refuses(fields: dict[str, Any], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        ClusterSettings(**fields)


def test_cluster_settings_constructor_takes_the_frameworks_command() -> None:
    assert ClusterSettings(framework=Framework.PYTORCH).training_command == ClusterSettings.from_mapping(
        {"cluster_framework": "pytorch"}).training_command
    assert ClusterSettings(training_command="{python} -m my.trainer --steps 5").training_command == (
        "{python}", "-m", "my.trainer", "--steps", "5")
    assert ClusterSettings() == ClusterSettings.from_mapping({})


# ---- training_command: shell-style string or list -------------------------------------------------


@pytest.mark.parametrize(
    ("value", "expected"),
    [
        ("{python} my_train.py --epochs 3", ("{python}", "my_train.py", "--epochs", "3")),
        ("{python} -c 'print(1, 2)'", ("{python}", "-c", "print(1, 2)")),
        ('["{python}", "a b.py"]', ("{python}", "a b.py")),
        (["{python}", "train.py"], ("{python}", "train.py")),
    ],
)
def test_training_command_takes_a_shell_style_string_or_a_list(value: Any, expected: tuple[str, ...]) -> None:
    assert StackSettings.from_mapping({"training_command": value}).training_command == expected
    assert ClusterSettings.from_mapping({"cluster_training_command": value}).training_command == expected


def test_training_command_with_an_open_quote_names_the_key() -> None:
    with pytest.raises(ValueError, match=r"'training_command'.*No closing quotation"):
        StackSettings.from_mapping({"training_command": "python 'train.py"})


# ---- unknown context keys --------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("key", "near"),
    [("max_workrs", "cluster_max_workers"), ("instance_type", "instance_types"), ("trainig_command", "training_command")],
)
def test_an_unknown_context_key_is_refused_with_the_nearest_known_one(key: str, near: str) -> None:
    with pytest.raises(ValueError, match=rf"unknown context key\(s\): '{key}' \(did you mean '{near}'\?\)"):
        check_context_keys({key: "3", "stack_name": "S"}, KNOWN)


def test_cdks_own_context_keys_are_not_settings() -> None:
    check_context_keys({"@aws-cdk/core:checkSecretUsage": True, "aws:cdk:enable-path-metadata": True,
                        "availability-zones:account=1:region=r": ["a"], "acknowledged-issue-numbers": [1]}, KNOWN)
    check_context_keys(json.loads(Path("cdk.json").read_text())["context"], KNOWN)


def test_preflight_refuses_an_unknown_context_key(capsys: pytest.CaptureFixture[str]) -> None:
    parser = preflight.argparse.ArgumentParser()
    preflight.add_arguments(parser)
    args = parser.parse_args(["-c", "max_workrs=3", "--region", "us-east-1"])
    assert preflight.run(args, client_factory=lambda *a: pytest.fail("no AWS call before the settings are valid")) == preflight.EXIT_USAGE
    assert "did you mean 'cluster_max_workers'?" in capsys.readouterr().err


# ---- fuzz ---------------------------------------------------------------------------------------------


def _nested(depth: int) -> Any:
    value: Any = "x"
    for _ in range(depth):
        value = [value]
    return value


def _values(rng: random.Random) -> list[Any]:
    """Hostile and ordinary context values, strings as ``-c`` passes them and JSON as cdk.json does."""
    fixed: list[Any] = [
        "5" * 5000, "-" + "9" * 5000, "７０００", "１", "0.５", "٣", 10**60, -(10**60), 2**63, 1e308, float("inf"),
        float("nan"), "inf", "nan", "1e308", True, False, "true", "", " ", "none", [], {}, [1, 2], {"a": 1}, ["a", ["b"]],
        _nested(5000), "[" * 5000 + "]" * 5000, '{"a": [1]}', "[1, 2]", '["g5.xlarge"]', "0", "1", "-1", "3000", "65535",
        "1.5", 0.75, 3, 0, -3, "g5.xlarge", "us-east-1", "us-east-1a", "/usr/bin/python3", "x" * 300, "\x00", "a,b,,c",
        "python 'unclosed", "{python} train.py", "\u202e", "ubuntu", "https://example.com/r.git",
    ]
    for _ in range(12):
        fixed.append("".join(rng.choice("0123456789.-,[]{}\" 'aZ_/:@") for _ in range(rng.randint(1, 40))))
        fixed.append(rng.randint(-10**12, 10**12))
        fixed.append(rng.uniform(-1e6, 1e6))
    return fixed


def _check_one(build: Any, key: str, value: Any) -> str:
    try:
        settings = build({key: value})
    except ValueError as exc:
        assert key in str(exc), f"{key}={value!r:.80}: the error does not name the key: {exc}"
        assert len(str(exc)) < 2000, f"{key}={value!r:.80}: an error of {len(str(exc))} characters"
        return "refused"
    # Accepted: the typed constructor agrees on the converted value (one validation, two doors).
    assert dataclasses.replace(settings) == settings
    return "accepted"


def test_seeded_context_fuzz_accepts_in_range_or_refuses_naming_the_key() -> None:
    rng = random.Random(20261128)
    values = _values(rng)
    limit = sys.getrecursionlimit()
    outcomes = {"accepted": 0, "refused": 0}
    cluster_only = [k.name for k in CLUSTER_CONTEXT_KEYS]
    cases = [(StackSettings.from_mapping, k.name) for k in CONTEXT_KEYS] + [(ClusterSettings.from_mapping, k) for k in cluster_only]
    for build, key in cases:
        for value in values:
            outcomes[_check_one(build, key, value)] += 1
    assert sys.getrecursionlimit() == limit
    assert sum(outcomes.values()) == len(cases) * len(values) > 3000
    assert outcomes["accepted"] > 100 and outcomes["refused"] > 2000, outcomes


@pytest.mark.parametrize(("key", "value"), [("max_price", "７０００"), ("target_capacity", "5" * 5000),
                                            ("volume_size_gib", "１００"), ("availability_zones", "us-east-１a")])
def test_full_width_digits_and_long_numbers_are_refused(key: str, value: str) -> None:
    with pytest.raises(ValueError, match=rf"context key '{key}'"):
        StackSettings.from_mapping({key: value})


@pytest.mark.slow
def test_the_app_fails_synth_on_a_misspelled_context_key() -> None:
    """What ``cdk synth -c max_workrs=3`` runs: the app with the context in CDK_CONTEXT_JSON (it
    fails before any construct is built, so this costs an aws_cdk import)."""
    import os
    import subprocess

    env = {**os.environ, "CDK_CONTEXT_JSON": json.dumps({"max_workrs": "3"}), "CDK_OUTDIR": "/nonexistent"}
    done = subprocess.run([sys.executable, "app.py"], env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode != 0
    assert "unknown context key(s): 'max_workrs' (did you mean 'cluster_max_workers'?)" in done.stderr
