"""The library's cdk-nag acknowledgements travel with its constructs: a consumer that runs its own
``AwsSolutionsChecks`` (not our ``apply_nag``) over an app holding them sees no error from them,
and each suppression it reads carries a reason."""

from __future__ import annotations

import aws_cdk as cdk
import pytest
import cdk_nag
from aws_cdk import assertions

from spot_training.infra.cluster_config import ClusterSettings
from spot_training.infra.cluster_stack import DistributedTrainingStack
from spot_training.infra.config import StackSettings
from spot_training.infra.stack import SpotTrainingStack


@pytest.mark.slow
def test_a_consumers_own_aws_solutions_checks_report_nothing_from_the_library(tmp_path) -> None:
    app = cdk.App(outdir=str(tmp_path))
    single = SpotTrainingStack(app, settings=StackSettings.from_mapping({"efs": "true", "fis_drill": "true"}))
    cluster = DistributedTrainingStack(app, settings=ClusterSettings())
    cdk.Aspects.of(app).add(cdk_nag.AwsSolutionsChecks())  # the consumer's, nothing of ours
    app.synth()
    for stack in (single, cluster):
        errors = assertions.Annotations.from_stack(stack).find_error("*", assertions.Match.any_value())
        assert not errors, [f"{m.id}: {m.entry.data}" for m in errors]
        warnings = assertions.Annotations.from_stack(stack).find_warning("*", assertions.Match.string_like_regexp("AwsSolutions"))
        assert not warnings, [f"{m.id}: {m.entry.data}" for m in warnings]
    role_policies = [r for r in app.synth().get_stack_by_name(single.stack_name).template["Resources"].values()
                     if r["Type"] == "AWS::IAM::Policy"]
    reasons = [s["reason"] for r in role_policies for s in r.get("Metadata", {}).get("cdk_nag", {}).get("rules_to_suppress", [])]
    assert reasons and all(len(reason) > 40 for reason in reasons)
