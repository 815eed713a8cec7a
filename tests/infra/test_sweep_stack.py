"""The SpotSweep stack synthesized: retry rules, IMDSv2 hop limit, EFS, IAM scope, cdk-nag, cfn-lint, checkov."""

from __future__ import annotations

import json
from pathlib import Path

import aws_cdk as cdk
import pytest
from infra_helpers import Synth, _synth, as_list, assert_docs_list_context_keys, cfn_lint_errors

from spot_training import contract
from spot_training.infra.sweep import SpotSweepStack, SweepSettings


def synth_sweep(outdir: Path, settings: SweepSettings | None = None) -> Synth:
    app = cdk.App(outdir=str(outdir))
    return _synth(app, SpotSweepStack(app, settings=settings or SweepSettings()), outdir)


@pytest.fixture(scope="module")
def sweep(tmp_path_factory: pytest.TempPathFactory) -> Synth:
    return synth_sweep(tmp_path_factory.mktemp("cdk-sweep"))


@pytest.fixture(scope="module")
def sweep_on_demand(tmp_path_factory: pytest.TempPathFactory) -> Synth:
    return synth_sweep(tmp_path_factory.mktemp("cdk-sweep-od"), SweepSettings.from_mapping(
        {"sweep_on_demand_fallback": "true", "sweep_retry_attempts": "5", "sweep_gpus": "0"}))


def test_retry_rules_retry_reclaims_and_exit_on_anything_else(sweep: Synth) -> None:
    (jd,) = sweep.resources("AWS::Batch::JobDefinition").values()
    retry = jd["Properties"]["RetryStrategy"]
    assert retry["Attempts"] == 3
    assert retry["EvaluateOnExit"] == [
        {"Action": "RETRY", "OnStatusReason": "Host EC2*"},
        {"Action": "RETRY", "OnExitCode": str(contract.EXIT_SWEEP_RECLAIM_NOT_TAKEN)},
        {"Action": "EXIT", "OnReason": "*"},
    ]
    container = jd["Properties"]["ContainerProperties"]
    assert container["MountPoints"] == [{"ContainerPath": contract.SWEEP_MOUNT_POINT, "SourceVolume": "storage"}]
    efs = container["Volumes"][0]["EfsVolumeConfiguration"]
    assert efs["TransitEncryption"] == "ENABLED" and efs["AuthorizationConfig"]["Iam"] == "ENABLED"
    assert container["Command"][:4] == ["python", "-m", "spot_training.agent.sweep_child", "--"]


def test_spot_environment_first_on_demand_behind_it(sweep: Synth, sweep_on_demand: Synth) -> None:
    (ce,) = sweep.resources("AWS::Batch::ComputeEnvironment").values()
    assert ce["Properties"]["ComputeResources"]["Type"] == "SPOT"
    assert ce["Properties"]["ComputeResources"]["AllocationStrategy"] == "SPOT_PRICE_CAPACITY_OPTIMIZED"
    envs = sweep_on_demand.resources("AWS::Batch::ComputeEnvironment")
    types = {k: v["Properties"]["ComputeResources"]["Type"] for k, v in envs.items()}
    (queue,) = sweep_on_demand.resources("AWS::Batch::JobQueue").values()
    order = sorted(queue["Properties"]["ComputeEnvironmentOrder"], key=lambda o: o["Order"])
    assert [types[o["ComputeEnvironment"]["Fn::GetAtt"][0]] for o in order] == ["SPOT", "EC2"]
    assert queue["Properties"]["JobStateTimeLimitActions"][0]["Reason"] == "CAPACITY:INSUFFICIENT_INSTANCE_CAPACITY"


def test_hosts_require_imdsv2_with_hop_limit_2(sweep: Synth) -> None:
    (lt,) = sweep.resources("AWS::EC2::LaunchTemplate").values()
    options = lt["Properties"]["LaunchTemplateData"]["MetadataOptions"]
    assert options["HttpTokens"] == "required" and options["HttpPutResponseHopLimit"] == 2


def test_one_efs_access_point(sweep: Synth) -> None:
    assert len(sweep.resources("AWS::EFS::FileSystem")) == 1
    assert len(sweep.resources("AWS::EFS::AccessPoint")) == 1


def test_no_mutating_action_on_every_resource(sweep: Synth) -> None:
    """Resource "*" only on ecr:GetAuthorizationToken (no resource-level permissions), never on a
    mutating action without a tag condition."""
    for policy in sweep.resources("AWS::IAM::Policy").values():
        for st in policy["Properties"]["PolicyDocument"]["Statement"]:
            if "*" in as_list(st["Resource"]):
                assert as_list(st["Action"]) == ["ecr:GetAuthorizationToken"] or "Condition" in st, st


def test_nag_clean_and_cfn_lint_clean(sweep: Synth, sweep_on_demand: Synth) -> None:
    for synth in (sweep, sweep_on_demand):
        assert synth.nag_errors == []
        assert cfn_lint_errors(synth.template_file) == []


@pytest.mark.slow
def test_checkov_findings_acknowledged(sweep: Synth, sweep_on_demand: Synth) -> None:
    """Nothing fails, and each of the sweep's acknowledgements is a skip checkov saw with its reason."""
    from spot_training.infra.acknowledgements import CHECKOV
    from spot_training.infra.checkov import run_checkov_report, unacknowledged

    findings, skipped = run_checkov_report([sweep.template_file, sweep_on_demand.template_file])
    assert unacknowledged(findings) == []
    seen = {(s.check_id, s.comment) for s in skipped}
    for ack in CHECKOV["ParallelExperiments"]:
        assert (ack.check_id, ack.reason) in seen, f"stale acknowledgement {ack.check_id} {ack.path}"


@pytest.mark.parametrize("key, value", [("sweep_retry_attempts", "11"), ("sweep_gpus", "-1"), ("sweep_on_demand_fallback", "maybe"),
                                        ("sweep_instance_types", "not a type"), ("sweep_max_vcpus", "2"), ("sweep_image", "bad image!"),
                                        ("sweep_stack_name", "9lives"), ("sweep_stack_name", "a_b")])
def test_bad_context_value_names_key(key: str, value: str) -> None:
    with pytest.raises(ValueError, match=key):
        SweepSettings.from_mapping({key: value})


def test_template_is_json_serializable(sweep: Synth) -> None:
    assert json.loads(sweep.template_file.read_text())["Resources"]


def test_docs_list_every_sweep_context_key_with_its_default() -> None:
    from spot_training.infra.sweep import SWEEP_CONTEXT_KEYS

    assert_docs_list_context_keys(SWEEP_CONTEXT_KEYS, "sweeps.md")
    assert SweepSettings.from_mapping({k.name: k.default for k in SWEEP_CONTEXT_KEYS}) == SweepSettings()
