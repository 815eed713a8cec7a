"""The DistributedTraining stack with ``cluster_framework=pytorch``: TorchElastic workers on the
spot fleet, the c10d rendezvous on the on-demand coordinator, no parameter servers, only the rendezvous and
collective ports open between members; cfn-lint and cdk-nag gates as the other frameworks."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from infra_helpers import Synth, cfn_lint_errors, launch_templates_by_role, synth_cluster
from test_infra_cluster import PSEUDO, _ingress_rules, _render

from spot_training.infra.cluster import TORCH_COLLECTIVE_PORTS, Framework
from spot_training.infra.cluster_config import ClusterSettings
from spot_training.infra.userdata import extract_config


@pytest.fixture(scope="module")
def torch_synth(tmp_path_factory: pytest.TempPathFactory) -> Synth:
    settings = ClusterSettings.from_mapping({
        "vpc_flow_logs": "false", "cluster_stack_name": "TorchCluster", "cluster_framework": "pytorch",
        "cluster_workers": "2", "cluster_min_workers": "1", "cluster_max_workers": "4",
        "cluster_scheduler_port": "29400", "cluster_torch_max_restarts": "7", "cluster_torch_shutdown_timeout_s": "60",
    })
    return synth_cluster(tmp_path_factory.mktemp("cdk-cluster-torch"), settings)


_templates = launch_templates_by_role


def _config(lt: dict[str, Any]):
    from spot_training.agent.config import parse_config

    return parse_config(extract_config(_render(lt["Properties"]["LaunchTemplateData"]["UserData"]["Fn::Base64"], PSEUDO)))


def test_gates(torch_synth: Synth) -> None:
    assert cfn_lint_errors(torch_synth.template_file) == []
    assert torch_synth.nag_errors == []


def test_no_parameter_servers_the_coordinator_on_demand_and_the_workers_on_spot(torch_synth: Synth) -> None:
    assert sorted(_templates(torch_synth)) == ["scheduler", "worker"]
    (group,) = torch_synth.resources("AWS::AutoScaling::AutoScalingGroup").values()
    assert (group["Properties"]["MinSize"], group["Properties"]["MaxSize"]) == ("1", "1")
    assert "InstanceMarketOptions" not in _templates(torch_synth)["scheduler"]["Properties"]["LaunchTemplateData"]
    (fleet,) = torch_synth.resources("AWS::EC2::SpotFleet").values()
    assert fleet["Properties"]["SpotFleetRequestConfigData"]["TargetCapacity"] == 2
    outputs = torch_synth.data["Outputs"]
    assert "ServerGroupName" not in outputs and "SchedulerGroupName" in outputs


def test_members_reach_each_other_only_on_the_rendezvous_and_collective_ports(torch_synth: Synth) -> None:
    groups = torch_synth.resources("AWS::EC2::SecurityGroup")
    (member_sg,) = [k for k in groups if k.startswith("ClusterSecurityGroup")]
    member_ref = {"Fn::GetAtt": [member_sg, "GroupId"]}
    rules = _ingress_rules(torch_synth)
    for rule in rules:
        assert "CidrIp" not in rule and "CidrIpv6" not in rule and "SourcePrefixListId" not in rule, rule
        assert rule["SourceSecurityGroupId"] == member_ref and rule["IpProtocol"] == "tcp", rule
    member = sorted((r["FromPort"], r["ToPort"]) for r in rules if r["GroupId"] == member_ref)
    assert member == [(29400, 29400), TORCH_COLLECTIVE_PORTS]
    assert len(rules) == len(member) + 1  # + NFS to the mount targets


def test_node_configs_carry_torchrun_settings_the_agents_accept(torch_synth: Synth) -> None:
    from spot_training.agent.cluster_state import settings_from_config

    for role, lt in _templates(torch_synth).items():
        config = _config(lt)
        assert (config.node_role, config.training.framework, config.stack_name) == (role, "pytorch", "TorchCluster")
        cluster = settings_from_config(config.extensions["cluster"], framework="pytorch")
        assert (cluster.num_servers, cluster.min_workers, cluster.max_workers) == (0, 1, 4)
        assert (cluster.scheduler_port, cluster.torch_max_restarts, cluster.torch_shutdown_timeout_s,
                cluster.torch_nproc_per_node) == (29400, 7, 60.0, 1)
        assert tuple(config.training.command[-2:]) == ("-m", "spot_training.training.distributed.torch_ddp")
        # The coordinator's interpreter needs torch for the c10d store; workers get torch too.
        requirements = config.training.venv.requirements
        assert any(r.startswith("torch") for r in requirements), requirements


def test_defaults_in_one_place_and_bad_values_fail_synth() -> None:
    s = ClusterSettings.from_mapping({"cluster_framework": "pytorch"})
    assert (s.framework, s.torch_max_restarts, s.torch_shutdown_timeout_s, s.torch_nproc_per_node) == (
        Framework.PYTORCH, 100, 90, 1)
    for key, value, allowed in (("cluster_torch_shutdown_timeout_s", "200", "5 to 115"),
                                ("cluster_torch_max_restarts", "-1", "0 to 10000"),
                                ("cluster_torch_nproc_per_node", "0", "1 to 64")):
        with pytest.raises(ValueError, match=rf"'{key}': got .*{value}.*"):
            ClusterSettings.from_mapping({"cluster_framework": "pytorch", key: value})
    assert Path(__file__).exists()
