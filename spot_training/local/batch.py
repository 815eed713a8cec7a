"""Local AWS Batch for sweeps: array children as local processes, retries applied as Batch applies them.

moto 5.2.5 accepts the ``SpotSweep`` stack's Batch resources but runs jobs only in Docker, sets
neither ``AWS_BATCH_JOB_ARRAY_INDEX`` nor ``AWS_BATCH_JOB_ATTEMPT`` and never applies
``evaluateOnExit``; this machine has no Docker daemon. :class:`LocalBatch` takes the deployed job
definition from moto (its command, environment and ``retryStrategy``) and runs each array child
the way AWS Batch would on a managed spot compute environment:

- each attempt gets a host: an EC2 instance launched in the local AWS (tagged with the stack, in
  one of the stack's subnets, an instance type of the compute environment), its own IMDS emulator
  (spot_training/local/imds_emulator.py) and the shared EFS directory (``<efs_dir>/storage``);
- the child process gets the environment Batch gives a container (``AWS_BATCH_JOB_ARRAY_INDEX``,
  ``AWS_BATCH_JOB_ATTEMPT``, ``AWS_BATCH_JOB_ID`` = ``<array job id>:<index>``), the job's
  environment overrides, and the instance metadata endpoint;
- :meth:`LocalBatch.reclaim` posts a spot interruption notice on the child's IMDS, waits the notice
  lead time, then takes the host: the process group is killed, the instance terminated, and the
  attempt ends with ``statusReason`` ``Host EC2 (instance i-...) terminated.`` and no exit code;
- each ended attempt goes through :func:`evaluate_on_exit` (first matching rule wins; no match:
  retry; AWS Batch API reference, "EvaluateOnExit" and "RetryStrategy"), then retried while
  attempts remain, else the child is FAILED.

The API is a subset of boto3's Batch client (``submit_job``, ``describe_jobs``, ``list_jobs``,
``terminate_job``, ``cancel_job``) with the same request and response shapes, so
spot_training.ops.sweep reads a local sweep with the code that reads a real one.
"""

from __future__ import annotations

import dataclasses
import datetime as dt
import fnmatch
import itertools
import os
import signal
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

from spot_training import contract
from spot_training.agent.process_group import kill_tree
from spot_training.local.imds_emulator import ImdsEmulator
from spot_training.local.nodes import signal_group

#: The default notice lead of an injected reclaim, seconds: AWS gives two minutes; a local child
#: needs only a polling round and a checkpoint.
DEFAULT_NOTICE_LEAD_S = 3.0


@dataclasses.dataclass(frozen=True)
class RetryRule:
    """One ``evaluateOnExit`` entry: ``action`` (``RETRY``/``EXIT``) and its glob conditions (None: not set)."""

    action: str
    on_status_reason: str | None = None
    on_exit_code: str | None = None
    on_reason: str | None = None

    @classmethod
    def from_api(cls, entry: Mapping[str, Any]) -> "RetryRule":
        """From the Batch API's shape (``{"action": "retry", "onStatusReason": ...}``, any case of action)."""
        return cls(str(entry["action"]).upper(), entry.get("onStatusReason"), entry.get("onExitCode"), entry.get("onReason"))

    def matches(self, *, exit_code: int | None, status_reason: str | None, reason: str | None) -> bool:
        """Every condition set matches (AWS Batch: patterns may end with ``*``; an absent value matches only ``*``).

        Source: AWS Batch API Reference, "EvaluateOnExit".

        Args:
            exit_code: the attempt's container exit code, or None.
            status_reason: the attempt's status reason (``Host EC2 (instance ...) terminated.``), or None.
            reason: the container's reason, or None.

        Returns:
            whether this rule applies.
        """
        for pattern, value in ((self.on_status_reason, status_reason), (self.on_exit_code, None if exit_code is None else str(exit_code)),
                               (self.on_reason, reason)):
            if pattern is None:
                continue
            if value is None:
                if pattern != "*":
                    return False
            elif not fnmatch.fnmatchcase(value, pattern):
                return False
        return True


def evaluate_on_exit(rules: Sequence[RetryRule], *, exit_code: int | None, status_reason: str | None,
                     reason: str | None) -> str:
    """``RETRY`` or ``EXIT`` for an ended attempt: the first matching rule's action; none matches: ``RETRY``.

    Args:
        rules: the job definition's retry rules, in order.
        exit_code: the attempt's exit code, or None.
        status_reason: the attempt's status reason, or None.
        reason: the container's reason, or None.

    Returns:
        ``"RETRY"`` or ``"EXIT"``.
    """
    for rule in rules:
        if rule.matches(exit_code=exit_code, status_reason=status_reason, reason=reason):
            return rule.action
    return "RETRY"


def next_status(*, attempt: int, attempts: int, rules: Sequence[RetryRule], exit_code: int | None,
                status_reason: str | None, reason: str | None) -> str:
    """What Batch does after attempt ``attempt`` of a job allowed ``attempts``.

    Args:
        attempt: the ended attempt, 1-based.
        attempts: the job's retry strategy's attempts.
        rules: the retry rules.
        exit_code: the attempt's exit code, or None.
        status_reason: the attempt's status reason, or None.
        reason: the container's reason, or None.

    Returns:
        ``SUCCEEDED`` (exit 0 on a host that was not taken), ``RUNNABLE`` (retried) or ``FAILED``.
    """
    if exit_code == 0 and not (status_reason or "").startswith("Host EC2"):
        return "SUCCEEDED"
    action = evaluate_on_exit(rules, exit_code=exit_code, status_reason=status_reason, reason=reason)
    return "RUNNABLE" if action == "RETRY" and attempt < attempts else "FAILED"


def _ms(t: float) -> int:
    return int(t * 1000)


@dataclasses.dataclass
class _Attempt:
    number: int
    instance_id: str
    instance_type: str
    availability_zone: str
    imds: ImdsEmulator
    process: subprocess.Popen[bytes]
    started: float
    stopped: float | None = None
    exit_code: int | None = None
    status_reason: str | None = None
    reason: str | None = None
    reclaim_at: float | None = None
    noticed: bool = False


@dataclasses.dataclass
class _Child:
    job_id: str
    index: int
    status: str = "RUNNABLE"
    attempts: list[_Attempt] = dataclasses.field(default_factory=list)
    status_reason: str | None = None
    submitted: float = dataclasses.field(default_factory=time.time)


@dataclasses.dataclass
class _ArrayJob:
    job_id: str
    name: str
    queue: str
    size: int
    environment: dict[str, str]
    command: list[str]
    children: list[_Child]
    created: float = dataclasses.field(default_factory=time.time)


class LocalBatch:
    """A local AWS Batch queue for one deployed ``SpotSweep`` stack (see the module docstring).

    Args:
        ec2: boto3 EC2 client of the local AWS (hosts are launched and terminated there).
        job_definition: the deployed job definition as ``describe_job_definitions`` returns it.
        subnets: ``{availability_zone: subnet_id}`` the hosts go in.
        instance_types: the compute environment's types, assigned to attempts in turn.
        efs_dir: the shared file system's directory (children see it at ``<efs_dir>/storage``).
        work_dir: per-attempt logs go to ``<work_dir>/children/``.
        stack: the stack name (hosts are tagged ``spot-training:stack``).
        environment: the base environment of every child (default: this process's, without AWS_*).
        max_running: children running at once (the compute environment's maxvCpus / vCPUs per child).
        python: replaces ``python`` as the command's first word (default: this interpreter).
        on_event: called with event dicts (``attempt-started``, ``attempt-ended``, ``notice-posted`` ...).

    Use :meth:`tick` in a loop (or :meth:`wait`) to start, reap and retry children; :meth:`close` ends all.
    """

    def __init__(self, *, ec2: Any, job_definition: Mapping[str, Any], subnets: Mapping[str, str],
                 instance_types: Sequence[str], efs_dir: Path, work_dir: Path, stack: str,
                 environment: Mapping[str, str] | None = None, max_running: int = 16, python: str | None = None,
                 on_event: Callable[[dict[str, Any]], None] | None = None) -> None:
        if max_running < 1:
            raise ValueError(f"max_running must be >= 1, got {max_running!r}")
        if not instance_types or not subnets:
            raise ValueError(f"instance_types and subnets must not be empty, got {instance_types!r}, {subnets!r}")
        self.ec2 = ec2
        self.job_definition = dict(job_definition)
        retry = self.job_definition.get("retryStrategy") or {}
        self.attempts = int(retry.get("attempts") or 1)
        self.rules = [RetryRule.from_api(r) for r in retry.get("evaluateOnExit") or []]
        self.subnets = dict(subnets)
        self.instance_types = list(instance_types)
        self.efs_dir, self.work_dir, self.stack = Path(efs_dir), Path(work_dir), stack
        self.environment = dict(environment if environment is not None else
                                {k: v for k, v in os.environ.items() if not k.startswith("AWS_")})
        self.max_running = max_running
        self.python = python or sys.executable
        self._emit = on_event or (lambda event: None)
        self.jobs: dict[str, _ArrayJob] = {}
        self._placement = itertools.count()
        self._lock = threading.RLock()
        (self.work_dir / "children").mkdir(parents=True, exist_ok=True)

    # ---- the boto3 Batch client subset ----
    def submit_job(self, *, jobName: str, jobQueue: str, jobDefinition: str, arrayProperties: Mapping[str, int] | None = None,
                   containerOverrides: Mapping[str, Any] | None = None, parameters: Mapping[str, str] | None = None,
                   **_: Any) -> dict[str, str]:
        """Submit an array job (``arrayProperties.size`` children, 2..10000; absent: one child at index 0).

        Args:
            jobName: the job's name.
            jobQueue: the queue's name (recorded only).
            jobDefinition: the job definition (this LocalBatch's own is used).
            arrayProperties: ``{"size": children}``, or None for a single job.
            containerOverrides: ``environment`` and ``command`` overrides.
            parameters: ``Ref::`` substitutions for the command (over the definition's defaults).
        **_: other SubmitJob arguments, accepted and ignored.

        Returns:
            ``{"jobId", "jobName", "jobArn"}``, as Batch answers.

        Raises:
            ValueError: an array size outside 2..10000.
        """
        size = int((arrayProperties or {}).get("size", 1))
        if arrayProperties is not None and not 2 <= size <= contract.MAX_BATCH_ARRAY_SIZE:
            raise ValueError(f"arrayProperties.size must be 2..{contract.MAX_BATCH_ARRAY_SIZE}, got {size}")
        overrides = dict(containerOverrides or {})
        env = {e["name"]: e["value"] for e in overrides.get("environment", [])}
        params = {**(self.job_definition.get("parameters") or {}), **dict(parameters or {})}
        command = list(overrides.get("command") or self.job_definition["containerProperties"]["command"])
        command = [params.get(c[len("Ref::"):], c) if c.startswith("Ref::") else c for c in command]
        if command and command[0] == "python":
            command[0] = self.python
        job_id = str(uuid.uuid4())
        with self._lock:
            self.jobs[job_id] = _ArrayJob(job_id, jobName, jobQueue, size, env, command,
                                          [_Child(f"{job_id}:{i}", i) for i in range(size)])
        self._emit({"event": "submitted", "job_id": job_id, "size": size})
        return {"jobId": job_id, "jobName": jobName, "jobArn": f"arn:aws:batch:us-east-1:{contract_account()}:job/{job_id}"}

    def describe_jobs(self, *, jobs: Sequence[str]) -> dict[str, list[dict[str, Any]]]:
        """The array jobs and children (``<id>:<index>``) asked for, in Batch's response shape."""
        out = []
        with self._lock:
            for job_id in jobs:
                parent, _, index = job_id.partition(":")
                job = self.jobs.get(parent)
                if job is None:
                    continue
                if index:
                    if index.isdigit() and int(index) < job.size:
                        out.append(self._describe_child(job, job.children[int(index)]))
                    continue
                summary: dict[str, int] = {}
                for child in job.children:
                    summary[child.status] = summary.get(child.status, 0) + 1
                out.append({"jobId": job.job_id, "jobName": job.name, "jobQueue": job.queue, "status": self._array_status(job),
                            "createdAt": _ms(job.created), "arrayProperties": {"size": job.size, "statusSummary": summary},
                            "container": {"environment": [{"name": k, "value": v} for k, v in job.environment.items()],
                                          "command": job.command}})
        return {"jobs": out}

    def list_jobs(self, *, arrayJobId: str | None = None, jobQueue: str | None = None, jobStatus: str | None = None,
                  **_: Any) -> dict[str, list[dict[str, Any]]]:
        """Children of ``arrayJobId`` (or the array jobs of ``jobQueue``), filtered by ``jobStatus``.

        Args:
            arrayJobId: the array job whose children to list, or None.
            jobQueue: with no ``arrayJobId``: only this queue's array jobs (None: every queue).
            jobStatus: only jobs in this status (None: any).
        **_: other ListJobs arguments, accepted and ignored.

        Returns:
            ``{"jobSummaryList": [...]}``, as Batch answers.
        """
        with self._lock:
            if arrayJobId is not None:
                job = self.jobs.get(arrayJobId)
                rows = [{"jobId": c.job_id, "status": c.status, "arrayProperties": {"index": c.index}} for c in (job.children if job else [])]
            else:
                rows = [{"jobId": j.job_id, "jobName": j.name, "status": self._array_status(j)} for j in self.jobs.values()
                        if jobQueue in (None, j.queue)]
        return {"jobSummaryList": [r for r in rows if jobStatus in (None, r["status"])]}

    def terminate_job(self, *, jobId: str, reason: str) -> dict[str, Any]:
        """Stop every child of the array job (or the one child): SIGTERM, then FAILED with ``reason``.

        Args:
            jobId: an array job id, or a child's ``<id>:<index>``.
            reason: the status reason recorded.

        Returns:
            ``{}``, as Batch answers.
        """
        with self._lock:
            parent, _, index = jobId.partition(":")
            job = self.jobs.get(parent)
            children = [] if job is None else (job.children if not index else [job.children[int(index)]])
            for child in children:
                if child.status in ("SUCCEEDED", "FAILED"):
                    continue
                if child.status == "RUNNING":
                    signal_group(child.attempts[-1].process.pid, signal.SIGTERM)
                child.status_reason = reason
                child.status = "FAILED" if child.status != "RUNNING" else "STOPPING"
        return {}

    cancel_job = terminate_job

    # ---- injected reclaims ----
    def reclaim(self, child_id: str, *, notice: bool = True, lead_s: float = DEFAULT_NOTICE_LEAD_S) -> str:
        """Reclaim the host of a running child, with or without a spot notice first.

        A spot notice is posted on its IMDS now (``notice``) and the host taken ``lead_s`` seconds later
        (at once without a notice).

        Args:
            child_id: the child, ``<array job id>:<index>``.
            notice: post a spot interruption notice first (default True).
            lead_s: seconds between the notice and the reclaim (default :data:`DEFAULT_NOTICE_LEAD_S`).

        Returns:
            the reclaimed host's instance id.

        Raises:
            RuntimeError: the child is not running.
        """
        with self._lock:
            parent, _, index = child_id.partition(":")
            child = self.jobs[parent].children[int(index)]
            if child.status != "RUNNING":
                raise RuntimeError(f"child {child_id} is {child.status}, not RUNNING")
            attempt = child.attempts[-1]
            at = time.time() + (lead_s if notice else 0.0)
            if notice:
                attempt.imds.post_spot_interruption(time_iso=dt.datetime.fromtimestamp(at, dt.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ"))
                attempt.noticed = True
            attempt.reclaim_at = at
        self._emit({"event": "notice-posted" if notice else "reclaimed-without-notice", "job_id": child_id,
                    "attempt": attempt.number, "instance_id": attempt.instance_id, "lead_s": lead_s if notice else 0.0})
        return attempt.instance_id

    # ---- scheduling ----
    def tick(self) -> None:
        """Take hosts whose reclaim time came, reap ended attempts (retry rules), start RUNNABLE children."""
        with self._lock:
            now = time.time()
            running = 0
            for job in self.jobs.values():
                for child in job.children:
                    if child.status in ("RUNNING", "STOPPING"):
                        attempt = child.attempts[-1]
                        if attempt.reclaim_at is not None and now >= attempt.reclaim_at and attempt.process.poll() is None:
                            self._take_host(attempt)
                        elif attempt.reclaim_at is not None and now >= attempt.reclaim_at and attempt.status_reason is None:
                            self._take_host(attempt)
                        if attempt.process.poll() is not None:
                            self._end_attempt(job, child, attempt)
                    running += child.status in ("RUNNING", "STOPPING")
            for job in self.jobs.values():
                for child in job.children:
                    if running >= self.max_running:
                        return
                    if child.status == "RUNNABLE":
                        self._start_attempt(job, child)
                        running += 1

    def wait(self, *, timeout_s: float, poll_s: float = 0.1, tick: Callable[[], None] | None = None) -> bool:
        """:meth:`tick` until every child ended (True) or ``timeout_s`` passed (False).

        Args:
            timeout_s: the most seconds to wait.
            poll_s: seconds between ticks (default 0.1).
            tick: called after every tick (e.g. the drill's own injections), or None.

        Returns:
            True when every child ended.
        """
        deadline = time.time() + timeout_s
        while time.time() < deadline:
            self.tick()
            if tick is not None:
                tick()
            if all(c.status in ("SUCCEEDED", "FAILED") for j in self.jobs.values() for c in j.children):
                return True
            time.sleep(poll_s)
        return False

    def close(self) -> None:
        """Kill every running attempt and terminate its host (idempotent)."""
        with self._lock:
            for job in self.jobs.values():
                for child in job.children:
                    if child.status in ("RUNNING", "STOPPING"):
                        attempt = child.attempts[-1]
                        self._take_host(attempt)
                        attempt.process.wait()
                        self._end_attempt(job, child, attempt, final=True)

    # ---- internals ----
    def child(self, child_id: str) -> _Child:
        """The child ``<array job id>:<index>``."""
        parent, _, index = child_id.partition(":")
        return self.jobs[parent].children[int(index)]

    def _start_attempt(self, job: _ArrayJob, child: _Child) -> None:
        number = len(child.attempts) + 1
        slot = next(self._placement)
        zones = sorted(self.subnets)
        zone = zones[slot % len(zones)]
        instance_type = self.instance_types[slot % len(self.instance_types)]
        instance = self.ec2.run_instances(
            ImageId="ami-0123456789abcdef0", InstanceType=instance_type, MinCount=1, MaxCount=1, SubnetId=self.subnets[zone],
            InstanceMarketOptions={"MarketType": "spot", "SpotOptions": {"SpotInstanceType": "one-time"}},
            TagSpecifications=[{"ResourceType": "instance", "Tags": [{"Key": contract.STACK_TAG, "Value": self.stack},
                                                                     {"Key": "aws:batch:job-id", "Value": child.job_id}]}],
        )["Instances"][0]
        imds = ImdsEmulator(instance_id=instance["InstanceId"], availability_zone=zone, instance_type=instance_type).start()
        env = {**self.environment, **job.environment, contract.ENV_ROOT: str(self.efs_dir),
               contract.ENV_BATCH_ARRAY_INDEX: str(child.index), contract.ENV_BATCH_JOB_ATTEMPT: str(number),
               contract.ENV_BATCH_JOB_ID: child.job_id, "AWS_EC2_METADATA_SERVICE_ENDPOINT": imds.endpoint}
        log_path = self.work_dir / "children" / f"{job.job_id[:8]}-{child.index}-attempt-{number}.log"
        with open(log_path, "ab") as log:
            process = subprocess.Popen(job.command, env=env, cwd=str(self.work_dir), stdout=log, stderr=subprocess.STDOUT,
                                       stdin=subprocess.DEVNULL, start_new_session=True)
        child.attempts.append(_Attempt(number, instance["InstanceId"], instance_type, zone, imds, process, time.time()))
        child.status = "RUNNING"
        self._emit({"event": "attempt-started", "job_id": child.job_id, "index": child.index, "attempt": number,
                    "instance_id": instance["InstanceId"], "instance_type": instance_type, "availability_zone": zone})

    def _take_host(self, attempt: _Attempt) -> None:
        """The host goes away: everything on it dies at once (SIGKILL), the instance is terminated.
        Every descendant too: the child starts the trainer in a session of its own, which a signal to
        the child's group alone would leave running (the descendants are listed before any signal)."""
        if attempt.status_reason is None:
            attempt.status_reason = contract.BATCH_HOST_TERMINATED_REASON.format(instance_id=attempt.instance_id)
        kill_tree(attempt.process.pid)

    def _end_attempt(self, job: _ArrayJob, child: _Child, attempt: _Attempt, *, final: bool = False) -> None:
        attempt.process.wait()
        attempt.stopped = time.time()
        attempt.imds.stop()
        try:
            self.ec2.terminate_instances(InstanceIds=[attempt.instance_id])
        except Exception:  # noqa: BLE001 - the orphan check reports an instance left running
            pass
        host_taken = attempt.status_reason is not None
        if not host_taken:
            attempt.exit_code = attempt.process.returncode
            attempt.reason = "Essential container in task exited"
        if child.status == "STOPPING" or final:
            child.status = "FAILED"
        else:
            child.status = next_status(attempt=attempt.number, attempts=self.attempts, rules=self.rules, exit_code=attempt.exit_code,
                                       status_reason=attempt.status_reason, reason=attempt.reason)
            child.status_reason = attempt.status_reason or (None if child.status == "SUCCEEDED" else attempt.reason)
        self._emit({"event": "attempt-ended", "job_id": child.job_id, "index": child.index, "attempt": attempt.number,
                    "exit_code": attempt.exit_code, "status_reason": attempt.status_reason, "next": child.status,
                    "instance_id": attempt.instance_id})

    def _describe_child(self, job: _ArrayJob, child: _Child) -> dict[str, Any]:
        attempts = [{"container": {"exitCode": a.exit_code, "reason": a.reason, "containerInstanceArn": a.instance_id},
                     "startedAt": _ms(a.started), "stoppedAt": _ms(a.stopped) if a.stopped else None,
                     "statusReason": a.status_reason or a.reason}
                    for a in child.attempts if a.stopped is not None]
        out = {"jobId": child.job_id, "jobName": job.name, "status": child.status, "statusReason": child.status_reason,
               "arrayProperties": {"index": child.index}, "attempts": attempts, "createdAt": _ms(child.submitted)}
        if child.attempts:
            out["startedAt"] = _ms(child.attempts[0].started)
            last = child.attempts[-1]
            if last.stopped is not None and child.status in ("SUCCEEDED", "FAILED"):
                out["stoppedAt"] = _ms(last.stopped)
        return out

    @staticmethod
    def _array_status(job: _ArrayJob) -> str:
        statuses = {c.status for c in job.children}
        if statuses <= {"SUCCEEDED"}:
            return "SUCCEEDED"
        if statuses <= {"SUCCEEDED", "FAILED"}:
            return "FAILED"
        return "RUNNING" if statuses & {"RUNNING", "STOPPING", "SUCCEEDED", "FAILED"} else "PENDING"


def contract_account() -> str:
    """moto's account (the local AWS's)."""
    from spot_training.local.deploy import ACCOUNT

    return ACCOUNT
