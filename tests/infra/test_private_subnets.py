"""``-c private_subnets=true``: nodes without public IPs in isolated subnets, AWS through VPC endpoints
(docs/infra.md, "Private subnets")."""

from __future__ import annotations

import json

import pytest
from infra_helpers import Synth, cfn_lint_errors, synth_cluster, synth_stack

from spot_training.infra.cluster_config import ClusterSettings
from spot_training.infra.config import StackSettings

#: The interface endpoints' service name suffixes (com.amazonaws.<region>.<suffix>).
INTERFACE_SERVICES = {"ec2", "ssm", "ssmmessages", "ec2messages", "logs", "monitoring", "elasticfilesystem"}


@pytest.fixture(scope="module")
def private_synth(tmp_path_factory: pytest.TempPathFactory) -> Synth:
    return synth_stack(tmp_path_factory.mktemp("cdk-private"),
                       StackSettings.from_mapping({"private_subnets": "true", "efs": "true"}))


@pytest.fixture(scope="module")
def private_cluster_synth(tmp_path_factory: pytest.TempPathFactory) -> Synth:
    return synth_cluster(tmp_path_factory.mktemp("cdk-private-cluster"),
                         ClusterSettings.from_mapping({"private_subnets": "true"}))


def _service_suffix(endpoint: dict) -> str:
    # ServiceName is "com.amazonaws.<region>.<service>" as an Fn::Join with the region token.
    name = endpoint["Properties"]["ServiceName"]
    text = name if isinstance(name, str) else "".join(p if isinstance(p, str) else "<region>" for p in name["Fn::Join"][1])
    return text.rsplit(".", 1)[1]


@pytest.mark.parametrize("which", ["private_synth", "private_cluster_synth"])
def test_private_subnets_have_no_public_ip_no_internet_route_and_every_endpoint(which: str, request: pytest.FixtureRequest) -> None:
    synth: Synth = request.getfixturevalue(which)
    subnets = synth.resources("AWS::EC2::Subnet")
    assert subnets and all(not s["Properties"].get("MapPublicIpOnLaunch", False) for s in subnets.values())
    synth.template.resource_count_is("AWS::EC2::InternetGateway", 0)
    synth.template.resource_count_is("AWS::EC2::NatGateway", 0)
    for route in synth.resources("AWS::EC2::Route").values():
        assert "GatewayId" not in route["Properties"] and "NatGatewayId" not in route["Properties"], route
    endpoints = synth.resources("AWS::EC2::VPCEndpoint").values()
    gateway = [_service_suffix(e) for e in endpoints if e["Properties"].get("VpcEndpointType", "Gateway") == "Gateway"]
    interface = {_service_suffix(e): e for e in endpoints if e["Properties"].get("VpcEndpointType") == "Interface"}
    assert gateway == ["s3"]
    assert set(interface) == INTERFACE_SERVICES
    for endpoint in interface.values():
        assert endpoint["Properties"]["PrivateDnsEnabled"] is True
        assert len(endpoint["Properties"]["SubnetIds"]) == len(subnets)
    # each endpoint's security group: HTTPS from the VPC's CIDR only
    for group in synth.resources("AWS::EC2::SecurityGroup").values():
        for rule in group["Properties"].get("SecurityGroupIngress", []):
            assert rule.get("CidrIp") != "0.0.0.0/0", rule
    assert synth.nag_errors == []
    assert cfn_lint_errors(synth.template_file) == []


def test_nodes_and_mount_targets_use_the_private_subnets(private_synth: Synth) -> None:
    subnet_refs = {json.dumps({"Ref": k}) for k in private_synth.resources("AWS::EC2::Subnet")}
    (fleet,) = private_synth.resources("AWS::EC2::SpotFleet").values()
    overrides = [o for c in fleet["Properties"]["SpotFleetRequestConfigData"]["LaunchTemplateConfigs"] for o in c["Overrides"]]
    assert {json.dumps(o["SubnetId"]) for o in overrides} == subnet_refs
    targets = private_synth.resources("AWS::EFS::MountTarget").values()
    assert {json.dumps(t["Properties"]["SubnetId"]) for t in targets} == subnet_refs


def test_default_keeps_public_subnets_without_endpoints(default_synth: Synth) -> None:
    default_synth.template.resource_count_is("AWS::EC2::VPCEndpoint", 0)
    assert all(s["Properties"]["MapPublicIpOnLaunch"] for s in default_synth.resources("AWS::EC2::Subnet").values())


def test_private_subnets_with_an_existing_vpc_is_refused() -> None:
    with pytest.raises(ValueError, match=r"private_subnets.*vpc_id"):
        StackSettings.from_mapping({"private_subnets": "true", "vpc_id": "vpc-0123456789abcdef0",
                                    "account": "123456789012", "region": "eu-west-1"})
    with pytest.raises(ValueError, match=r"private_subnets"):
        StackSettings.from_mapping({"private_subnets": "maybe"})
