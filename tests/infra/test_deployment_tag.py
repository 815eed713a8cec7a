"""Each deployment of a stack name has an identity of its own in the tags: the data
volume, the nodes' volume filter and the cleanup custom resource all name it."""

from __future__ import annotations

from infra_helpers import Synth, launch_template_user_data

from spot_training.infra.tags import DEPLOYMENT_TAG_KEY
from spot_training.infra.userdata import extract_config

#: The stack id's UUID part, as the template spells it.
STACK_UUID = {"Fn::Select": [2, {"Fn::Split": ["/", {"Ref": "AWS::StackId"}]}]}


def test_volume_config_and_cleanup_carry_this_deployments_tag(default_synth: Synth) -> None:
    (volume,) = default_synth.resources("AWS::EC2::Volume").values()
    tags = {t["Key"]: t["Value"] for t in volume["Properties"]["Tags"]}
    assert tags[DEPLOYMENT_TAG_KEY] == STACK_UUID
    (cleanup,) = default_synth.resources("Custom::SpotTrainingDataCleanup").values()
    assert cleanup["Properties"]["DeploymentTagValue"] == STACK_UUID
    # The node finds its volume by every tag in volume.tags: rendered, the deployment is the stack id's UUID.
    config = extract_config(launch_template_user_data(default_synth.template))
    assert config["volume"]["tags"] == {"spot-training:stack": "SpotTraining", "spot-training:purpose": "data-volume",
                                        DEPLOYMENT_TAG_KEY: "1f2e3d4c-0000-4000-8000-00000000abcd"}


def test_adopting_a_retained_volume_creates_none_and_tells_the_agent(tmp_path) -> None:
    import pytest
    from infra_helpers import cfn_lint_errors, synth_stack

    from spot_training.infra.config import StackSettings

    synth = synth_stack(tmp_path, StackSettings.from_mapping({"adopt_volume_id": "vol-0123456789abcdef0"}))
    synth.template.resource_count_is("AWS::EC2::Volume", 0)
    config = extract_config(launch_template_user_data(synth.template))
    assert config["volume"]["adopt_volume_id"] == "vol-0123456789abcdef0"
    assert set(config["volume"]["tags"]) == {"spot-training:stack", "spot-training:purpose", DEPLOYMENT_TAG_KEY}
    assert synth.data["Outputs"]["DataVolumeId"]["Value"] == "vol-0123456789abcdef0"
    assert synth.nag_errors == [] and cfn_lint_errors(synth.template_file) == []
    with pytest.raises(ValueError, match="adopt_volume_id"):
        StackSettings.from_mapping({"adopt_volume_id": "snap-0123456789abcdef0"})


def _node_statements(synth: Synth) -> dict[str, dict]:
    import json

    roles = [k for k, v in synth.resources("AWS::IAM::Role").items()
             if "ec2.amazonaws.com" in json.dumps(v["Properties"]["AssumeRolePolicyDocument"])]
    out = {}
    for policy in synth.resources("AWS::IAM::Policy").values():
        if any({"Ref": r} in policy["Properties"]["Roles"] for r in roles):
            out.update({s["Sid"]: s for s in policy["Properties"]["PolicyDocument"]["Statement"] if "Sid" in s})
    return out


def _resources(statement: dict) -> list:
    return statement["Resource"] if isinstance(statement["Resource"], list) else [statement["Resource"]]


def test_every_volume_and_snapshot_action_requires_this_deployment(default_synth: Synth) -> None:
    """A node's credentials (readable by anything on the instance through IMDS) cannot delete, attach,
    copy or retag data an earlier deployment of the same stack name retained."""
    import json

    statements = _node_statements(default_synth)
    touched = [s for s in statements.values() if s["Sid"] != "Describe"
               and any("volume/" in json.dumps(r) or "snapshot/" in json.dumps(r) for r in _resources(s))]
    assert {s["Sid"] for s in touched} >= {"CreateTaggedVolume", "CreateVolumeFromOwnSnapshot", "CreateTaggedSnapshot",
                                           "SnapshotOwnVolume", "TagOnCreate", "RetagOwnResources",
                                           "UntagOwnBookkeeping", "AttachOwnVolumes", "DeleteOwnVolumesAndSnapshots"}
    for statement in touched:
        equals = statement["Condition"]["StringEquals"]
        keys = {k.split("/", 1)[1] for k in equals if k.startswith(("aws:ResourceTag/", "aws:RequestTag/"))}
        assert keys == {"spot-training:stack", DEPLOYMENT_TAG_KEY}, statement["Sid"]
        assert all(v == STACK_UUID for k, v in equals.items() if k.endswith(DEPLOYMENT_TAG_KEY)), statement["Sid"]
    # No request may set or change the stack or deployment tag of an existing volume or snapshot.
    for sid in ("RetagOwnResources", "UntagOwnBookkeeping"):
        assert set(statements[sid]["Condition"]["ForAllValues:StringNotEquals"]["aws:TagKeys"]) == {
            "spot-training:stack", DEPLOYMENT_TAG_KEY}
    assert "AdoptNamedVolume" not in statements


def test_adoption_may_retag_only_the_named_volume(tmp_path) -> None:
    from infra_helpers import synth_stack

    from spot_training.infra.config import StackSettings

    synth = synth_stack(tmp_path, StackSettings.from_mapping({"adopt_volume_id": "vol-0123456789abcdef0"}))
    adopt = _node_statements(synth)["AdoptNamedVolume"]
    assert adopt["Action"] == "ec2:CreateTags"
    assert "volume/vol-0123456789abcdef0" in str(_resources(adopt))
    assert adopt["Condition"]["ForAllValues:StringEquals"] == {"aws:TagKeys": [DEPLOYMENT_TAG_KEY]}
    assert adopt["Condition"]["StringEquals"][f"aws:RequestTag/{DEPLOYMENT_TAG_KEY}"] == STACK_UUID
