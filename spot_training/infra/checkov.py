"""checkov over the synthesized CloudFormation templates.

The library's acknowledged checkov findings are not listed here: each construct writes checkov's own
resource-level skip (``Metadata.checkov.skip``, id and comment) onto its resources
(:mod:`spot_training.infra.acknowledgements`), so any checkov run over a template holding them, ours
or a consumer's, reports them as skipped with the reason. tests/infra/test_checkov.py runs checkov
(pinned in requirements-checkov.txt, installed by ``make setup`` into ``.venv-checkov``, an
environment of its own) over what ``cdk synth`` produces with cdk.json and over the stacks' variants,
and fails on any failed check. Run it by hand over ``cdk synth``'s output::

    python -m spot_training.infra.checkov cdk.out/SpotTraining.template.json cdk.out/DistributedTraining.template.json
"""

from __future__ import annotations

import dataclasses
import json
import subprocess
import sys
from collections.abc import Iterable, Sequence
from pathlib import Path


@dataclasses.dataclass(frozen=True)
class Finding:
    """One failed checkov check: id, name, ``<type>.<logical id>`` and the template file."""

    check_id: str
    check_name: str
    resource: str
    file: str

    def __str__(self) -> str:
        return f"{self.check_id} {self.resource} ({self.check_name}) in {self.file}"


#: The interpreter of checkov's own environment (``make setup`` builds it).
CHECKOV_PYTHON = Path(__file__).resolve().parents[2] / ".venv-checkov" / "bin" / "python"


def run_checkov(template_files: Sequence[Path | str], *, python: Path | str | None = None,
                timeout_s: float = 600) -> list[Finding]:
    """Run checkov's CloudFormation checks over ``template_files`` in a child process.

    Args:
        template_files: synthesized CloudFormation templates (JSON).
        python: the interpreter that has checkov; default :data:`CHECKOV_PYTHON` when it exists, else this one.
        timeout_s: seconds checkov may run (default 600).

    Returns:
        the failed checks as :class:`Finding` objects (empty when everything passed).

    Raises:
        RuntimeError: checkov did not produce a JSON report (not installed, crashed), with its stderr.
        subprocess.TimeoutExpired: it ran longer than ``timeout_s`` seconds.
    """
    return run_checkov_report(template_files, python=python, timeout_s=timeout_s)[0]


def run_checkov_report(template_files: Sequence[Path | str], *, python: Path | str | None = None,
                       timeout_s: float = 600) -> tuple[list[Finding], list[Skipped]]:
    """Like :func:`run_checkov`, also returning the checks skipped by a resource's ``Metadata.checkov.skip``.

    Args:
        template_files: synthesized CloudFormation templates (JSON).
        python: as :func:`run_checkov`.
        timeout_s: seconds checkov may run (default 600).

    Returns:
        (failed checks, skipped checks with their comments).

    Raises:
        RuntimeError: checkov did not produce a JSON report (not installed, crashed), with its stderr.
        subprocess.TimeoutExpired: it ran longer than ``timeout_s`` seconds.
    """
    if python is None:
        python = CHECKOV_PYTHON if CHECKOV_PYTHON.exists() else sys.executable
    # Not --quiet: it leaves the skipped checks out of the JSON report.
    command = [str(python), "-m", "checkov.main", "--framework", "cloudformation", "--output", "json",
               "--compact", "--skip-download"]
    for path in template_files:
        command += ["--file", str(path)]
    done = subprocess.run(command, capture_output=True, text=True, timeout=timeout_s, check=False)
    try:
        report = json.loads(done.stdout)
    except json.JSONDecodeError as error:
        raise RuntimeError(f"checkov printed no JSON report (exit {done.returncode}): {done.stderr[-2000:]}") from error
    reports = report if isinstance(report, list) else [report]
    findings: list[Finding] = []
    skipped: list[Skipped] = []
    for one in reports:
        # A run where every check passed on empty input is a summary without "results".
        results = one.get("results", {})
        for check in results.get("failed_checks", []):
            findings.append(Finding(check["check_id"], check.get("check_name", ""), check["resource"],
                                    check.get("file_path", "")))
        for check in results.get("skipped_checks", []):
            comment = (check.get("check_result") or {}).get("suppress_comment", "")
            skipped.append(Skipped(check["check_id"], check["resource"], comment, check.get("file_path", "")))
    return findings, skipped


@dataclasses.dataclass(frozen=True)
class Skipped:
    """One check checkov skipped because of a resource's ``Metadata.checkov.skip``: id, resource, comment, file."""

    check_id: str
    resource: str
    comment: str
    file: str


def unacknowledged(findings: Iterable[Finding]) -> list[Finding]:
    """The findings nothing acknowledges: every failed check (the acknowledged ones checkov skips itself)."""
    return list(findings)


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
