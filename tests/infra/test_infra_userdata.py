"""infra.userdata.extract_config: pure Python, reads back exactly what the stack wrote."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from infra.userdata import CONFIG_BEGIN, CONFIG_END, agent_commands, config_block, extract_config, node_config

REPO_ROOT = Path(__file__).resolve().parents[2]


def _user_data(config: dict) -> str:
    lines = ["#!/bin/bash", "set -euo pipefail", *config_block(json.dumps(config, indent=2)),
             *agent_commands(archive_path="/tmp/x.zip", boto3_requirement="boto3>=1.34,<2")]
    return "\n".join(lines) + "\n"


def _config() -> dict:
    return node_config(region="eu-west-1", stack_name="S", volume_tags={"spot-training:stack": "S"}, framework="mxnet",
                       python="/usr/bin/python3", command=["{python}", "train.py"], efs=None, imds_endpoint="http://127.0.0.1:1")


def test_round_trip() -> None:
    config = _config()
    assert extract_config(_user_data(config)) == config


def test_round_trip_with_awkward_text() -> None:
    config = _config()
    config["training"]["command"] = ["{python}", "-c", "print('EOF'); print(\"# END spot-training config\")"]
    assert extract_config(_user_data(config)) == config


def test_fails_when_markers_are_missing() -> None:
    with pytest.raises(ValueError, match=r"exactly one '# BEGIN spot-training config' line .* found 0 BEGIN and 0 END"):
        extract_config("#!/bin/bash\necho hi\n")


def test_fails_when_block_is_repeated() -> None:
    text = _user_data(_config())
    with pytest.raises(ValueError, match=r"found 2 BEGIN and 2 END"):
        extract_config(text + text)


def test_fails_when_json_is_broken() -> None:
    text = _user_data(_config()).replace('"schema_version": 1', '"schema_version": ')
    with pytest.raises(ValueError, match=r"the config block is not valid JSON"):
        extract_config(text)


def test_fails_when_heredoc_is_not_closed() -> None:
    text = f"{CONFIG_BEGIN}\ncat > /x <<'TAG'\n{{}}\n{CONFIG_END}\n"
    with pytest.raises(ValueError, match=r"<<'TAG' is not closed"):
        extract_config(text)


def test_fails_when_not_text() -> None:
    with pytest.raises(ValueError, match=r"user_data_text must be str .* got bytes"):
        extract_config(b"abc")  # type: ignore[arg-type]


def test_user_data_is_valid_bash_and_writes_the_config(tmp_path: Path) -> None:
    """Run the config block of the user data with real bash, into a temporary root."""
    config = _config()
    block = "\n".join(config_block(json.dumps(config, indent=2))).replace("/etc/spot-training", str(tmp_path / "etc"))
    subprocess.run(["bash", "-euo", "pipefail", "-c", block], check=True)
    assert json.loads((tmp_path / "etc" / "config.json").read_text()) == config
    subprocess.run(["bash", "-n", "-c", _user_data(config)], check=True)


def test_importing_extract_config_does_not_load_the_cdk() -> None:
    code = "import sys, infra.userdata; sys.exit(1 if 'aws_cdk' in sys.modules or 'jsii' in sys.modules else 0)"
    assert subprocess.run([sys.executable, "-c", code], cwd=REPO_ROOT).returncode == 0


def test_boto3_requirement_matches_requirements_agent() -> None:
    from infra.stack import BOTO3_REQUIREMENT

    lines = [ln.split("#")[0].strip() for ln in (REPO_ROOT / "requirements-agent.txt").read_text().splitlines()]
    assert BOTO3_REQUIREMENT in lines
