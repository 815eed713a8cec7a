"""NoticeHandler with real signals to this process and to a child, and SaveSchedule with a fake clock."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from spot_training.training.notice import REQUEST_FILE_ENV, NoticeHandler, SaveSchedule

REPO = Path(__file__).resolve().parents[2]


def test_sigterm_sets_stop_and_sigusr1_requests_one_checkpoint(tmp_path):
    before = signal.getsignal(signal.SIGTERM)
    with NoticeHandler(request_file=None) as notice:
        assert not notice.stop_requested and not notice.consume_checkpoint_request()
        os.kill(os.getpid(), signal.SIGUSR1)
        assert notice.consume_checkpoint_request() is True
        assert notice.consume_checkpoint_request() is False, "one request, one checkpoint"
        assert not notice.stop_requested
        os.kill(os.getpid(), signal.SIGTERM)
        assert notice.stop_requested and notice.stop_signal == signal.SIGTERM
    assert signal.getsignal(signal.SIGTERM) is before, "uninstall restores the previous handler"


def test_request_file_from_environment_is_consumed_once_and_deleted(tmp_path, monkeypatch):
    request = tmp_path / "checkpoint-request"
    monkeypatch.setenv(REQUEST_FILE_ENV, str(request))
    notice = NoticeHandler()
    assert notice.request_file == request
    assert notice.consume_checkpoint_request() is False
    request.write_text("")
    assert notice.consume_checkpoint_request() is True
    assert not request.exists()
    assert notice.consume_checkpoint_request() is False


def test_no_request_file_when_environment_is_unset(monkeypatch):
    monkeypatch.delenv(REQUEST_FILE_ENV, raising=False)
    assert NoticeHandler().request_file is None


def test_fails_when_one_signal_both_stops_and_checkpoints():
    with pytest.raises(ValueError, match="cannot both stop and request a checkpoint"):
        NoticeHandler(stop_signals=(signal.SIGTERM,), checkpoint_signals=(signal.SIGTERM,))


CHILD = textwrap.dedent("""
    import sys, time
    from spot_training.training.notice import NoticeHandler
    steps = checkpoints = 0
    with NoticeHandler() as notice:
        print("ready", flush=True)
        while not notice.stop_requested:
            time.sleep(0.01)  # one "step"
            steps += 1
            if notice.consume_checkpoint_request():
                checkpoints += 1
                print("checkpoint", flush=True)
    print(f"stopped steps={steps} checkpoints={checkpoints}", flush=True)
""")


@pytest.mark.integration
def test_a_child_keeps_running_on_sigusr1_and_request_file_and_exits_0_on_sigterm(tmp_path):
    request = tmp_path / "req"
    proc = subprocess.Popen([sys.executable, "-c", CHILD], stdout=subprocess.PIPE, text=True,
                            env={**os.environ, "PYTHONPATH": str(REPO), REQUEST_FILE_ENV: str(request)})
    try:
        assert proc.stdout.readline().strip() == "ready"
        proc.send_signal(signal.SIGUSR1)
        assert proc.stdout.readline().strip() == "checkpoint"
        request.write_text("")
        assert proc.stdout.readline().strip() == "checkpoint"
        assert not request.exists()
        proc.send_signal(signal.SIGTERM)
        out, _ = proc.communicate(timeout=10)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode == 0
    assert "checkpoints=2" in out


def test_save_schedule_by_steps_is_a_multiple_of_the_step_number():
    schedule = SaveSchedule(every_steps=50)
    assert [s for s in range(0, 201) if schedule.due(s)] == [50, 100, 150, 200]


def test_save_schedule_by_seconds_restarts_after_each_save():
    now = [100.0]
    schedule = SaveSchedule(every_steps=None, every_seconds=30, clock=lambda: now[0])
    assert not schedule.due(1)
    now[0] = 130.0
    assert schedule.due(2)
    schedule.saved()
    assert not schedule.due(3)
    assert schedule.due(4, now=160.0)


def test_save_schedule_with_neither_is_on_demand_only():
    schedule = SaveSchedule(every_steps=None, every_seconds=None)
    assert not any(schedule.due(s, now=1e9) for s in range(1, 1000))


@pytest.mark.parametrize("kwargs,match", [
    ({"every_steps": 0}, "Received: every_steps=0"),
    ({"every_steps": True}, "Received: every_steps=True"),
    ({"every_steps": None, "every_seconds": -1}, "Received: every_seconds=-1"),
])
def test_fails_on_bad_schedule(kwargs, match):
    with pytest.raises(ValueError, match=match):
        SaveSchedule(**kwargs)


@pytest.mark.integration
def test_stop_watcher_hears_the_signal_on_its_thread_and_forked_children_ignore_it():
    import threading

    heard = threading.Event()
    notice = NoticeHandler(request_file=None, stop_signals=(signal.SIGUSR2,), checkpoint_signals=())
    notice.add_stop_watcher(lambda: heard.set() if threading.current_thread() is not threading.main_thread() else None)
    with notice:
        pid = os.fork()
        if pid == 0:  # a worker forked while the handlers are installed: the stop signal is ignored
            os.kill(os.getpid(), signal.SIGUSR2)
            os._exit(0 if signal.getsignal(signal.SIGUSR2) not in (signal.SIG_DFL, notice._on_stop) else 1)
        assert os.waitpid(pid, 0)[1] == 0, "the forked child kept the trainer's stop handler or died of the signal"
        os.kill(os.getpid(), signal.SIGUSR2)
        assert heard.wait(5), "the watcher thread did not hear the stop signal"
        assert notice.stop_requested and notice.stop_signal == signal.SIGUSR2
    assert signal.getsignal(signal.SIGUSR2) is signal.SIG_DFL
    assert signal.set_wakeup_fd(-1) == -1, "uninstall left the wakeup fd set"


@pytest.mark.integration
def test_a_forked_child_ignores_the_stop_signal_while_the_trainer_runs_and_ends_on_it_once_the_trainer_is_done():
    # multiprocessing.Pool.terminate (MXNet's DataLoader runs it when freed, as the trainer exits after
    # its stop checkpoint) ends its workers with SIGTERM and joins them: ignored for good, the join
    # held the trainer's exit until the agent's SIGKILL at the end of the notice budget.
    import time

    notice = NoticeHandler(request_file=None, stop_signals=(signal.SIGUSR2,), checkpoint_signals=())
    notice.add_stop_watcher(lambda: None)
    notice.install()
    try:
        read, write = os.pipe()
        pid = os.fork()
        if pid == 0:  # a loader worker: says it is ready, then waits to be stopped
            os.close(read)
            os.write(write, b"r")
            time.sleep(30)
            os._exit(0)
        os.close(write)
        assert os.read(read, 1) == b"r"
        os.close(read)
        os.kill(pid, signal.SIGUSR2)  # the trainer still runs: the child ignores the notice
        time.sleep(0.3)
        assert os.waitpid(pid, os.WNOHANG) == (0, 0), "the child died of a notice while the trainer ran"
    finally:
        notice.uninstall()  # the trainer is done: its stop checkpoint is committed
    os.kill(pid, signal.SIGUSR2)  # Pool.terminate, or the agent's SIGTERM to the rest of the group
    deadline = time.monotonic() + 10
    while (status := os.waitpid(pid, os.WNOHANG)) == (0, 0) and time.monotonic() < deadline:
        time.sleep(0.02)
    if status == (0, 0):
        os.kill(pid, signal.SIGKILL)
        os.waitpid(pid, 0)
    assert status[0] == pid and os.WIFSIGNALED(status[1]) and os.WTERMSIG(status[1]) == signal.SIGUSR2, status
