"""Each deployment of a stack name has an identity of its own in the tags (issue 15 item 1): the data
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
