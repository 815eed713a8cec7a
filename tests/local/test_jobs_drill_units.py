"""The jobs drill's pieces that need no deployed stack: options, the jobs context key, finding one job's
fleet, launch template and volume among a stack's resources, and the checks that say whether each job
kept to its own volume and was read back alone. In-process (unit tier)."""

from __future__ import annotations

import io
import json
from typing import Any

import pytest

from spot_training.cli import ProgressDisplay, main
from spot_training.local.deploy import Clients, stack_resources
from spot_training.local.jobs_app import parse_jobs
from spot_training.local.jobs_drill import (
    JobsDrillOptions,
    format_jobs_report,
    passed,
    reads_only_its_own,
    volumes_shared,
)

STACK = "SpotTrainingJobs"
TAG = "spot-training:stack"


# ---- options and the jobs context key -----------------------------------------------------------------
def test_options_name_the_jobs_and_spread_the_interruptions() -> None:
    options = JobsDrillOptions(jobs=3, interruptions=2, steps=400)
    assert options.job_ids == [f"{STACK}-JobA", f"{STACK}-JobB", f"{STACK}-JobC"]
    assert options.trigger_steps() == [100, 200]
    # Job A's first replacement stays, job B's moves, and each job alternates.
    assert [[options.moves(j, i) for i in range(2)] for j in range(2)] == [[False, True], [True, False]]
    assert [options.learning_rate(i) for i in range(2)] == [0.5, 0.25]
    args = options.trainer_args(1, "/data")
    assert args[:2] == ["-m", "spot_training.training.examples.sweep_softmax"]
    assert args[args.index("--lr") + 1] == "0.25" and args[-1] == "/data/final_weights.npz"


@pytest.mark.parametrize("changes, message", [
    ({"jobs": 1}, "jobs must be an integer >= 2, got 1"),
    ({"jobs": 5}, "jobs must be at most 4"),
    ({"interruptions": 0}, "interruptions must be an integer >= 1, got 0"),
    ({"steps": 150, "interruptions": 2}, r"steps must be >= 100 per interruption \(200\)"),
    ({"step_delay_s": 2.0}, "step_delay_s must be 0..1 seconds, got 2.0"),
    ({"stack": "bad_name"}, "stack must be a CloudFormation stack name"),
    ({"on_demand_prices": {"g5.xlarge": 1.0}}, "on_demand_prices must give a positive USD/hour for every instance type"),
    ({"on_demand_prices": {"g5.xlarge": 1.0, "g4dn.xlarge": True}}, "on_demand_prices must give a positive USD/hour"),
    ({"timeout_s": float("inf")}, "timeout_s must be > 0 seconds, got inf"),
])
def test_bad_options_name_the_option(changes: dict[str, Any], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        JobsDrillOptions(**changes).validate()


def test_the_jobs_drill_states_the_dated_tables_on_demand_prices() -> None:
    """One price source for every drill: the jobs drill hard-coded its own copy of the table's prices."""
    from spot_training.local.spot_prices import load_table

    options = JobsDrillOptions()
    assert options.on_demand_prices == {t: load_table().on_demand[t] for t in options.instance_types}


def test_cli_jobs_drill_refuses_bad_options_before_starting_anything(capsys: pytest.CaptureFixture[str], tmp_path) -> None:
    assert main(["local", "drill", "--jobs", "1", "--work-dir", str(tmp_path / "w")]) == 2
    assert "jobs must be an integer >= 2, got 1" in capsys.readouterr().err
    assert not (tmp_path / "w").exists()


def test_jobs_context_key_parses_and_names_what_is_wrong() -> None:
    assert parse_jobs('{"JobA": ["{python}", "a.py"], "JobB": ["b"]}') == {"JobA": ["{python}", "a.py"], "JobB": ["b"]}
    for bad, message in ((None, "non-empty JSON object"), ("{}", "non-empty JSON object"), ("[", "JSON object"),
                         ('{"job-a": ["x"]}', "construct id 'job-a'"), ('{"JobA": "x"}', "JobA's command must be"),
                         ('{"JobA": ["x", ""]}', "JobA's command must be")):
        with pytest.raises(ValueError, match=message):
            parse_jobs(bad)


# ---- one job of a stack of several --------------------------------------------------------------------
class _Ec2:
    """DescribeSpotFleetRequests and DescribeVolumes as moto answers them (no LaunchTemplateConfigs)."""

    def __init__(self, fleets: dict[str, str], volumes: dict[str, str]) -> None:
        self.fleets, self.volumes = fleets, volumes

    def describe_spot_fleet_requests(self, SpotFleetRequestIds: list[str]) -> dict[str, Any]:
        assert SpotFleetRequestIds, "an empty id list describes every fleet request of the account"
        return {"SpotFleetRequestConfigs": [
            {"SpotFleetRequestId": i, "SpotFleetRequestConfig": {}, "Tags": [{"Key": TAG, "Value": self.fleets[i]}]}
            for i in SpotFleetRequestIds]}

    def describe_volumes(self, VolumeIds: list[str] | None = None, Filters: Any = None) -> dict[str, Any]:
        assert VolumeIds, "an empty id list describes every volume of the account"
        return {"Volumes": [{"VolumeId": i, "Tags": [{"Key": TAG, "Value": self.volumes[i]}]} for i in VolumeIds]}

    def describe_subnets(self, Filters: Any) -> dict[str, Any]:
        return {"Subnets": [{"AvailabilityZone": "us-east-1a", "SubnetId": "subnet-1"}]}


class _CloudFormation:
    def __init__(self, resources: dict[str, tuple[str, str]], template: dict[str, Any]) -> None:
        self.resources, self.template = resources, template

    def describe_stacks(self, StackName: str) -> dict[str, Any]:
        return {"Stacks": [{"StackStatus": "CREATE_COMPLETE"}]}

    def describe_stack_resources(self, StackName: str) -> dict[str, Any]:
        return {"StackResources": [{"LogicalResourceId": logical, "ResourceType": kind, "PhysicalResourceId": physical}
                                   for logical, (kind, physical) in self.resources.items()]}

    def get_template(self, StackName: str) -> dict[str, Any]:
        return {"TemplateBody": json.dumps(self.template)}


def _two_job_stack() -> Clients:
    # Job B's resources are listed first and its fleet's logical id sorts first: only the tags and the
    # template's Ref tie a fleet to its launch template.
    resources = {
        "Vpc": ("AWS::EC2::VPC", "vpc-1"),
        "JobBFleet": ("AWS::EC2::SpotFleet", "sfr-b"), "JobBFleetLaunchTemplate": ("AWS::EC2::LaunchTemplate", "lt-b"),
        "JobBDataVolume": ("AWS::EC2::Volume", "vol-b"),
        "JobAFleet": ("AWS::EC2::SpotFleet", "sfr-a"), "JobAFleetLaunchTemplate": ("AWS::EC2::LaunchTemplate", "lt-a"),
        "JobADataVolume": ("AWS::EC2::Volume", "vol-a"),
    }

    def fleet(template: str) -> dict[str, Any]:
        return {"Type": "AWS::EC2::SpotFleet", "Properties": {"SpotFleetRequestConfigData": {"LaunchTemplateConfigs": [
            {"LaunchTemplateSpecification": {"LaunchTemplateId": {"Ref": template},
                                             "Version": {"Fn::GetAtt": [template, "LatestVersionNumber"]}}}]}}}

    template = {"Resources": {"JobAFleet": fleet("JobAFleetLaunchTemplate"), "JobBFleet": fleet("JobBFleetLaunchTemplate")}}
    ec2 = _Ec2({"sfr-a": f"{STACK}-JobA", "sfr-b": f"{STACK}-JobB"}, {"vol-a": f"{STACK}-JobA", "vol-b": f"{STACK}-JobB"})
    return Clients(ec2=ec2, cloudformation=_CloudFormation(resources, template), s3=None)


def test_stack_resources_of_one_job_are_its_own_fleet_launch_template_and_volume() -> None:
    aws = _two_job_stack()
    for job, suffix in ((f"{STACK}-JobA", "a"), (f"{STACK}-JobB", "b")):
        deployed = stack_resources(aws, STACK, job=job)
        assert (deployed.name, deployed.fleet_request_id, deployed.launch_template_id, deployed.data_volume_id) == \
            (job, f"sfr-{suffix}", f"lt-{suffix}", f"vol-{suffix}")
    with pytest.raises(RuntimeError, match=r"job 'Other' has 0 fleet requests .* \['SpotTrainingJobs-JobA', "
                                           r"'SpotTrainingJobs-JobB'\]"):
        stack_resources(aws, STACK, job="Other")
    with pytest.raises(RuntimeError, match=r"2 AWS::EC2::SpotFleet resources.*name one with job=<job id>"):
        stack_resources(aws, STACK)


# ---- the drill's checks ----------------------------------------------------------------------------------
def _job(instances: list[str], volumes: list[str], **changes: Any) -> dict[str, Any]:
    job = {"completed": True, "lost_steps": 0, "error": None, "interruptions": 1,
           "agent_exit_codes": {i: 0 for i in instances}, "matches_uninterrupted_baseline": True,
           "instances": instances, "volume_ids": volumes, "volume_dirs": [f"/ebs/{v}" for v in volumes],
           "status_instances": instances, "status_volumes": volumes[-1:], "cost_instances": instances}
    job.update(changes)
    job["reads_only_its_own"] = reads_only_its_own(job)
    return job


def _report(jobs: dict[str, dict[str, Any]]) -> dict[str, Any]:
    return {"jobs": jobs, "error": None, "volumes_shared": volumes_shared(jobs), "orphans_after_destroy": [],
            "phases_s": {"deploy": 40.0}, "wall_s": 100.0}


def test_a_drill_where_each_job_kept_to_its_own_passes() -> None:
    report = _report({"A": _job(["i-1", "i-2"], ["vol-a"]), "B": _job(["i-3", "i-4"], ["vol-b", "vol-b2"])})
    assert report["volumes_shared"] == []
    assert passed(report, JobsDrillOptions())
    report["passed"] = True
    text = format_jobs_report(report)
    assert "reads only its own" in text and "vol-b, vol-b2" in text and text.rstrip().endswith("True")


def test_a_volume_or_block_device_in_two_jobs_fails_the_drill() -> None:
    jobs = {"A": _job(["i-1"], ["vol-a"]), "B": _job(["i-3"], ["vol-b", "vol-a"], status_volumes=["vol-a"])}
    assert volumes_shared(jobs) == ["/ebs/vol-a", "vol-a"]
    assert not passed(_report(jobs), JobsDrillOptions())
    jobs = {"A": _job(["i-1"], ["vol-a"]), "B": _job(["i-3"], ["vol-b"], volume_dirs=["/ebs/vol-a"])}
    assert volumes_shared(jobs) == ["/ebs/vol-a"]


@pytest.mark.parametrize("changes", [
    {"status_instances": ["i-1", "i-2", "i-3"]},  # status --job listed another job's instance
    {"cost_instances": ["3 priced"]},             # cost --job priced more than status listed
    {"status_volumes": ["vol-b"]},                # status --job showed another job's volume
    {"status_volumes": []},                       # ... or none
])
def test_a_read_back_that_sees_more_than_the_job_fails_the_drill(changes: dict[str, Any]) -> None:
    jobs = {"A": _job(["i-1", "i-2"], ["vol-a"], **changes), "B": _job(["i-3"], ["vol-b"])}
    assert jobs["A"]["reads_only_its_own"] is False
    assert not passed(_report(jobs), JobsDrillOptions())


@pytest.mark.parametrize("changes", [
    {"agent_exit_codes": {"i-1": 0, "i-2": 78}},  # a refused config, e.g. two independent tagged volumes
    {"matches_uninterrupted_baseline": False}, {"lost_steps": 3}, {"interruptions": 0}, {"completed": False},
])
def test_a_job_that_did_not_train_through_its_interruption_fails_the_drill(changes: dict[str, Any]) -> None:
    jobs = {"A": _job(["i-1", "i-2"], ["vol-a"], **changes), "B": _job(["i-3"], ["vol-b"])}
    assert not passed(_report(jobs), JobsDrillOptions())


def test_the_live_display_says_whose_event_it_is() -> None:
    out = io.StringIO()
    display = ProgressDisplay(out, tty=False)
    display({"event": "checkpointed", "t": 1.0, "step": 166, "notice_to_checkpoint_s": 0.5, "job": "Stack-JobB"})
    display({"event": "checkpointed", "t": 2.0, "step": 7, "notice_to_checkpoint_s": 0.5})
    assert out.getvalue().splitlines() == ["[    1.0s] Stack-JobB:    checkpoint at step 166, 0.5 s after the notice",
                                           "[    2.0s]    checkpoint at step 7, 0.5 s after the notice"]
