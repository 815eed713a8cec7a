"""checkov over the synthesized CloudFormation templates, and every acknowledged finding with its reason.

This is the one place checkov findings are acknowledged (cdk-nag's are in :mod:`spot_training.infra.nag`).
tests/infra/test_checkov.py runs checkov (pinned in requirements-checkov.txt, installed by ``make
setup`` into ``.venv-checkov``, an environment of its own) over both stacks' templates
in their variants and fails on any failed check that :data:`ACKNOWLEDGEMENTS` does not cover, and on
any acknowledgement that no longer matches a finding. Run it by hand over ``cdk synth``'s output::

    python -m spot_training.infra.checkov cdk.out/SpotTraining.template.json cdk.out/DistributedTraining.template.json

An acknowledgement names one check id and a regular expression that the whole resource name
(``<CloudFormation type>.<logical id>``) must match, so it covers our construct's resources only,
never a new resource that happens to fail the same check.
"""

from __future__ import annotations

import dataclasses
import json
import re
import subprocess
import sys
from collections.abc import Iterable, Sequence
from pathlib import Path


@dataclasses.dataclass(frozen=True)
class Acknowledgement:
    """One acknowledged checkov finding.

    Attributes:
        check_id: checkov's check id such as ``CKV_AWS_117``.
        resource: regular expression the whole ``<type>.<logical id>`` must match.
        reason: why the finding stays (what it would cost to fix, or why it does not apply).
    """

    check_id: str
    resource: str
    reason: str

    def covers(self, finding: Finding) -> bool:
        """Whether this acknowledgement covers ``finding``."""
        return finding.check_id == self.check_id and re.fullmatch(self.resource, finding.resource) is not None


@dataclasses.dataclass(frozen=True)
class Finding:
    """One failed checkov check: id, name, ``<type>.<logical id>`` and the template file."""

    check_id: str
    check_name: str
    resource: str
    file: str

    def __str__(self) -> str:
        return f"{self.check_id} {self.resource} ({self.check_name}) in {self.file}"


#: The two Lambda functions of :class:`spot_training.infra.cleanup.DataCleanup`: its handler and the
#: ``custom_resources.Provider`` framework function aws-cdk-lib adds.
_CLEANUP_LAMBDAS = r"AWS::Lambda::Function\.DataCleanup(Handler|ProviderframeworkonEvent)[0-9A-F]{8}"
#: Our log groups: VPC flow logs, the nodes' logs (monitoring), the cleanup functions' logs.
_LOG_GROUPS = r"AWS::Logs::LogGroup\.(FlowLogs|MonitoringNodeLogs|DataCleanupHandlerLogs|DataCleanupProviderLogs)[0-9A-F]{8}"

#: Every checkov finding we keep, with its reason. Keep the reasons specific.
ACKNOWLEDGEMENTS: tuple[Acknowledgement, ...] = (
    Acknowledgement(
        "CKV_AWS_158", _LOG_GROUPS,
        "CloudWatch Logs encrypts every log group at rest with a service key; a customer managed KMS key "
        "would add a key (USD 1/month) and a key policy for logs.<region>.amazonaws.com for logs that hold "
        "no secrets (flow records, agent and cleanup messages). Users who need one can set it on the "
        "construct (TrainingMonitoring, DataCleanup take their log groups from aws-cdk-lib).",
    ),
    Acknowledgement(
        "CKV_AWS_116", _CLEANUP_LAMBDAS,
        "A dead-letter queue catches failed asynchronous invocations nobody waits for; here CloudFormation "
        "waits for each custom-resource response, and a failed cleanup surfaces as the stack's "
        "DELETE_FAILED event with the handler's error (spot_training/infra/cleanup.py), which a queue nobody reads "
        "would only duplicate.",
    ),
    Acknowledgement(
        "CKV_AWS_117", _CLEANUP_LAMBDAS,
        "The cleanup functions only call the EC2 and Lambda APIs and touch nothing inside the VPC; in the "
        "VPC they would need a NAT gateway or endpoints and ENIs that delay the stack's deletion, for no "
        "isolation gain (their IAM policy is what bounds them, tag-conditioned and cdk-nag checked).",
    ),
    Acknowledgement(
        "CKV_AWS_115", _CLEANUP_LAMBDAS,
        "They run once per stack update or deletion; reserved concurrency would take capacity from the "
        "account's unreserved pool and could make a concurrent cdk destroy of two stacks throttle, while "
        "nothing could invoke them in a flood (only CloudFormation's custom resource and the framework do).",
    ),
    Acknowledgement(
        "CKV_AWS_173", _CLEANUP_LAMBDAS,
        "The only environment variable is the handler function's ARN, which aws-cdk-lib's Provider "
        "framework sets (USER_ON_EVENT_FUNCTION_ARN); it is no secret, and Lambda encrypts environment "
        "variables at rest with an AWS managed key anyway.",
    ),
)


#: The interpreter of checkov's own environment (``make setup`` builds it).
CHECKOV_PYTHON = Path(__file__).resolve().parents[2] / ".venv-checkov" / "bin" / "python"


def run_checkov(template_files: Sequence[Path | str], *, python: Path | str | None = None,
                timeout_s: float = 600) -> list[Finding]:
    """Run checkov's CloudFormation checks over ``template_files`` in a child process.

    ``python``: the interpreter that has checkov; default :data:`CHECKOV_PYTHON` when it exists, else
    this one. Returns the failed checks as :class:`Finding` objects (empty when everything passed).

    Raises:
        RuntimeError: checkov did not produce a JSON report (not installed, crashed), with its stderr.
        subprocess.TimeoutExpired: it ran longer than ``timeout_s`` seconds.
    """
    if python is None:
        python = CHECKOV_PYTHON if CHECKOV_PYTHON.exists() else sys.executable
    command = [str(python), "-m", "checkov.main", "--framework", "cloudformation", "--output", "json",
               "--compact", "--quiet", "--skip-download"]
    for path in template_files:
        command += ["--file", str(path)]
    done = subprocess.run(command, capture_output=True, text=True, timeout=timeout_s, check=False)
    try:
        report = json.loads(done.stdout)
    except json.JSONDecodeError as error:
        raise RuntimeError(f"checkov printed no JSON report (exit {done.returncode}): {done.stderr[-2000:]}") from error
    reports = report if isinstance(report, list) else [report]
    findings: list[Finding] = []
    for one in reports:
        # A run where every check passed on empty input is a summary without "results".
        for check in one.get("results", {}).get("failed_checks", []):
            findings.append(Finding(check["check_id"], check.get("check_name", ""), check["resource"],
                                    check.get("file_path", "")))
    return findings


def unacknowledged(findings: Iterable[Finding],
                   acknowledgements: Sequence[Acknowledgement] = ACKNOWLEDGEMENTS) -> list[Finding]:
    """The findings no acknowledgement covers."""
    return [f for f in findings if not any(a.covers(f) for a in acknowledgements)]


def unused(findings: Sequence[Finding],
           acknowledgements: Sequence[Acknowledgement] = ACKNOWLEDGEMENTS) -> list[Acknowledgement]:
    """The acknowledgements that cover none of ``findings`` (stale: remove them)."""
    return [a for a in acknowledgements if not any(a.covers(f) for f in findings)]


def main(argv: Sequence[str] | None = None) -> int:
    """``python -m spot_training.infra.checkov TEMPLATE...``: print unacknowledged findings; exit 1 if any, else 0."""
    files = list(sys.argv[1:] if argv is None else argv)
    if not files:
        print("usage: python -m spot_training.infra.checkov TEMPLATE.json...", file=sys.stderr)
        return 2
    left = unacknowledged(run_checkov(files))
    for finding in left:
        print(finding)
    return 1 if left else 0


if __name__ == "__main__":
    sys.exit(main())
