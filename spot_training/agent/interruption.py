"""Watch for spot interruption notices and rebalance recommendations and act on them.

Monitors share one small protocol, ``poll() -> Event | None`` (as aws-node-termination-handler's
monitors do), and every event carries an ``id`` derived from the notice itself, so a notice that IMDS
keeps serving on every poll is acted on once. :class:`InterruptionWatcher` polls its monitors every
``poll_interval_s`` (5 s by default) from the supervisor's wait loop (:meth:`InterruptionWatcher.tick`)
and acts through a :class:`TrainerControl` (the supervisor):

- spot interruption (``spot/instance-action``): SIGTERM to the trainer's process group, wait for it to
  exit until the notice's deadline minus ``margin_s``, then flush the logs and ``os.sync()`` so the
  checkpoint is on the volume before the instance goes away;
- rebalance recommendation (``events/recommendations/rebalance``): ask the trainer for an extra
  checkpoint (docs/contracts.md: the request file or SIGUSR1), keep training.

Clock, wall clock, sleep and sync are injected (tests use fakes).
"""

from __future__ import annotations

import datetime as dt
import logging
import os
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable, Protocol

from spot_training.agent.config import DEFAULT_NOTICE_POLL_INTERVAL_S
from spot_training.agent.imds import ImdsClient, ImdsError, RebalanceRecommendation, SpotInstanceAction
from spot_training.agent.logs import flush_logs
from spot_training.contract import CLUSTER_MEMBER_TAG, check_seconds

log = logging.getLogger(__name__)

SPOT_INTERRUPTION = "spot-interruption"
REBALANCE_RECOMMENDATION = "rebalance-recommendation"
#: Seconds kept back from the notice deadline to flush logs and sync the volume.
DEFAULT_MARGIN_S = 15.0
#: The least time given to the trainer to save and exit, seconds, even when the notice is late.
MIN_STOP_WAIT_S = 5.0


@dataclass(frozen=True)
class Event:
    """Something a monitor saw. ``kind``: ``spot-interruption`` or ``rebalance-recommendation``;
    ``id``: stable for the same notice; ``deadline``: when the instance is taken (UTC, spot only);
    ``detail``: the notice's fields (``action``, ...)."""

    kind: str
    id: str
    deadline: dt.datetime | None = None
    detail: dict = field(default_factory=dict)


class Monitor(Protocol):
    """A source of events: ``poll()`` returns the current event or None; it may return the same event
    (same ``id``) on every call while the notice stands."""

    def poll(self) -> Event | None:
        """The current event, or None when there is none."""
        ...


class TrainerControl(Protocol):
    """What the watcher needs from the supervisor."""

    def terminate(self, *, timeout_s: float, reason: str) -> int | None:
        """SIGTERM the trainer's process group and wait up to ``timeout_s`` seconds.

        Args:
            timeout_s: seconds to wait for the trainer to exit.
            reason: why, for the log (``spot-interruption``...).

        Returns:
            the exit status, or None if it is still running (or there is no trainer).
        """
        ...

    def request_checkpoint(self) -> bool:
        """Ask the trainer for an extra checkpoint; False when no trainer is running."""
        ...


class _ImdsNoticeMonitor:
    """Polls one IMDS notice through an :class:`ImdsClient`: :meth:`_read` asks IMDS (None: no
    notice now), :meth:`_event` turns the notice into the :class:`Event` the watcher acts on."""

    def __init__(self, imds: ImdsClient) -> None:
        self.imds = imds

    def poll(self) -> Event | None:
        notice = self._read()
        return None if notice is None else self._event(notice)

    def _read(self) -> Any:
        raise NotImplementedError

    def _event(self, notice: Any) -> Event:
        raise NotImplementedError


class SpotInterruptionMonitor(_ImdsNoticeMonitor):
    """Polls ``meta-data/spot/instance-action`` through an :class:`ImdsClient`."""

    def _read(self) -> SpotInstanceAction | None:
        return self.imds.spot_instance_action()

    def _event(self, notice: SpotInstanceAction) -> Event:
        return Event(kind=SPOT_INTERRUPTION, id=notice.id, deadline=notice.time,
                     detail={"action": notice.action, "time": notice.time.isoformat()})


class RebalanceMonitor(_ImdsNoticeMonitor):
    """Polls ``meta-data/events/recommendations/rebalance`` through an :class:`ImdsClient`."""

    def _read(self) -> RebalanceRecommendation | None:
        return self.imds.rebalance_recommendation()

    def _event(self, notice: RebalanceRecommendation) -> Event:
        return Event(kind=REBALANCE_RECOMMENDATION, id=notice.id,
                     detail={"notice_time": notice.notice_time.isoformat()})


def imds_monitors(imds: ImdsClient) -> list[Monitor]:
    """The two monitors of a spot node, spot interruption first (it wins when both are up)."""
    return [SpotInterruptionMonitor(imds), RebalanceMonitor(imds)]


def poll_events(monitors: Iterable[Monitor], seen: set[str]) -> list[Event]:
    """One round over ``monitors``: the one error policy of every node kind (single node and cluster).

    A transient IMDS error (:class:`~spot_training.agent.imds.ImdsUnavailableError`: a timeout, a 5xx, a
    refused connection) is logged and that monitor is skipped until the next round, so a blip never
    ends the agent (and with it the trainer, without a checkpoint). An error whose exit code is 78
    (:class:`~spot_training.agent.imds.ImdsForbiddenError`: IMDS answered 403 or is turned off, which
    waiting cannot heal) is raised; the caller decides (a single node stops its trainer and exits, a
    cluster worker leaves through a checkpoint).

    Args:
        monitors: polled in order.
        seen: ids of the events already acted on; new ids are added to it.

    Returns:
        The events not seen before, in monitor order.

    Raises:
        ImdsError: one with exit code 78 (IMDS forbidden or off).
    """
    new = []
    for monitor in monitors:
        try:
            event = monitor.poll()
        except ImdsError as exc:
            if exc.exit_code == 78:
                raise
            log.warning("polling for notices failed; will retry next round",
                        extra={"monitor": type(monitor).__name__, "error": str(exc)})
            continue
        if event is None or event.id in seen:
            continue
        seen.add(event.id)
        new.append(event)
    return new


def stop_wait_s(event: Event | None, *, now: float, margin_s: float = 0.0, default_s: float = 0.0) -> float:
    """Seconds to wait for a trainer to save and exit after ``event``: until its deadline (the spot
    notice's ``time``, two minutes after the notice) minus ``margin_s``, at least :data:`MIN_STOP_WAIT_S`.

    Args:
        event: the event that stops the trainer; None or an event without a deadline (the member tag
            removed, the agent stopped) gives ``default_s``.
        now: the wall clock, epoch seconds.
        margin_s: seconds kept back for flushing logs and syncing the file systems.
        default_s: the wait without a deadline, seconds.
    """
    if event is None or event.deadline is None:
        return default_s
    return max(MIN_STOP_WAIT_S, event.deadline.timestamp() - now - margin_s)


class InterruptionWatcher:
    """Polls monitors on a schedule and acts once per event id.

    Args:
        monitors: polled in order on each round.
        control: the trainer's supervisor.
        poll_interval_s: seconds between rounds (default 5).
        margin_s: seconds kept back from a spot notice's deadline for flushing and syncing (default 15).
        clock: monotonic seconds for scheduling; wall_clock: epoch seconds, to compare with the notice
            time; sync: makes written data durable (default ``os.sync``); flush: flushes logs.

    After a spot interruption has been handled, :attr:`interrupted` holds its event; the supervisor
    then does not restart the trainer. IMDS errors while polling are logged and the round is
    skipped, except :class:`~spot_training.agent.imds.ImdsForbiddenError` semantics are kept by re-raising
    errors whose exit code is 78 (IMDS turned off cannot heal by waiting).
    """

    def __init__(self, monitors: Iterable[Monitor], control: TrainerControl, *,
                 poll_interval_s: float = DEFAULT_NOTICE_POLL_INTERVAL_S, margin_s: float = DEFAULT_MARGIN_S,
                 clock: Callable[[], float] = time.monotonic, wall_clock: Callable[[], float] = time.time,
                 sync: Callable[[], None] = os.sync, flush: Callable[[], None] = flush_logs) -> None:
        check_seconds("poll_interval_s", poll_interval_s)
        check_seconds("margin_s", margin_s, zero=True)
        self.monitors = list(monitors)
        self.control = control
        self.poll_interval_s = poll_interval_s
        self.margin_s = margin_s
        self._clock, self._wall_clock, self._sync, self._flush = clock, wall_clock, sync, flush
        self._next_poll = clock()
        self.seen: set[str] = set()
        self.interrupted: Event | None = None

    def tick(self) -> list[Event]:
        """Poll every monitor if a round is due and act on new events; returns the events acted on
        (empty when no round was due or nothing new was seen)."""
        now = self._clock()
        if now < self._next_poll:
            return []
        self._next_poll = now + self.poll_interval_s
        return self.poll_once()

    def poll_once(self) -> list[Event]:
        """One round now: poll every monitor (:func:`poll_events`), act on events not seen before."""
        acted = []
        for event in poll_events(self.monitors, self.seen):
            self.handle(event)
            acted.append(event)
        return acted

    def handle(self, event: Event) -> None:
        """Act on one event (no de-duplication here; see :meth:`poll_once`)."""
        if event.kind == SPOT_INTERRUPTION:
            self._on_interruption(event)
        elif event.kind == REBALANCE_RECOMMENDATION:
            if self.interrupted is not None:
                return  # already stopping: an extra checkpoint would only compete with the final one
            requested = self.control.request_checkpoint()
            log.info("rebalance recommendation: asked the trainer for an extra checkpoint" if requested
                     else "rebalance recommendation: no trainer running",
                     extra={"event": "rebalance_recommendation", "event_id": event.id, **event.detail})
        else:
            log.warning("ignoring an event of unknown kind", extra={"event_id": event.id, "kind": event.kind})

    def stop_timeout_s(self, event: Event) -> float:
        """Seconds to wait for the trainer: until the notice deadline minus the margin, at least
        MIN_STOP_WAIT_S (:func:`stop_wait_s`)."""
        return stop_wait_s(event, now=self._wall_clock(), margin_s=self.margin_s, default_s=MIN_STOP_WAIT_S)

    def _on_interruption(self, event: Event) -> None:
        self.interrupted = event
        timeout_s = self.stop_timeout_s(event)
        log.warning("spot interruption notice: stopping the trainer", extra={
            "event": "spot_interruption_notice", "event_id": event.id, "timeout_s": round(timeout_s, 1), **event.detail})
        status = self.control.terminate(timeout_s=timeout_s, reason=event.id)
        if status is None:
            log.error("the trainer did not exit before the notice deadline minus the margin; syncing anyway",
                      extra={"timeout_s": round(timeout_s, 1)})
        else:
            log.info("trainer exited after the interruption notice", extra={"exit_status": status})
        self._flush()
        self._sync()
        log.info("logs flushed and file systems synced; waiting for the instance to be reclaimed")
        self._flush()


# ---- cluster workers: when to leave -----------------------------------------------------------------
#: ``leave_reason`` of a cluster worker whose member tag was removed (spot_training/agent/fleet_actions.py then
#: lowers its fleet's target capacity and terminates the instance).
MEMBER_TAG_REMOVED = "member-tag-removed"
#: ``leave_reason`` of a cluster worker whose IMDS answered 403 (it can no longer see notices).
IMDS_FORBIDDEN = "imds-forbidden"


class MemberTagMonitor:
    """A worker leaves when its membership tag is removed (as in the Dynamic Training article).

    Polls the instance tags in metadata (``InstanceMetadataTags=enabled`` on the launch template; no
    IAM needed). Only a tag seen once and then gone counts: an instance that never exposed it is
    left alone. ``poll()`` returns an event (kind ``member-tag-removed``) or None.

    Args:
        imds: the instance metadata client (its ``tags()``: the instance tags, or None when unreadable).
        key: the member tag's key (default :data:`CLUSTER_MEMBER_TAG`).
    """

    def __init__(self, imds: Any, key: str = CLUSTER_MEMBER_TAG) -> None:
        self.imds, self.key = imds, key
        self._seen = False

    def poll(self):
        """The ``member-tag-removed`` event once a tag seen before is gone; else None (also if unreadable)."""
        tags = self.imds.tags()
        if tags is None:
            return None
        if self.key in tags:
            self._seen = True
            return None
        if self._seen:
            return Event(kind=MEMBER_TAG_REMOVED, id=f"{MEMBER_TAG_REMOVED}:{self.key}", detail={"tag": self.key})
        return None


def cluster_monitors(imds: ImdsClient, member_tag: str = CLUSTER_MEMBER_TAG) -> list[Monitor]:
    """A cluster worker's monitors: the single node's (spot interruption, rebalance recommendation) and
    the member tag, polled through the one policy of :func:`poll_events`.

    Args:
        imds: the instance metadata client.
        member_tag: the member tag's key (default :data:`CLUSTER_MEMBER_TAG`).

    Returns:
        the monitors, in polling order.
    """
    return [*imds_monitors(imds), MemberTagMonitor(imds, member_tag)]
