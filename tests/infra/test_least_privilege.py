"""Least privilege of the node roles: every EC2 action granted is one the node code
calls, the bootstrap asset is readable as one object only, Session Manager without the SSM managed
policy, and a cluster worker terminates only itself."""

from __future__ import annotations

import ast
import json
import re
from pathlib import Path
from typing import Any

import boto3
from infra_helpers import Synth

from spot_training.infra.roles import SESSION_MANAGER_ACTIONS
from spot_training.infra.userdata import boot_failed_script

ROOT = Path(__file__).resolve().parents[2]


def _node_roles(synth: Synth) -> list[str]:
    return [k for k, v in synth.resources("AWS::IAM::Role").items()
            if "ec2.amazonaws.com" in json.dumps(v["Properties"]["AssumeRolePolicyDocument"])]


def _statements(synth: Synth, role: str) -> list[dict[str, Any]]:
    """Every statement of the inline policies attached to ``role`` (logical id)."""
    out: list[dict[str, Any]] = []
    for policy in synth.resources("AWS::IAM::Policy").values():
        if {"Ref": role} in policy["Properties"]["Roles"]:
            out += policy["Properties"]["PolicyDocument"]["Statement"]
    return out


def _actions(statement: dict[str, Any]) -> list[str]:
    action = statement["Action"]
    return [action] if isinstance(action, str) else list(action)


def _operation_names(service: str) -> dict[str, str]:
    """boto3 method name -> API operation name (``describe_volumes`` -> ``DescribeVolumes``)."""
    client = boto3.client(service, region_name="us-east-1", aws_access_key_id="x", aws_secret_access_key="x")
    return {method: op for method, op in client.meta.method_to_api_mapping.items()}, client


def used_ec2_actions() -> set[str]:
    """``ec2:<Operation>`` for every EC2 call the node code makes: boto3 client methods, waiters and
    paginators in spot_training/agent/ (found with ast), and ``aws ec2 <command>`` in the boot-failure script."""
    methods, client = _operation_names("ec2")
    used: set[str] = set()
    for path in (ROOT / "spot_training" / "agent").rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if not (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)):
                continue
            name = node.func.attr
            if name in ("get_waiter", "get_paginator") and node.args and isinstance(node.args[0], ast.Constant):
                arg = node.args[0].value
                if name == "get_waiter" or arg in methods:  # another service's paginator (S3's) is not EC2's
                    used.add(client.get_waiter(arg).config.operation if name == "get_waiter" else methods[arg])
            elif name == "get_waiter" or name == "get_paginator":
                # spot_training.agent.ebs.Ebs.wait(waiter_name, ...): the names come from its callers.
                pass
            elif name in methods and name not in ("get_waiter", "get_paginator", "close", "can_paginate"):
                used.add(methods[name])
    # The waiter names passed to spot_training.agent.ebs.Ebs.wait
    source = (ROOT / "spot_training" / "agent" / "ebs.py").read_text()
    for waiter in set(re.findall(r'self\.wait\(\s*"([a-z_]+)"', source)):
        used.add(client.get_waiter(waiter).config.operation)
    script = boot_failed_script(region="us-east-1", stack_name="S", volume_tags={"spot-training:stack": "S"},
                                max_failed_boots=3)
    for command in re.findall(r"\baws ec2 ([a-z-]+)", script):
        used.add("".join(part.capitalize() for part in command.split("-")))
    return {f"ec2:{op}" for op in used}


def test_every_granted_ec2_action_is_used_by_the_node_code(default_synth: Synth, cluster_synth: Synth) -> None:
    granted: set[str] = set()
    for synth in (default_synth, cluster_synth):
        for role in _node_roles(synth):
            for statement in _statements(synth, role):
                granted |= {a for a in _actions(statement) if a.startswith("ec2:")}
    used = used_ec2_actions()
    assert granted == used, f"granted but unused: {sorted(granted - used)}; used but not granted: {sorted(used - granted)}"


def test_node_reads_only_the_bootstrap_asset_object(default_synth: Synth, cluster_synth: Synth) -> None:
    for synth in (default_synth, cluster_synth):
        for role in _node_roles(synth):
            s3 = [s for s in _statements(synth, role) if any(a.startswith("s3:") for a in _actions(s))
                  and not s.get("Sid", "").startswith("Dataset")]
            assert len(s3) == 1, s3
            assert _actions(s3[0]) == ["s3:GetObject"]
            resource = json.dumps(s3[0]["Resource"])
            # bucket ARN + "/" + the asset's object key (its content hash), no wildcard anywhere
            assert "*" not in resource and ".zip" in resource, resource


def test_default_dataset_is_read_as_one_asset_object(default_synth: Synth) -> None:
    """The default job's digits come from a CDK asset of the stack: the node may get that one
    object and list only its key, nothing else of the assets bucket."""
    (role,) = _node_roles(default_synth)
    dataset = {s["Sid"]: s for s in _statements(default_synth, role) if s.get("Sid", "").startswith("Dataset")}
    assert sorted(dataset) == ["DatasetList", "DatasetRead"]
    assert _actions(dataset["DatasetRead"]) == ["s3:GetObject"]
    read = json.dumps(dataset["DatasetRead"]["Resource"])
    assert "*" not in read and ".zip" in read, read
    assert _actions(dataset["DatasetList"]) == ["s3:ListBucket"]
    prefix = dataset["DatasetList"]["Condition"]["StringLike"]["s3:prefix"]
    assert ".zip" in json.dumps(prefix) and "*" not in json.dumps(prefix), prefix
    config = json.dumps(default_synth.data)
    assert '\\"unpack\\": true' in config or '"unpack": true' in config


def test_user_dataset_prefix_is_the_only_readable_part_of_its_bucket(tmp_path: Path) -> None:
    from infra_helpers import synth_stack

    from spot_training.infra.config import StackSettings

    synth = synth_stack(tmp_path, StackSettings.from_mapping({"dataset_uri": "s3://my-data-bucket/jobs/digits/"}))
    (role,) = _node_roles(synth)
    dataset = {s["Sid"]: s for s in _statements(synth, role) if s.get("Sid", "").startswith("Dataset")}
    assert json.dumps(dataset["DatasetRead"]["Resource"]).endswith(':s3:::my-data-bucket/jobs/digits/*"]]}'), \
        dataset["DatasetRead"]["Resource"]
    assert _actions(dataset["DatasetRead"]) == ["s3:GetObject"]
    assert _actions(dataset["DatasetList"]) == ["s3:ListBucket"]
    assert json.dumps(dataset["DatasetList"]["Resource"]).endswith(':s3:::my-data-bucket"]]}')
    assert dataset["DatasetList"]["Condition"] == {"StringLike": {"s3:prefix": ["jobs/digits/*"]}}
    assert not synth.nag_errors, synth.nag_errors
    # no dataset asset when the user names the data
    assert not any("digits" in json.dumps(a) for a in synth.resources("AWS::CDK::Metadata").values())


def test_session_manager_without_the_ssm_managed_policy(default_synth: Synth, cluster_synth: Synth) -> None:
    for synth in (default_synth, cluster_synth):
        for role in _node_roles(synth):
            props = synth.resources("AWS::IAM::Role")[role]["Properties"]
            assert "ManagedPolicyArns" not in props, props.get("ManagedPolicyArns")
            ssm = [a for s in _statements(synth, role) for a in _actions(s) if a.split(":")[0] in ("ssm", "ssmmessages", "ec2messages")]
            assert sorted(ssm) == sorted(SESSION_MANAGER_ACTIONS)
            assert not [a for a in ssm if a.startswith("ssm:Get")]


def test_cluster_worker_terminates_only_itself(cluster_synth: Synth) -> None:
    terminate = [(role, s) for role in _node_roles(cluster_synth) for s in _statements(cluster_synth, role)
                 if "ec2:TerminateInstances" in _actions(s)]
    assert len(terminate) == 1, terminate
    _role, statement = terminate[0]
    equals = statement["Condition"]["StringEquals"]
    assert "aws:ResourceTag/spot-training:stack" in equals
    # the target's ARN (built from its ec2:InstanceID) must be the caller's own instance ARN
    source = equals["ec2:SourceInstanceARN"]
    assert source["Fn::Join"][1][-1].endswith(":instance/${ec2:InstanceID}"), source
    assert "ec2:InstanceProfile" in statement["Condition"]["ArnEquals"]
