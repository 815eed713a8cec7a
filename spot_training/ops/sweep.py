"""``spot-train sweep submit | status | best | logs | cost | cancel``: sweeps against a deployed ``SpotSweep`` stack.

A sweep is one AWS Batch array job (spot_training/infra/sweep.py). ``submit`` uploads the parameter
sets as ``s3://<manifest bucket>/sweeps/<sweep>/manifest.json`` (the seed's hyperparameter list in
S3) and submits ``arrayProperties.size`` = their count; child ``i`` trains set ``i`` and writes
under ``/storage/<sweep>/<i>/`` on EFS. Each child mirrors its ``metrics.json`` and
``attempts.json`` to ``s3://<bucket>/sweeps/<sweep>/<i>/`` (spot_training/agent/sweep_child.py), so
these commands read S3 and Batch only, never the file system.

Every function takes boto3-shaped clients (``batch``, ``s3``, ``cloudformation``); local mode passes
spot_training.local.batch.LocalBatch as ``batch``. Exit codes are spot_training.ops.operations.Exit.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime as dt
import itertools
import json
import re
import sys
import uuid
from pathlib import Path
from typing import Any, Callable

from spot_training import contract
from spot_training.ops.operations import Exit, OperationsError

#: S3 key prefix of every sweep in the manifest bucket.
PREFIX = "sweeps"
_SWEEP_ID = re.compile(r"[a-z0-9][a-z0-9-]{0,62}")


@dataclasses.dataclass(frozen=True)
class SweepStack:
    """What the commands need of a deployed SpotSweep stack (read from its resources)."""

    name: str
    job_queue: str
    job_definition: str
    bucket: str


def sweep_stack(cloudformation: Any, stack: str) -> SweepStack:
    """Read ``stack``'s job queue, job definition and manifest bucket.

    Args:
        cloudformation: a boto3 CloudFormation client.
        stack: the SpotSweep stack's name.

    Returns:
        its job queue, job definition and manifest bucket.

    Raises:
        OperationsError(STACK_NOT_FOUND): no such stack, or it is not a SpotSweep stack.
    """
    try:
        resources = cloudformation.describe_stack_resources(StackName=stack)["StackResources"]
    except Exception as error:  # noqa: BLE001 - botocore's ClientError (does not exist) and friends
        raise OperationsError(f"stack {stack!r} not found: {error}", Exit.STACK_NOT_FOUND) from None
    found: dict[str, str] = {}
    for r in resources:
        kind = r.get("ResourceType", "")
        if kind == "AWS::S3::Bucket" and "ManifestBucket" in r.get("LogicalResourceId", ""):
            found["bucket"] = r["PhysicalResourceId"]
        elif kind in ("AWS::Batch::JobQueue", "AWS::Batch::JobDefinition"):
            found[kind.rsplit(":", 1)[-1]] = r["PhysicalResourceId"]
    if set(found) != {"bucket", "JobQueue", "JobDefinition"}:
        raise OperationsError(f"stack {stack!r} is not a SpotSweep stack (found {sorted(found)})", Exit.STACK_NOT_FOUND)
    return SweepStack(stack, found["JobQueue"], found["JobDefinition"], found["bucket"])


def parameter_sets(spec: Any) -> list[dict[str, Any]]:
    """The parameter sets of a sweep file's content: a list of objects as is, or
    ``{"grid": {name: [values]}, "base": {...}}``: every combination (``itertools.product``, the
    grid's key order), each on top of ``base``.

    Raises:
        ValueError: naming what is wrong and what is allowed.
    """
    if isinstance(spec, dict) and "grid" in spec:
        grid, base = spec["grid"], spec.get("base", {})
        if not isinstance(grid, dict) or not grid or not all(isinstance(v, list) and v for v in grid.values()):
            raise ValueError(f"grid must map each parameter to a non-empty list of values, got {grid!r}")
        if not isinstance(base, dict):
            raise ValueError(f"base must be an object of parameters, got {base!r}")
        sets = [{**base, **dict(zip(grid, values))} for values in itertools.product(*grid.values())]
    elif isinstance(spec, list):
        sets = spec
    else:
        raise ValueError("a sweep file holds a list of parameter objects or {\"grid\": {name: [values]}}")
    from spot_training.agent.sweep_child import SweepConfigError, check_manifest

    try:
        return check_manifest(sets, where="sweep file")
    except SweepConfigError as error:
        raise ValueError(str(error)) from None


def read_sweep_file(path: Path) -> list[dict[str, Any]]:
    """:func:`parameter_sets` of a JSON or YAML file (by suffix ``.yaml``/``.yml``)."""
    text = Path(path).read_text(encoding="utf-8")
    if Path(path).suffix in (".yaml", ".yml"):
        import yaml

        return parameter_sets(yaml.safe_load(text))
    return parameter_sets(json.loads(text))


def submit(batch: Any, s3: Any, stack: SweepStack, sets: list[dict[str, Any]], *, command: str,
           sweep_id: str | None = None) -> dict[str, Any]:
    """Upload the manifest and submit one array job (one plain job when there is one set: Batch's arrays hold 2..10000).

    Source: AWS Batch User Guide, "Array jobs".

    Args:
        batch: a boto3 Batch client.
        s3: a boto3 S3 client.
        stack: the sweep stack's resources (:func:`sweep_stack`).
        sets: the parameter sets, index i = child i.
        command: the training command (the job definition's ``command`` parameter).
        sweep_id: the sweep's id (default: ``<UTC time>-<6 hex digits>``).

    Returns:
        ``{"sweep_id", "job_id", "manifest_uri", "size", "command"}`` (also written as ``job.json``).

    Raises:
        ValueError: a bad ``sweep_id`` (lower-case letters, digits, hyphens) or an empty command.
    """
    sweep_id = sweep_id or dt.datetime.now(dt.timezone.utc).strftime("%Y%m%d-%H%M%S-") + uuid.uuid4().hex[:6]
    if not _SWEEP_ID.fullmatch(sweep_id):
        raise ValueError(f"sweep id must be lower-case letters, digits and hyphens (<= 63), got {sweep_id!r}")
    if not command.strip():
        raise ValueError("the training command must not be empty")
    key = f"{PREFIX}/{sweep_id}/{contract.SWEEP_MANIFEST_FILE}"
    s3.put_object(Bucket=stack.bucket, Key=key, Body=json.dumps(sets, indent=1).encode())
    uri = f"s3://{stack.bucket}/{key}"
    env = [{"name": contract.ENV_SWEEP_ID, "value": sweep_id}, {"name": contract.ENV_SWEEP_MANIFEST_URI, "value": uri}]
    kwargs: dict[str, Any] = {"arrayProperties": {"size": len(sets)}} if len(sets) > 1 else {}
    job = batch.submit_job(jobName=f"sweep-{sweep_id}", jobQueue=stack.job_queue, jobDefinition=stack.job_definition,
                           containerOverrides={"environment": env}, parameters={"command": command}, **kwargs)
    record = {"sweep_id": sweep_id, "job_id": job["jobId"], "manifest_uri": uri, "size": len(sets), "command": command}
    s3.put_object(Bucket=stack.bucket, Key=f"{PREFIX}/{sweep_id}/job.json", Body=json.dumps(record).encode())
    return record


def _read_json(s3: Any, bucket: str, key: str) -> Any:
    try:
        return json.loads(s3.get_object(Bucket=bucket, Key=key)["Body"].read())
    except Exception:  # noqa: BLE001 - absent (NoSuchKey) or unreadable: nothing yet
        return None


def _job(s3: Any, stack: SweepStack, sweep_id: str) -> dict[str, Any]:
    record = _read_json(s3, stack.bucket, f"{PREFIX}/{sweep_id}/job.json")
    if record is None:
        raise OperationsError(f"no sweep {sweep_id!r} in s3://{stack.bucket}/{PREFIX}/", Exit.STACK_NOT_FOUND)
    return record


def status_report(batch: Any, s3: Any, stack: SweepStack, sweep_id: str, *, metric: str = "accuracy",
                  price: Callable[[str, str, dt.datetime, dt.datetime], float] | None = None) -> dict[str, Any]:
    """The sweep's status per index and its best-so-far table.

    Per index: state, attempts, reclaims (attempts whose host went, ``Host EC2*``), step/total,
    ``metric`` at the newest committed checkpoint, params, and with ``price`` the cost summed over
    every attempt.

    Args:
        batch: a boto3 Batch client.
        s3: a boto3 S3 client.
        stack: the sweep stack's resources.
        sweep_id: the sweep.
        metric: the metric column and ranking key (default ``accuracy``, higher is better).
        price: ``price(instance_type, az, start, end) -> USD`` (None: no costs).

    Returns:
        ``{"sweep_id", "job_id", "size", "metric", "children", "best", "total_cost_usd"}``.

    Raises:
        OperationsError: ``STACK_NOT_FOUND`` when there is no such sweep.
    """
    record = _job(s3, stack, sweep_id)
    manifest = _read_json(s3, stack.bucket, f"{PREFIX}/{sweep_id}/{contract.SWEEP_MANIFEST_FILE}") or []
    size = record["size"]
    ids = [f"{record['job_id']}:{i}" for i in range(size)] if size > 1 else [record["job_id"]]
    described: dict[str, dict[str, Any]] = {}
    for start in range(0, len(ids), 100):  # DescribeJobs takes up to 100 ids
        for job in batch.describe_jobs(jobs=ids[start:start + 100])["jobs"]:
            described[job["jobId"]] = job
    rows = []
    for index, job_id in enumerate(ids):
        job = described.get(job_id, {})
        base = f"{PREFIX}/{sweep_id}/{index}/"
        metrics = _read_json(s3, stack.bucket, base + contract.SWEEP_METRICS_FILE) or {}
        recorded = {a["attempt"]: a for a in (_read_json(s3, stack.bucket, base + contract.SWEEP_ATTEMPTS_FILE) or {}).get("attempts", [])}
        attempts = []
        for number, attempt in enumerate(job.get("attempts", []), start=1):
            own = recorded.get(number, {})
            started = dt.datetime.fromtimestamp(attempt["startedAt"] / 1000, dt.timezone.utc) if attempt.get("startedAt") else None
            stopped = dt.datetime.fromtimestamp(attempt["stoppedAt"] / 1000, dt.timezone.utc) if attempt.get("stoppedAt") else None
            row = {"attempt": number, "status_reason": attempt.get("statusReason"), "exit_code": (attempt.get("container") or {}).get("exitCode"),
                   "instance_id": own.get("instance_id"), "instance_type": own.get("instance_type"),
                   "availability_zone": own.get("availability_zone"), "start_step": own.get("start_step"),
                   "end_step": own.get("end_step"), "seconds": (stopped - started).total_seconds() if started and stopped else None,
                   "cost_usd": None}
            if price is not None and started and stopped and row["instance_type"] and row["availability_zone"]:
                row["cost_usd"] = round(price(row["instance_type"], row["availability_zone"], started, stopped), 8)
            attempts.append(row)
        reclaims = sum(1 for a in attempts if str(a["status_reason"] or "").startswith("Host EC2"))
        costs = [a["cost_usd"] for a in attempts if a["cost_usd"] is not None]
        rows.append({"index": index, "state": job.get("status", "UNKNOWN"), "status_reason": job.get("statusReason"),
                     "attempts": len(attempts) + (1 if job.get("status") in ("RUNNING", "STARTING") else 0), "reclaims": reclaims,
                     "step": metrics.get("step"), "total_steps": metrics.get("total_steps"), metric: metrics.get(metric),
                     "params": manifest[index] if index < len(manifest) else None,
                     "cost_usd": round(sum(costs), 8) if costs else None, "attempt_details": attempts})
    return {"sweep_id": sweep_id, "job_id": record["job_id"], "size": size, "metric": metric, "children": rows,
            "best": best_table(rows, metric=metric), "total_cost_usd": round(sum(r["cost_usd"] or 0.0 for r in rows), 8)}


def best_table(rows: list[dict[str, Any]], *, metric: str = "accuracy", top: int = 10) -> list[dict[str, Any]]:
    """The best-so-far table: children with a committed ``metric``, highest first (ties: lower index).

    Args:
        rows: :func:`status_report`'s children.
        metric: the ranking key (default ``accuracy``).
        top: the most rows (default 10).

    Returns:
        ``[{"rank", "index", metric, "step", "total_steps", "state", "params"}]``.
    """
    scored = [r for r in rows if isinstance(r.get(metric), (int, float))]
    scored.sort(key=lambda r: (-r[metric], r["index"]))
    return [{"rank": n + 1, "index": r["index"], metric: r[metric], "step": r["step"], "total_steps": r["total_steps"],
             "state": r["state"], "params": r["params"]} for n, r in enumerate(scored[:top])]


def cancel(batch: Any, s3: Any, stack: SweepStack, sweep_id: str) -> dict[str, Any]:
    """Terminate the sweep's array job (every child; running ones get SIGTERM and checkpoint).

    Args:
        batch: a boto3 Batch client.
        s3: a boto3 S3 client.
        stack: the sweep stack's resources.
        sweep_id: the sweep.

    Returns:
        ``{"sweep_id", "job_id", "cancelled": True}``.

    Raises:
        OperationsError: ``STACK_NOT_FOUND`` when there is no such sweep.
    """
    record = _job(s3, stack, sweep_id)
    batch.terminate_job(jobId=record["job_id"], reason=f"spot-train sweep cancel {sweep_id}")
    return {"sweep_id": sweep_id, "job_id": record["job_id"], "cancelled": True}


def format_report(report: dict[str, Any]) -> str:
    """The status table and the best-so-far table as text."""
    metric = report["metric"]
    lines = [f"sweep {report['sweep_id']} (array job {report['job_id']}, {report['size']} children)",
             f"{'index':>5} {'state':<10} {'att':>3} {'recl':>4} {'step/total':>12} {metric:>10} {'cost USD':>10}  params"]
    for r in report["children"]:
        step = f"{r['step'] if r['step'] is not None else '-'}/{r['total_steps'] if r['total_steps'] is not None else '?'}"
        value = f"{r[metric]:.4f}" if isinstance(r[metric], (int, float)) else "-"
        cost = f"{r['cost_usd']:.6f}" if r["cost_usd"] is not None else "-"
        lines.append(f"{r['index']:>5} {r['state']:<10} {r['attempts']:>3} {r['reclaims']:>4} {step:>12} {value:>10} {cost:>10}  {json.dumps(r['params'])}")
    lines.append("best so far:")
    for b in report["best"]:
        lines.append(f"  #{b['rank']} index {b['index']}: {metric} {b[metric]:.4f} at step {b['step']} ({b['state']}) {json.dumps(b['params'])}")
    lines.append(f"total cost: {report['total_cost_usd']:.6f} USD (every attempt, at its instance's spot price)")
    return "\n".join(lines) + "\n"


# ---- the command line ----------------------------------------------------------------------------
def add_parser(sub: Any) -> None:
    """Register ``spot-train sweep ...`` on the top-level subparsers ``sub``."""
    sweep = sub.add_parser("sweep", help="parameter sweeps on AWS Batch against a deployed SpotSweep stack")
    actions = sweep.add_subparsers(dest="sweep_command", required=True, metavar="ACTION")

    def common(p: argparse.ArgumentParser) -> None:
        p.add_argument("--stack", default="SpotSweep", help="stack name (default SpotSweep)")
        p.add_argument("--region", default=None, help="AWS region (default: the profile's / AWS_REGION)")
        p.add_argument("--profile", default=None, help="AWS profile")
        p.add_argument("--endpoint-url", default=None, help="one endpoint for every AWS API (local mode's moto server)")
        p.add_argument("--json", action="store_true", help="print JSON instead of tables")

    p = actions.add_parser("submit", help="upload the parameter sets (JSON/YAML list or grid) and submit one array job")
    common(p)
    p.add_argument("file", type=Path, help="the sweep file")
    p.add_argument("--command", required=True, help="the training command; each parameter is appended as --name value")
    p.add_argument("--sweep-id", default=None, help="default: <UTC time>-<random>")
    p.set_defaults(handler=_cli, action=_submit)
    for name, text in (("status", "per index: state, attempts, reclaims, step/total, metric, cost; best so far"),
                       ("best", "the best-so-far table"), ("cost", "cost per index over every attempt"),
                       ("logs", "each attempt's end (status reason, exit code, instance)"), ("cancel", "terminate every child")):
        p = actions.add_parser(name, help=text)
        common(p)
        p.add_argument("sweep_id", help="the sweep id submit printed")
        p.add_argument("--metric", default="accuracy", help="the metric in metrics.json to rank by (default accuracy, higher is better)")
        p.set_defaults(handler=_cli, action=_show if name != "cancel" else _cancel)


def _clients(args: argparse.Namespace) -> tuple[Any, Any, Any, Any]:
    from spot_training.ops.operations import connect, spot_cost

    aws = connect(region=args.region, profile=args.profile, endpoint_url=args.endpoint_url)
    import boto3
    from botocore.config import Config

    extra = {"endpoint_url": args.endpoint_url} if args.endpoint_url else {}
    session = boto3.Session(profile_name=args.profile, region_name=aws.region)
    make = lambda service: session.client(service, config=Config(retries={"mode": "standard"}), **extra)  # noqa: E731
    price = lambda t, az, a, b: spot_cost(aws, t, az, a, b)[0]  # noqa: E731
    return make("batch"), make("s3"), aws.cloudformation, price


def _cli(args: argparse.Namespace) -> int:
    try:
        batch, s3, cloudformation, price = _clients(args)
        stack = sweep_stack(cloudformation, args.stack)
        return int(args.action(args, batch, s3, stack, price))
    except OperationsError as error:
        print(f"spot-train: error: {error}", file=sys.stderr)
        return int(error.exit_code)
    except (ValueError, OSError) as error:
        print(f"spot-train: error: {error}", file=sys.stderr)
        return int(Exit.USAGE)


def _submit(args: argparse.Namespace, batch: Any, s3: Any, stack: SweepStack, price: Any) -> int:
    record = submit(batch, s3, stack, read_sweep_file(args.file), command=args.command, sweep_id=args.sweep_id)
    print(json.dumps(record) if args.json else f"sweep {record['sweep_id']}: array job {record['job_id']}, "
          f"{record['size']} children, manifest {record['manifest_uri']}")
    return int(Exit.OK)


def _show(args: argparse.Namespace, batch: Any, s3: Any, stack: SweepStack, price: Any) -> int:
    report = status_report(batch, s3, stack, args.sweep_id, metric=args.metric,
                           price=price if args.sweep_command in ("status", "cost") else None)
    view = {"status": report, "best": {"sweep_id": report["sweep_id"], "best": report["best"]},
            "cost": {"sweep_id": report["sweep_id"], "total_cost_usd": report["total_cost_usd"],
                     "children": [{k: r[k] for k in ("index", "attempts", "reclaims", "cost_usd", "attempt_details")} for r in report["children"]]},
            "logs": {"sweep_id": report["sweep_id"], "children": [{k: r[k] for k in ("index", "state", "status_reason", "attempt_details")}
                                                                  for r in report["children"]]}}[args.sweep_command]
    print(json.dumps(view, indent=1, default=str) if args.json or args.sweep_command in ("cost", "logs") else format_report(report).rstrip()
          if args.sweep_command == "status" else "\n".join(format_report(report).splitlines()[len(report["children"]) + 2:]))
    return int(Exit.OK)


def _cancel(args: argparse.Namespace, batch: Any, s3: Any, stack: SweepStack, price: Any) -> int:
    result = cancel(batch, s3, stack, args.sweep_id)
    print(json.dumps(result) if args.json else f"sweep {args.sweep_id}: cancelled (array job {result['job_id']})")
    return int(Exit.OK)
