"""Interruption notices from the IMDS emulator (over HTTP) reach a real trainer process."""

from __future__ import annotations

import datetime as dt
import json
import threading
import time
import urllib.request

import pytest

from spot_training.agent.imds import ImdsClient
from spot_training.agent.interruption import (MIN_STOP_WAIT_S, REBALANCE_RECOMMENDATION, SPOT_INTERRUPTION, Event,
                                    InterruptionWatcher, RebalanceMonitor, SpotInterruptionMonitor, imds_monitors)
from spot_training.agent.errors import ExitCode
from spot_training.agent.imds import ImdsForbiddenError
from spot_training.agent.supervisor import Outcome
from spot_training.local.imds_emulator import ImdsEmulator
from test_supervisor import events, make_supervisor


def _post(url: str, body: dict) -> dict:
    req = urllib.request.Request(url, method="POST", data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=5) as resp:
        return json.loads(resp.read())


def _iso(seconds_from_now: float) -> str:
    when = dt.datetime.now(dt.timezone.utc) + dt.timedelta(seconds=seconds_from_now)
    return when.strftime("%Y-%m-%dT%H:%M:%SZ")


@pytest.fixture
def imds():
    with ImdsEmulator(instance_id="i-0abc", availability_zone="us-east-1a") as emulator:
        yield emulator


class RecordingControl:
    def __init__(self, status: int | None = 0) -> None:
        self.status = status
        self.terminations: list[tuple[float, str]] = []
        self.checkpoint_requests = 0

    def terminate(self, *, timeout_s: float, reason: str) -> int | None:
        self.terminations.append((timeout_s, reason))
        return self.status

    def request_checkpoint(self) -> bool:
        self.checkpoint_requests += 1
        return True


def _wait_for(predicate, timeout: float = 20.0) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError("condition not reached in time")
        time.sleep(0.05)


@pytest.mark.integration
def test_spot_notice_stops_a_real_trainer_cleanly_within_the_deadline(tmp_path, imds):
    sup = make_supervisor(tmp_path)
    syncs: list[float] = []
    watcher = InterruptionWatcher(imds_monitors(ImdsClient(imds.endpoint)), sup, poll_interval_s=0.2,
                                  margin_s=10, sync=lambda: syncs.append(time.monotonic()))
    outcome: list[Outcome] = []
    thread = threading.Thread(target=lambda: outcome.append(sup.run(watcher)))
    thread.start()
    try:
        _wait_for(lambda: events(tmp_path))
        time.sleep(0.5)  # a few training steps
        posted_at = time.monotonic()
        _post(imds.endpoint + "/control/spot/instance-action", {"action": "terminate", "time": _iso(30)})
        thread.join(timeout=30)
    finally:
        sup.request_stop()
        thread.join(timeout=30)
    assert outcome == [Outcome.INTERRUPTED]  # not COMPLETED: no cleanup after an interruption
    assert sup.last_status == 0
    kinds = [e[0] for e in events(tmp_path)]
    assert kinds == ["start", "sigterm-checkpoint"]
    assert int((tmp_path / "dltraining" / "checkpoints" / "step").read_text()) > 0
    assert len(syncs) == 1 and syncs[0] - posted_at < 30 - 10  # synced before deadline minus margin
    assert watcher.interrupted is not None and watcher.interrupted.detail["action"] == "terminate"


@pytest.mark.integration
def test_rebalance_recommendation_makes_the_trainer_save_an_extra_checkpoint(tmp_path, imds):
    sup = make_supervisor(tmp_path, env={"FAKE_STEPS": "150"})  # about 3 s of training
    watcher = InterruptionWatcher(imds_monitors(ImdsClient(imds.endpoint)), sup, poll_interval_s=0.2)
    outcome: list[Outcome] = []
    thread = threading.Thread(target=lambda: outcome.append(sup.run(watcher)))
    thread.start()
    try:
        _wait_for(lambda: events(tmp_path))
        _post(imds.endpoint + "/control/rebalance", {})
        thread.join(timeout=30)
    finally:
        sup.request_stop()
        thread.join(timeout=30)
    kinds = [e[0] for e in events(tmp_path)]
    # Exactly one extra checkpoint although the recommendation stayed up for many polls; training went on.
    assert kinds == ["start", "extra-checkpoint", "completed"]
    assert outcome == [Outcome.COMPLETED]
    assert not sup.workspace.request_file.exists()  # the trainer consumed the request


@pytest.mark.integration
def test_same_notice_polled_twice_acts_once(imds):
    control = RecordingControl()
    watcher = InterruptionWatcher(imds_monitors(ImdsClient(imds.endpoint)), control, sync=lambda: None)
    assert watcher.poll_once() == []
    imds.post_rebalance(notice_time_iso="2026-11-21T07:00:00Z")
    imds.post_spot_interruption(time_iso=_iso(120))
    first = watcher.poll_once()
    assert [e.kind for e in first] == [SPOT_INTERRUPTION, REBALANCE_RECOMMENDATION]
    assert watcher.poll_once() == [] and watcher.poll_once() == []
    assert len(control.terminations) == 1
    assert control.checkpoint_requests == 0  # already stopping: no competing extra checkpoint
    # A new notice (new time: a different id) is acted on again.
    imds.post_spot_interruption(time_iso=_iso(300))
    assert [e.kind for e in watcher.poll_once()] == [SPOT_INTERRUPTION]
    assert len(control.terminations) == 2


@pytest.mark.integration
def test_polls_on_its_interval_only(imds):
    now = [100.0]
    client = ImdsClient(imds.endpoint)
    watcher = InterruptionWatcher([SpotInterruptionMonitor(client)], RecordingControl(), poll_interval_s=5,
                                  clock=lambda: now[0], sync=lambda: None)
    gets = lambda: imds.stats["gets"]  # noqa: E731
    watcher.tick()
    assert gets() == 1
    now[0] += 4.9
    watcher.tick()
    assert gets() == 1
    now[0] += 0.1
    watcher.tick()
    assert gets() == 2


def test_stop_timeout_is_deadline_minus_margin_with_a_floor():
    wall = [1_000_000.0]
    watcher = InterruptionWatcher([], RecordingControl(), margin_s=15, wall_clock=lambda: wall[0], sync=lambda: None)
    deadline = dt.datetime.fromtimestamp(wall[0] + 120, dt.timezone.utc)
    event = Event(kind=SPOT_INTERRUPTION, id="x", deadline=deadline)
    assert watcher.stop_timeout_s(event) == pytest.approx(105)
    wall[0] += 118  # a notice seen late still gives the trainer the floor
    assert watcher.stop_timeout_s(event) == MIN_STOP_WAIT_S


def test_trainer_that_does_not_exit_in_time_is_left_and_volume_synced_anyway():
    control = RecordingControl(status=None)
    synced = []
    watcher = InterruptionWatcher([], control, sync=lambda: synced.append(True))
    watcher.handle(Event(kind=SPOT_INTERRUPTION, id="late", deadline=dt.datetime.now(dt.timezone.utc)))
    assert control.terminations[0][0] == MIN_STOP_WAIT_S
    assert synced == [True]


@pytest.mark.integration
def test_imds_outage_while_polling_is_skipped_until_it_recovers(imds):
    control = RecordingControl()
    client = ImdsClient(imds.endpoint, timeout_s=0.2, attempts=2, sleep=lambda s: None)
    watcher = InterruptionWatcher([SpotInterruptionMonitor(client)], control, sync=lambda: None)
    imds.post_spot_interruption(time_iso=_iso(120))
    imds.set_fail_mode(status=500)
    assert watcher.poll_once() == []
    imds.set_fail_mode()
    assert [e.kind for e in watcher.poll_once()] == [SPOT_INTERRUPTION]


@pytest.mark.integration
def test_imds_403_while_polling_is_fatal(imds):
    watcher = InterruptionWatcher([RebalanceMonitor(ImdsClient(imds.endpoint))], RecordingControl())
    imds.set_fail_mode(status=403)
    with pytest.raises(ImdsForbiddenError) as info:
        watcher.poll_once()
    assert info.value.exit_code == ExitCode.CONFIG


@pytest.mark.integration
def test_interruption_during_restart_backoff_prevents_the_restart(tmp_path, imds):
    sup = make_supervisor(tmp_path, env={"FAKE_MODE": "crash"}, max_restarts=5, backoff_base_s=2.0,
                          backoff_max_s=2.0, rng=lambda: 1.0)
    watcher = InterruptionWatcher(imds_monitors(ImdsClient(imds.endpoint)), sup, poll_interval_s=0.1,
                                  sync=lambda: None)

    def post_after_first_start() -> None:  # the trainer crashes right after it records "start"
        _wait_for(lambda: events(tmp_path), timeout=20)
        imds.post_spot_interruption(time_iso=_iso(60))

    poster = threading.Thread(target=post_after_first_start)
    poster.start()
    started = time.monotonic()
    assert sup.run(watcher) is Outcome.INTERRUPTED
    poster.join(timeout=20)
    # The notice was seen during the 2 s backoff, and no restart followed.
    assert [e[0] for e in events(tmp_path)] == ["start"]
    assert sup.starts == 1
    assert time.monotonic() - started < 2.0 + 1.5


@pytest.mark.integration
def test_agent_failing_while_training_stops_the_trainer_first(tmp_path, imds):
    sup = make_supervisor(tmp_path, stop_timeout_s=20)
    watcher = InterruptionWatcher(imds_monitors(ImdsClient(imds.endpoint)), sup, poll_interval_s=0.1)

    def forbid_after_start() -> None:
        _wait_for(lambda: events(tmp_path))
        time.sleep(0.3)
        imds.set_fail_mode(status=403)

    thread = threading.Thread(target=forbid_after_start)
    thread.start()
    with pytest.raises(ImdsForbiddenError):
        sup.run(watcher)
    thread.join(timeout=20)
    # The trainer was not orphaned: it got SIGTERM, saved and exited before the agent gave up.
    assert [e[0] for e in events(tmp_path)] == ["start", "sigterm-checkpoint"]
