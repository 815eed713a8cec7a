"""The interruption injector: a spot interruption of one local node, as EC2 would deliver it.

One :meth:`InterruptionInjector.interrupt` is: post the two-minute notice on the node's IMDS emulator ->
wait until the agent has had its trainer checkpoint and exit (the node's agent exits 0) -> stop the node
by PID -> terminate the instance in moto -> launch the replacement in the chosen Availability Zone (the
runner acts for moto's fleet, see :mod:`spot_training.local.nodes`) -> start its node -> wait until training has
resumed on it. It measures what a user cares about:

- ``notice_to_checkpoint_s``: seconds from the notice to the newest checkpoint's commit (``LATEST``
  written); the agent polls IMDS every 5 s, so up to ~5 s of this is the poll interval.
- ``boot_to_resume_s``: seconds from the replacement instance's launch to the first training step it
  logs (agent start, volume attach or AZ move through a snapshot, trainer start and restore).
- ``volume_moved``: whether the data volume ended up in another AZ (``az_moves`` counts these).
"""

from __future__ import annotations

import csv
import dataclasses
import json
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from spot_training.local.deploy import STACK_TAG_KEY
from spot_training.local.nodes import LocalNode, NodeRunner
from spot_training.contract import COMPLETED_FILE, DATA_VOLUME_PURPOSE, LATEST_FILE, PURPOSE_TAG, TRAINING_LOG_FILE

LOG_NAME = TRAINING_LOG_FILE
#: Seconds to wait for the trainer's checkpoint after a notice: the two minutes EC2 gives.
NOTICE_LEAD_S = 120.0
#: Seconds to wait for a replacement node to log its first resumed step.
DEFAULT_RESUME_TIMEOUT_S = 300.0


class InterruptionError(RuntimeError):
    """An interruption did not go as EC2 and the contracts say (the message names what and where)."""


@dataclasses.dataclass
class Interruption:
    """What happened in one interruption (times in seconds, steps are optimizer steps)."""

    index: int
    instance_id: str
    from_az: str
    replacement_instance_id: str = ""
    to_az: str = ""
    notice_at: float = 0.0
    step_at_notice: int = 0
    checkpoint_step: int = 0
    notice_to_checkpoint_s: float = 0.0
    boot_to_resume_s: float = 0.0
    resumed_at_step: int = 0
    volume_id_before: str = ""
    volume_id_after: str = ""
    volume_az_before: str = ""
    volume_az_after: str = ""

    @property
    def volume_moved(self) -> bool:
        """True when the data volume ended in another AZ than it started in."""
        return bool(self.volume_az_before) and self.volume_az_before != self.volume_az_after

    def to_dict(self) -> dict[str, Any]:
        """JSON-able dict with the derived ``volume_moved``; times rounded to milliseconds."""
        data = dataclasses.asdict(self)
        data["volume_moved"] = self.volume_moved
        return {k: round(v, 3) if isinstance(v, float) else v for k, v in data.items()}


def read_training_log(path: Path) -> list[dict[str, float]]:
    """Rows of a trainer's ``training_log.csv`` (``step, epoch, loss, accuracy, wall_time``) as floats.

    A missing file gives ``[]``; a torn last line (being written) is skipped.
    """
    if not path.exists():
        return []
    rows = []
    with open(path, newline="") as handle:
        for row in csv.DictReader(handle):
            try:
                rows.append({key: float(row[key]) for key in ("step", "epoch", "loss", "accuracy", "wall_time")})
            except (TypeError, ValueError, KeyError):
                continue
    return rows


def latest_checkpoint(checkpoint_dir: Path) -> tuple[int, float] | None:
    """``(step, commit time)`` of the ``LATEST`` pointer in ``checkpoint_dir`` (time = the pointer's mtime)."""
    pointer = checkpoint_dir / LATEST_FILE
    try:
        data = json.loads(pointer.read_text())
        return int(data["step"]), pointer.stat().st_mtime
    except (OSError, ValueError, KeyError):
        return None


def _committed_after(checkpoint_dir: Path, step: int, since: float) -> dict[str, float] | None:
    """``{"step", "wall_time"}`` of a checkpoint newer than ``step`` (or of ``COMPLETED``) committed at or
    after ``since``: proof that a trainer which logs no steps resumed and went on; else None."""
    latest = latest_checkpoint(checkpoint_dir)
    if latest is not None and latest[0] > step and latest[1] >= since:
        return {"step": float(latest[0]), "wall_time": latest[1]}
    completed = checkpoint_dir / COMPLETED_FILE
    try:
        data = json.loads(completed.read_text())
        if completed.stat().st_mtime >= since:
            return {"step": float(data["step"]), "wall_time": completed.stat().st_mtime}
    except (OSError, ValueError, KeyError):
        pass
    return None


def data_volume(aws_ec2: Any, stack: str) -> tuple[str, str] | None:
    """``(volume id, AZ)`` of the stack's data volume (both stack tags; not being deleted), or None.

    With two copies during a move, the one attached, else the newest.

    Args:
        aws_ec2: a boto3 EC2 client of the moto server.
        stack: the stack name (its tag value).
    """
    volumes = aws_ec2.describe_volumes(Filters=[
        {"Name": f"tag:{STACK_TAG_KEY}", "Values": [stack]},
        {"Name": f"tag:{PURPOSE_TAG}", "Values": [DATA_VOLUME_PURPOSE]},
    ])["Volumes"]
    volumes = [v for v in volumes if v["State"] in ("available", "in-use", "creating")]
    if not volumes:
        return None
    volumes.sort(key=lambda v: (v["State"] == "in-use", v["CreateTime"]))
    return volumes[-1]["VolumeId"], volumes[-1]["AvailabilityZone"]


class InterruptionInjector:
    """Interrupts nodes of a :class:`NodeRunner` (see the module docstring).

    Args:
        runner: the node runner (acts for the fleet).
        stack_name: for finding the data volume by its tags.
        on_event: called with a dict per step (``notice-posted``, ``checkpointed``, ``instance-terminated``,
            ``resumed``); default: nothing.
        notice_lead_s: longest wait for the checkpoint after the notice (default 120 s, EC2's lead).
        resume_timeout_s: longest wait for the replacement's first step (default 300 s).
        clock: wall-clock seconds (default ``time.time``; the trainer's log uses wall time too).
    """

    def __init__(self, runner: NodeRunner, *, stack_name: str,
                 on_event: Callable[[dict[str, Any]], None] | None = None,
                 notice_lead_s: float = NOTICE_LEAD_S, resume_timeout_s: float = DEFAULT_RESUME_TIMEOUT_S,
                 clock: Callable[[], float] = time.time) -> None:
        self.runner = runner
        self.stack_name = stack_name
        self.on_event = on_event or (lambda event: None)
        self.notice_lead_s = notice_lead_s
        self.resume_timeout_s = resume_timeout_s
        self.clock = clock

    def interrupt(self, node: LocalNode, *, index: int, target_az: str,
                  tick: Callable[[], None] | None = None) -> tuple[Interruption, LocalNode]:
        """Interrupt ``node`` and bring up its replacement in ``target_az``; returns (record, new node).

        ``tick`` is called about every 0.2 s while waiting (for a live display).

        Args:
            node: the running node to interrupt.
            index: the interruption's number in the drill, from 0.
            target_az: the AZ the replacement is launched in.
            tick: called about every 0.2 s while waiting, or None.

        Returns:
            ``(the interruption's record, the replacement node)``.

        Raises:
            InterruptionError: the agent did not exit 0 within the notice lead, training had already
                completed, no newer checkpoint was written, or the replacement did not resume in time.
        """
        tick = tick or (lambda: None)
        record = Interruption(index=index, instance_id=node.instance_id, from_az=node.availability_zone)
        before = data_volume(self.runner.aws.ec2, self.stack_name)
        if before:
            record.volume_id_before, record.volume_az_before = before
        rows = read_training_log(node.log_dir / LOG_NAME)
        record.step_at_notice = int(rows[-1]["step"]) if rows else 0
        previous = latest_checkpoint(node.checkpoint_dir)
        record.notice_at = self.clock()
        node.post_interruption_notice()
        self.on_event({"event": "notice-posted", "index": index, "instance_id": node.instance_id,
                       "availability_zone": node.availability_zone, "step": record.step_at_notice})

        deadline = record.notice_at + self.notice_lead_s
        while node.alive and self.clock() < deadline:
            tick()
            time.sleep(0.2)
        if node.alive:
            raise InterruptionError(f"node {node.instance_id}'s agent did not exit within {self.notice_lead_s} s "
                                    f"of the interruption notice; see {node.log_path}")
        status = node.process.returncode
        if status != 0:
            raise InterruptionError(f"node {node.instance_id}'s agent exited {status} after the notice; expected 0 "
                                    f"(trainer checkpointed and stopped); see {node.log_path}")
        if (node.checkpoint_dir / COMPLETED_FILE).exists():
            raise InterruptionError(f"training completed on {node.instance_id} before the notice was acted on; "
                                    "interrupt earlier (more epochs, or fewer interruptions)")
        checkpoint = latest_checkpoint(node.checkpoint_dir)
        if checkpoint is None or (previous is not None and checkpoint[1] <= previous[1]):
            raise InterruptionError(f"no checkpoint was committed after the notice on {node.instance_id} "
                                    f"(LATEST before: {previous}, after: {checkpoint})")
        record.checkpoint_step = checkpoint[0]
        record.notice_to_checkpoint_s = max(0.0, checkpoint[1] - record.notice_at)
        self.on_event({"event": "checkpointed", "index": index, "step": record.checkpoint_step,
                       "notice_to_checkpoint_s": round(record.notice_to_checkpoint_s, 3)})

        instance_type = self._instance_type(node.instance_id)
        node.stop()
        self.runner.terminate_instance(node.instance_id)
        self.on_event({"event": "instance-terminated", "index": index, "instance_id": node.instance_id,
                       "reason": "spot interruption"})

        replacement_id = self.runner.launch_for_fleet(target_az, instance_type=instance_type)
        booted_at = self.clock()
        replacement = self.runner.start_node(replacement_id)
        record.replacement_instance_id = replacement_id
        record.to_az = replacement.availability_zone
        resumed = self._wait_for_resume(replacement, record.checkpoint_step, booted_at, tick)
        record.resumed_at_step = int(resumed["step"])
        record.boot_to_resume_s = max(0.0, resumed["wall_time"] - booted_at)
        after = data_volume(self.runner.aws.ec2, self.stack_name)
        if after:
            record.volume_id_after, record.volume_az_after = after
        self.on_event({"event": "resumed", "index": index, "instance_id": replacement_id,
                       "availability_zone": record.to_az, "step": record.resumed_at_step,
                       "boot_to_resume_s": round(record.boot_to_resume_s, 3), "volume_moved": record.volume_moved,
                       "volume_id": record.volume_id_after})
        return record, replacement

    def _instance_type(self, instance_id: str) -> str:
        reservation = self.runner.aws.ec2.describe_instances(InstanceIds=[instance_id])["Reservations"][0]
        return reservation["Instances"][0]["InstanceType"]

    def _wait_for_resume(self, node: LocalNode, checkpoint_step: int, booted_at: float,
                         tick: Callable[[], None]) -> dict[str, float]:
        deadline = booted_at + self.resume_timeout_s
        log_path = node.log_dir / LOG_NAME
        while self.clock() < deadline:
            for row in read_training_log(log_path):
                if row["wall_time"] >= booted_at and row["step"] > checkpoint_step:
                    return row
            if not log_path.exists():  # a trainer that logs no steps (a user's own script): its checkpoints
                resumed = _committed_after(node.checkpoint_dir, checkpoint_step, booted_at)
                if resumed is not None:
                    return resumed
            if not node.alive:
                raise InterruptionError(f"replacement node {node.instance_id}'s agent exited {node.process.returncode} "
                                        f"before training resumed; see {node.log_path}")
            tick()
            time.sleep(0.2)
        raise InterruptionError(f"replacement node {node.instance_id} logged no step after {checkpoint_step} within "
                                f"{self.resume_timeout_s} s; see {node.log_path}")
