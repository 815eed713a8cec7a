"""The sweep drill (``spot-train local drill --sweep``): a parameter sweep on local AWS Batch through reclaims.

moto server -> ``cdk bootstrap`` -> ``cdk deploy SpotSweep`` (the real CLI) -> ``spot-train sweep
submit``'s code uploads the manifest (``children`` parameter sets, the last one with a parameter
the trainer does not know: a code error) and submits one array job to :class:`LocalBatch` -> while
the children train, reclaims are injected (spot notice on the child's IMDS, host taken
``notice_lead_s`` later): ``reclaims`` children once, the first of them a second time -> every
child but the code-error one completes; the code-error child fails after one attempt (the retry
rules) -> the status/best/cost report is read back through spot_training.ops.sweep -> the manifest
bucket is emptied, ``cdk destroy``, the orphan check (instances, volumes, snapshots, the stack,
Batch compute environments, queues and active job definitions, EFS file systems).

Two reclaimed children are compared with uninterrupted runs of the same index (same command and
parameters): their final ``W`` and ``b`` must be bitwise equal. ``report.json`` holds ``passed``
and the figures (see :func:`passed`).
"""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from spot_training import contract
from spot_training.agent import sweep_child
from spot_training.local.batch import LocalBatch
from spot_training.local.deploy import CdkCli, client, clients, destroy_and_check
from spot_training.local.drill import EventLog, bootstrap_and_deploy, fresh_work_dir, options_dict, weights_match
from spot_training.local.injector import read_training_log
from spot_training.local.moto_server import MotoServer

FINAL_WEIGHTS = "final_weights.npz"
#: The parameter the code-error child gets: the trainer has no such option (argparse exits 2).
CODE_ERROR_PARAM = "momentum"


@dataclasses.dataclass
class SweepDrillOptions:
    """What the sweep drill does.

    Attributes:
        work_dir: everything goes here (emptied first; default ``out/sweep-drill``).
        stack: the stack name (default ``SpotSweep``).
        children: array size, >= 4 (default 8); the last child is the code-error one.
        reclaims: children reclaimed during training (default 3); the first of them twice.
        steps: trainer steps per child (default 300). step_delay_s: the trainer's pause per step.
        save_every_steps: the trainer's checkpoint cadence (default 25).
        notice_lead_s: seconds between a reclaim's notice and the host going (default 3).
        max_running: children running at once (default 8).
        timeout_s: the longest the sweep may take (default 300 s).
        instance_types: the compute environment's types (moto has spot price history for them).
    """

    work_dir: Path = Path("out/sweep-drill")
    stack: str = "SpotSweep"
    children: int = 8
    reclaims: int = 3
    steps: int = 300
    step_delay_s: float = 0.02
    save_every_steps: int = 25
    notice_lead_s: float = 3.0
    max_running: int = 8
    timeout_s: float = 300.0
    instance_types: tuple[str, ...] = ("g5.xlarge", "g4dn.xlarge")

    def validate(self) -> None:
        """Raise ``ValueError`` naming the bad option, its value and what is allowed."""
        if self.children < 4:
            raise ValueError(f"children must be >= 4, got {self.children!r}")
        if not 2 <= self.reclaims <= self.children - 2:
            raise ValueError(f"reclaims must be 2..children-2 ({self.children - 2}), got {self.reclaims!r}")
        for name in ("steps", "save_every_steps", "max_running"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)!r}")

    def command(self) -> str:
        """The training command every child runs (parameters are appended by the child)."""
        return (f"{sys.executable} -m spot_training.training.examples.sweep_softmax "
                f"--step-delay-s {self.step_delay_s} --save-every-steps {self.save_every_steps} --save-final-weights {FINAL_WEIGHTS}")

    def parameter_sets(self) -> list[dict[str, Any]]:
        """A learning-rate x L2 grid; the last set carries :data:`CODE_ERROR_PARAM`."""
        rates, l2s = (0.05, 0.1, 0.2, 0.5, 1.0), (0.0, 1e-4)
        sets: list[dict[str, Any]] = [{"lr": rates[i % len(rates)], "l2": l2s[(i // len(rates)) % len(l2s)], "seed": i,
                                       "steps": self.steps} for i in range(self.children)]
        sets[-1][CODE_ERROR_PARAM] = 0.9
        return sets


def batch_orphans(endpoint_url: str, stack: str) -> list[str]:
    """What of the SpotSweep stack ``stack`` is still in the local AWS.

    Batch compute environments and job queues named for ``stack``, its ACTIVE job definitions, and EFS
    file systems tagged with it.

    Args:
        endpoint_url: the moto server.
        stack: the stack name.

    Returns:
        ``"kind name-or-id"`` strings; empty when nothing is left.
    """
    batch, efs = client(endpoint_url, "batch"), client(endpoint_url, "efs")
    out = [f"compute-environment {c['computeEnvironmentName']}" for c in batch.describe_compute_environments()["computeEnvironments"]
           if c["computeEnvironmentName"].startswith(stack + "-")]
    out += [f"job-queue {q['jobQueueName']}" for q in batch.describe_job_queues()["jobQueues"] if q["jobQueueName"].startswith(stack + "-")]
    out += [f"job-definition {d['jobDefinitionName']}" for d in batch.describe_job_definitions(status="ACTIVE")["jobDefinitions"]
            if d["jobDefinitionName"].startswith(stack + "-")]
    for fs in efs.describe_file_systems()["FileSystems"]:
        if {t["Key"]: t["Value"] for t in fs.get("Tags", [])}.get(contract.STACK_TAG) == stack:
            out.append(f"file-system {fs['FileSystemId']}")
    return out


def deployed_batch(server: MotoServer, stack_name: str, *, work_dir: Path, instance_types: tuple[str, ...], max_running: int,
                   on_event: Callable[[dict[str, Any]], None] | None = None, notice_poll_interval_s: float = 0.5) -> tuple[LocalBatch, Any, Any]:
    """A :class:`LocalBatch` for the deployed SpotSweep stack ``stack_name``, its sweep stack and an S3 client.

    The LocalBatch uses the job definition as deployed and the stack's subnets. The children reach the
    local AWS through the server's environment. Also used by bench/bench_sweep.py.

    Args:
        server: the running moto server.
        stack_name: the deployed SpotSweep stack.
        work_dir: where the children's folders and the EFS stand-in go.
        instance_types: the instance types the children are placed on.
        max_running: the most children running at once.
        on_event: called with every LocalBatch event, or None.
        notice_poll_interval_s: seconds between the children's IMDS polls (default 0.5).

    Returns:
        ``(batch, sweep stack, s3 client)``.

    Raises:
        OperationsError: the stack is not a deployed SpotSweep stack.
    """
    from spot_training.ops import sweep as sweep_ops

    cloudformation, s3, ec2 = client(server.endpoint_url, "cloudformation"), client(server.endpoint_url, "s3"), client(server.endpoint_url, "ec2")
    stack = sweep_ops.sweep_stack(cloudformation, stack_name)
    job_definition = client(server.endpoint_url, "batch").describe_job_definitions(jobDefinitions=[stack.job_definition])["jobDefinitions"][0]
    vpc = [r["PhysicalResourceId"] for r in cloudformation.describe_stack_resources(StackName=stack_name)["StackResources"]
           if r.get("ResourceType") == "AWS::EC2::VPC"][0]
    subnets = {s["AvailabilityZone"]: s["SubnetId"] for s in ec2.describe_subnets(Filters=[{"Name": "vpc-id", "Values": [vpc]}])["Subnets"]}
    environment = {k: v for k, v in os.environ.items() if not k.startswith("AWS_")}
    environment.update({**server.env(), sweep_child.POLL_ENV: str(notice_poll_interval_s),
                        "PYTHONPATH": str(Path(__file__).resolve().parents[2])})
    batch = LocalBatch(ec2=ec2, job_definition=job_definition, subnets=subnets, instance_types=instance_types,
                       efs_dir=work_dir / "efs", work_dir=work_dir, stack=stack_name, environment=environment,
                       max_running=max_running, on_event=on_event)
    return batch, stack, s3


#: The CDK context of a local SpotSweep deployment (the image is never pulled locally).
def local_sweep_context(instance_types: tuple[str, ...]) -> dict[str, str]:
    """``-c`` keys that make SpotSweep deployable to the moto server (pinned AZs, no flow logs, CPU children)."""
    return {"account": "123456789012", "region": "us-east-1", "availability_zones": "us-east-1a,us-east-1b",
            "vpc_flow_logs": "false", "sweep_image": "local/spot-training-sweep:latest", "sweep_gpus": "0",
            "sweep_instance_types": ",".join(instance_types)}


def empty_bucket(s3: Any, bucket: str) -> None:
    """Delete every object version and delete marker in ``bucket`` (a versioned bucket is deleted only empty).

    Args:
        s3: a boto3 S3 client.
        bucket: the bucket's name.
    """
    for page in s3.get_paginator("list_object_versions").paginate(Bucket=bucket):
        for item in page.get("Versions", []) + page.get("DeleteMarkers", []):
            s3.delete_object(Bucket=bucket, Key=item["Key"], VersionId=item["VersionId"])


def _baseline(options: SweepDrillOptions, params: dict[str, Any], root: Path) -> subprocess.Popen[bytes]:
    """The same trainer and parameters, uninterrupted, in ``root`` (as a child runs it: cwd = its folder)."""
    from spot_training.agent.sweep_child import trainer_argv

    root.mkdir(parents=True)
    env = {**os.environ, contract.ENV_CHECKPOINT_DIR: str(root / "checkpoints"), contract.ENV_LOG_DIR: str(root / "logs"),
           "PYTHONUNBUFFERED": "1"}
    import shlex

    with open(root / "trainer.log", "ab") as log:
        return subprocess.Popen(trainer_argv(shlex.split(options.command()), params), cwd=root, env=env, stdout=log,
                                stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, start_new_session=True)


def run_sweep_drill(options: SweepDrillOptions, *, on_event: Callable[[dict[str, Any]], None] | None = None) -> dict[str, Any]:
    """Run the drill (module docstring); returns the report, also written to ``report.json``.

    Args:
        options: the drill's options.
        on_event: called with every progress event, or None.

    Returns:
        the report.

    Raises:
        ValueError: bad options (nothing started). Failures later are recorded in ``error``.
    """
    from spot_training.ops import operations as ops
    from spot_training.ops import sweep as sweep_ops

    options.validate()
    started = time.time()
    work_dir = fresh_work_dir(options.work_dir)
    record = EventLog(started, on_event)
    record({"event": "phase", "phase": "start", "message": f"work directory {work_dir}"})
    sets = options.parameter_sets()
    code_error_index = len(sets) - 1
    report: dict[str, Any] = {"stack": options.stack, "work_dir": str(work_dir), "options": options_dict(options), "error": None,
                              "children": [], "best": [], "reclaims": [], "phases_s": {}, "orphans_after_destroy": None}
    server = MotoServer(work_dir / "moto")
    context = local_sweep_context(options.instance_types)
    cdk: CdkCli | None = None
    batch: LocalBatch | None = None
    baselines: dict[int, subprocess.Popen[bytes]] = {}
    stack = None
    try:
        record({"event": "phase", "phase": "moto", "message": "starting the moto server on 127.0.0.1"})
        server.start()
        cdk = CdkCli(server.endpoint_url, work_dir=work_dir)
        bootstrap_and_deploy(cdk, options.stack, context, record=record, phases=report["phases_s"])
        batch, stack, s3 = deployed_batch(server, options.stack, work_dir=work_dir, instance_types=options.instance_types,
                                          max_running=options.max_running, on_event=record)
        record({"event": "phase", "phase": "submit", "message": f"{len(sets)} parameter sets -> one array job"})
        t = time.time()
        submitted = sweep_ops.submit(batch, s3, stack, sets, command=options.command(), sweep_id="drill")
        report["sweep"] = submitted
        job_id = submitted["job_id"]
        reclaimed = [0, 1, 2][: options.reclaims] if options.reclaims <= 3 else list(range(options.reclaims))
        # Two reclaimed children's uninterrupted twins, started now beside the sweep.
        for index in reclaimed[:2]:
            baselines[index] = _baseline(options, sets[index], work_dir / "baseline" / str(index))
        plan = [(index, 1, options.steps // 3) for index in reclaimed] + [(reclaimed[0], 2, 2 * options.steps // 3)]
        pending = list(plan)
        first_step: dict[int, float] = {}
        efs_root = work_dir / "efs" / contract.SWEEP_MOUNT_POINT.lstrip("/") / "drill"
        deadline = t + options.timeout_s

        def tick() -> None:
            for index in range(len(sets)):
                rows = read_training_log(efs_root / str(index) / contract.LOGS_DIR / contract.TRAINING_LOG_FILE)
                if rows and index not in first_step:
                    first_step[index] = min(r["wall_time"] for r in rows) - t
                child = batch.child(f"{job_id}:{index}")
                for entry in list(pending):
                    target, attempt, step = entry
                    if target != index or child.status != "RUNNING" or len(child.attempts) != attempt or not rows:
                        continue
                    if int(rows[-1]["step"]) >= step and child.attempts[-1].reclaim_at is None:
                        instance = batch.reclaim(f"{job_id}:{index}", lead_s=options.notice_lead_s)
                        report["reclaims"].append({"index": index, "attempt": attempt, "at_step": int(rows[-1]["step"]), "instance_id": instance})
                        pending.remove(entry)
            if time.time() > deadline:
                raise RuntimeError(f"the sweep did not finish within timeout_s={options.timeout_s} s")

        record({"event": "phase", "phase": "training", "message": "children train; reclaims injected"})
        batch.wait(timeout_s=options.timeout_s, tick=tick)
        report["phases_s"]["training"] = round(time.time() - t, 3)
        for process in baselines.values():
            process.wait(timeout=120)
        aws = ops.connect(region="us-east-1", endpoint_url=server.endpoint_url, credentials=("testing", "testing"))
        status = sweep_ops.status_report(batch, s3, stack, "drill", price=lambda ty, az, a, b: ops.spot_cost(aws, ty, az, a, b)[0])
        report["best"], report["total_cost_usd"] = status["best"], status["total_cost_usd"]
        for row in status["children"]:
            index = row["index"]
            rows = read_training_log(efs_root / str(index) / contract.LOGS_DIR / contract.TRAINING_LOG_FILE)
            completed = (efs_root / str(index) / contract.CHECKPOINTS_DIR / contract.COMPLETED_FILE).exists()
            noticed = sum(1 for a in batch.child(f"{job_id}:{index}").attempts if a.noticed)
            entry = {**{k: row[k] for k in ("index", "state", "status_reason", "attempts", "reclaims", "step", "total_steps", "accuracy",
                                             "params", "cost_usd")},
                     "completed": completed, "steps_executed": len(rows),
                     "lost_steps": len(rows) - options.steps if completed else None, "noticed_reclaims": noticed,
                     "submit_to_first_step_s": round(first_step[index], 3) if index in first_step else None,
                     "attempt_costs_usd": [a["cost_usd"] for a in row["attempt_details"]]}
            if index in baselines:
                ours, theirs = efs_root / str(index) / FINAL_WEIGHTS, work_dir / "baseline" / str(index) / FINAL_WEIGHTS
                entry["matches_uninterrupted_run"] = bool(ours.exists() and theirs.exists() and weights_match(ours, theirs))
            report["children"].append(entry)
        report["code_error_index"] = code_error_index
        report["pending_reclaims"] = pending
    except Exception as error:  # noqa: BLE001 - recorded in the report; teardown still runs
        report["error"] = f"{type(error).__name__}: {error}"
        record({"event": "error", "message": report["error"]})
    finally:
        if batch is not None:
            batch.close()
        for process in baselines.values():
            if process.poll() is None:
                process.kill()
                process.wait()
        try:
            if cdk is not None and server.process is not None:
                manifests = stack.bucket if stack is not None else None
                destroy_and_check(
                    cdk, clients(server.endpoint_url), options.stack, context=context, report=report, record=record,
                    before_destroy=None if manifests is None else (
                        lambda: empty_bucket(client(server.endpoint_url, "s3"), manifests)),
                    more_orphans=lambda: batch_orphans(server.endpoint_url, options.stack),
                    message="empty the manifest bucket, cdk destroy, orphan check")
        finally:
            server.stop()
        report["wall_s"] = round(time.time() - started, 3)
        report["passed"] = passed(report, options)
        record.write(work_dir / "events.jsonl")
        (work_dir / "report.json").write_text(json.dumps(report, indent=2, default=str) + "\n")
    return report


def passed(report: dict[str, Any], options: SweepDrillOptions) -> bool:
    """Whether the sweep drill passed.

    Passed: every child but the code-error one completed with 0 lost steps (all reclaims came with a
    notice); the code-error child FAILED after one attempt; >= ``reclaims`` children reclaimed, one
    twice; the compared children match their uninterrupted runs bitwise; every child has a cost;
    nothing left after destroy.

    Args:
        report: the drill's report.
        options: its options.

    Returns:
        True when every condition holds.
    """
    children = report.get("children") or []
    if report.get("error") or len(children) != options.children:
        return False
    code_error = children[report["code_error_index"]]
    others = [c for c in children if c["index"] != report["code_error_index"]]
    compared = [c for c in children if "matches_uninterrupted_run" in c]
    return bool(
        code_error["state"] == "FAILED" and code_error["attempts"] == 1
        and all(c["state"] == "SUCCEEDED" and c["completed"] and c["lost_steps"] == 0 for c in others)
        and sum(1 for c in children if c["reclaims"] >= 1) >= options.reclaims and any(c["reclaims"] >= 2 for c in children)
        and len(compared) == 2 and all(c["matches_uninterrupted_run"] for c in compared)
        and all(c["cost_usd"] is not None for c in children) and report["best"]
        and report.get("orphans_after_destroy") == []
    )


def cmd_sweep_drill(args: Any) -> int:
    """``spot-train local drill --sweep``: run the drill, print the report's summary; exit 0 passed, 1 failed."""
    options = SweepDrillOptions(work_dir=args.work_dir if args.work_dir is not None else SweepDrillOptions.work_dir,
                                stack=args.stack if args.stack is not None else SweepDrillOptions.stack,
                                timeout_s=args.timeout if args.timeout is not None else SweepDrillOptions.timeout_s)
    try:
        report = run_sweep_drill(options, on_event=lambda e: print(f"[{e['t']:7.1f}s] {e['event']}: "
                                                                      f"{e.get('message') or e.get('job_id', '')}", flush=True))
    except ValueError as error:
        print(f"spot-train: error: {error}", file=sys.stderr)
        return 2
    for child in report["children"]:
        print(f"index {child['index']}: {child['state']:<9} attempts {child['attempts']} reclaims {child['reclaims']} "
              f"lost steps {child['lost_steps']} accuracy {child['accuracy']} cost {child['cost_usd']} USD"
              + (f" matches uninterrupted: {child['matches_uninterrupted_run']}" if "matches_uninterrupted_run" in child else ""))
    print(f"orphans after destroy: {report['orphans_after_destroy']}; error: {report['error']}; passed: {report['passed']}")
    print(f"report: {Path(report['work_dir']) / 'report.json'}")
    return 0 if report["passed"] else 1
