"""A CDK app of one stack that holds several training jobs (``TrainingJob``), for local mode's jobs drill.

The CDK CLI runs it as ``python -m spot_training.local.jobs_app`` (spot_training.local.jobs_drill). It is
what a team's app with two jobs in one stack looks like (tests/consumer/app.py is the AWS-shaped one):
a ``SettingsStack`` with one VPC and one :class:`~spot_training.infra.job.TrainingJob` per entry of the
``jobs`` context key, each with its own data volume, node role, fleet, log group and metrics, all
tagged ``spot-training:stack = <job id>``. The job id is the construct's default,
``<stack name>-<construct id>``.

Context: every :class:`~spot_training.infra.config.StackSettings` key that a job reads (``stack_name``,
``account``, ``region``, ``availability_zones``, ``image_id``, ``instance_types``, ``training_python``,
``training_requirements``, ``training_inherit_site_packages``, ``notice_poll_interval_s``,
``monitoring_interval_s``, ``checkpoint_every_steps``, ``vpc_flow_logs``; what
spot_training.local.deploy.local_context sets), plus ``jobs``: a JSON object ``{construct id: training
command}``, each command a list of strings (``{python}`` is the node's Python). Jobs bring no dataset
(``dataset_uri="none"``): the drill's trainer reads scikit-learn's bundled digits.
"""

from __future__ import annotations

import json
import os
import re
from typing import Any

#: The context key naming the jobs: ``{construct id: training command}``.
JOBS_CONTEXT_KEY = "jobs"
_CONSTRUCT_ID = re.compile(r"^[A-Za-z][A-Za-z0-9]{0,62}$")


def parse_jobs(value: Any) -> dict[str, list[str]]:
    """The ``jobs`` context value as ``{construct id: training command}``.

    Args:
        value: a JSON object as text (``-c jobs={...}``) or a dict: construct ids (a letter, then
            letters and digits, at most 63) mapping to non-empty lists of non-empty strings.

    Returns:
        The jobs in the given order.

    Raises:
        ValueError: ``value`` is missing, not a JSON object, empty, or holds a bad id or command
            (the message names the bad entry and what is allowed).
    """
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except json.JSONDecodeError as error:
            raise ValueError(f"{JOBS_CONTEXT_KEY} must be a JSON object {{construct id: [command ...]}}, "
                             f"got {value!r} ({error})") from None
    if not isinstance(value, dict) or not value:
        raise ValueError(f"{JOBS_CONTEXT_KEY} must be a non-empty JSON object {{construct id: [command ...]}}, "
                         f"got {value!r}")
    jobs: dict[str, list[str]] = {}
    for construct_id, command in value.items():
        if not _CONSTRUCT_ID.match(str(construct_id)):
            raise ValueError(f"{JOBS_CONTEXT_KEY}: construct id {construct_id!r} must be a letter, then letters "
                             "and digits (at most 63)")
        if not isinstance(command, list) or not command or not all(isinstance(a, str) and a for a in command):
            raise ValueError(f"{JOBS_CONTEXT_KEY}: {construct_id}'s command must be a non-empty list of strings "
                             f"such as [\"{{python}}\", \"train.py\"], got {command!r}")
        jobs[construct_id] = list(command)
    return jobs


def build(app: Any) -> Any:
    """Define the jobs stack in ``app`` (a ``cdk.App``) from its context; returns the stack.

    Raises:
        ValueError: a bad context value (:func:`parse_jobs`, ``StackSettings``), naming the key.
    """
    from spot_training.infra.config import StackSettings
    from spot_training.infra.job import TrainingJob
    from spot_training.infra.stack import SettingsStack, machine_image, new_vpc

    settings = StackSettings.from_context(app.node.try_get_context)
    jobs = parse_jobs(app.node.try_get_context(JOBS_CONTEXT_KEY))
    stack = SettingsStack(app, None, stack_name=settings.stack_name, account=settings.account, region=settings.region,
                          availability_zones=settings.availability_zones,
                          default_description=f"Spot training: {len(jobs)} jobs in one stack (local mode's jobs drill)")
    vpc = new_vpc(stack, None, flow_logs=settings.vpc_flow_logs)
    node_options = {"requirements": settings.training_requirements,
                    "inherit_site_packages": settings.training_inherit_site_packages,
                    "notice_poll_interval_s": settings.notice_poll_interval_s,
                    "checkpoint_every_steps": settings.checkpoint_every_steps}
    for construct_id, command in jobs.items():
        TrainingJob(stack, construct_id, vpc=vpc, training_command=command, training_python=settings.training_python,
                    machine_image=machine_image(settings.image_id, settings.ami_ssm_parameter),
                    instance_types=settings.instance_types, dataset_uri="none",
                    monitoring_interval_s=settings.monitoring_interval_s, node_options=node_options)
    return stack


def main() -> None:
    """Synthesize the app (what ``cdk --app "python -m spot_training.local.jobs_app"`` runs)."""
    for name, value in (("JSII_SILENCE_WARNING_DEPRECATED_NODE_VERSION", "1"),
                        ("JSII_SILENCE_WARNING_UNTESTED_NODE_VERSION", "1"),
                        ("JSII_SILENCE_WARNING_END_OF_LIFE_NODE_VERSION", "14,16,18,20")):
        os.environ.setdefault(name, value)  # as app.py: jsii reads these at its start
    # aws-cdk-lib's built-in CloudFormation validation (a WebAssembly linter run at every synth) takes
    # 10+ s of a 20 s synth on 2 cores and finds only warnings here (pinned AZs); the library's
    # templates are cfn-lint checked by its tests (tests/consumer). CDK_VALIDATION=true turns it back on.
    os.environ.setdefault("CDK_VALIDATION", "false")
    import aws_cdk as cdk

    from spot_training.infra.nag import apply_nag

    app = cdk.App()
    build(app)
    apply_nag(app)
    app.synth()


if __name__ == "__main__":
    main()
