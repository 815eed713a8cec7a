"""docs/operations.md lists the IAM actions `spot-train status|logs|cost|preflight` need; this checks
the list against the boto3 calls spot_training/ops/operations.py and spot_training/infra/preflight.py
make (found with ast, mapped to API operations by botocore's model). In-process, well under a second."""

from __future__ import annotations

import ast
import re
from pathlib import Path

import boto3

ROOT = Path(__file__).resolve().parents[2]
#: Client variable/attribute names in the two modules -> boto3 service name.
SERVICES = {"cloudformation": "cloudformation", "ec2": "ec2", "cloudwatch": "cloudwatch", "logs": "logs",
            "pricing": "pricing", "iam": "iam", "ssm": "ssm", "quotas": "service-quotas"}
#: boto3 service name -> IAM action prefix, where they differ.
IAM_PREFIX = {"service-quotas": "servicequotas"}


def _name(node: ast.AST) -> str | None:
    return node.attr if isinstance(node, ast.Attribute) else node.id if isinstance(node, ast.Name) else None


def used_actions(path: Path) -> set[str]:
    """``prefix:Operation`` for every client method the module names (``aws.ec2.describe_x``, a
    paginator or ``_paginate(aws.ec2, "describe_x", ...)``)."""
    found: set[tuple[str, str]] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Attribute) and _name(node.value) in SERVICES:
            found.add((SERVICES[_name(node.value)], node.attr))
        if isinstance(node, ast.Call):
            args = node.args
            if len(args) >= 2 and _name(args[0]) in SERVICES and isinstance(args[1], ast.Constant):
                found.add((SERVICES[_name(args[0])], args[1].value))
            if (isinstance(node.func, ast.Attribute) and node.func.attr in ("get_paginator", "get_waiter")
                    and _name(node.func.value) in SERVICES and args and isinstance(args[0], ast.Constant)):
                found.add((SERVICES[_name(node.func.value)], args[0].value))
    actions = set()
    for service, method in found:
        client = boto3.client(service, region_name="us-east-1", aws_access_key_id="x", aws_secret_access_key="x")
        operation = client.meta.method_to_api_mapping.get(method)
        if operation:
            actions.add(f"{IAM_PREFIX.get(service, service)}:{operation}")
    return actions


def documented() -> dict[str, set[str]]:
    text = (ROOT / "docs" / "operations.md").read_text()
    section = text.split("### IAM permissions each command needs", 1)[1].split("\n#", 1)[0]
    rows = {}
    for line in section.splitlines():
        match = re.match(r"\| `(\w+)` \| (.+) \|$", line)
        if match:
            rows[match[1]] = set(re.findall(r"`([a-z0-9-]+:[A-Za-z]+)`", match[2]))
    return rows


def test_documented_iam_actions_match_the_calls_the_commands_make():
    rows = documented()
    assert set(rows) == {"status", "logs", "cost", "preflight"}
    ops_used = used_actions(ROOT / "spot_training" / "ops" / "operations.py")
    assert ops_used and ops_used == rows["status"] | rows["logs"] | rows["cost"]
    preflight_used = used_actions(ROOT / "spot_training" / "infra" / "preflight.py")
    assert preflight_used and preflight_used == rows["preflight"]
