"""The consumer's own package named ``infra`` (as many CDK apps have): its network and naming rules.

It must not collide with the library, which lives in ``spot_training.infra``.
"""

from __future__ import annotations

import aws_cdk as cdk
from aws_cdk import aws_ec2 as ec2

#: The company's address plan for training VPCs.
TEAM_CIDR = "10.99.0.0/16"


def team_vpc(scope: cdk.Stack) -> ec2.Vpc:
    """The team's VPC: 10.99.0.0/16, public subnets in two AZs, no NAT gateway, flow logs on."""
    vpc = ec2.Vpc(scope, "TeamVpc", ip_addresses=ec2.IpAddresses.cidr(TEAM_CIDR), max_azs=2, nat_gateways=0,
                  subnet_configuration=[ec2.SubnetConfiguration(name="Public", subnet_type=ec2.SubnetType.PUBLIC)])
    vpc.add_flow_log("FlowLog")
    return vpc


def job_name(team: str, model: str) -> str:
    """The company's naming rule for training jobs: ``<team>-<model>``."""
    return f"{team}-{model}"
