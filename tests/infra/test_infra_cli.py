"""The real `cdk synth` CLI (node_modules/.bin/cdk) on app.py, in a copy-free temporary output directory."""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest
from infra_helpers import cfn_lint_errors

REPO_ROOT = Path(__file__).resolve().parents[2]
CDK = REPO_ROOT / "node_modules" / ".bin" / "cdk"


def _cdk_synth(outdir: Path, *context: str) -> subprocess.CompletedProcess[str]:
    env = dict(os.environ)
    env["PATH"] = f"{REPO_ROOT / '.venv' / 'bin'}:{REPO_ROOT / 'node_modules' / '.bin'}:{env['PATH']}"
    env.update(
        CDK_DISABLE_CLI_TELEMETRY="true",
        JSII_SILENCE_WARNING_DEPRECATED_NODE_VERSION="1",
        JSII_SILENCE_WARNING_UNTESTED_NODE_VERSION="1",
    )
    # No AWS credentials or profile: synth must not need them.
    for name in ("AWS_PROFILE", "AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_SESSION_TOKEN", "AWS_ENDPOINT_URL"):
        env.pop(name, None)
    args = [str(CDK), "synth", "--no-notices", "--no-version-reporting", "--quiet", "--output", str(outdir)]
    for item in context:
        args += ["-c", item]
    return subprocess.run(args, cwd=REPO_ROOT, env=env, capture_output=True, text=True, timeout=300)


@pytest.fixture(scope="module")
def cli_synth(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """One real `cdk synth` of app.py (both stacks) shared by the tests of this module."""
    outdir = tmp_path_factory.mktemp("cdk-cli")
    result = _cdk_synth(outdir)
    assert result.returncode == 0, result.stderr[-3000:]
    return outdir


@pytest.mark.slow
def test_cli_synth_writes_the_must_show_template(cli_synth: Path) -> None:
    tmp_path = cli_synth
    template_file = tmp_path / "SpotTraining.template.json"
    template = json.loads(template_file.read_text())
    resources = template["Resources"].values()
    fleets = [r for r in resources if r["Type"] == "AWS::EC2::SpotFleet"]
    assert len(fleets) == 1 and fleets[0]["Properties"]["SpotFleetRequestConfigData"]["LaunchTemplateConfigs"]
    (lt,) = [r for r in resources if r["Type"] == "AWS::EC2::LaunchTemplate"]
    assert lt["Properties"]["LaunchTemplateData"]["MetadataOptions"]["HttpTokens"] == "required"
    (volume,) = [r for r in resources if r["Type"] == "AWS::EC2::Volume"]
    assert volume["Properties"]["Encrypted"] is True and volume["Properties"]["VolumeType"] == "gp3"
    principals = [json.dumps(r["Properties"]["AssumeRolePolicyDocument"]) for r in resources if r["Type"] == "AWS::IAM::Role"]
    assert sum("ec2.amazonaws.com" in p for p in principals) == 1
    assert sum("spotfleet.amazonaws.com" in p for p in principals) == 1
    assets = json.loads((tmp_path / "SpotTraining.assets.json").read_text())["files"]
    staged = [tmp_path / a["source"]["path"] for a in assets.values() if a["source"].get("packaging") == "zip"]
    assert any((p / "spot_training" / "agent" / "__init__.py").is_file() and (p / "spot_training" / "training" / "__init__.py").is_file() for p in staged)
    assert cfn_lint_errors(template_file) == []


@pytest.mark.slow
def test_cli_synth_writes_both_stacks_without_credentials(cli_synth: Path) -> None:
    """One `cdk synth` of app.py: SpotTraining and DistributedTraining, cdk-nag clean, cfn-lint clean."""
    tmp_path = cli_synth
    cluster_file = tmp_path / "DistributedTraining.template.json"
    cluster = json.loads(cluster_file.read_text())
    resources = list(cluster["Resources"].values())
    groups = [r["Properties"] for r in resources if r["Type"] == "AWS::AutoScaling::AutoScalingGroup"]
    assert sorted((g["MinSize"], g["MaxSize"]) for g in groups) == [("1", "1"), ("2", "2")]
    (fleet,) = [r for r in resources if r["Type"] == "AWS::EC2::SpotFleet"]
    assert fleet["Properties"]["SpotFleetRequestConfigData"]["TargetCapacity"] == 2
    templates = [r for r in resources if r["Type"] == "AWS::EC2::LaunchTemplate"]
    assert len(templates) == 3
    assert all(t["Properties"]["LaunchTemplateData"]["MetadataOptions"]["HttpTokens"] == "required" for t in templates)
    assert cfn_lint_errors(cluster_file) == []
    assert cfn_lint_errors(tmp_path / "SpotTraining.template.json") == []
    for name in ("SpotTraining", "DistributedTraining"):
        metadata = json.loads((tmp_path / f"{name}.metadata.json").read_text())
        errors = [e for entries in metadata.values() for e in entries if e["type"] == "aws:cdk:error"]
        assert errors == [], name


@pytest.mark.slow
@pytest.mark.parametrize("context, message, template", [
    pytest.param("cluster_workers=12",
                 "context key 'cluster_workers': got 12; allowed: from cluster_min_workers=1 to cluster_max_workers=8",
                 "DistributedTraining", id="cluster-workers-above-max"),
    pytest.param("volume_size_gib=0", "context key 'volume_size_gib': got '0'; allowed: an integer (GiB) from 1 to 16384",
                 "SpotTraining", id="volume-size-zero"),
])
def test_cli_synth_fails_on_a_bad_context_value(tmp_path: Path, context: str, message: str, template: str) -> None:
    result = _cdk_synth(tmp_path, context)
    assert result.returncode != 0
    assert message in result.stderr
    assert not (tmp_path / f"{template}.template.json").exists()


@pytest.mark.slow
def test_cli_synth_with_framework_mxnet_runs_the_gluon_example(tmp_path: Path) -> None:
    """`cdk synth -c framework=mxnet` over cdk.json: the node runs the Gluon example (a bug once:
    it kept the Keras command that cdk.json pinned)."""
    from aws_cdk import assertions
    from infra_helpers import launch_template_user_data

    from spot_training.infra.userdata import extract_config

    result = _cdk_synth(tmp_path, "framework=mxnet")
    assert result.returncode == 0, result.stderr[-3000:]
    template = assertions.Template.from_json(json.loads((tmp_path / "SpotTraining.template.json").read_text()))
    training = extract_config(launch_template_user_data(template))["training"]
    assert (training["framework"], training["command"]) == ("mxnet", ["{python}", "spot_training/training/examples/gluon_resnet.py"])


@pytest.mark.slow
def test_cli_synth_fails_on_an_unknown_framework(tmp_path: Path) -> None:
    result = _cdk_synth(tmp_path, "framework=jax")
    assert result.returncode != 0
    assert "context key 'framework': got 'jax'; allowed: one of tensorflow, mxnet, pytorch" in result.stderr
    assert not (tmp_path / "SpotTraining.template.json").exists()


@pytest.mark.slow
def test_docs_import_example_synthesizes(tmp_path: Path) -> None:
    """The "import them into your own CDK app" example of docs/infra.md runs as written."""
    import re
    import sys

    text = (REPO_ROOT / "docs" / "infra.md").read_text()
    blocks = re.findall(r"```python\n(.*?)```", text, flags=re.S)
    example = next(b for b in blocks if "app.synth()" in b)
    script = tmp_path / "example_app.py"
    script.write_text(example)
    env = dict(os.environ, JSII_SILENCE_WARNING_DEPRECATED_NODE_VERSION="1", PYTHONPATH=str(REPO_ROOT),
               CDK_OUTDIR=str(tmp_path / "cdk.out"))
    result = subprocess.run([sys.executable, str(script)], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    for name in ("SpotTraining.template.json", "MyTraining.template.json"):
        template = json.loads((tmp_path / "cdk.out" / name).read_text())
        assert any(r["Type"] == "AWS::EC2::SpotFleet" for r in template["Resources"].values())
        assert cfn_lint_errors(tmp_path / "cdk.out" / name) == []
    # cdk-nag findings are error annotations in <stack>.metadata.json (the CLI fails on them).
    metadata_files = sorted((tmp_path / "cdk.out").glob("*.metadata.json"))
    assert len(metadata_files) == 2
    errors = [(path, e["data"]) for f in metadata_files for path, entries in json.loads(f.read_text()).items()
              for e in entries if e["type"] == "aws:cdk:error"]
    assert errors == []


def _node_configs(template_file: Path) -> list[dict]:
    """Every node config in the launch templates' user data of a synthesized template."""
    from aws_cdk import assertions
    from infra_helpers import render_intrinsics

    from spot_training.infra.userdata import extract_config

    template = assertions.Template.from_json(json.loads(template_file.read_text()))
    found = template.find_resources("AWS::EC2::LaunchTemplate")
    return [extract_config(render_intrinsics(lt["Properties"]["LaunchTemplateData"]["UserData"]["Fn::Base64"]))
            for lt in found.values()]


@pytest.mark.slow
def test_cli_synth_carries_the_checkpoint_cadence_and_poll_interval_to_every_node(tmp_path: Path) -> None:
    """`-c checkpoint_every_steps=7` reaches the node config of the single node and of
    every cluster role; `-c notice_poll_interval_s=2` reaches the cluster nodes too (item 3). The agent
    accepts each config (region as a deploy resolves it)."""
    from spot_training.agent.config import parse_config

    result = _cdk_synth(tmp_path, "checkpoint_every_steps=7", "checkpoint_every_seconds=600", "notice_poll_interval_s=2")
    assert result.returncode == 0, result.stderr[-3000:]
    single = _node_configs(tmp_path / "SpotTraining.template.json")
    cluster = _node_configs(tmp_path / "DistributedTraining.template.json")
    assert len(single) == 1 and len(cluster) == 3
    for config in single + cluster:
        assert config["training"]["checkpoint_every_steps"] == 7
        assert config["training"]["checkpoint_every_seconds"] == 600
        assert config["notice_poll_interval_s"] == 2
        # Tokens as a deploy resolves them: the region, and the EFS ids of the cluster's file system.
        efs = config["efs"] and {**config["efs"], "file_system_id": "fs-0123abcd", "access_point_id": "fsap-0123abcd"}
        agent = parse_config({**config, "region": "us-east-1", "efs": efs})
        assert (agent.training.checkpoint_every_steps, agent.notice_poll_interval_s) == (7, 2.0)


@pytest.mark.slow
@pytest.mark.parametrize("item, message", [
    ("checkpoint_every_steps=0", "context key 'checkpoint_every_steps': got '0'; allowed: an integer from 1 to 1e+09 (steps)"),
    ("checkpoint_every_seconds=often",
     "context key 'checkpoint_every_seconds': got 'often'; allowed: a number of seconds from 1 to 86400"),
])
def test_cli_synth_fails_on_a_bad_checkpoint_cadence(tmp_path: Path, item: str, message: str) -> None:
    result = _cdk_synth(tmp_path, item)
    assert result.returncode != 0
    assert message in result.stderr
    assert not (tmp_path / "SpotTraining.template.json").exists()
