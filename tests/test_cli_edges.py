"""Edges of the ``spot-train`` command line: bad numbers are usage errors, not tracebacks or busy
loops; the region hint names the variable boto3 reads; preflight without credentials says so (exit 4,
as status/logs/cost); no command prints jsii's Node.js banner as raw bytes."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from spot_training import cli


@pytest.mark.parametrize("interval", ["-5", "0", "0.2", "nan", "inf", "ten"])
def test_status_watch_interval_out_of_range_is_a_usage_error(interval: str, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exit_info:
        cli.parse_args(["status", "--watch", "--interval", interval])
    assert exit_info.value.code == 2
    assert f"--interval: got {interval!r}; expected seconds from 1 to 86400" in capsys.readouterr().err


def test_status_watch_interval_in_range_is_taken() -> None:
    assert cli.parse_args(["status", "--watch", "--interval", "2.5"]).interval == 2.5


@pytest.mark.parametrize("option", ["--ebs-gb-month-price", "--snapshot-gb-month-price"])
@pytest.mark.parametrize("price", ["-1", "-0.01", "nan", "inf"])
def test_cost_negative_or_non_finite_price_is_a_usage_error(option: str, price: str, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exit_info:
        cli.parse_args(["cost", option, price])
    assert exit_info.value.code == 2
    assert f"{option}: got {price!r}; expected a price in USD >= 0" in capsys.readouterr().err


def test_region_hints_name_the_variable_boto3_reads() -> None:
    import inspect

    from spot_training.ops import operations

    for text in (inspect.getsource(cli), inspect.getsource(operations.connect)):
        assert "AWS_DEFAULT_REGION" in text
        assert "/ AWS_REGION)" not in text and "set AWS_REGION" not in text and "AWS_REGION=us-east-1" not in text


@pytest.mark.integration  # imports aws_cdk: jsii starts Node.js (tests/tier_guard.py)
def test_preflight_without_credentials_exits_4_saying_so(monkeypatch: pytest.MonkeyPatch, tmp_path, capsys: pytest.CaptureFixture[str]) -> None:
    for name in list(os.environ):
        if name.startswith("AWS_"):
            monkeypatch.delenv(name)
    monkeypatch.setenv("AWS_SHARED_CREDENTIALS_FILE", str(tmp_path / "none"))
    monkeypatch.setenv("AWS_CONFIG_FILE", str(tmp_path / "none"))
    monkeypatch.setenv("AWS_EC2_METADATA_DISABLED", "true")
    # Port 9 on loopback: nothing answers, and nothing is asked (boto3 finds no credentials before a request).
    code = cli.main(["preflight", "--region", "us-east-1", "--endpoint-url", "http://127.0.0.1:9"])
    err = capsys.readouterr().err
    assert code == 4, err
    assert "no AWS credentials" in err and "endpoint" not in err


@pytest.mark.slow
def test_a_command_that_imports_aws_cdk_prints_no_raw_bytes() -> None:
    """``spot-train preflight`` reads the settings (aws_cdk, jsii) in a clean environment."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("JSII_")}
    done = subprocess.run([sys.executable, "-m", "spot_training.cli", "preflight", "-c", "target_capacity=-1", "--region", "us-east-1"],
                          env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 2, done.stderr
    assert "context key 'target_capacity'" in done.stderr
    assert "b'" not in done.stdout + done.stderr and "!!!!" not in done.stdout + done.stderr


@pytest.mark.parametrize("command", [["local", "up"], ["local", "drill"]])
def test_local_mode_without_the_local_extra_says_to_install_it(command: list[str], monkeypatch: pytest.MonkeyPatch,
                                                               capsys: pytest.CaptureFixture[str], tmp_path) -> None:
    """A pip install of the library alone has no moto: a clear message and exit 2, not a traceback."""
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "moto" else real(name, *a))
    assert cli.main([*command, "--work-dir", str(tmp_path / "w")]) == 2
    err = capsys.readouterr().err
    assert "moto (the moto server that emulates AWS)" in err and "pip install 'spot-training[local,tensorflow]'" in err
    assert not (tmp_path / "w").exists()  # nothing started


def test_extras_keep_frameworks_out_of_a_cdk_only_install() -> None:
    import tomllib
    from pathlib import Path

    project = tomllib.loads((Path(__file__).resolve().parents[1] / "pyproject.toml").read_text())["project"]
    frameworks = ("tensorflow", "torch", "mxnet", "keras", "moto")
    assert not [d for d in project["dependencies"] if d.startswith(frameworks)]
    extras = project["optional-dependencies"]
    assert {"pytorch", "tensorflow", "mxnet", "local"} <= set(extras)
    assert any(d.startswith("torch") for d in extras["pytorch"]) and any(d.startswith("mxnet") for d in extras["mxnet"])
    assert any(d.startswith("tensorflow") for d in extras["tensorflow"]) and any(d.startswith("moto[server") for d in extras["local"])
    for name in cli.LOCAL_MODE_MODULES:  # everything local mode checks for comes with the extra
        assert any(d.lower().startswith(name) or (name == "flask" and d.startswith("moto[server")) for d in extras["local"]), name


@pytest.mark.parametrize("price", ["nan", "inf", "-1", "0", "cheap"])
def test_on_demand_price_that_is_no_positive_finite_number_is_a_usage_error(price: str, capsys: pytest.CaptureFixture[str]) -> None:
    assert cli.main(["cost", "--stack", "S", "--on-demand-price", f"g5.xlarge={price}"]) == 2
    assert f"--on-demand-price: got 'g5.xlarge={price}'" in capsys.readouterr().err
