"""The library as a company CDK app uses it: ``tests/consumer/app.py`` runs in its own process from its
own directory, beside its own package named ``infra``, with its own VPC (10.99.0.0/16) and bucket, two
jobs in one stack and one in another, ``bucket.grant_read(job)`` and
``fs.connections.allow_default_port_from(job)``, and its own ``AwsSolutionsChecks``."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

HERE = Path(__file__).resolve().parent


@pytest.fixture(scope="module")
def consumer(tmp_path_factory: pytest.TempPathFactory) -> dict:
    outdir = tmp_path_factory.mktemp("consumer-cdk-out")
    env = {**os.environ, "JSII_SILENCE_WARNING_UNTESTED_NODE_VERSION": "1", "JSII_SILENCE_WARNING_DEPRECATED_NODE_VERSION": "1"}
    env.pop("PYTHONPATH", None)  # only what a consumer has: its directory and the installed library
    done = subprocess.run([sys.executable, "app.py", str(outdir)], cwd=HERE, env=env, capture_output=True, text=True,
                          timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads((outdir / "summary.json").read_text())


@pytest.mark.slow
def test_consumer_app_synthesizes_with_distinct_jobs_and_nothing_from_the_library_in_its_nag_run(consumer: dict) -> None:
    assert consumer["job_ids"] == ["vision-resnet", "vision-vit", "LanguageTraining-Bert"]
    library = [e for e in consumer["nag_errors"] if any(e["path"].startswith(f"/{p}/") for p in consumer["job_paths"])]
    assert library == []
    # What remains is the consumer's own: its bucket without access logs (its choice, not the library's).
    assert [e["path"] for e in consumer["nag_errors"]] == ["/TeamShared/Datasets/Resource"]
    templates = {name: json.loads(Path(path).read_text()) for name, path in consumer["templates"].items()}
    vpcs = [r for t in templates.values() for r in t["Resources"].values() if r["Type"] == "AWS::EC2::VPC"]
    assert [v["Properties"]["CidrBlock"] for v in vpcs] == ["10.99.0.0/16"]
    volumes = [r for t in templates.values() for r in t["Resources"].values() if r["Type"] == "AWS::EC2::Volume"]
    assert sorted(next(tag["Value"] for tag in v["Properties"]["Tags"] if tag["Key"] == "spot-training:stack")
                  for v in volumes) == sorted(consumer["job_ids"])
    ingress = [r for r in templates["VisionTraining"]["Resources"].values()
               if r["Type"] == "AWS::EC2::SecurityGroupIngress" and r["Properties"].get("FromPort") == 2049]
    assert len(ingress) == 2


@pytest.mark.slow
def test_consumer_templates_are_cfn_lint_clean(consumer: dict) -> None:
    from cfnlint.api import lint_file

    for name, path in consumer["templates"].items():
        errors = [f"{m.rule.id} {m.message}" for m in lint_file(Path(path)) if m.rule.id.startswith("E")]
        assert errors == [], name
