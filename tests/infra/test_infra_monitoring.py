"""The SpotTraining stack's monitoring (spot_training.infra.monitoring.TrainingMonitoring) in synthesized CloudFormation:
log group, dashboard, alarms, optional SNS topic, scoped IAM; cfn-lint and cdk-nag clean."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from aws_cdk import assertions  # noqa: F401 - Synth.template is an assertions.Template
from infra_helpers import Synth, cfn_lint_errors, launch_template_user_data, synth_stack

from spot_training.agent.config import parse_config
from spot_training.infra.config import StackSettings
from spot_training.infra.userdata import extract_config
from test_infra_stack import PSEUDO, _user_data


@pytest.fixture(scope="module")
def email_synth(tmp_path_factory: pytest.TempPathFactory) -> Synth:
    settings = StackSettings.from_mapping({"notification_email": "ops@example.com", "log_retention_days": "90",
                                           "alarm_no_progress_minutes": "15", "alarm_no_capacity_minutes": "30",
                                           "monitoring_interval_s": "5"})
    return synth_stack(tmp_path_factory.mktemp("cdk-email"), settings)


def _template(synth: Synth) -> assertions.Template:
    return synth.template


def _alarm(synth: Synth, prefix: str) -> dict:
    found = [r["Properties"] for k, r in synth.resources("AWS::CloudWatch::Alarm").items() if k.startswith(prefix)]
    assert len(found) == 1, f"expected one alarm {prefix}*, found {len(found)}"
    return found[0]


def test_log_group_is_named_for_the_stack_with_retention(default_synth: Synth, email_synth: Synth) -> None:
    _template(default_synth).has_resource("AWS::Logs::LogGroup", {
        "Properties": {"LogGroupName": "/spot-training/SpotTraining", "RetentionInDays": 30},
        "DeletionPolicy": "Delete"})
    _template(email_synth).has_resource_properties("AWS::Logs::LogGroup", {
        "LogGroupName": "/spot-training/SpotTraining", "RetentionInDays": 90})


def test_dashboard_shows_progress_loss_interruptions_and_instances_by_type_and_az(default_synth: Synth) -> None:
    dashboards = default_synth.resources("AWS::CloudWatch::Dashboard")
    assert len(dashboards) == 1
    props = next(iter(dashboards.values()))["Properties"]
    assert props["DashboardName"] == "SpotTraining-training"
    body = json.dumps(props["DashboardBody"])
    for text in ("GlobalStep", "StepsTotal", "Loss", "InterruptionNotices", "RebalanceRecommendations", "VolumeMoves",
                 "NoticeToCheckpointSeconds", "BootToResumeSeconds", "CheckpointAgeSeconds",
                 "Running instances by type and AZ", "InstanceType,AvailabilityZone", "RunningInstances"):
        assert text in body, f"the dashboard does not show {text}"


def test_hang_alarm_is_no_steps_for_n_minutes_while_a_node_publishes(default_synth: Synth, email_synth: Synth) -> None:
    alarm = _alarm(default_synth, "MonitoringNoProgress")
    assert alarm["Namespace"] == "SpotTraining/SpotTraining" and alarm["MetricName"] == "StepsDone"
    assert alarm["Dimensions"] == [{"Name": "Stack", "Value": "SpotTraining"}]
    assert (alarm["Statistic"], alarm["Period"], alarm["EvaluationPeriods"], alarm["DatapointsToAlarm"]) == ("Sum", 60, 30, 30)
    assert (alarm["ComparisonOperator"], alarm["Threshold"]) == ("LessThanOrEqualToThreshold", 0)
    assert alarm["TreatMissingData"] == "notBreaching"  # no node running is the capacity alarm's business
    assert _alarm(email_synth, "MonitoringNoProgress")["EvaluationPeriods"] == 15


def test_capacity_alarm_compares_the_fleets_target_and_fulfilled_capacity(default_synth: Synth, email_synth: Synth) -> None:
    alarm = _alarm(default_synth, "MonitoringNoSpotCapacity")
    expressions = [m["Expression"] for m in alarm["Metrics"] if "Expression" in m]
    assert expressions == ["target - fulfilled"]
    stats = [m["MetricStat"] for m in alarm["Metrics"] if "MetricStat" in m]
    assert {s["Metric"]["MetricName"] for s in stats} == {"TargetCapacity", "FulfilledCapacity"}
    assert all(s["Metric"]["Namespace"] == "AWS/EC2Spot" and s["Period"] == 300 for s in stats)
    fleet_ref = [d["Value"] for s in stats for d in s["Metric"]["Dimensions"] if d["Name"] == "FleetRequestId"]
    assert fleet_ref and all(v == {"Ref": next(iter(default_synth.resources("AWS::EC2::SpotFleet")))} for v in fleet_ref)
    assert (alarm["EvaluationPeriods"], alarm["ComparisonOperator"], alarm["Threshold"]) == (12, "GreaterThanThreshold", 0)
    assert _alarm(email_synth, "MonitoringNoSpotCapacity")["EvaluationPeriods"] == 6


def test_no_topic_without_an_email_and_every_alarm_notifies_it_with_one(default_synth: Synth, email_synth: Synth) -> None:
    assert default_synth.resources("AWS::SNS::Topic") == {}
    assert all("AlarmActions" not in a["Properties"] for a in default_synth.resources("AWS::CloudWatch::Alarm").values())
    topics = email_synth.resources("AWS::SNS::Topic")
    assert len(topics) == 1
    topic_id, topic = next(iter(topics.items()))
    assert "KmsMasterKeyId" in topic["Properties"]
    _template(email_synth).has_resource_properties("AWS::SNS::Subscription", {
        "Protocol": "email", "Endpoint": "ops@example.com", "TopicArn": {"Ref": topic_id}})
    alarms = email_synth.resources("AWS::CloudWatch::Alarm")
    assert len(alarms) == 4  # no progress, no capacity, completed, failed
    assert all(a["Properties"]["AlarmActions"] == [{"Ref": topic_id}] for a in alarms.values())
    key = next(iter(email_synth.resources("AWS::KMS::Key").values()))["Properties"]
    assert key["EnableKeyRotation"] is True
    assert any(s.get("Principal") == {"Service": "cloudwatch.amazonaws.com"} for s in key["KeyPolicy"]["Statement"])


def test_nodes_write_only_to_the_stacks_log_group_and_only_our_namespace(default_synth: Synth) -> None:
    statements = [s for p in default_synth.resources("AWS::IAM::Policy").values()
                  if any("NodeRole" in r["Ref"] for r in p["Properties"]["Roles"])
                  for s in p["Properties"]["PolicyDocument"]["Statement"]]
    def actions(s):
        return s["Action"] if isinstance(s["Action"], list) else [s["Action"]]
    logs = [s for s in statements if any(a.startswith("logs:") for a in actions(s))]
    group = next(k for k, r in default_synth.resources("AWS::Logs::LogGroup").items() if k.startswith("MonitoringNodeLogs"))
    assert logs == [{"Action": ["logs:CreateLogStream", "logs:PutLogEvents"], "Effect": "Allow",
                     "Resource": {"Fn::GetAtt": [group, "Arn"]}}]
    metrics = [s for s in statements if any(a.startswith("cloudwatch:") for a in actions(s))]
    assert len(metrics) == 1 and actions(metrics[0]) == ["cloudwatch:PutMetricData"]
    # The stack's own namespace: another stack's nodes cannot fake this stack's metrics (and alarms).
    assert metrics[0]["Condition"] == {"StringEquals": {"cloudwatch:namespace": "SpotTraining/SpotTraining"}}
    namespaces = {a["Properties"].get("Namespace") for a in default_synth.resources("AWS::CloudWatch::Alarm").values()}
    namespaces |= {m["MetricStat"]["Metric"]["Namespace"] for a in default_synth.resources("AWS::CloudWatch::Alarm").values()
                   for m in a["Properties"].get("Metrics", []) if "MetricStat" in m}
    assert namespaces - {None, "AWS/EC2Spot"} == {"SpotTraining/SpotTraining"}
    config = extract_config(launch_template_user_data(default_synth.template))
    assert config["monitoring"]["namespace"] == "SpotTraining/SpotTraining"


def test_node_config_carries_the_monitoring_section_the_agent_accepts(default_synth: Synth, email_synth: Synth) -> None:
    for synth, interval in ((default_synth, 10.0), (email_synth, 5.0)):
        config = extract_config(_user_data(synth, PSEUDO))
        assert config["monitoring"]["log_group"] == "/spot-training/SpotTraining"
        assert parse_config(config).monitoring.interval_s == interval


def test_monitoring_off_adds_nothing(tmp_path: Path) -> None:
    synth = synth_stack(tmp_path, StackSettings.from_mapping({"monitoring": "false"}))
    assert synth.resources("AWS::CloudWatch::Alarm") == {} and synth.resources("AWS::CloudWatch::Dashboard") == {}
    assert not any(r["Properties"].get("LogGroupName") == "/spot-training/SpotTraining"
                   for r in synth.resources("AWS::Logs::LogGroup").values())
    assert synth.nag_errors == []


def test_email_variant_is_cfn_lint_and_cdk_nag_clean(email_synth: Synth) -> None:
    assert cfn_lint_errors(email_synth.template_file) == []
    assert email_synth.nag_errors == []


def test_cluster_stack_has_the_same_monitoring_for_every_role(cluster_synth: Synth) -> None:
    from test_infra_cluster import _launch_templates
    from test_infra_cluster import _user_data as cluster_user_data

    for role, lt in _launch_templates(cluster_synth).items():
        monitoring = parse_config(extract_config(cluster_user_data(lt))).monitoring
        assert (monitoring.log_group, monitoring.namespace) == ("/spot-training/DistributedTraining",
                                                               "SpotTraining/DistributedTraining"), role
    groups = [r["Properties"] for r in cluster_synth.resources("AWS::Logs::LogGroup").values()
              if r["Properties"].get("LogGroupName") == "/spot-training/DistributedTraining"]
    assert len(groups) == 1 and groups[0]["RetentionInDays"] == 30
    assert len(cluster_synth.resources("AWS::CloudWatch::Dashboard")) == 1
    alarms = cluster_synth.resources("AWS::CloudWatch::Alarm")
    assert sorted(k[len("Monitoring"):].rstrip("0123456789ABCDEF") for k in alarms) == [
        "Completed", "NoProgress", "NoSpotCapacity", "TrainerFailed"]
    capacity = next(a["Properties"] for k, a in alarms.items() if k.startswith("MonitoringNoSpotCapacity"))
    fleet = next(iter(cluster_synth.resources("AWS::EC2::SpotFleet")))
    assert {"Ref": fleet} in [d["Value"] for m in capacity["Metrics"] if "MetricStat" in m
                              for d in m["MetricStat"]["Metric"]["Dimensions"]]
    roles = {k for k, r in cluster_synth.resources("AWS::IAM::Role").items()
             if r["Properties"]["AssumeRolePolicyDocument"]["Statement"][0]["Principal"] == {"Service": "ec2.amazonaws.com"}}
    granted = set()
    for policy in cluster_synth.resources("AWS::IAM::Policy").values():
        for st in policy["Properties"]["PolicyDocument"]["Statement"]:
            if st["Action"] == "cloudwatch:PutMetricData":
                assert st["Condition"] == {"StringEquals": {"cloudwatch:namespace": "SpotTraining/DistributedTraining"}}
                granted |= {r["Ref"] for r in policy["Properties"]["Roles"]}
    assert granted == roles and len(roles) == 2  # scheduler/server role and worker role
    assert cluster_synth.nag_errors == []
