"""The jobs drill: two (or more) training jobs in one stack, each interrupted, each on its own volume.

moto server up -> ``cdk bootstrap`` -> ``cdk deploy`` of :mod:`spot_training.local.jobs_app` (one stack, one
VPC, one ``TrainingJob`` per job: its own data volume, node role, fleet, log group and metrics, all
tagged ``spot-training:stack = <job id>``) -> a node runner per job starts its fleet's instance as a
local node -> each job, in a thread of its own, is interrupted ``interruptions`` times by the injector
(job A's first replacement stays in its AZ, job B's moves, and so on alternately, so one volume
moves through a snapshot while the other stays) -> both train to the end -> ``spot-train status --job``
and ``spot-train cost --job`` (their code, spot_training.ops.operations) read each job back from the
local AWS -> ``cdk destroy`` -> the orphan check of the stack and of every job id.

Each job trains the numpy softmax example (spot_training.training.examples.sweep_softmax) with a
learning rate of its own, so a job that resumed from the other's checkpoint would not end equal to
its own uninterrupted run (which runs beside the drill, as in the single-node drill).

:func:`run_jobs_drill` returns the report (and writes ``report.json``, ``events.jsonl`` and, per job,
``results/<job id>/`` with the trainer's log, ``COMPLETED``, the final weights and the text of
``status.txt`` and ``cost.txt`` into ``work_dir``). Report fields (times in seconds): ``stack``, ``jobs`` (one dict per job id:
``completed``, ``steps_total``, ``steps_executed``, ``lost_steps``, ``interruptions``, ``az_moves``,
``interruption_events``, ``instances`` (every instance its runner booted), ``volume_ids`` (every data
volume it used: the deployed one and the copies an AZ move made), ``volume_dirs`` (the local block
devices its nodes mounted), ``agent_exit_codes`` (per instance; 78 would be a refused config such
as two independent tagged volumes), ``test_accuracy``, ``matches_uninterrupted_baseline``, ``status_instances`` /
``status_volumes`` (what ``status --job`` lists), ``cost_instances`` (the instances ``cost --job``
priced), ``cost_usd``, ``savings_pct``, ``reads_only_its_own``, ``error``), ``volumes_shared`` (volume
ids or directories in more than one job: ``[]`` is the goal), ``orphans_after_destroy``, ``wall_s``,
``phases_s``, ``error`` and ``passed``.
"""

from __future__ import annotations

import dataclasses
import datetime as dt
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from spot_training import contract
from spot_training.contract import DEFAULT_MOUNT_POINT as MOUNT_POINT
from spot_training.local.deploy import CdkCli, DeployedStack, clients, destroy_and_check, local_context, stack_resources
from spot_training.local.drill import (
    FINAL_WEIGHTS,
    REPO_ROOT,
    EventLog,
    bootstrap_and_deploy,
    check_on_demand_prices,
    fresh_work_dir,
    options_dict,
    table_on_demand_prices,
    weights_match,
)
from spot_training.local.injector import LOG_NAME, Interruption, InterruptionInjector, read_training_log
from spot_training.local.jobs_app import JOBS_CONTEXT_KEY
from spot_training.local.moto_server import MotoServer
from spot_training.local.nodes import LocalNode, NodeRunner, signal_group

#: The trainer every job runs (numpy only; bitwise-reproducible across resumes).
TRAINER_MODULE = "spot_training.training.examples.sweep_softmax"
#: The most jobs the drill runs (each is a node with an agent and a trainer at a time).
MAX_JOBS = 4
#: The trainer's last line (it goes to the agent's log through the agent).
_ACCURACY = re.compile(r"done: \d+ steps, test accuracy ([0-9.]+)")


@dataclasses.dataclass
class JobsDrillOptions:
    """What the jobs drill does (``spot-train local drill --jobs N``).

    Attributes:
        work_dir: everything goes here (default ``out/jobs-drill``); emptied first.
        stack: stack name (default ``SpotTrainingJobs``); the job ids are ``<stack>-JobA``, ``<stack>-JobB``, ...
        jobs: how many jobs (default 2; 2..:data:`MAX_JOBS`).
        interruptions: spot interruptions per job (default 1; >= 1).
        steps: optimizer steps of each job's trainer (default 400; >= 100 per interruption).
        step_delay_s: the trainer's sleep after each step (default 0.02 s: 50 steps/s, so that a
            notice finds training running).
        save_every_steps: the trainer's checkpoint cadence in steps (default: the contract's, 50).
        seed: the trainers' seed (default 0); job i trains with learning rate ``0.5 / (i + 1)``.
        baseline: run each job's uninterrupted twin and compare final weights (default True).
        timeout_s: the longest the training phase may take (default 600 s).
        instance_types, on_demand_prices, ebs_gb_month_price, snapshot_gb_month_price: as the
            single-node drill's (spot_training.local.drill.DrillOptions): what the fleets launch and the
            stated prices ``cost --job`` uses.
    """

    work_dir: Path = Path("out/jobs-drill")
    stack: str = "SpotTrainingJobs"
    jobs: int = 2
    interruptions: int = 1
    steps: int = 400
    step_delay_s: float = 0.02
    save_every_steps: int = contract.default("checkpoint_every_steps")
    seed: int = 0
    baseline: bool = True
    timeout_s: float = 600.0
    instance_types: tuple[str, ...] = ("g5.xlarge", "g4dn.xlarge")
    on_demand_prices: dict[str, float] = dataclasses.field(
        default_factory=lambda: table_on_demand_prices(("g5.xlarge", "g4dn.xlarge")))
    ebs_gb_month_price: float = 0.08
    snapshot_gb_month_price: float = 0.05

    def validate(self) -> None:
        """Raise ``ValueError`` naming the bad option, its value and what is allowed."""
        for name, low in (("jobs", 2), ("interruptions", 1), ("steps", 1), ("save_every_steps", 1)):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < low:
                raise ValueError(f"{name} must be an integer >= {low}, got {value!r}")
        if self.jobs > MAX_JOBS:
            raise ValueError(f"jobs must be at most {MAX_JOBS} (each runs a node at a time), got {self.jobs}")
        if self.steps < 100 * self.interruptions:
            raise ValueError(f"steps must be >= 100 per interruption ({100 * self.interruptions}) so that each "
                             f"notice finds training running, got {self.steps}")
        if not 0 <= self.step_delay_s <= 1:
            raise ValueError(f"step_delay_s must be 0..1 seconds, got {self.step_delay_s!r}")
        contract.check_seconds("timeout_s", self.timeout_s)
        check_on_demand_prices(self.instance_types, self.on_demand_prices)
        if not re.fullmatch(r"[A-Za-z][A-Za-z0-9-]{0,100}", self.stack):
            raise ValueError(f"stack must be a CloudFormation stack name (letters, digits, -; at most 101, so that "
                             f"the job ids <stack>-JobA fit), got {self.stack!r}")

    @property
    def construct_ids(self) -> list[str]:
        """The jobs' construct ids: ``JobA``, ``JobB``, ..."""
        return [f"Job{chr(ord('A') + i)}" for i in range(self.jobs)]

    @property
    def job_ids(self) -> list[str]:
        """The jobs' ids, ``TrainingJob``'s default for a job in this stack: ``<stack>-<construct id>``."""
        return [f"{self.stack}-{c}" for c in self.construct_ids]

    def learning_rate(self, index: int) -> float:
        """Job ``index``'s learning rate: ``0.5 / (index + 1)``."""
        return 0.5 / (index + 1)

    def trainer_args(self, index: int, root: str = MOUNT_POINT, *, step_delay_s: float | None = None) -> list[str]:
        """Job ``index``'s trainer arguments after the interpreter.

        Args:
            index: the job's 0-based position in :attr:`job_ids`.
            root: the directory the final weights go under (default: the node's mount point).
            step_delay_s: seconds of sleep per step; default: the options' ``step_delay_s``.

        Returns:
            the argument list, e.g. ``["-m", TRAINER_MODULE, "--lr", "0.5", ...]``.
        """
        delay = self.step_delay_s if step_delay_s is None else step_delay_s
        return ["-m", TRAINER_MODULE, "--lr", str(self.learning_rate(index)), "--steps", str(self.steps),
                "--seed", str(self.seed), "--step-delay-s", str(delay), "--save-every-steps", str(self.save_every_steps),
                "--save-final-weights", f"{root}/{FINAL_WEIGHTS}"]

    def trigger_steps(self) -> list[int]:
        """The step after which each interruption's notice is posted: ``steps * (i + 1) / (n + 2)``,
        as the single-node drill spreads them (the last leaves 2/(n + 2) of the steps)."""
        n = self.interruptions
        return [round(self.steps * (i + 1) / (n + 2)) for i in range(n)]

    def moves(self, job_index: int, interruption: int) -> bool:
        """Whether a job's replacement goes to the other AZ: alternately, job A first staying and job B first moving.

        Args:
            job_index: the job's 0-based position in :attr:`job_ids`.
            interruption: the interruption's 0-based index.

        Returns:
            True when the replacement moves to the other Availability Zone.
        """
        return (job_index + interruption) % 2 == 1


def volumes_shared(jobs: dict[str, dict[str, Any]]) -> list[str]:
    """The volume ids and block-device directories that appear in more than one job's
    ``volume_ids`` / ``volume_dirs`` (sorted); ``[]`` when every job kept to its own."""
    owners: dict[str, set[str]] = {}
    for job_id, job in jobs.items():
        for item in [*job.get("volume_ids", []), *job.get("volume_dirs", [])]:
            owners.setdefault(item, set()).add(job_id)
    return sorted(item for item, found in owners.items() if len(found) > 1)


def reads_only_its_own(job: dict[str, Any]) -> bool:
    """Whether what ``status --job`` and ``cost --job`` read for a job is exactly its own: the
    instances status lists and cost prices are the ones its runner booted, and the data volumes
    status lists are among the ones it used."""
    own = set(job.get("instances", []))
    return bool(own) and set(job.get("status_instances") or []) == own \
        and sorted(job.get("cost_instances") or []) == sorted(own) \
        and set(job.get("status_volumes") or []) <= set(job.get("volume_ids", [])) \
        and bool(job.get("status_volumes"))


def passed(report: dict[str, Any], options: JobsDrillOptions) -> bool:
    """Whether the drill shows what it must.

    Every job completed with no lost step after at least ``interruptions`` interruptions, equal to its
    uninterrupted twin (with ``baseline``), every agent exited 0, no volume shared, each job read back
    alone, nothing orphaned.

    Args:
        report: the drill's report (:func:`run_jobs_drill`).
        options: the options it ran with.

    Returns:
        True when every check holds.
    """
    jobs = report["jobs"]
    return bool(
        report["error"] is None and len(jobs) == options.jobs and report["volumes_shared"] == []
        and report["orphans_after_destroy"] == []
        and all(j["completed"] and j["lost_steps"] == 0 and j["error"] is None
                and j["interruptions"] >= options.interruptions
                and set(j["agent_exit_codes"].values()) == {0}
                and (j["matches_uninterrupted_baseline"] or not options.baseline)
                and j["reads_only_its_own"] for j in jobs.values())
    )


def _start_baseline(options: JobsDrillOptions, index: int, root: Path) -> subprocess.Popen[bytes]:
    """Job ``index``'s trainer, same arguments and seed, uninterrupted (no step delay), in ``root``."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("AWS_", "SPOT_TRAINING_"))}
    env.update({"SPOT_TRAINING_CHECKPOINT_DIR": str(root / "checkpoints"), "SPOT_TRAINING_LOG_DIR": str(root / "logs"),
                "PYTHONUNBUFFERED": "1", "PYTHONDONTWRITEBYTECODE": "1"})
    root.mkdir(parents=True)
    with open(root / "trainer.log", "ab") as log:
        return subprocess.Popen([sys.executable, *options.trainer_args(index, str(root), step_delay_s=0.0)],
                                cwd=REPO_ROOT, env=env, stdout=log, stderr=subprocess.STDOUT,
                                stdin=subprocess.DEVNULL, start_new_session=True)


class _Job:
    """One job's runner, injector and figures while the drill runs."""

    def __init__(self, *, index: int, job_id: str, stack: DeployedStack, runner: NodeRunner,
                 record: Callable[[dict[str, Any]], None]) -> None:
        self.index, self.job_id, self.stack, self.runner, self.record = index, job_id, stack, runner, record
        self.interruptions: list[Interruption] = []
        self.node: LocalNode | None = None
        self.error: str | None = None
        self.volume_dirs: set[str] = set()

    def note_volume(self, node: LocalNode) -> None:
        """Remember the block device ``node`` mounted (its mount point links into the moto server's EBS data plane)."""
        if node.mount_point.is_symlink() or node.mount_point.exists():
            self.volume_dirs.add(str(node.mount_point.resolve()))


def _train(job: _Job, options: JobsDrillOptions, zones: list[str], deadline: float, stop: threading.Event) -> None:
    """Interrupt ``job``'s node ``options.interruptions`` times and wait until its last node ends
    (run in a thread of its own); a failure is kept in ``job.error``."""
    try:
        node = job.node
        assert node is not None
        injector = InterruptionInjector(job.runner, stack_name=job.job_id, on_event=job.record)
        last_step = [0]

        def tick() -> None:
            if stop.is_set():
                raise RuntimeError("the drill was stopped")
            if time.time() > deadline:
                raise RuntimeError(f"job {job.job_id} did not finish within timeout_s={options.timeout_s} s")
            current = job.node
            rows = read_training_log(current.log_dir / LOG_NAME) if current is not None else []
            if rows:
                last_step[0] = int(rows[-1]["step"])

        for i, trigger in enumerate(options.trigger_steps()):
            resumed_from = job.interruptions[-1].resumed_at_step if job.interruptions else 0
            while last_step[0] < max(trigger, resumed_from + 10):
                if not node.alive:
                    raise RuntimeError(f"node {node.instance_id} exited {node.process.returncode} before "
                                       f"interruption {i + 1}; see {node.log_path}")
                tick()
                time.sleep(0.2)
            job.note_volume(node)
            target = next(z for z in zones if z != node.availability_zone) if options.moves(job.index, i) \
                else node.availability_zone
            interruption, node = injector.interrupt(node, index=i + 1, target_az=target, tick=tick)
            job.node = node
            job.interruptions.append(interruption)
        while node.alive:
            tick()
            time.sleep(0.2)
        job.note_volume(node)
    except Exception as error:  # noqa: BLE001 - the job's report says what failed
        job.error = f"{type(error).__name__}: {error}"
        job.record({"event": "error", "message": job.error})


def _collect(node: LocalNode, results: Path) -> None:
    """Copy the trainer's log, COMPLETED and final weights off the node's volume before destroy deletes it."""
    results.mkdir(parents=True, exist_ok=True)
    for source in (node.log_dir / LOG_NAME, node.checkpoint_dir / contract.COMPLETED_FILE, node.mount_point / FINAL_WEIGHTS):
        if source.exists():
            shutil.copy2(source, results / source.name)


def _job_report(job: _Job, work_dir: Path) -> dict[str, Any]:
    """The job's figures from its last node's volume and its runner (before the read-back)."""
    out: dict[str, Any] = {
        "completed": False, "steps_total": 0, "steps_executed": 0, "lost_steps": None,
        "interruptions": len(job.interruptions), "az_moves": sum(1 for i in job.interruptions if i.volume_moved),
        "interruption_events": [i.to_dict() for i in job.interruptions], "instances": sorted(job.runner.nodes),
        "volume_ids": sorted({job.stack.data_volume_id} | {v for i in job.interruptions
                                                           for v in (i.volume_id_before, i.volume_id_after) if v}),
        "volume_dirs": sorted(job.volume_dirs),
        "agent_exit_codes": {i: n.process.poll() for i, n in sorted(job.runner.nodes.items())},
        "test_accuracy": None, "matches_uninterrupted_baseline": False, "error": job.error,
    }
    if job.node is not None:
        results = work_dir / "results" / job.job_id
        _collect(job.node, results)
        completed = results / contract.COMPLETED_FILE
        if completed.exists():
            out["completed"] = True
            out["steps_total"] = int(json.loads(completed.read_text())["step"])
        rows = read_training_log(results / LOG_NAME)
        out["steps_executed"] = len(rows)
        out["lost_steps"] = len(rows) - out["steps_total"]
        found = _ACCURACY.findall(job.node.log_path.read_text(errors="replace")) if job.node.log_path.exists() else []
        out["test_accuracy"] = float(found[-1]) if found else None
    return out


def read_back_job(endpoint_url: str, stack: str, job_id: str, options: JobsDrillOptions, *,
                  out_dir: Path | None = None) -> dict[str, Any]:
    """What ``spot-train status --stack STACK --job JOB_ID`` and ``spot-train cost --stack STACK --job
    JOB_ID`` read from the local AWS for one job (spot_training.ops.operations, the commands' code).
    Call it before the stack is destroyed.

    Args:
        endpoint_url: the moto server.
        stack: the stack name; job_id: the job's id.
        options: the stated prices (``on_demand_prices``, ``ebs_gb_month_price``, ``snapshot_gb_month_price``).
        out_dir: when given, the commands' text output goes to ``status.txt`` and ``cost.txt`` in it.

    Returns:
        ``status_instances`` (instance ids), ``status_volumes`` (data volume ids), ``status_step`` (the
        training step its metrics show), ``status_interruptions`` (count), ``cost_instances`` (the
        instance ids cost priced: those status lists when the rows count as many, else one
        ``"<n> priced"`` item), ``cost_usd``, ``savings_pct``.

    Raises:
        spot_training.ops.operations.OperationsError: an AWS call failed.
    """
    from spot_training.ops import operations as ops

    aws = ops.connect(region="us-east-1", endpoint_url=endpoint_url, credentials=("testing", "testing"))
    now = dt.datetime.now(dt.timezone.utc)
    status = ops.status_report(aws, stack, now=now, job=job_id)
    cost = json.loads(ops.to_json(ops.cost_report(
        aws, stack, now=now, job=job_id, on_demand=options.on_demand_prices,
        ebs_gb_month=options.ebs_gb_month_price, snapshot_gb_month=options.snapshot_gb_month_price)))
    if out_dir is not None:
        out_dir.mkdir(parents=True, exist_ok=True)
        (out_dir / "status.txt").write_text(ops.format_status(status))
        (out_dir / "cost.txt").write_text(ops.format_cost(cost))
    priced = sum(row["instances"] for row in cost["rows"])
    listed = [i["instance_id"] for i in status["instances"] if i["state"] != "pending"]
    return {"status_instances": sorted(i["instance_id"] for i in status["instances"]),
            "status_volumes": sorted(v["volume_id"] for v in status["data_volume"]),
            "status_step": status["training"]["step"], "status_interruptions": len(status["interruptions"]),
            # cost prices the very instances status lists (same tag query); a count that differs is a defect.
            "cost_instances": sorted(listed) if priced == len(listed) else [f"{priced} priced"],
            "cost_usd": cost["cost_usd"], "savings_pct": cost["savings_pct"]}


def run_jobs_drill(options: JobsDrillOptions, *,
                   on_event: Callable[[dict[str, Any]], None] | None = None) -> dict[str, Any]:
    """Run the jobs drill (see the module docstring).

    Args:
        options: what to run (validated first).
        on_event: gets every event as a dict with an ``event`` key; a job's events carry ``job`` (its id).

    Returns:
        the report, also written to ``report.json`` in the work directory.

    Raises:
        ValueError: bad options (nothing started).
        KeyboardInterrupt: re-raised after the teardown (destroy, every process stopped).
    """
    options.validate()
    started = time.time()
    work_dir = fresh_work_dir(options.work_dir)
    record = EventLog(started, on_event)
    job_ids = options.job_ids
    report: dict[str, Any] = {"stack": options.stack, "work_dir": str(work_dir), "job_ids": job_ids, "jobs": {},
                              "volumes_shared": None, "orphans_after_destroy": None, "wall_s": 0.0, "phases_s": {},
                              "options": options_dict(options), "error": None}
    phases = report["phases_s"]
    baselines = ({job_id: _start_baseline(options, i, work_dir / "baseline" / job_id) for i, job_id in enumerate(job_ids)}
                 if options.baseline else {})
    commands = {c: ["{python}", *options.trainer_args(i)] for i, c in enumerate(options.construct_ids)}
    context = local_context(extra={"stack_name": options.stack, "instance_types": ",".join(options.instance_types),
                                   "monitoring_interval_s": "1", JOBS_CONTEXT_KEY: json.dumps(commands)})
    server = MotoServer(work_dir / "moto")
    cdk: CdkCli | None = None
    jobs: list[_Job] = []
    stop = threading.Event()
    try:
        record({"event": "phase", "phase": "moto", "message": "starting the moto server on 127.0.0.1"})
        server.start()
        aws = clients(server.endpoint_url)
        cdk = CdkCli(server.endpoint_url, work_dir=work_dir, app_command=f"{sys.executable} -m spot_training.local.jobs_app")
        bootstrap_and_deploy(cdk, options.stack, context, record=record, phases=phases)
        for index, job_id in enumerate(job_ids):
            stack = stack_resources(aws, options.stack, job=job_id)

            def job_record(event: dict[str, Any], job_id: str = job_id) -> None:
                record({**event, "job": job_id})

            job_record({"event": "deployed", "fleet_request_id": stack.fleet_request_id,
                        "data_volume_id": stack.data_volume_id, "availability_zones": sorted(stack.subnets)})
            runner = NodeRunner(aws=clients(server.endpoint_url), endpoint_url=server.endpoint_url,
                                volumes_dir=server.volumes_dir, stack=stack, work_dir=work_dir / "jobs" / job_id,
                                on_event=job_record)
            jobs.append(_Job(index=index, job_id=job_id, stack=stack, runner=runner, record=job_record))

        t = time.time()
        record({"event": "phase", "phase": "training", "message": f"{len(jobs)} fleets' instances -> local nodes"})
        for job in jobs:
            nodes = job.runner.sync()
            if len(nodes) != 1:
                raise RuntimeError(f"expected job {job.job_id}'s fleet to run 1 instance, found {len(nodes)}")
            job.node = nodes[0]
        zones = sorted(jobs[0].stack.subnets)
        threads = [threading.Thread(target=_train, args=(job, options, zones, t + options.timeout_s, stop),
                                    name=f"jobs-drill-{job.job_id}", daemon=True) for job in jobs]
        for thread in threads:
            thread.start()
        for thread in threads:
            while thread.is_alive():
                thread.join(timeout=0.5)  # a short join keeps Ctrl-C deliverable to this thread
        phases["training"] = round(time.time() - t, 3)
        for job in jobs:
            job.runner.reconcile()
            report["jobs"][job.job_id] = entry = _job_report(job, work_dir)
            job.record({"event": "completed", "step": entry["steps_total"], "test_accuracy": entry["test_accuracy"]})
        record({"event": "phase", "phase": "read-back", "message": "spot-train status --job / cost --job for each job"})
        for job in jobs:
            entry = report["jobs"][job.job_id]
            try:
                entry.update(read_back_job(server.endpoint_url, options.stack, job.job_id, options,
                                           out_dir=work_dir / "results" / job.job_id))
            except Exception as error:  # noqa: BLE001 - the job's own figures stand; say what failed
                entry["read_back_error"] = f"{type(error).__name__}: {error}"
            entry["reads_only_its_own"] = reads_only_its_own(entry)
            job.record({"event": "read-back", "savings_pct": entry.get("savings_pct"),
                        "interruptions": entry.get("status_interruptions", 0)})
    except Exception as error:  # noqa: BLE001 - recorded in the report; teardown still runs below
        report["error"] = f"{type(error).__name__}: {error}"
        record({"event": "error", "message": report["error"]})
    except BaseException:  # Ctrl-C / SIGTERM: tear down, then re-raise
        report["error"] = "interrupted by the user"
        raise
    finally:
        stop.set()
        for job in jobs:
            if job.job_id not in report["jobs"]:
                report["jobs"][job.job_id] = _job_report(job, work_dir)
            report["jobs"][job.job_id].setdefault("reads_only_its_own", False)
        report["volumes_shared"] = volumes_shared(report["jobs"])
        _teardown(report, options, server, cdk, context, jobs, record)
        for job_id, baseline in baselines.items():
            _finish_baseline(report["jobs"].get(job_id), baseline, work_dir, job_id, record)
        report["wall_s"] = round(time.time() - started, 3)
        report["passed"] = passed(report, options)
        record.write(work_dir / "events.jsonl")
        (work_dir / "report.json").write_text(json.dumps(report, indent=2) + "\n")
    return report


def _teardown(report: dict[str, Any], options: JobsDrillOptions, server: MotoServer, cdk: CdkCli | None,
              context: dict[str, str], jobs: list[_Job], record: Callable[[dict[str, Any]], None]) -> None:
    """Stop every node, ``cdk destroy``, then the orphan check of the stack and of each job id."""
    try:
        for job in jobs:
            job.runner.close()
        if cdk is not None and server.process is not None:
            destroy_and_check(cdk, clients(server.endpoint_url), options.stack, context=context, report=report,
                              record=record, jobs={job.job_id: [job.stack.fleet_request_id] for job in jobs})
    finally:
        server.stop()


def _finish_baseline(entry: dict[str, Any] | None, baseline: subprocess.Popen[bytes], work_dir: Path, job_id: str,
                     record: Callable[[dict[str, Any]], None]) -> None:
    try:
        baseline.wait(timeout=120)
    except subprocess.TimeoutExpired:  # numpy at full speed takes seconds; stop it by its process group
        signal_group(baseline.pid, signal.SIGKILL)
        baseline.wait(timeout=10)
    ours, theirs = work_dir / "results" / job_id / FINAL_WEIGHTS, work_dir / "baseline" / job_id / FINAL_WEIGHTS
    matches = bool(ours.exists() and theirs.exists() and weights_match(ours, theirs))
    if entry is not None:
        entry["matches_uninterrupted_baseline"] = matches
    record({"event": "baseline", "job": job_id, "exit_status": baseline.returncode, "matches": matches})


def format_jobs_report(report: dict[str, Any]) -> str:
    """The report for the terminal: one column per job, then the drill's own lines."""
    jobs = report.get("jobs") or {}
    rows = [("completed", "completed"), ("steps_total", "steps"), ("lost_steps", "lost steps"),
            ("interruptions", "interruptions"), ("az_moves", "AZ moves"), ("instances", "instances"),
            ("volume_ids", "data volumes"), ("agent_exit_codes", "agent exit codes"),
            ("matches_uninterrupted_baseline", "equals uninterrupted run"), ("test_accuracy", "test accuracy"),
            ("status_instances", "status --job: instances"), ("status_volumes", "status --job: volumes"),
            ("cost_instances", "cost --job: instances"), ("cost_usd", "cost --job: USD"),
            ("savings_pct", "cost --job: savings %"), ("reads_only_its_own", "reads only its own")]

    def cell(value: Any) -> str:
        if isinstance(value, dict):
            value = sorted(set(value.values()))
        if isinstance(value, list):
            return str(len(value)) if len(value) > 2 and all(isinstance(v, str) for v in value) else \
                ", ".join(map(str, value)) or "-"
        if isinstance(value, float):
            return f"{value:.6g}"
        return "-" if value is None else str(value)

    width = max(len(label) for _, label in rows)
    columns = [[cell(job.get(key)) for key, _ in rows] for job in jobs.values()]
    widths = [max(len(job_id), *(len(c) for c in column)) for job_id, column in zip(jobs, columns)]
    lines = ["", "Jobs drill report", "-" * (width + 2 + sum(w + 2 for w in widths)),
             " " * (width + 2) + "  ".join(job_id.ljust(w) for job_id, w in zip(jobs, widths))]
    for n, (_, label) in enumerate(rows):
        lines.append(label.ljust(width + 2) + "  ".join(column[n].ljust(w) for column, w in zip(columns, widths)))
    lines.append("")
    for key in ("volumes_shared", "orphans_after_destroy", "wall_s"):
        lines.append(f"{key.ljust(width)}  {cell(report.get(key)) if report.get(key) != [] else '[]'}")
    lines += [f"{('phase ' + name + ' (s)').ljust(width)}  {value}" for name, value in report.get("phases_s", {}).items()]
    for job_id, job in jobs.items():
        for key in ("error", "read_back_error"):
            if job.get(key):
                lines.append(f"{job_id}: {key}: {job[key]}")
    if report.get("error"):
        lines.append(f"{'error'.ljust(width)}  {report['error']}")
    lines.append(f"{'passed'.ljust(width)}  {report.get('passed')}")
    return "\n".join(lines) + "\n"
