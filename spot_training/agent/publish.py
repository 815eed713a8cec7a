"""Publish the node's logs and training progress to CloudWatch, in the background (docs/agent.md).

:class:`Publisher` runs one daemon thread that every ``monitoring.interval_s`` seconds (10 by default):

- sends the buffered log lines to the CloudWatch Logs group ``monitoring.log_group``, stream = the
  instance id (so a job's history outlives its instances): the agent's own JSON lines (through
  :meth:`Publisher.log_handler`, a ``logging.Handler``) and the trainer's output lines (through
  :meth:`Publisher.add_line`, fed by the supervisor's output copy), each trainer line wrapped as a
  JSON line with ``logger`` ``"trainer"``;
- reads what the trainer already writes (docs/contracts.md: ``training_log.csv`` in the log
  directory, ``LATEST`` and ``COMPLETED`` in the checkpoint directory, optional ``progress.json``)
  and puts metrics (``PutMetricData``) under ``monitoring.namespace`` with dimension
  ``Stack=<stack name>``: see :data:`METRICS`.

Events come from the agent's structured log records (their ``event`` field), so no agent module has
to know about the publisher: ``spot_interruption_notice``, ``rebalance_recommendation``,
``copy_verified`` (the data volume moved to this AZ).

Never in the way of training: the thread is the only caller of CloudWatch; the handler and
:meth:`add_line` only append to a bounded buffer (``max_buffered_lines``; when full the oldest line is
dropped and counted in :attr:`Publisher.dropped_lines`); a failed call is logged (at most once per
``warn_every_s``) and retried on the next round with the lines kept; nothing it raises reaches the
agent. A log group that does not exist is the same: lines are kept (bounded) and retried.

Why a thread of our own and not the CloudWatch agent or ``watchtower``: the agent must run with the
standard library and boto3 only (docs/agent.md), and the metrics come from our own files and events.
PutLogEvents limits (10,000 events or 1,048,576 bytes per call, 26 bytes overhead per event, events
in time order within 24 hours): CloudWatch Logs API Reference, "PutLogEvents".
"""

from __future__ import annotations

import collections
import csv
import io
import json
import logging
import os
import threading
import time
from pathlib import Path
from typing import Any, Callable

from spot_training.agent.config import AgentConfig, MonitoringConfig
# The trainer's files the publisher reads (docs/contracts.md): the contract's names.
from spot_training.contract import COMPLETED_FILE, LATEST_FILE, PROGRESS_FILE, TRAINING_LOG_FILE
from spot_training.agent.logs import LOGGER_NAME, JsonLineFormatter

log = logging.getLogger(__name__)

#: Metric names (unit) the publisher puts, all with dimension ``Stack``; ``RunningInstances`` also
#: with ``InstanceType`` and ``AvailabilityZone``.
METRICS: dict[str, str] = {
    "GlobalStep": "Count",                 # last step in training_log.csv
    "StepsTotal": "Count",                 # progress.json's steps_total, or COMPLETED's step
    "StepsDone": "Count",                  # steps logged since the previous round (0: no progress)
    "Loss": "None",                        # loss of the last step
    "CheckpointStep": "Count",             # step of the last committed checkpoint (LATEST)
    "CheckpointAgeSeconds": "Seconds",     # now minus LATEST's commit time
    "InterruptionNotices": "Count",        # spot interruption notices acted on
    "RebalanceRecommendations": "Count",   # rebalance recommendations acted on
    "NoticeToCheckpointSeconds": "Seconds",  # notice -> commit of the checkpoint after it
    "BootToResumeSeconds": "Seconds",      # instance launch (pendingTime) -> first resumed step
    "VolumeMoves": "Count",                # data volume moved to this instance's AZ
    "Completed": "Count",                  # 1 when the trainer wrote COMPLETED
    "TrainerFailed": "Count",              # 1 when the agent gave up on a crashing trainer
    "RunningInstances": "Count",           # 1 per round per running agent
}
LOG_NAME = TRAINING_LOG_FILE
#: PutLogEvents limits (CloudWatch Logs API Reference).
MAX_EVENTS_PER_CALL = 10_000
MAX_BYTES_PER_CALL = 1_048_576
EVENT_OVERHEAD_BYTES = 26
MAX_EVENT_BYTES = 256 * 1024 - EVENT_OVERHEAD_BYTES
#: PutMetricData: at most 1,000 metric data in one call.
MAX_METRIC_DATA_PER_CALL = 1000
#: First read of an existing training_log.csv: only its last bytes (the last row is what counts).
_TAIL_BYTES = 64 * 1024


def cloudwatch_clients(region: str) -> tuple[Any, Any]:
    """``(logs, cloudwatch)`` boto3 clients for ``region`` with standard retries and short timeouts
    (3 s connect, 10 s read, 3 attempts): a slow endpoint only delays the background thread. The
    endpoints follow ``AWS_ENDPOINT_URL``/``AWS_ENDPOINT_URL_LOGS``/``AWS_ENDPOINT_URL_CLOUDWATCH``."""
    import boto3

    from spot_training.agent.retry import client_config

    config = client_config(connect_timeout=3, read_timeout=10, retries={"mode": "standard", "max_attempts": 3})
    return (boto3.client("logs", region_name=region, config=config),
            boto3.client("cloudwatch", region_name=region, config=config))


class _Handler(logging.Handler):
    """Formats agent records as JSON lines into the publisher's buffer and feeds their events."""

    def __init__(self, publisher: "Publisher") -> None:
        super().__init__()
        self.publisher = publisher
        self.setFormatter(JsonLineFormatter())

    def emit(self, record: logging.LogRecord) -> None:
        try:
            self.publisher._buffer_line(record.created, self.format(record))
            event = getattr(record, "event", None)
            if isinstance(event, str):
                self.publisher.on_agent_event(event, record.created)
        except Exception:  # noqa: BLE001 - a log handler must never raise into the agent
            self.handleError(record)


class Publisher:
    """Background publisher of one node's logs and metrics (see the module docstring).

    Args:
        monitoring: the config's ``monitoring`` section (``enabled`` must be true).
        stack_name: the ``Stack`` dimension value.
        instance_id: the log stream name.
        instance_type: a dimension of ``RunningInstances``.
        availability_zone: a dimension of ``RunningInstances``.
        log_dir: where the trainer writes ``training_log.csv`` (and may write ``progress.json``).
        checkpoint_dir: where ``LATEST`` and ``COMPLETED`` are.
        logs_client: a boto3 CloudWatch Logs client (default: :func:`cloudwatch_clients`).
        cloudwatch_client: a boto3 CloudWatch client (default: :func:`cloudwatch_clients`).
        region: the clients' region when they are made here (default ``$AWS_REGION`` or ``us-east-1``).
        boot_time: epoch seconds the instance launched (IMDS ``pendingTime``), for
            ``BootToResumeSeconds``; default: when the publisher was made.
        max_buffered_lines: log lines kept while CloudWatch Logs cannot be reached (default 10,000).
        warn_every_s: at most one warning per this many seconds about failed calls (default 60).
        wall_clock: epoch seconds (default ``time.time``).
        progress: read the trainer's files and put the training metrics (default True). A cluster's
            nodes share one log directory on EFS: only the coordinator (``scheduler``) does, so the
            figures are not counted once per node; every node still sends its lines, its events and
            ``RunningInstances``.

    Raises:
        ValueError: ``max_buffered_lines`` < 1.
    """

    def __init__(self, monitoring: MonitoringConfig, *, stack_name: str, instance_id: str, instance_type: str,
                 availability_zone: str, log_dir: Path, checkpoint_dir: Path, logs_client: Any = None,
                 cloudwatch_client: Any = None, region: str | None = None, boot_time: float | None = None,
                 max_buffered_lines: int = 10_000, warn_every_s: float = 60.0,
                 wall_clock: Callable[[], float] = time.time, progress: bool = True) -> None:
        if max_buffered_lines < 1:
            raise ValueError(f"max_buffered_lines must be >= 1, got {max_buffered_lines!r}")
        if logs_client is None or cloudwatch_client is None:
            default_logs, default_cw = cloudwatch_clients(region or os.environ.get("AWS_REGION", "us-east-1"))
            logs_client = logs_client or default_logs
            cloudwatch_client = cloudwatch_client or default_cw
        self.monitoring = monitoring
        self.stack_name, self.instance_id = stack_name, instance_id
        self.instance_type, self.availability_zone = instance_type, availability_zone
        self.log_dir, self.checkpoint_dir = Path(log_dir), Path(checkpoint_dir)
        self.logs, self.cloudwatch = logs_client, cloudwatch_client
        self._now = wall_clock
        self.started = wall_clock()
        self.boot_time = boot_time if boot_time is not None else self.started
        self.max_buffered_lines = max_buffered_lines
        self.progress = progress
        # StepsDone (the hang alarm's metric) is put only once the trainer has logged a step on this boot:
        # before that the node is still preparing (volume, dataset, environment: a long dataset sync is no
        # hang) or the script writes no training log at all; missing data does not breach the alarm.
        self._steps_logged_this_boot = False
        self.warn_every_s = warn_every_s
        self._lock = threading.Lock()
        self._lines: collections.deque[tuple[int, str]] = collections.deque()
        self._pending_metrics: list[dict[str, Any]] = []
        self.dropped_lines = 0
        self.dropped_metrics = 0
        self.failures = 0
        self.rounds = 0
        self.lines_sent = 0
        self.metrics_sent = 0
        self._last_warning = 0.0
        self._stream_ready = False
        self._stop = threading.Event()
        self._wake = threading.Event()
        self._thread: threading.Thread | None = None
        self._handler = _Handler(self)
        # training_log.csv tail state
        self._csv_offset: int | None = None
        self._csv_inode: int | None = None
        self._csv_header: list[str] | None = None
        self._partial = ""
        self._last_row: dict[str, float] | None = None
        self._last_published_step: int | None = None
        self._resume_measured = False
        self._notice_time: float | None = None
        self._after_notice: tuple[int, float] | None = None
        self._latest_at_notice: tuple[Any, float] | None = None
        self._completed_sent = False

    # ---- inputs (never block) ---------------------------------------------------------------
    def log_handler(self) -> logging.Handler:
        """A ``logging.Handler`` to add to the agent's logger: every record is published."""
        return self._handler

    def add_line(self, text: str, *, source: str = "trainer", when: float | None = None) -> None:
        """Buffer one line of the trainer's output (wrapped as a JSON line, ``logger`` = ``source``).

        When the buffer is full the oldest line is dropped (counted in ``dropped_lines``).

        Args:
            text: the line (a trailing newline is removed; cut to CloudWatch Logs' event size).
            source: the ``logger`` field (default ``trainer``).
            when: the line's time, epoch seconds (default: now).
        """
        when = self._now() if when is None else when
        entry = {"time": time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(when)) + f".{int(when * 1000) % 1000:03d}Z",
                 "level": "INFO", "logger": source, "message": text.rstrip("\n")}
        self._buffer_line(when, json.dumps(entry, ensure_ascii=False))

    def _buffer_line(self, when: float, line: str) -> None:
        encoded = line.encode("utf-8")
        if len(encoded) > MAX_EVENT_BYTES:
            line = encoded[:MAX_EVENT_BYTES].decode("utf-8", errors="ignore")
        with self._lock:
            if len(self._lines) >= self.max_buffered_lines:
                self._lines.popleft()
                self.dropped_lines += 1
            self._lines.append((int(when * 1000), line))

    def metric(self, name: str, value: float, *, when: float | None = None) -> None:
        """Queue one datum of metric ``name`` (a key of :data:`METRICS`) with dimension ``Stack``.

        Args:
            name: the metric name; its unit comes from :data:`METRICS`.
            value: the value, in that unit.
            when: the datum's time, epoch seconds (default: now).

        Raises:
            ValueError: an unknown metric name.
        """
        if name not in METRICS:
            raise ValueError(f"unknown metric {name!r}; expected one of {', '.join(METRICS)}")
        datum = {"MetricName": name, "Value": float(value), "Unit": METRICS[name],
                 "Timestamp": self._now() if when is None else when,
                 "Dimensions": [{"Name": "Stack", "Value": self.stack_name}]}
        with self._lock:
            if len(self._pending_metrics) >= 10 * MAX_METRIC_DATA_PER_CALL:
                self._pending_metrics.pop(0)
                self.dropped_metrics += 1
            self._pending_metrics.append(datum)

    def on_agent_event(self, event: str, when: float) -> None:
        """Turn an agent log event into metrics (called by the log handler).

        Args:
            event: the record's ``event`` field (``spot_interruption_notice``...).
            when: the record's time, epoch seconds.
        """
        if event == "spot_interruption_notice":
            self._notice_time = when
            # What LATEST said when the notice came: any other commit is the one made after it. Comparing
            # the file's mtime with the notice time instead is wrong by up to a kernel tick, because the
            # kernel stamps files from its coarse clock, which lags time.time() (a checkpoint written 1 ms
            # after the notice could carry an mtime before it).
            latest = self._read_json(self.checkpoint_dir / LATEST_FILE)
            self._latest_at_notice = (latest[0].get("step"), latest[1]) if latest else None
            self.metric("InterruptionNotices", 1, when=when)
        elif event == "rebalance_recommendation":
            self.metric("RebalanceRecommendations", 1, when=when)
        elif event == "copy_verified":
            self.metric("VolumeMoves", 1, when=when)
        elif event == "trainer_failed":
            self.metric("TrainerFailed", 1, when=when)

    # ---- thread ------------------------------------------------------------------------------
    def start(self) -> "Publisher":
        """Start the background thread (daemon: it never keeps the agent alive).

        Returns:
            self.
        """
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name="cloudwatch-publisher", daemon=True)
            self._thread.start()
        return self

    def close(self, timeout_s: float = 10.0) -> None:
        """One last round (read the files, send what is buffered), then stop; waits at most
        ``timeout_s`` seconds (the instance may be about to go). Never raises."""
        self._stop.set()
        self._wake.set()
        if self._thread is not None:
            self._thread.join(timeout_s)

    def flush_soon(self) -> None:
        """Ask the thread for a round now (e.g. right after an interruption notice)."""
        self._wake.set()

    def _run(self) -> None:
        while True:
            stopping = self._stop.is_set()
            self.round(final=stopping)
            if stopping:
                return
            self._wake.wait(self.monitoring.interval_s)
            self._wake.clear()

    def round(self, *, final: bool = False) -> None:
        """One publishing round: read progress, put metrics, send log lines. Never raises. ``final``:
        the last round (the trainer has exited): also report notice -> checkpoint."""
        self.rounds += 1
        try:
            self._read_progress(final=final)
        except Exception as exc:  # noqa: BLE001 - a torn or odd file must not stop publishing
            self._warn("reading training progress failed", exc)
        self._send_metrics()
        self._send_logs()

    # ---- progress from the trainer's files ------------------------------------------------------
    def _read_new_rows(self) -> list[dict[str, float]]:
        path = self.log_dir / LOG_NAME
        try:
            st = path.stat()
        except FileNotFoundError:
            return []
        if self._csv_inode != st.st_ino or (self._csv_offset is not None and st.st_size < self._csv_offset):
            self._csv_inode, self._csv_offset, self._csv_header, self._partial = st.st_ino, None, None, ""
        with open(path, "rb") as handle:
            if self._csv_offset is None:
                header = handle.readline().decode("utf-8", errors="replace")
                self._csv_header = next(csv.reader([header]), None)
                start = max(handle.tell(), st.st_size - _TAIL_BYTES)
                handle.seek(start)
                data = handle.read().decode("utf-8", errors="replace")
                if start > len(header.encode()):
                    data = data.split("\n", 1)[1] if "\n" in data else ""  # skip the cut line
            else:
                handle.seek(self._csv_offset)
                data = self._partial + handle.read().decode("utf-8", errors="replace")
            self._csv_offset = handle.tell()
        if not self._csv_header:
            return []
        complete, _, self._partial = data.rpartition("\n")
        rows = []
        for values in csv.reader(io.StringIO(complete)):
            if len(values) != len(self._csv_header):
                continue
            try:
                rows.append({k: float(v) for k, v in zip(self._csv_header, values)})
            except ValueError:
                continue
        return rows

    def _read_json(self, path: Path) -> tuple[dict[str, Any], float] | None:
        try:
            return json.loads(path.read_text()), path.stat().st_mtime
        except (OSError, ValueError):
            return None

    def _read_progress(self, *, final: bool = False) -> None:
        now = self._now()
        dims_running = [{"Name": "Stack", "Value": self.stack_name},
                        {"Name": "InstanceType", "Value": self.instance_type},
                        {"Name": "AvailabilityZone", "Value": self.availability_zone}]
        with self._lock:
            self._pending_metrics.append({"MetricName": "RunningInstances", "Value": 1.0, "Unit": "Count",
                                          "Timestamp": now, "Dimensions": dims_running})
        if not self.progress:
            return
        rows = self._read_new_rows()
        new = [r for r in rows if "step" in r]
        if new:
            last = new[-1]
            fresh = [r for r in new if r.get("wall_time", now) >= self.started]  # rows this boot's trainer wrote
            self._steps_logged_this_boot |= bool(fresh)
            previous = self._last_published_step
            if previous is None:  # first round: count only the fresh rows
                done = len(fresh)
            else:
                done = max(0, int(last["step"]) - previous)
            if fresh and not self._resume_measured:
                self._resume_measured = True
                if int(fresh[0]["step"]) > 1:  # a resumed run, not the first start
                    seconds = max(0.0, fresh[0].get("wall_time", now) - self.boot_time)
                    self.metric("BootToResumeSeconds", seconds)
                    log.info("training resumed", extra={"event": "resumed", "step": int(fresh[0]["step"]),
                                                        "boot_to_resume_s": round(seconds, 3)})
            self._last_row = last
            self._last_published_step = int(last["step"])
        if self._steps_logged_this_boot:
            self.metric("StepsDone", done if new else 0)
        if self._last_row is not None:
            self.metric("GlobalStep", self._last_row["step"])
            if "loss" in self._last_row:
                self.metric("Loss", self._last_row["loss"])
        progress = self._read_json(self.log_dir / PROGRESS_FILE)
        completed = self._read_json(self.checkpoint_dir / COMPLETED_FILE)
        total = None
        if progress and isinstance(progress[0].get("steps_total"), int):
            total = progress[0]["steps_total"]
        elif completed and isinstance(completed[0].get("step"), int):
            total = completed[0]["step"]
        if total is not None:
            self.metric("StepsTotal", total)
        latest = self._read_json(self.checkpoint_dir / LATEST_FILE)
        if latest and isinstance(latest[0].get("step"), int):
            step, committed = latest[0]["step"], latest[1]
            self.metric("CheckpointStep", step)
            self.metric("CheckpointAgeSeconds", max(0.0, now - committed))
            if self._notice_time is not None and (step, committed) != self._latest_at_notice:
                # The newest checkpoint after the notice: a cadence save may land first; the trainer's
                # last one (on SIGTERM) is what counts, known for sure in the final round.
                self._after_notice = (step, committed)
        if final and self._notice_time is not None and self._after_notice is not None:
            step, committed = self._after_notice
            seconds = max(0.0, committed - self._notice_time)
            self.metric("NoticeToCheckpointSeconds", seconds)
            log.info("checkpoint committed after the interruption notice", extra={
                "event": "checkpoint_after_notice", "checkpoint_step": step,
                "notice_to_checkpoint_s": round(seconds, 3)})
            self._notice_time = self._after_notice = self._latest_at_notice = None
        if completed and not self._completed_sent:
            self._completed_sent = True
            self.metric("Completed", 1)

    # ---- sending ------------------------------------------------------------------------------
    def _warn(self, what: str, exc: BaseException) -> None:
        self.failures += 1
        now = time.monotonic()
        if now - self._last_warning >= self.warn_every_s or self._last_warning == 0.0:
            self._last_warning = now
            log.warning(f"{what}; will retry next round (training goes on)", extra={
                "error": f"{type(exc).__name__}: {exc}"[:500], "failures": self.failures,
                "dropped_lines": self.dropped_lines})

    def _send_metrics(self) -> None:
        with self._lock:
            pending, self._pending_metrics = self._pending_metrics, []
        sent = 0
        try:
            while sent < len(pending):
                chunk = pending[sent:sent + MAX_METRIC_DATA_PER_CALL]
                self.cloudwatch.put_metric_data(Namespace=self.monitoring.namespace, MetricData=[
                    {**d, "Timestamp": _utc(d["Timestamp"])} for d in chunk])
                sent += len(chunk)
                self.metrics_sent += len(chunk)
        except Exception as exc:  # noqa: BLE001 - never fatal: keep the unsent data for the next round
            with self._lock:
                self._pending_metrics[:0] = pending[sent:]
                excess = len(self._pending_metrics) - 10 * MAX_METRIC_DATA_PER_CALL
                if excess > 0:
                    del self._pending_metrics[:excess]
                    self.dropped_metrics += excess
            self._warn("PutMetricData failed", exc)

    def _ensure_stream(self) -> None:
        if self._stream_ready:
            return
        try:
            self.logs.create_log_stream(logGroupName=self.monitoring.log_group, logStreamName=self.instance_id)
        except Exception as exc:  # noqa: BLE001 - classified below
            code = getattr(exc, "response", {}).get("Error", {}).get("Code")
            if code != "ResourceAlreadyExistsException":
                raise
        self._stream_ready = True

    def _send_logs(self) -> None:
        with self._lock:
            if not self._lines:
                return
            batch = sorted(self._lines, key=lambda line: line[0])  # time order; stable for equal stamps
            self._lines.clear()
        sent = 0
        try:
            self._ensure_stream()
            while sent < len(batch):
                chunk, size = [], 0
                first = batch[sent][0]
                for stamp, message in batch[sent:]:
                    cost = len(message.encode("utf-8")) + EVENT_OVERHEAD_BYTES
                    if (len(chunk) >= MAX_EVENTS_PER_CALL or size + cost > MAX_BYTES_PER_CALL
                            or stamp - first > 23 * 3600 * 1000):
                        break
                    chunk.append({"timestamp": stamp, "message": message or " "})
                    size += cost
                response = self.logs.put_log_events(logGroupName=self.monitoring.log_group,
                                                    logStreamName=self.instance_id, logEvents=chunk)
                sent += len(chunk)
                self.lines_sent += len(chunk)
                rejected = (response or {}).get("rejectedLogEventsInfo")
                if rejected:
                    log.debug("CloudWatch Logs rejected some events", extra={"rejected": rejected})
        except Exception as exc:  # noqa: BLE001 - never fatal: put the unsent lines back (bounded)
            code = getattr(exc, "response", {}).get("Error", {}).get("Code")
            if code == "ResourceNotFoundException":
                self._stream_ready = False  # group or stream deleted: create the stream again next time
            with self._lock:
                self._lines.extendleft(reversed(batch[sent:]))
                while len(self._lines) > self.max_buffered_lines:
                    self._lines.popleft()
                    self.dropped_lines += 1
            self._warn("PutLogEvents failed", exc)


def _utc(epoch: float):
    import datetime as dt

    return dt.datetime.fromtimestamp(epoch, tz=dt.timezone.utc)


def start_publisher(config: AgentConfig, *, instance_id: str, instance_type: str, availability_zone: str,
                    boot_time: float | None = None, **kwargs: Any) -> Publisher | None:
    """Make and start the node's :class:`Publisher` when ``config.monitoring`` is enabled.

    Adds its handler to the agent's logger. Never raises: a failure to set up is logged and the node
    goes on without publishing.

    Args:
        config: the validated node config.
        instance_id: this instance (the log stream name).
        instance_type: this instance's type (a ``RunningInstances`` dimension).
        availability_zone: this instance's AZ (a ``RunningInstances`` dimension).
        boot_time: epoch seconds the instance launched (default: now).
        **kwargs: more :class:`Publisher` arguments (clients, clocks).

    Returns:
        the started publisher, or None when publishing is off or could not be set up.
    """
    monitoring = config.monitoring
    if monitoring is None or not monitoring.enabled:
        return None
    try:
        publisher = Publisher(monitoring, stack_name=config.stack_name, instance_id=instance_id,
                              instance_type=instance_type, availability_zone=availability_zone,
                              log_dir=config.training.log_dir, checkpoint_dir=config.training.checkpoint_dir,
                              region=config.region, boot_time=boot_time,
                              progress=config.node_role in ("single", "scheduler"), **kwargs)
    except Exception as exc:  # noqa: BLE001 - publishing is optional; training is not
        log.warning("CloudWatch publishing could not be set up; going on without it",
                    extra={"error": f"{type(exc).__name__}: {exc}"})
        return None
    logging.getLogger(LOGGER_NAME).addHandler(publisher.log_handler())
    log.info("publishing logs and metrics to CloudWatch", extra={
        "event": "publisher_started", "instance_id": instance_id, "instance_type": instance_type,
        "availability_zone": availability_zone, "log_group": monitoring.log_group, "log_stream": instance_id, "namespace": monitoring.namespace,
        "interval_s": monitoring.interval_s})
    return publisher.start()


def stop_publisher(publisher: Publisher | None, timeout_s: float = 10.0) -> None:
    """Remove the publisher's handler and close it (a last round of sends).

    Args:
        publisher: the publisher, or None (nothing done).
        timeout_s: seconds the last round may take (default 10).
    """
    if publisher is None:
        return
    publisher.close(timeout_s)
    logging.getLogger(LOGGER_NAME).removeHandler(publisher.log_handler())
