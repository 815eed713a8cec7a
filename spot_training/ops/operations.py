"""``spot-train status | logs | cost``: what a deployed training stack is doing, and what it cost.

Works against AWS (``--stack``, ``--region``, ``--profile``: boto3's standard credential chain) and,
unchanged, against local mode's moto server (``--endpoint-url``, or the live ``spot-train local up``
state): the same calls, the same code. Everything is read from AWS's own services: CloudFormation (the
stack and its outputs), EC2 (the fleet request, its instances, the data volume, the spot price history),
CloudWatch (the agents' metrics, namespace ``SpotTraining/<stack>``, dimension ``Stack``; the alarms),
CloudWatch Logs (``/spot-training/<stack>``, one stream per instance) and the AWS Price List API
(``pricing`` in us-east-1) for on-demand prices. docs/operations.md describes the output.

Exit codes (:class:`Exit`): 0 ok; 1 an AWS call failed; 2 usage; 3 the stack does not exist;
4 AWS cannot be reached or the credentials are missing or refused; 130 interrupted.

Savings are computed as SageMaker does for managed spot training ("Managed Spot Training", SageMaker
Developer Guide): ``(1 - spot cost / on-demand cost) * 100``, here with the instance-hours of every
instance of the stack priced at the spot price history of its type and Availability Zone over its
lifetime, against the on-demand price of the same type and region. Without an on-demand price (the
Price List API unreachable and none given), no savings figure is printed.
"""

from __future__ import annotations

import dataclasses
import datetime as dt
import enum
import json
import math
import re
import time
from collections import defaultdict
from typing import Any, Callable, Iterable, Iterator

from spot_training.contract import METRICS_NAMESPACE_PREFIX, PURPOSE_TAG, STACK_TAG, metrics_namespace  # noqa: F401  (PURPOSE_TAG, STACK_TAG re-exported for local mode)

NAMESPACE = METRICS_NAMESPACE_PREFIX  # each stack's: metrics_namespace(stack), SpotTraining/<stack name>
LOG_GROUP_PREFIX = "/spot-training/"
#: Hours in a month as AWS prices GB-month storage (730 h).
HOURS_PER_MONTH = 730.0
#: Agent log events that make up the interruption history (spot_training.agent.publish, spot_training.agent.interruption, spot_training.agent.ebs).
HISTORY_EVENTS = ("spot_interruption_notice", "checkpoint_after_notice", "resumed", "copy_verified")
TABLE_WIDTH = 100


class Exit(enum.IntEnum):
    """Exit codes of ``spot-train status | logs | cost``."""

    OK = 0
    AWS_ERROR = 1
    USAGE = 2
    STACK_NOT_FOUND = 3
    UNREACHABLE = 4
    INTERRUPTED = 130


class OperationsError(Exception):
    """A failure with the exit code to give (``exit_code``) and a message for the user.

    Args:
        message: what went wrong and what to do, for the user.
        exit_code: the command's exit code (default :attr:`Exit.AWS_ERROR`).
    """

    def __init__(self, message: str, exit_code: Exit = Exit.AWS_ERROR) -> None:
        super().__init__(message)
        self.exit_code = exit_code


@dataclasses.dataclass
class Aws:
    """The boto3 clients the commands use (standard retry mode)."""

    region: str
    cloudformation: Any
    ec2: Any
    logs: Any
    cloudwatch: Any
    pricing: Any


def connect(*, region: str | None = None, profile: str | None = None, endpoint_url: str | None = None,
            credentials: tuple[str, str] | None = None) -> Aws:
    """boto3 clients for ``region``, credentials from the standard chain (``profile`` if given).

    The Price List API is always asked in us-east-1, where it lives.

    Args:
        region: the region (default: the profile's or ``AWS_DEFAULT_REGION``, which boto3 reads; it
            ignores ``AWS_REGION``).
        profile: a named profile of the AWS config, or None.
        endpoint_url: one endpoint for every client (local mode's moto server), or None.
        credentials: an explicit ``(access key id, secret)`` (local mode's fake ones), or None.

    Returns:
        the clients.

    Raises:
        OperationsError: ``UNREACHABLE`` when the profile does not exist; ``USAGE`` when there is no region.
    """
    import boto3
    import botocore.exceptions
    from botocore.config import Config

    try:
        keys = {"aws_access_key_id": credentials[0], "aws_secret_access_key": credentials[1]} if credentials else {}
        session = boto3.Session(profile_name=profile, region_name=region, **keys)
    except botocore.exceptions.ProfileNotFound as error:
        raise OperationsError(f"AWS profile {profile!r} does not exist: {error}", Exit.UNREACHABLE) from None
    region = session.region_name
    if not region:
        raise OperationsError("no AWS region: pass --region or set AWS_DEFAULT_REGION / a profile's region", Exit.USAGE)
    config = Config(retries={"mode": "standard"}, connect_timeout=5, read_timeout=30)
    extra = {"endpoint_url": endpoint_url} if endpoint_url else {}
    make = lambda service, r=region: session.client(service, region_name=r, config=config, **extra)  # noqa: E731
    return Aws(region=region, cloudformation=make("cloudformation"), ec2=make("ec2"), logs=make("logs"),
               cloudwatch=make("cloudwatch"), pricing=make("pricing", "us-east-1"))


def _call(what: str, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
    """Run one AWS call; turn botocore failures into :class:`OperationsError` with an exit code."""
    import botocore.exceptions

    try:
        return fn(*args, **kwargs)
    except (botocore.exceptions.NoCredentialsError, botocore.exceptions.PartialCredentialsError) as error:
        raise OperationsError(f"{what}: no AWS credentials ({error}); configure a profile or AWS_* variables",
                              Exit.UNREACHABLE) from None
    except (botocore.exceptions.EndpointConnectionError, botocore.exceptions.ConnectTimeoutError,
            botocore.exceptions.ReadTimeoutError) as error:
        raise OperationsError(f"{what}: AWS cannot be reached ({error})", Exit.UNREACHABLE) from None
    except botocore.exceptions.ClientError as error:
        code = error.response.get("Error", {}).get("Code", "")
        if code in ("UnrecognizedClientException", "InvalidClientTokenId", "AccessDenied", "AccessDeniedException",
                    "ExpiredToken", "AuthFailure", "UnauthorizedOperation"):
            raise OperationsError(f"{what}: credentials refused ({code}: {error})", Exit.UNREACHABLE) from None
        raise OperationsError(f"{what} failed: {error}") from None


def _utc(value: Any) -> dt.datetime:
    if isinstance(value, dt.datetime):
        return value if value.tzinfo else value.replace(tzinfo=dt.timezone.utc)
    return dt.datetime.fromtimestamp(float(value), tz=dt.timezone.utc)


def _iso(value: dt.datetime | None) -> str | None:
    return value.astimezone(dt.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ") if value else None


# ---- the stack ----------------------------------------------------------------------------------
def describe_stack(aws: Aws, stack: str) -> dict[str, Any]:
    """The stack's name, status, creation time and outputs.

    Args:
        aws: the clients (:func:`connect`).
        stack: the CloudFormation stack name.

    Returns:
        ``{"name", "status", "created" (UTC datetime), "outputs": {key: value}}``.

    Raises:
        OperationsError: ``STACK_NOT_FOUND`` when there is no such stack (or it was deleted); another
            code when the call failed.
    """
    try:
        found = _call("DescribeStacks", aws.cloudformation.describe_stacks, StackName=stack)["Stacks"]
    except OperationsError as error:
        if "does not exist" in str(error):
            raise OperationsError(f"stack {stack!r} does not exist in {aws.region} (deploy it with "
                                  f"`cdk deploy {stack}`, or check --stack/--region)", Exit.STACK_NOT_FOUND) from None
        raise
    live = [s for s in found if s["StackStatus"] != "DELETE_COMPLETE"]
    if not live:
        raise OperationsError(f"stack {stack!r} does not exist in {aws.region} (it was deleted)", Exit.STACK_NOT_FOUND)
    s = live[0]
    return {"name": s["StackName"], "status": s["StackStatus"], "created": _utc(s["CreationTime"]),
            "outputs": {o["OutputKey"]: o["OutputValue"] for o in s.get("Outputs", [])}}


def _stack_resource(aws: Aws, stack: str, resource_type: str) -> str | None:
    """The physical id of the stack's (first) resource of ``resource_type``, or None."""
    resources = _call("DescribeStackResources", aws.cloudformation.describe_stack_resources, StackName=stack)
    return next((r.get("PhysicalResourceId") for r in resources.get("StackResources", [])
                 if r["ResourceType"] == resource_type), None)


def _paginate(client: Any, operation: str, key: str, **kwargs: Any) -> list[Any]:
    items: list[Any] = []
    for page in _call(operation, lambda: list(client.get_paginator(operation).paginate(**kwargs))):
        items.extend(page.get(key, []))
    return items


def _instance_end(instance: dict[str, Any]) -> dt.datetime | None:
    """When a stopped/terminated instance ended: the time in its StateTransitionReason
    (``"... (2026-11-23 08:00:00 GMT)"``, as EC2 writes it), else None."""
    match = re.search(r"\((\d{4}-\d\d-\d\d \d\d:\d\d:\d\d) (?:GMT|UTC)\)", instance.get("StateTransitionReason") or "")
    if match:
        return dt.datetime.strptime(match.group(1), "%Y-%m-%d %H:%M:%S").replace(tzinfo=dt.timezone.utc)
    return None


def stack_instances(aws: Aws, stack: str, *, now: dt.datetime) -> list[dict[str, Any]]:
    """Every instance tagged with the stack (all states, plus those only the agents' ledger knows), oldest first.

    Each: id, type, AZ, state, launch and end time (None while running; ``end_estimated`` when EC2 did
    not say when it ended and ``now`` was used).

    Args:
        aws: the clients.
        stack: the stack's ``spot-training:stack`` tag value.
        now: the current time (UTC).

    Returns:
        one dict per instance.

    Raises:
        OperationsError: an AWS call failed.
    """
    reservations = _paginate(aws.ec2, "describe_instances", "Reservations",
                             Filters=[{"Name": f"tag:{STACK_TAG}", "Values": [stack]}])
    out = []
    for reservation in reservations:
        for i in reservation["Instances"]:
            state = i["State"]["Name"]
            end = _instance_end(i) if state in ("stopped", "terminated", "shutting-down") else None
            tags = {t["Key"]: t["Value"] for t in i.get("Tags", [])}
            out.append({"instance_id": i["InstanceId"], "instance_type": i["InstanceType"],
                        "availability_zone": i["Placement"]["AvailabilityZone"], "state": state,
                        "launch_time": _utc(i["LaunchTime"]), "end_time": end,
                        "end_estimated": end is None and state in ("stopped", "terminated"),
                        "lifecycle": i.get("InstanceLifecycle", "on-demand"),
                        "fleet_request_id": tags.get("aws:ec2spot:fleet-request-id")})
    # What existed is the agents' ledger's to say: EC2 lists a terminated instance for about an hour
    # only (EC2 API Reference, TerminateInstances). DescribeInstances fills in what is live.
    seen = {i["instance_id"] for i in out}
    for instance_id, item in ledger_instances(aws, stack).items():
        if instance_id not in seen:
            out.append({**item, "state": "terminated", "end_estimated": item["end_time"] is None,
                        "source": "ledger"})
    return sorted(out, key=lambda x: x["launch_time"])


#: The agents' ledger record (spot_training/agent/cli.py): one per instance, in the instance's log stream.
LEDGER_EVENT = "instance_ledger"


def ledger_instances(aws: Aws, stack: str) -> dict[str, dict[str, Any]]:
    """Every instance the stack's agents recorded, from their ledger records in the stack's log group
    (one stream per instance; kept for the group's retention, ``log_retention_days``), whether or not
    EC2 still lists it: instance id -> ``instance_type``, ``availability_zone``, ``lifecycle``,
    ``launch_time`` and ``end_time``: the spot interruption notice's termination time when the stream
    has one, else the stream's last event (the agent publishes until it stops). Empty when the stack
    has no log group (monitoring off).

    Args:
        aws: the clients.
        stack: the stack name (its log group's suffix).

    Returns:
        ``{instance id: record}``.

    Raises:
        OperationsError: an AWS call failed (a missing log group is no error).
    """
    try:
        events = [e for e in _ledger_events(aws, stack)]
    except OperationsError as error:
        if error.exit_code == Exit.STACK_NOT_FOUND:
            return {}
        raise
    last: dict[str, int] = {}
    for stream in _paginate(aws.logs, "describe_log_streams", "logStreams", logGroupName=log_group(stack)):
        if stream.get("lastEventTimestamp"):
            last[stream["logStreamName"]] = stream["lastEventTimestamp"]
    out: dict[str, dict[str, Any]] = {}
    notices: dict[str, dt.datetime] = {}
    for e in events:
        data = _parsed(e)
        if data.get("event") == "spot_interruption_notice" and data.get("time"):
            try:
                notices[e["instance_id"]] = _utc(dt.datetime.fromisoformat(str(data["time"]).replace("Z", "+00:00")))
            except ValueError:
                pass
        if data.get("event") != LEDGER_EVENT or not data.get("launch_time"):
            continue
        out[e["instance_id"]] = {
            "instance_id": e["instance_id"], "instance_type": data.get("instance_type", "unknown"),
            "availability_zone": data.get("availability_zone", "unknown"), "lifecycle": data.get("lifecycle", "spot"),
            "launch_time": _utc(dt.datetime.fromisoformat(str(data["launch_time"]).replace("Z", "+00:00"))),
            "fleet_request_id": data.get("fleet_request_id")}
    for instance_id, item in out.items():
        ends = [t for t in (notices.get(instance_id),) if t is not None]
        if instance_id in last:
            ends.append(dt.datetime.fromtimestamp(last[instance_id] / 1000, tz=dt.timezone.utc))
        item["end_time"] = max(ends) if ends else None
    return out


def _ledger_events(aws: Aws, stack: str) -> list[dict[str, Any]]:
    """The ledger records and interruption notices of the stack's log group (a term filter, so a long
    job's other lines are not read)."""
    events: list[dict[str, Any]] = []
    for term in (LEDGER_EVENT, "spot_interruption_notice"):
        token = None
        while True:
            try:
                response = _call("FilterLogEvents", aws.logs.filter_log_events, logGroupName=log_group(stack),
                                 filterPattern=f'"{term}"', **({"nextToken": token} if token else {}))
            except OperationsError as error:
                if "ResourceNotFoundException" in str(error):
                    raise OperationsError(f"log group {log_group(stack)!r} does not exist", Exit.STACK_NOT_FOUND) from None
                raise
            events += [{"timestamp": e["timestamp"], "instance_id": e["logStreamName"], "message": e["message"]}
                       for e in response.get("events", [])]
            token = response.get("nextToken")
            if not token:
                break
    return sorted(events, key=lambda e: e["timestamp"])


def _fleet(aws: Aws, fleet_id: str | None) -> dict[str, Any] | None:
    if not fleet_id:
        return None
    import botocore.exceptions

    try:
        configs = aws.ec2.describe_spot_fleet_requests(SpotFleetRequestIds=[fleet_id])["SpotFleetRequestConfigs"]
    except botocore.exceptions.ClientError:
        return {"id": fleet_id, "state": "not found", "target_capacity": None, "fulfilled_capacity": None}
    if not configs:
        return {"id": fleet_id, "state": "not found", "target_capacity": None, "fulfilled_capacity": None}
    c = configs[0]
    data = c["SpotFleetRequestConfig"]
    fulfilled = data.get("FulfilledCapacity")
    return {"id": fleet_id, "state": c["SpotFleetRequestState"], "target_capacity": data.get("TargetCapacity"),
            "fulfilled_capacity": int(fulfilled) if isinstance(fulfilled, float) and fulfilled.is_integer() else fulfilled}


def job_fleet_id(aws: Aws, job: str) -> str | None:
    """The newest spot fleet request tagged ``spot-training:stack`` = ``job``, or None.

    A job's identity is that tag (:mod:`spot_training.infra.job`). Spot Fleet's describe call takes no
    tag filter, hence the scan.

    Args:
        aws: the clients.
        job: the job id.

    Returns:
        the request id (``sfr-…``), or None.

    Raises:
        OperationsError: the call failed.
    """
    configs = _paginate(aws.ec2, "describe_spot_fleet_requests", "SpotFleetRequestConfigs")
    own = [c for c in configs if {t["Key"]: t["Value"] for t in c.get("Tags", [])}.get(STACK_TAG) == job]
    own.sort(key=lambda c: _utc(c["CreateTime"]) if c.get("CreateTime") else dt.datetime.min.replace(tzinfo=dt.timezone.utc))
    return own[-1]["SpotFleetRequestId"] if own else None


def data_volumes(aws: Aws, stack: str) -> list[dict[str, Any]]:
    """The stack's data volume(s): the volumes carrying both tags (stack and ``purpose=data-volume``).

    Args:
        aws: the clients.
        stack: the stack's tag value.

    Returns:
        one dict per volume: ``volume_id``, ``availability_zone``, ``size_gib``, ``volume_type`` (None
        where EC2 gives none), ``state``, ``create_time`` (UTC datetime), ``attached_to`` (instance ids).

    Raises:
        OperationsError: the call failed.
    """
    volumes = _paginate(aws.ec2, "describe_volumes", "Volumes", Filters=[
        {"Name": f"tag:{STACK_TAG}", "Values": [stack]}, {"Name": f"tag:{PURPOSE_TAG}", "Values": ["data-volume"]}])
    return [{"volume_id": v["VolumeId"], "availability_zone": v["AvailabilityZone"], "size_gib": v["Size"],
             "volume_type": v.get("VolumeType"), "state": v["State"], "create_time": _utc(v["CreateTime"]),
             "attached_to": [a["InstanceId"] for a in v.get("Attachments", [])]} for v in volumes]


def snapshots(aws: Aws, stack: str) -> list[dict[str, Any]]:
    """The stack's snapshots owned by this account (the stack tag; migration and periodic ones alike).

    Args:
        aws: the clients.
        stack: the stack's tag value.

    Returns:
        one dict per snapshot: ``snapshot_id``, ``size_gib`` (the source volume's size), ``start_time``
        (UTC datetime).

    Raises:
        OperationsError: the call failed.
    """
    found = _paginate(aws.ec2, "describe_snapshots", "Snapshots", OwnerIds=["self"],
                      Filters=[{"Name": f"tag:{STACK_TAG}", "Values": [stack]}])
    return [{"snapshot_id": s["SnapshotId"], "size_gib": s["VolumeSize"], "start_time": _utc(s["StartTime"])}
            for s in found]


# ---- metrics ------------------------------------------------------------------------------------------
METRIC_STATS = {"GlobalStep": "Maximum", "StepsTotal": "Maximum", "Loss": "Average", "CheckpointStep": "Maximum",
                "CheckpointAgeSeconds": "Minimum", "Completed": "Maximum", "InterruptionNotices": "Sum",
                "VolumeMoves": "Sum", "StepsDone": "Sum"}


def metric_series(aws: Aws, stack: str, *, start: dt.datetime, end: dt.datetime, period_s: int = 60) -> dict[str, list[tuple[dt.datetime, float]]]:
    """The agents' metrics of ``stack`` (:data:`METRIC_STATS`) from ``start`` to ``end`` (``GetMetricData``).

    Args:
        aws: the clients.
        stack: the stack name (its metrics namespace and ``Stack`` dimension).
        start: the first time (UTC).
        end: the last time (UTC).
        period_s: the statistics' period, seconds (default 60).

    Returns:
        ``{metric name: [(timestamp, value)]}``, oldest first.

    Raises:
        OperationsError: the call failed.
    """
    queries = [{"Id": f"m{n}", "Label": name, "ReturnData": True, "MetricStat": {
        "Metric": {"Namespace": metrics_namespace(stack), "MetricName": name, "Dimensions": [{"Name": "Stack", "Value": stack}]},
        "Period": period_s, "Stat": stat}} for n, (name, stat) in enumerate(METRIC_STATS.items())]
    series: dict[str, list[tuple[dt.datetime, float]]] = {name: [] for name in METRIC_STATS}
    token = None
    while True:
        kwargs = {"NextToken": token} if token else {}
        response = _call("GetMetricData", aws.cloudwatch.get_metric_data, MetricDataQueries=queries, StartTime=start,
                         EndTime=end, ScanBy="TimestampAscending", **kwargs)
        for result in response["MetricDataResults"]:
            name = result["Label"]
            series.setdefault(name, []).extend(zip((_utc(t) for t in result["Timestamps"]), result["Values"]))
        token = response.get("NextToken")
        if not token:
            break
    return {k: sorted(v) for k, v in series.items()}


def training_summary(series: dict[str, list[tuple[dt.datetime, float]]], *, now: dt.datetime) -> dict[str, Any]:
    """Step, total, loss, ETA, checkpoint and its age, completed, from :func:`metric_series`.

    Args:
        series: :func:`metric_series`'s result.
        now: the current time (UTC), for the checkpoint's age.

    Returns:
        ``{"step", "steps_total", "loss", "eta_s" (seconds, from the last 10 minutes' step rate),
        "last_checkpoint_step", "last_checkpoint_age_s", "completed", "last_report"}`` (None where unknown).
    """
    def last(name: str) -> tuple[dt.datetime, float] | None:
        return series.get(name, [])[-1] if series.get(name) else None

    step, total, loss = last("GlobalStep"), last("StepsTotal"), last("Loss")
    checkpoint, age = last("CheckpointStep"), last("CheckpointAgeSeconds")
    completed = bool(series.get("Completed"))
    eta = None
    steps = series.get("GlobalStep", [])
    if step and total and not completed:
        recent = [(t, v) for t, v in steps if (step[0] - t).total_seconds() <= 600]
        if len(recent) >= 2 and recent[-1][1] > recent[0][1]:
            rate = (recent[-1][1] - recent[0][1]) / max(1.0, (recent[-1][0] - recent[0][0]).total_seconds())
            eta = max(0.0, (total[1] - step[1]) / rate)
    checkpoint_age = None
    if age:
        checkpoint_age = age[1] + (now - age[0]).total_seconds()
    return {"step": int(step[1]) if step else None, "steps_total": int(total[1]) if total else None,
            "loss": loss[1] if loss else None, "eta_s": round(eta, 1) if eta is not None else None,
            "last_checkpoint_step": int(checkpoint[1]) if checkpoint else None,
            "last_checkpoint_age_s": round(checkpoint_age, 1) if checkpoint_age is not None else None,
            "completed": completed, "last_report": _iso(step[0]) if step else None}


def alarms(aws: Aws, stack: str, *, now: dt.datetime | None = None, job: str | None = None) -> list[dict[str, Any]]:
    """The stack's CloudWatch alarms (names start with the stack name, as CloudFormation names them):
    name, ``state`` (CloudWatch's), description, and ``evaluated``: the state :func:`evaluate_alarm`
    gives a single-metric alarm from its metric's statistics up to ``now`` (None for metric-math
    alarms or without ``now``). Local mode's moto stores alarms without evaluating them, so there
    ``evaluated`` is the one that means something. With ``job``: only that job's alarms (their
    descriptions start with ``<job id>:``, spot_training.infra.monitoring).

    Args:
        aws: the clients.
        stack: the stack name.
        now: evaluate single-metric alarms up to this time (UTC); None: no evaluation.
        job: only this job's alarms (None: all).

    Returns:
        ``[{"name", "state", "evaluated", "description"}]``.

    Raises:
        OperationsError: a call failed.
    """
    found = _call("DescribeAlarms", aws.cloudwatch.describe_alarms, AlarmNamePrefix=f"{stack}-")
    out = []
    for a in found.get("MetricAlarms", []) + found.get("CompositeAlarms", []):
        if job is not None and not a.get("AlarmDescription", "").startswith(f"{job}:"):
            continue
        evaluated = None
        if now is not None and a.get("MetricName") and a.get("Statistic") and a.get("Period"):
            period, n = int(a["Period"]), int(a["EvaluationPeriods"])
            points = _call("GetMetricStatistics", aws.cloudwatch.get_metric_statistics, Namespace=a["Namespace"],
                           MetricName=a["MetricName"], Dimensions=a.get("Dimensions", []),
                           StartTime=now - dt.timedelta(seconds=period * (n + 1)), EndTime=now, Period=period,
                           Statistics=[a["Statistic"]])["Datapoints"]
            series = [(_utc(p["Timestamp"]), p[a["Statistic"]]) for p in points]
            evaluated = evaluate_alarm(a, period_values(series, end=now, period_s=period, periods=n,
                                                        statistic=a["Statistic"]))
        out.append({"name": a["AlarmName"], "state": a["StateValue"], "evaluated": evaluated,
                    "description": a.get("AlarmDescription", "")})
    return out


# ---- alarm evaluation ---------------------------------------------------------------------------------
def evaluate_alarm(alarm: dict[str, Any], values: list[float | None]) -> str:
    """The state CloudWatch gives a metric alarm for the last ``EvaluationPeriods`` period values
    (oldest first; None = no data point in that period), with ``DatapointsToAlarm`` (M of N) and
    ``TreatMissingData`` (``missing``, ``notBreaching``, ``breaching``, ``ignore``): ``ALARM``, ``OK``
    or ``INSUFFICIENT_DATA``. Source: CloudWatch User Guide, "Evaluating an alarm" and "Configuring
    how CloudWatch alarms treat missing data". ``ignore`` keeps the current state, which a stateless
    evaluation cannot know; it is reported as ``INSUFFICIENT_DATA`` when every period is missing. For
    ``missing``/``ignore`` with some periods missing, only the present points are counted (CloudWatch
    also looks at older points then); the stack's alarms use ``notBreaching``, which is exact here.

    Args:
        alarm: the alarm as DescribeAlarms returns it (``EvaluationPeriods``, ``DatapointsToAlarm``,
            ``Threshold``, ``ComparisonOperator``, ``TreatMissingData``).
        values: one value per period, oldest first (None: no data point).

    Returns:
        ``"ALARM"``, ``"OK"`` or ``"INSUFFICIENT_DATA"``.

    Raises:
        ValueError: ``values`` holds fewer periods than ``EvaluationPeriods``, or an unknown operator.
    """
    n = int(alarm["EvaluationPeriods"])
    m = int(alarm.get("DatapointsToAlarm") or n)
    if len(values) < n:
        raise ValueError(f"need {n} period values (EvaluationPeriods), got {len(values)}")
    window = values[-n:]
    threshold = float(alarm["Threshold"])
    compare = {
        "GreaterThanOrEqualToThreshold": lambda v: v >= threshold,
        "GreaterThanThreshold": lambda v: v > threshold,
        "LessThanThreshold": lambda v: v < threshold,
        "LessThanOrEqualToThreshold": lambda v: v <= threshold,
    }.get(alarm["ComparisonOperator"])
    if compare is None:
        raise ValueError(f"unsupported ComparisonOperator {alarm['ComparisonOperator']!r}")
    treat = alarm.get("TreatMissingData", "missing")
    present = [v for v in window if v is not None]
    if treat == "breaching":
        states = [True if v is None else compare(v) for v in window]
    elif treat == "notBreaching":
        states = [False if v is None else compare(v) for v in window]
    else:  # missing / ignore: only the periods with data count
        if not present:
            return "INSUFFICIENT_DATA"
        states = [compare(v) for v in present]
    return "ALARM" if sum(states) >= m else "OK"


def period_values(points: list[tuple[dt.datetime, float]], *, end: dt.datetime, period_s: int, periods: int,
                  statistic: str = "Sum") -> list[float | None]:
    """Aggregate ``(timestamp, value)`` points into ``periods`` periods of ``period_s`` seconds ending at ``end``.

    Args:
        points: the data points.
        end: the end of the last period (UTC).
        period_s: the period, seconds.
        periods: how many periods.
        statistic: ``Sum`` (default), ``Maximum``, ``Minimum``, anything else averages.

    Returns:
        one value per period, oldest first; None where a period has no point.
    """
    out: list[float | None] = []
    for k in range(periods, 0, -1):
        lo = end - dt.timedelta(seconds=k * period_s)
        hi = lo + dt.timedelta(seconds=period_s)
        inside = [v for t, v in points if lo <= t < hi]
        if not inside:
            out.append(None)
        elif statistic == "Sum":
            out.append(sum(inside))
        elif statistic == "Maximum":
            out.append(max(inside))
        elif statistic == "Minimum":
            out.append(min(inside))
        else:
            out.append(sum(inside) / len(inside))
    return out


# ---- logs -------------------------------------------------------------------------------------------
def log_group(stack: str) -> str:
    """The stack's log group (spot_training.infra.monitoring.log_group_name)."""
    return f"{LOG_GROUP_PREFIX}{stack}"


def log_stream_names(aws: Aws, stack: str) -> list[str]:
    """The log streams of the stack's log group: one per instance that has logged (its instance id).

    Args:
        aws: the clients.
        stack: the stack name.

    Returns:
        the stream names, sorted.

    Raises:
        OperationsError(STACK_NOT_FOUND): the log group does not exist (monitoring off, or no stack).
    """
    def names() -> list[str]:
        pages = aws.logs.get_paginator("describe_log_streams").paginate(logGroupName=log_group(stack))
        return sorted(stream["logStreamName"] for page in pages for stream in page.get("logStreams", []))

    try:
        return _call("DescribeLogStreams", names)
    except OperationsError as error:
        if "ResourceNotFoundException" in str(error):
            raise OperationsError(f"log group {log_group(stack)!r} does not exist in {aws.region} (the stack "
                                  "was deployed with -c monitoring=false, or is not deployed)", Exit.STACK_NOT_FOUND) from None
        raise


def log_events(aws: Aws, stack: str, *, instance: str | None = None, start_ms: int | None = None) -> list[dict[str, Any]]:
    """Every event of the stack's log group (or one instance's stream) from ``start_ms``, merged across
    streams in time order: ``{"timestamp" (ms), "instance_id", "message", "event_id"}``.

    Args:
        aws: the clients.
        stack: the stack name.
        instance: one instance's stream only (None: every stream).
        start_ms: the first time, milliseconds since the epoch (None: the beginning).

    Returns:
        the events, oldest first.

    Raises:
        OperationsError(STACK_NOT_FOUND): the log group does not exist (monitoring off, or no stack).
    """
    kwargs: dict[str, Any] = {"logGroupName": log_group(stack)}
    if instance:
        kwargs["logStreamNames"] = [instance]
    if start_ms is not None:
        kwargs["startTime"] = start_ms
    events: list[dict[str, Any]] = []
    token = None
    while True:
        try:
            response = _call("FilterLogEvents", aws.logs.filter_log_events, **kwargs,
                             **({"nextToken": token} if token else {}))
        except OperationsError as error:
            if "ResourceNotFoundException" in str(error):
                raise OperationsError(f"log group {log_group(stack)!r} does not exist in {aws.region} (the stack "
                                      "was deployed with -c monitoring=false, or is not deployed)",
                                      Exit.STACK_NOT_FOUND) from None
            raise
        for e in response.get("events", []):
            events.append({"timestamp": e["timestamp"], "instance_id": e["logStreamName"], "message": e["message"],
                           "event_id": e.get("eventId") or f"{e['logStreamName']}/{e['timestamp']}/{len(events)}"})
        token = response.get("nextToken")
        if not token:
            break
    return sorted(events, key=lambda e: e["timestamp"])  # stable: each stream's order is kept


def _parsed(event: dict[str, Any]) -> dict[str, Any]:
    try:
        data = json.loads(event["message"])
        return data if isinstance(data, dict) else {"message": event["message"]}
    except ValueError:
        return {"message": event["message"]}


#: Terminal escape sequences (ECMA-48): CSI ``ESC [ ... final``, OSC/DCS/PM/APC/SOS strings up to BEL or
#: ``ESC \``, two-byte ``ESC x``, and their 8-bit C1 forms.
_ESCAPE_SEQUENCE = re.compile(r"(?:\x1b\[|\x9b)[0-?]*[ -/]*[@-~]"
                              r"|(?:\x1b[\]PX^_]|[\x90\x98\x9d\x9e\x9f])[^\x07\x1b\x9c]*(?:\x07|\x1b\\|\x9c)?"
                              r"|\x1b[ -/]*[0-~]?")
_CONTROL = re.compile(r"[\x00-\x08\x0a-\x1f\x7f-\x9f]")


def strip_control(text: str) -> str:
    """``text`` safe to print on a terminal: escape sequences (colours, cursor moves, title changes,
    OSC 52 clipboard writes) removed; a newline or carriage return shown as ``\\n``/``\\r`` (one event
    stays one line and cannot overwrite or fake another); every other C0/C1 control character removed."""
    text = _ESCAPE_SEQUENCE.sub("", text).replace("\r", "\\r").replace("\n", "\\n")
    return _CONTROL.sub("", text)


def format_log_line(event: dict[str, Any]) -> str:
    """``TIME INSTANCE SOURCE MESSAGE`` for one log event (agent lines: level and logger; trainer lines:
    'trainer'). The trainer writes what it likes: terminal control sequences are stripped (:func:`strip_control`)."""
    data = _parsed(event)
    when = dt.datetime.fromtimestamp(event["timestamp"] / 1000, tz=dt.timezone.utc).strftime("%H:%M:%S.%f")[:-3]
    source = data.get("logger", "")
    source = "trainer" if source == "trainer" else f"agent {str(data.get('level', ''))[:4]}".strip()
    return strip_control(f"{when} {event['instance_id']} {source:<10} {data.get('message', '')}")


def interruption_history(events: Iterable[dict[str, Any]]) -> list[dict[str, Any]]:
    """The interruptions, from the agents' structured log events (time order): per notice its time,
    instance, AZ, the notice->checkpoint seconds and checkpoint step the agent measured, and the
    replacement's resume (the first instance whose agent began logging after the notice): its id,
    boot->resume seconds, resumed step and whether the volume moved there."""
    history: list[dict[str, Any]] = []
    streams: dict[str, list[dict[str, Any]]] = defaultdict(list)
    order: list[str] = []
    for e in events:
        data = _parsed(e)
        if data.get("event") in HISTORY_EVENTS or data.get("availability_zone"):
            if e["instance_id"] not in streams:
                order.append(e["instance_id"])
            streams[e["instance_id"]].append({**data, "timestamp": e["timestamp"]})
    az = {i: next((d.get("availability_zone") for d in streams[i] if d.get("availability_zone")), None) for i in order}
    for instance in order:
        for d in streams[instance]:
            if d.get("event") != "spot_interruption_notice":
                continue
            item = {"time": _iso(dt.datetime.fromtimestamp(d["timestamp"] / 1000, tz=dt.timezone.utc)),
                    "instance_id": instance, "availability_zone": az.get(instance), "notice_to_checkpoint_s": None,
                    "checkpoint_step": None, "replacement_instance_id": None, "replacement_availability_zone": None,
                    "boot_to_resume_s": None, "resumed_at_step": None, "volume_moved": None}
            after = next((x for x in streams[instance] if x.get("event") == "checkpoint_after_notice"
                          and x["timestamp"] >= d["timestamp"]), None)
            if after:
                item["notice_to_checkpoint_s"] = after.get("notice_to_checkpoint_s")
                item["checkpoint_step"] = after.get("checkpoint_step")
            # The replacement: the first instance whose agent started logging after the notice (in a
            # cluster, the workers already running are not replacements).
            nxt = next((o for o in order if o != instance and streams[o][0]["timestamp"] >= d["timestamp"]), None)
            if nxt is not None:
                resumed = next((x for x in streams[nxt] if x.get("event") == "resumed"), None)
                item["replacement_instance_id"] = nxt
                item["replacement_availability_zone"] = az.get(nxt)
                item["volume_moved"] = any(x.get("event") == "copy_verified" for x in streams[nxt])
                if resumed:
                    item["boot_to_resume_s"] = resumed.get("boot_to_resume_s")
                    item["resumed_at_step"] = resumed.get("step")
            history.append(item)
    return history


# ---- cost -------------------------------------------------------------------------------------------------
def _price_segments(history: list[dict[str, Any]], start: dt.datetime, end: dt.datetime) -> list[tuple[dt.datetime, dt.datetime, float]]:
    """The spot price in effect over ``[start, end)`` as segments: each price holds from its timestamp
    until the next one (EC2's spot price history semantics); before the first point the first price."""
    points = sorted((_utc(p["Timestamp"]), float(p["SpotPrice"])) for p in history)
    if not points:
        return []
    segments = []
    for n, (t, price) in enumerate(points):
        lo = max(start, t) if n else start
        hi = min(end, points[n + 1][0]) if n + 1 < len(points) else end
        if hi > lo:
            segments.append((lo, hi, price))
    return segments


def spot_cost(aws: Aws, instance_type: str, availability_zone: str, start: dt.datetime, end: dt.datetime) -> tuple[float, float]:
    """``(cost USD, hours)`` of one instance of ``instance_type`` in ``availability_zone`` from
    ``start`` to ``end``, priced with ``DescribeSpotPriceHistory`` (Linux/UNIX) time-weighted.

    Args:
        aws: the clients.
        instance_type: the instance type.
        availability_zone: the AZ it ran in.
        start: when it launched (UTC).
        end: when it ended, or now (UTC).

    Returns:
        ``(cost in USD, hours)``.

    Raises:
        OperationsError: no spot price history for that type and AZ.
    """
    history = _paginate(aws.ec2, "describe_spot_price_history", "SpotPriceHistory", InstanceTypes=[instance_type],
                        AvailabilityZone=availability_zone, StartTime=start, EndTime=end,
                        ProductDescriptions=["Linux/UNIX", "Linux/UNIX (Amazon VPC)"])
    history = [p for p in history if p.get("AvailabilityZone", availability_zone) == availability_zone
               and p.get("InstanceType", instance_type) == instance_type]
    if not history:
        raise OperationsError(f"no spot price history for {instance_type} in {availability_zone}")
    end = max(start, end)  # EC2's end time has whole seconds; an instance ended within its first second
    segments = _price_segments(history, start, end)
    hours = (end - start).total_seconds() / 3600
    return sum(p * (hi - lo).total_seconds() / 3600 for lo, hi, p in segments), hours


def on_demand_price(aws: Aws, instance_type: str) -> float:
    """The Linux on-demand price (USD/hour) of ``instance_type`` in ``aws.region`` from the AWS Price List API.

    ``GetProducts``, service ``AmazonEC2``: shared tenancy, no pre-installed software, capacity status Used.

    Args:
        aws: the clients (``pricing`` in us-east-1).
        instance_type: the instance type.

    Returns:
        USD per hour.

    Raises:
        OperationsError: the API cannot be reached or has no such price.
    """
    filters = [{"Type": "TERM_MATCH", "Field": k, "Value": v} for k, v in (
        ("instanceType", instance_type), ("regionCode", aws.region), ("operatingSystem", "Linux"),
        ("tenancy", "Shared"), ("preInstalledSw", "NA"), ("capacitystatus", "Used"))]
    try:
        products = aws.pricing.get_products(ServiceCode="AmazonEC2", Filters=filters, MaxResults=10)["PriceList"]
    except Exception as error:  # noqa: BLE001 - any failure means: no on-demand figure
        first = (str(error).splitlines() or [""])[0][:160]
        raise OperationsError(f"the AWS Price List API cannot be reached ({type(error).__name__}: {first})") from None
    for product in products:
        data = json.loads(product) if isinstance(product, str) else product
        for term in data.get("terms", {}).get("OnDemand", {}).values():
            for dimension in term.get("priceDimensions", {}).values():
                usd = dimension.get("pricePerUnit", {}).get("USD")
                if usd is not None and float(usd) > 0:
                    return float(usd)
    raise OperationsError(f"the AWS Price List API has no Linux on-demand price for {instance_type} in {aws.region}")


def cost_report(aws: Aws, stack: str | None, *, now: dt.datetime, on_demand: dict[str, float] | None = None,
                ebs_gb_month: float | None = None, snapshot_gb_month: float | None = None,
                job: str | None = None) -> dict[str, Any]:
    """What the stack's (or one job's) instances cost, per instance type and AZ, and what they would have cost on demand.

    Args:
        aws: the clients (:func:`connect`).
        stack: the stack whose tag value (its one job) is priced; reported as ``stack``.
        now: the current time (UTC); running instances are priced up to it.
        job: price the instances, volume and snapshots tagged with this job id instead (a
            ``TrainingJob``'s identity); reported as ``job``.
        on_demand: USD/hour per instance type given by the user (local mode states its price this way);
            types not in it are asked of the Price List API.
        ebs_gb_month: USD per GB-month for the data volume (its type's price); None: not priced (its
            size and hours are still reported).
        snapshot_gb_month: USD per GB-month for snapshots; None: not priced (their sizes and hours
            are still reported).

    Spot instances (``InstanceLifecycle`` spot: the fleet's) are priced with the spot price history;
    on-demand ones (a cluster's scheduler and parameter servers, in Auto Scaling groups) at the
    on-demand price, which is what they are billed.

    Returns: ``rows`` (type, AZ, ``lifecycle`` spot/on-demand, instances, hours, ``spot_cost_usd`` (spot
    rows; None for on-demand rows), ``cost_usd`` (what the row was billed), ``on_demand_cost_usd``),
    ``spot_cost_usd`` (the spot rows), ``cost_usd`` (every row as billed), ``on_demand_cost_usd`` (every
    row at the on-demand price; None when any type has no on-demand price), ``savings_pct``
    (SageMaker's formula, ``1 - cost / on-demand cost``; None without both), ``on_demand_source``,
    ``notes``, ``storage``.
    """
    on_demand = dict(on_demand or {})
    notes: list[str] = []
    tag = job or stack
    if tag is None:
        raise OperationsError("cost needs a stack or a job id", Exit.USAGE)
    instances = [i for i in stack_instances(aws, tag, now=now) if i["state"] != "pending"]
    groups: dict[tuple[str, str], dict[str, Any]] = {}
    for i in instances:
        end = i["end_time"] or now
        if i["end_estimated"]:
            notes.append(f"{i['instance_id']}: EC2 gave no end time; counted until now")
        lifecycle = "spot" if i["lifecycle"] == "spot" else "on-demand"
        row = groups.setdefault((i["instance_type"], i["availability_zone"], lifecycle), {
            "instance_type": i["instance_type"], "availability_zone": i["availability_zone"], "lifecycle": lifecycle,
            "instances": 0, "hours": 0.0, "spot_cost_usd": 0.0 if lifecycle == "spot" else None, "cost_usd": None,
            "on_demand_cost_usd": None})
        row["instances"] += 1
        if lifecycle == "on-demand":  # billed at the on-demand price (below)
            row["hours"] += max(0.0, (end - i["launch_time"]).total_seconds() / 3600)
            continue
        try:
            spot, hours = spot_cost(aws, i["instance_type"], i["availability_zone"], i["launch_time"], end)
        except OperationsError as error:  # no price: no figure for this row (never a made-up one)
            notes.append(f"{i['instance_id']}: {error}; its spot cost is unknown")
            hours, spot = max(0.0, (end - i["launch_time"]).total_seconds() / 3600), None
        row["hours"] += hours
        row["spot_cost_usd"] = None if spot is None or row["spot_cost_usd"] is None else row["spot_cost_usd"] + spot
    sources: dict[str, str] = {}
    for itype in sorted({k[0] for k in groups}):
        if itype in on_demand:
            sources[itype] = "given"
            continue
        try:
            on_demand[itype] = on_demand_price(aws, itype)
            sources[itype] = "AWS Price List API"
        except OperationsError as error:
            notes.append(f"on-demand price of {itype} unknown: {error}; spot cost only")
    for row in groups.values():
        price = on_demand.get(row["instance_type"])
        row["on_demand_cost_usd"] = price * row["hours"] if price is not None else None
        row["cost_usd"] = row["spot_cost_usd"] if row["lifecycle"] == "spot" else row["on_demand_cost_usd"]
    rows = sorted(groups.values(), key=lambda r: (r["lifecycle"] != "spot", r["instance_type"], r["availability_zone"]))
    spot_rows = [r for r in rows if r["lifecycle"] == "spot"]
    spot_known = all(r["spot_cost_usd"] is not None for r in spot_rows)
    spot_total = sum(r["spot_cost_usd"] for r in spot_rows) if spot_known else None
    paid_known = all(r["cost_usd"] is not None for r in rows)
    paid_total = sum(r["cost_usd"] for r in rows) if paid_known else None
    known = all(r["on_demand_cost_usd"] is not None for r in rows) and rows
    od_total = sum(r["on_demand_cost_usd"] for r in rows) if known else None
    savings = (1 - paid_total / od_total) * 100 if od_total and paid_total is not None else None

    volumes = data_volumes(aws, tag)
    snaps = snapshots(aws, tag)
    volume_gb_hours = sum(v["size_gib"] * max(0.0, (now - v["create_time"]).total_seconds()) / 3600 for v in volumes)
    snapshot_gb_hours = sum(s["size_gib"] * max(0.0, (now - s["start_time"]).total_seconds()) / 3600 for s in snaps)
    storage = {
        "volume_gib_hours": volume_gb_hours, "snapshot_gib_hours": snapshot_gb_hours,
        "volume_cost_usd": volume_gb_hours / HOURS_PER_MONTH * ebs_gb_month if ebs_gb_month is not None else None,
        "snapshot_cost_usd": (snapshot_gb_hours / HOURS_PER_MONTH * snapshot_gb_month
                              if snapshot_gb_month is not None else None),
        "snapshots": len(snaps),
    }
    if ebs_gb_month is None:
        notes.append("EBS volume not priced (give --ebs-gb-month-price); GiB-hours shown")
    if snapshot_gb_month is None and snaps:
        notes.append("snapshots not priced (give --snapshot-gb-month-price); GiB-hours of their full size shown")
    return {"stack": stack, "job": tag, "region": aws.region, "as_of": _iso(now), "rows": rows,
            "instance_hours": sum(r["hours"] for r in rows), "spot_cost_usd": spot_total, "cost_usd": paid_total,
            "on_demand_cost_usd": od_total, "savings_pct": savings,
            "on_demand_price_usd_per_hour": {k: on_demand[k] for k in sorted(on_demand) if k in sources},
            "on_demand_source": sources, "storage": storage, "notes": notes}


# ---- status -----------------------------------------------------------------------------------------
def status_report(aws: Aws, stack: str | None, *, now: dt.datetime, window_s: float = 14 * 24 * 3600,
                  job: str | None = None) -> dict[str, Any]:
    """Everything ``spot-train status`` shows (see the module docstring); raises OperationsError.

    Args:
        aws: the clients (:func:`connect`).
        stack: the CloudFormation stack (its status, outputs and alarms); None with ``job``: the job alone.
        now: the current time (UTC).
        window_s: how far back metrics are read, seconds (default 14 days; never before the stack's
            creation).
        job: a job id (spot_training.infra.job.TrainingJob): its instances, fleet request, data volume,
            metrics and logs are those tagged with it; default: the stack's name (the single-node stack's job).

    Raises:
        OperationsError: no such stack; STACK_NOT_FOUND also when a job has no fleet request, instance or volume.
    """
    if stack is None and job is None:
        raise OperationsError("status needs a stack or a job id", Exit.USAGE)
    tag = job or stack
    info = describe_stack(aws, stack) if stack is not None else None
    if job is not None:
        fleet_id = job_fleet_id(aws, job)
    else:
        fleet_id = info["outputs"].get("FleetRequestId") or _stack_resource(aws, stack, "AWS::EC2::SpotFleet")
    fleet = _fleet(aws, fleet_id)
    instances = stack_instances(aws, tag, now=now)
    volumes = data_volumes(aws, tag)
    if info is None and fleet is None and not instances and not volumes:
        raise OperationsError(f"job {job!r} has no fleet request, instance or data volume in {aws.region} "
                              "(check --job/--region)", Exit.STACK_NOT_FOUND)
    created = info["created"] if info else min([i["launch_time"] for i in instances] + [v["create_time"] for v in volumes]
                                                + [now - dt.timedelta(seconds=window_s)])
    if fleet is not None and fleet["fulfilled_capacity"] is None:
        fleet["fulfilled_capacity"] = sum(1 for i in instances if i["state"] in ("pending", "running"))
    # From the stack's creation (at most window_s back), in at most 1,440 periods of whole minutes:
    # one GetMetricData answer per metric on AWS, and seconds, not minutes, against moto.
    start = max(now - dt.timedelta(seconds=window_s), created - dt.timedelta(minutes=1))
    period = 60 * max(1, math.ceil((now - start).total_seconds() / 60 / 1440))
    series = metric_series(aws, tag, start=start, end=now + dt.timedelta(minutes=1), period_s=period)
    try:
        events = [e for e in log_events(aws, tag, start_ms=int(start.timestamp() * 1000))]
        history = interruption_history(events)
        logs_note = None
    except OperationsError as error:
        history, logs_note = [], str(error)
    alarm_states = alarms(aws, stack, now=now, job=job) if stack is not None else []
    return {
        "stack": info["name"] if info else None, "stack_status": info["status"] if info else None, "job": tag,
        "region": aws.region, "as_of": _iso(now),
        "fleet": fleet,
        "instances": [{**i, "launch_time": _iso(i["launch_time"]), "end_time": _iso(i["end_time"])} for i in instances],
        "training": training_summary(series, now=now),
        "interruptions": history,
        "data_volume": [{**v, "create_time": _iso(v["create_time"])} for v in volumes],
        "alarms": alarm_states,
        "notes": [logs_note] if logs_note else [],
    }


# ---- formatting ------------------------------------------------------------------------------------------
def table(headers: list[str], rows: list[list[Any]], width: int = TABLE_WIDTH) -> str:
    """A plain text table no wider than ``width`` columns (the widest column is cut with '~').

    Args:
        headers: the column titles.
        rows: the cells (None shows as ``-``).
        width: the most characters per line (default :data:`TABLE_WIDTH`).

    Returns:
        the table's lines, joined by newlines.
    """
    cells = [[("-" if v is None else str(v)) for v in row] for row in rows]
    widths = [max(len(h), *(len(r[i]) for r in cells)) if cells else len(h) for i, h in enumerate(headers)]
    while sum(widths) + 2 * (len(widths) - 1) > width and max(widths) > 4:
        widths[widths.index(max(widths))] -= 1
    def fit(text: str, w: int) -> str:
        return text if len(text) <= w else text[: w - 1] + "~"
    lines = ["  ".join(fit(h, widths[i]).ljust(widths[i]) for i, h in enumerate(headers)).rstrip(),
             "  ".join("-" * w for w in widths)]
    lines += ["  ".join(fit(c, widths[i]).ljust(widths[i]) for i, c in enumerate(r)).rstrip() for r in cells]
    return "\n".join(lines)


def progress_bar(step: int | None, total: int | None, width: int = 30) -> str:
    """``[#########.....]  45.0%`` (``[?...]`` when step or total is unknown).

    Args:
        step: completed steps, or None.
        total: total steps, or None.
        width: characters inside the brackets (default 30).

    Returns:
        the bar.
    """
    if not step or not total:
        return "[" + "?" * width + "]"
    fraction = min(1.0, step / total)
    filled = int(round(fraction * width))
    return f"[{'#' * filled}{'.' * (width - filled)}] {fraction * 100:5.1f}%"


def _dur(seconds: float | None) -> str:
    if seconds is None:
        return "-"
    seconds = int(seconds)
    h, rest = divmod(seconds, 3600)
    m, s = divmod(rest, 60)
    return f"{h}h{m:02d}m" if h else (f"{m}m{s:02d}s" if m else f"{s}s")


def _subject(report: dict[str, Any], *, status: bool = True) -> str:
    """``stack S (STATUS)``, ``job J of stack S (STATUS)`` or ``job J``: what a report is about."""
    stack, job = report.get("stack"), report.get("job")
    of_stack = f"stack {stack}" + (f" ({report.get('stack_status')})" if status and report.get("stack_status") else "")
    if job is None or job == stack:
        return of_stack
    return f"job {job}" + (f" of {of_stack}" if stack else "")


def format_status(report: dict[str, Any]) -> str:
    """``spot-train status`` as text, every line within 100 columns."""
    t = report["training"]
    fleet = report["fleet"] or {}
    lines = [f"{_subject(report)} in {report['region']}, as of {report['as_of']}",
             f"fleet {fleet.get('id', '-')}: {fleet.get('state', '-')}, target {fleet.get('target_capacity', '-')}, "
             f"fulfilled {fleet.get('fulfilled_capacity', '-')}", ""]
    step = f"{t['step']}/{t['steps_total']}" if t["step"] is not None else "no progress reported yet"
    loss = f"{t['loss']:.4f}" if t["loss"] is not None else "-"
    lines.append(f"training {progress_bar(t['step'], t['steps_total'])} step {step} loss {loss} "  # <= 100 columns
                 f"ETA {_dur(t['eta_s']) if not t['completed'] else 'done'}")
    lines.append(f"last checkpoint: step {t['last_checkpoint_step'] if t['last_checkpoint_step'] is not None else '-'}, "
                 f"{_dur(t['last_checkpoint_age_s'])} old; completed: {'yes' if t['completed'] else 'no'}")
    lines += ["", "Instances"]
    lines.append(table(["instance", "type", "AZ", "state", "launched (UTC)", "ended (UTC)"], [
        [i["instance_id"], i["instance_type"], i["availability_zone"], i["state"], i["launch_time"], i["end_time"]]
        for i in report["instances"]]))
    lines += ["", "Interruptions"]
    if report["interruptions"]:
        lines.append(table(["#", "notice", "instance", "AZ", "n->ckpt s", "ckpt", "resumed on", "b->res s", "volume"], [
            [n + 1, (h["time"] or "")[11:19], h["instance_id"], az_move(h),
             format_number(h["notice_to_checkpoint_s"]), h["checkpoint_step"], h["replacement_instance_id"],
             format_number(h["boot_to_resume_s"]),
             "moved" if h["volume_moved"] else ("stayed" if h["volume_moved"] is False else "-")]
            for n, h in enumerate(report["interruptions"])]))
    else:
        lines.append("none")
    lines += ["", "Data volume"]
    lines.append(table(["volume", "AZ", "GiB", "state", "attached to"], [
        [v["volume_id"], v["availability_zone"], v["size_gib"], v["state"], ", ".join(v["attached_to"]) or "-"]
        for v in report["data_volume"]]) if report["data_volume"] else "none")
    if report["alarms"]:
        lines += ["", "Alarms"]
        lines.append(table(["alarm", "state", "evaluated now"],
                           [[a["name"], a["state"], a.get("evaluated")] for a in report["alarms"]]))
    for note in report.get("notes", []):
        lines.append(f"note: {note}")
    return "\n".join(lines) + "\n"


def az_move(item: dict[str, Any]) -> str:
    """``1a->1b``: the interruption's AZ and its replacement's, shortened to fit the table."""
    short = lambda az: az[-2:] if az else "?"  # noqa: E731 - us-east-1a -> 1a
    return f"{short(item.get('availability_zone'))}->{short(item.get('replacement_availability_zone'))}"


def format_number(value: Any) -> str:
    """``value`` with two decimals for a table, ``-`` for None."""
    return "-" if value is None else f"{float(value):.2f}"


def _usd(value: float | None) -> str:
    if value is None:
        return "n/a"
    if 0 < value < 0.01:
        return "$" + f"{value:.10f}".rstrip("0")  # tiny (local mode's prices): every digit, no exponent
    return f"${value:,.2f}"


def format_cost(report: dict[str, Any]) -> str:
    """``spot-train cost`` as text, every line within 100 columns."""
    lines = [f"cost of {_subject(report, status=False)} in {report['region']}, as of {report['as_of']}", ""]
    lines.append(table(["type", "AZ", "billed as", "instances", "hours", "cost", "on-demand cost"], [
        [r["instance_type"], r["availability_zone"], r["lifecycle"], r["instances"], f"{r['hours']:.3f}",
         _usd(r["cost_usd"]), _usd(r["on_demand_cost_usd"])] for r in report["rows"]]) if report["rows"] else "no instances")
    lines.append("")
    lines.append(f"instance-hours      {report['instance_hours']:.3f}")
    lines.append(f"spot cost           {_usd(report['spot_cost_usd'])}"
                 + ("" if report["spot_cost_usd"] is not None else " (a spot price history is missing)"))
    if any(r["lifecycle"] == "on-demand" for r in report["rows"]):
        lines.append(f"cost (all)          {_usd(report['cost_usd'])} (on-demand instances at the on-demand price)")
    lines.append(f"on-demand cost      {_usd(report['on_demand_cost_usd'])}")
    for itype, price in report["on_demand_price_usd_per_hour"].items():
        lines.append(f"  on-demand price   {itype} ${price}/h ({report['on_demand_source'][itype]})")
    savings = report["savings_pct"]
    lines.append(f"savings             {f'{savings:.3f} %' if savings is not None else 'n/a (no spot or no on-demand cost)'}")
    s = report["storage"]
    lines.append(f"EBS data volume     {s['volume_gib_hours']:.1f} GiB-h, {_usd(s['volume_cost_usd'])}")
    lines.append(f"snapshots ({s['snapshots']})       {s['snapshot_gib_hours']:.1f} GiB-h, {_usd(s['snapshot_cost_usd'])}")
    for note in report["notes"]:
        lines.append(f"note: {note}")
    return "\n".join(lines) + "\n"


def follow_logs(aws: Aws, stack: str, *, instance: str | None, start_ms: int | None, poll_s: float = 2.0,
                sleep: Callable[[float], None] = time.sleep) -> Iterator[dict[str, Any]]:
    """Yield log events as they arrive (``logs --follow``).

    Everything from ``start_ms``, then new events every ``poll_s`` seconds, each once (by event id).
    Ends only when the caller stops.

    Args:
        aws: the clients.
        stack: the stack name.
        instance: one instance's stream only (None: every stream).
        start_ms: the first time, milliseconds since the epoch (None: the beginning).
        poll_s: seconds between polls (default 2).
        sleep: sleeps the given seconds (default ``time.sleep``).

    Yields:
        the events of :func:`log_events`.

    Raises:
        OperationsError: as :func:`log_events`.
    """
    seen: set[str] = set()
    since = start_ms
    while True:
        for event in log_events(aws, stack, instance=instance, start_ms=since):
            if event["event_id"] in seen:
                continue
            seen.add(event["event_id"])
            since = max(since or 0, event["timestamp"])
            yield event
        sleep(poll_s)


def to_json(data: Any) -> str:
    """JSON for ``--json`` (datetimes as ISO 8601 UTC)."""
    return json.dumps(data, indent=2, default=lambda v: _iso(v) if isinstance(v, dt.datetime) else str(v))
