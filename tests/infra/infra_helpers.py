"""Helpers for the CDK tests: synthesize a SpotTrainingStack, lint a template (no fixtures here)."""

from __future__ import annotations

import dataclasses
import json
import os
from pathlib import Path
from typing import Any

os.environ.setdefault("JSII_SILENCE_WARNING_DEPRECATED_NODE_VERSION", "1")
os.environ.setdefault("JSII_SILENCE_WARNING_UNTESTED_NODE_VERSION", "1")
os.environ.setdefault("JSII_SILENCE_WARNING_END_OF_LIFE_NODE_VERSION", "14,16,18,20")

import aws_cdk as cdk  # noqa: E402
from aws_cdk import assertions  # noqa: E402

from spot_training.infra.cluster_config import ClusterSettings  # noqa: E402
from spot_training.infra.cluster_stack import DistributedTrainingStack  # noqa: E402
from spot_training.infra.config import StackSettings  # noqa: E402
from spot_training.infra.nag import apply_nag  # noqa: E402
from spot_training.infra.stack import SpotTrainingStack  # noqa: E402


@dataclasses.dataclass
class Synth:
    """One synthesized stack (SpotTrainingStack or DistributedTrainingStack): the stack, its template
    (dict and assertions), its files and cdk-nag's error annotations."""

    stack: Any
    template: assertions.Template
    data: dict[str, Any]
    template_file: Path
    outdir: Path
    nag_errors: list[str]

    def resources(self, cfn_type: str) -> dict[str, dict[str, Any]]:
        """Logical id -> resource of every resource of ``cfn_type``."""
        return {k: v for k, v in self.data["Resources"].items() if v["Type"] == cfn_type}


def synth_stack(outdir: Path, settings: StackSettings | None = None) -> Synth:
    """Synthesize a SpotTrainingStack with cdk-nag applied (as app.py does) into ``outdir``."""
    app = cdk.App(outdir=str(outdir))
    stack = SpotTrainingStack(app, settings=settings or StackSettings())
    return _synth(app, stack, outdir)


def synth_cluster(outdir: Path, settings: ClusterSettings | None = None) -> Synth:
    """Synthesize a DistributedTrainingStack with cdk-nag applied (as app.py does) into ``outdir``."""
    app = cdk.App(outdir=str(outdir))
    stack = DistributedTrainingStack(app, settings=settings or ClusterSettings())
    return _synth(app, stack, outdir)


def _synth(app: cdk.App, stack: cdk.Stack, outdir: Path) -> Synth:
    apply_nag(app)
    assembly = app.synth()
    artifact = assembly.get_stack_artifact(stack.artifact_id)
    template_file = outdir / artifact.template_file
    nag_errors = [
        f"{m.id}: {m.entry.data}"
        for m in assertions.Annotations.from_stack(stack).find_error("*", assertions.Match.any_value())
    ]
    data = json.loads(template_file.read_text())
    return Synth(stack, assertions.Template.from_json(data), data, template_file, outdir, nag_errors)


def cfn_lint_errors(template_file: Path) -> list[str]:
    """cfn-lint's error-level findings (rule ids starting with E) for a template file."""
    from cfnlint.api import lint_file

    return [f"{m.rule.id} {m.message} ({getattr(m, 'path_string', None) or getattr(m, 'path', '')})"
            for m in lint_file(template_file) if m.rule.id.startswith("E")]


#: Values for the pseudo parameters in rendered user data.
PSEUDO_PARAMETERS = {"AWS::Region": "us-east-1", "AWS::AccountId": "123456789012", "AWS::URLSuffix": "amazonaws.com",
                     "AWS::Partition": "aws",
                     "AWS::StackId": "arn:aws:cloudformation:us-east-1:123456789012:stack/SpotTraining/1f2e3d4c-0000-4000-8000-00000000abcd"}


def render_intrinsics(value: Any, pseudo: dict[str, str] = PSEUDO_PARAMETERS, refs=None) -> str:
    """Render the intrinsics our user data uses (Fn::Join, Fn::Sub, Ref to pseudo parameters, Fn::Select
    of an Fn::Split). Any other Ref: ``refs(logical id)`` gives its physical id (None: AssertionError);
    without ``refs`` it stands for ``<logical id>-id``."""
    if isinstance(value, str):
        return value
    ((fn, arg),) = value.items()
    if fn == "Fn::Join":
        return arg[0].join(render_intrinsics(v, pseudo, refs) for v in arg[1])
    if fn == "Fn::Sub":
        for name, v in pseudo.items():
            arg = arg.replace("${" + name + "}", v)
        return arg
    if fn == "Ref" and arg in pseudo:
        return pseudo[arg]
    if fn == "Ref" and refs is None:
        return f"{arg}-id"
    if fn == "Ref" and refs(arg) is not None:
        return refs(arg)
    if fn == "Fn::Select" and isinstance(arg[1], dict) and "Fn::Split" in arg[1]:
        separator, text = arg[1]["Fn::Split"]
        return render_intrinsics(text, pseudo, refs).split(separator)[int(arg[0])]
    raise AssertionError(f"unexpected intrinsic {fn} {arg!r} in user data")


def launch_template_user_data(template: assertions.Template) -> str:
    """The user data text of the one launch template in ``template`` (found with aws_cdk.assertions)."""
    found = template.find_resources("AWS::EC2::LaunchTemplate",
                                    {"Properties": {"LaunchTemplateData": {"UserData": assertions.Match.any_value()}}})
    assert len(found) == 1, f"expected one launch template with user data, found {sorted(found)}"
    (lt,) = found.values()
    return render_intrinsics(lt["Properties"]["LaunchTemplateData"]["UserData"]["Fn::Base64"])


def as_list(value: Any) -> list[Any]:
    """An IAM statement's Action or Resource as a list (CloudFormation allows one value or a list)."""
    return value if isinstance(value, list) else [value]


def launch_templates_by_role(synth: Synth) -> dict[str, dict[str, Any]]:
    """A cluster stack's launch templates by role (``scheduler``, ``server``, ``worker``: those it has)."""
    out = {}
    for logical_id, lt in synth.resources("AWS::EC2::LaunchTemplate").items():
        for role, prefix in (("scheduler", "ClusterSchedulerLaunchTemplate"), ("server", "ClusterServerLaunchTemplate"),
                             ("worker", "ClusterWorkerFleetLaunchTemplate")):
            if logical_id.startswith(prefix):
                out[role] = lt
    return out


def assert_resource_star_only_where_no_resource_level_permissions(statements: list[dict[str, Any]]) -> None:
    """Every statement on Resource "*" is Describe*, CloudWatch PutMetricData scoped to our namespace,
    or Session Manager's channels: the actions with no resource-level permissions."""
    from spot_training.infra.roles import SESSION_MANAGER_ACTIONS

    for st in statements:
        if "*" in as_list(st["Resource"]):
            if as_list(st["Action"]) == ["cloudwatch:PutMetricData"]:
                # No resource-level permissions exist for it: scoped to the stack's (or job's) own namespace,
                # SpotTraining/<id> (spot_training.contract.metrics_namespace), instead.
                namespace = st["Condition"]["StringEquals"]["cloudwatch:namespace"]
                assert list(st["Condition"]) == ["StringEquals"] and list(st["Condition"]["StringEquals"]) == [
                    "cloudwatch:namespace"] and namespace.startswith("SpotTraining/") and namespace != "SpotTraining/", st
                continue
            if sorted(as_list(st["Action"])) == sorted(a for a in SESSION_MANAGER_ACTIONS if a.startswith("ssmmessages:")):
                # Session Manager's channels: no resource-level permissions exist (spot_training.infra.roles).
                continue
            assert all(a.split(":")[1].startswith("Describe") for a in as_list(st["Action"])), st


def synth_app_as_cdk_does(outdir: Path) -> list[Path]:
    """Synthesize app.py exactly as ``cdk synth`` does, with cdk.json's context and feature flags (so
    aws-cdk-lib adds what they add, such as the VpcRestrictDefaultSG custom resource Lambda).

    With the CDK CLI installed (``make setup``: node_modules/.bin/cdk) it runs ``cdk synth``; without
    it, app.py with the context the CLI passes (CDK_CONTEXT_JSON: cdk.json's "context" plus the CLI's
    own aws:cdk:* keys) and CDK_OUTDIR. Returns the stacks' template files.
    """
    import subprocess
    import sys

    root = Path(__file__).resolve().parents[2]
    cli = root / "node_modules" / ".bin" / "cdk"
    env = {**os.environ, "CDK_DISABLE_CLI_TELEMETRY": "true"}
    if cli.exists():
        env["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{env.get('PATH', '')}"
        command = [str(cli), "synth", "--quiet", "--no-notices", "--no-version-reporting", "--output", str(outdir)]
    else:
        context = json.loads((root / "cdk.json").read_text())["context"]
        context.update({"aws:cdk:enable-path-metadata": True, "aws:cdk:enable-asset-metadata": True,
                        "aws:cdk:version-reporting": False, "aws:cdk:bundling-stacks": ["**"]})
        env.update({"CDK_CONTEXT_JSON": json.dumps(context), "CDK_OUTDIR": str(outdir)})
        command = [sys.executable, "app.py"]
    done = subprocess.run(command, cwd=root, env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    return sorted(outdir.glob("*.template.json"))


def assert_docs_list_context_keys(keys, doc: str) -> None:
    """Every context key in ``keys`` (``ContextKey``s) has a table row ``| `name` ...`` in ``docs/<doc>``
    that shows its default (``none`` for None, ``true``/``false`` for a bool, a list comma-separated)."""
    text = (Path(__file__).resolve().parents[2] / "docs" / doc).read_text()
    for key in keys:
        row = next((line for line in text.splitlines() if line.startswith(f"| `{key.name}`")), None)
        assert row is not None, f"docs/{doc} has no table row for context key {key.name!r}"
        default = "none" if key.default is None else str(key.default).lower() if isinstance(key.default, bool) else key.default
        shown = ", ".join(default) if isinstance(default, list) else str(default)
        assert shown in row, f"docs/{doc} row for {key.name!r} does not show its default {shown!r}: {row}"
