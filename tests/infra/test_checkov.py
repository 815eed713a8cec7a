"""checkov over what ``cdk synth`` produces with cdk.json (feature flags included) and over every
template variant: each failed check is fixed or acknowledged on the construct's own resources
(``Metadata.checkov.skip`` with the reason, spot_training/infra/acknowledgements.py), so checkov
itself reports nothing unexplained, ours or a consumer's run alike; the gate fails on a new finding."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from infra_helpers import Synth, synth_app_as_cdk_does, synth_stack

from spot_training.infra.acknowledgements import CHECKOV
from spot_training.infra.checkov import Finding, Skipped, run_checkov, run_checkov_report, unacknowledged
from spot_training.infra.config import StackSettings


@pytest.fixture(scope="module")
def real_templates(tmp_path_factory: pytest.TempPathFactory) -> list[Path]:
    """SpotTraining, DistributedTraining and SpotSweep as ``cdk synth`` writes them with cdk.json's context."""
    files = synth_app_as_cdk_does(tmp_path_factory.mktemp("cdk-synth-real"))
    assert {f.name for f in files} == {"SpotTraining.template.json", "DistributedTraining.template.json", "SpotSweep.template.json"}
    return files


@pytest.fixture(scope="module")
def report(real_templates: list[Path], default_synth: Synth, efs_synth: Synth, pinned_synth: Synth, cluster_synth: Synth,
           cluster_tf_synth: Synth, tmp_path_factory: pytest.TempPathFactory) -> tuple[list[Finding], list[Skipped]]:
    """checkov's failed and skipped checks over the real synth output and SpotTraining (default, EFS,
    pinned with a KMS key and MXNet, private subnets with EFS and the FIS drill) and
    DistributedTraining (MXNet, TensorFlow), in one run."""
    private = synth_stack(tmp_path_factory.mktemp("cdk-checkov-private"),
                          StackSettings.from_mapping({"private_subnets": "true", "efs": "true", "fis_drill": "true"}))
    files = [*real_templates, *(s.template_file for s in (default_synth, efs_synth, pinned_synth, private, cluster_synth, cluster_tf_synth))]
    return run_checkov_report(files)


def test_checkov_finds_nothing_unacknowledged(report: tuple[list[Finding], list[Skipped]]) -> None:
    left = unacknowledged(report[0])
    assert not left, "checkov findings neither fixed nor acknowledged (spot_training/infra/acknowledgements.py):\n" + "\n".join(map(str, left))


def test_the_real_synth_output_carries_the_custom_resource_lambda_and_its_reasons(real_templates: list[Path],
                                                                                  report: tuple[list[Finding], list[Skipped]]) -> None:
    """cdk.json's @aws-cdk/aws-ec2:restrictDefaultSecurityGroup adds a Lambda function that tests
    synthesizing without the flags never saw; checkov skips its findings with our reasons."""
    data = json.loads(real_templates[-1].read_text())
    handlers = [k for k, r in data["Resources"].items()
                if r["Type"] == "AWS::Lambda::Function" and k.startswith("CustomVpcRestrictDefaultSGCustomResourceProvider")]
    assert handlers, "the real synth output has no VpcRestrictDefaultSG Lambda: are cdk.json's feature flags applied?"
    skipped = {(s.check_id, s.resource.split(".")[-1]) for s in report[1] if s.file.endswith(real_templates[-1].name) and s.comment}
    assert {("CKV_AWS_115", handlers[0]), ("CKV_AWS_116", handlers[0]), ("CKV_AWS_117", handlers[0])} <= skipped


def test_every_checkov_acknowledgement_still_matches_and_has_a_reason(report: tuple[list[Finding], list[Skipped]]) -> None:
    """Each acknowledgement is seen by checkov as a skip with its reason (none stale), and each reason says why."""
    seen = {(s.check_id, s.comment) for s in report[1]}
    for kind, acks in CHECKOV.items():
        for ack in acks:
            assert len(ack.reason) > 40, ack
            assert (ack.check_id, ack.reason) in seen, f"stale checkov acknowledgement of {kind}: {ack.check_id} {ack.resource_type} {ack.path}"


def test_checkov_gate_fails_on_a_new_finding(tmp_path: Path) -> None:
    """A role with an inline wildcard policy (CKV_AWS_111-style findings) is reported and not covered."""
    template = {
        "Resources": {
            "WideOpenRole": {
                "Type": "AWS::IAM::Role",
                "Properties": {
                    "AssumeRolePolicyDocument": {"Version": "2012-10-17", "Statement": [
                        {"Effect": "Allow", "Principal": {"Service": "ec2.amazonaws.com"}, "Action": "sts:AssumeRole"}]},
                    "Policies": [{"PolicyName": "all", "PolicyDocument": {"Version": "2012-10-17", "Statement": [
                        {"Effect": "Allow", "Action": "*", "Resource": "*"}]}}],
                },
            }
        }
    }
    path = tmp_path / "bad.template.json"
    path.write_text(json.dumps(template))
    left = unacknowledged(run_checkov([path]))
    assert any(f.resource == "AWS::IAM::Role.WideOpenRole" for f in left), left
