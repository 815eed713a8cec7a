"""Interruption notices inside the training process: signals, the request file, the save cadence.

The node agent watches instance metadata; the trainer only sees what docs/contracts.md fixes:
``SIGTERM`` = finish the current step, save, exit 0; ``SIGUSR1`` or the file named by
``SPOT_TRAINING_CHECKPOINT_REQUEST_FILE`` = save an extra checkpoint and keep training. This module
polls nothing from AWS. Signal handlers only set flags (the loop acts between steps), because a
handler that saves would run in the middle of a step with half-updated weights. A stop watcher
(:meth:`NoticeHandler.add_stop_watcher`) hears a stop at once on a thread of its own, so that the
checkpoint driver can save while the main thread is outside a step (spot_training/training/core.py).
"""

from __future__ import annotations

import logging
import os
import signal
import socket
import sys
import threading
import time
from pathlib import Path
from typing import Callable, Iterable

from spot_training import contract

__all__ = ["NoticeHandler", "SaveSchedule", "REQUEST_FILE_ENV", "request_file_from_env"]

REQUEST_FILE_ENV = contract.ENV_CHECKPOINT_REQUEST_FILE
_FROM_ENV = object()


def request_file_from_env(environ=None) -> Path | None:
    """The path in ``SPOT_TRAINING_CHECKPOINT_REQUEST_FILE``, or None when unset or empty."""
    value = (environ if environ is not None else os.environ).get(REQUEST_FILE_ENV, "")
    return Path(value) if value else None


class NoticeHandler:
    """Turns stop and checkpoint signals (and the request file) into flags the training loop polls.

    Use as a context manager, or call :meth:`install` / :meth:`uninstall`; installing must happen
    in the main thread (Python delivers signals there). The previous handlers are restored on uninstall.

    Args:
        request_file: path whose existence requests an extra checkpoint; the file is deleted when the
            request is consumed. Default: ``$SPOT_TRAINING_CHECKPOINT_REQUEST_FILE`` (None when unset).
        stop_signals: signals that request a stop (default ``(SIGTERM,)``).
        checkpoint_signals: signals that request an extra checkpoint (default ``(SIGUSR1,)``).

    Raises:
        ValueError: a signal is in both ``stop_signals`` and ``checkpoint_signals``; on :meth:`install`
            outside the main thread (from ``signal.signal``).
    """

    def __init__(
        self,
        *,
        request_file: str | os.PathLike | None = _FROM_ENV,  # type: ignore[assignment]
        stop_signals: Iterable[int] = (signal.SIGTERM,),
        checkpoint_signals: Iterable[int] = (signal.SIGUSR1,),
    ) -> None:
        self.request_file = request_file_from_env() if request_file is _FROM_ENV else (
            Path(request_file) if request_file is not None else None)
        self.stop_signals = tuple(stop_signals)
        self.checkpoint_signals = tuple(checkpoint_signals)
        overlap = set(self.stop_signals) & set(self.checkpoint_signals)
        if overlap:
            raise ValueError(
                f"a signal cannot both stop and request a checkpoint. Received: {sorted(overlap)} in both "
                "stop_signals and checkpoint_signals"
            )
        self._stop = threading.Event()
        self._checkpoint = threading.Event()
        self._previous: dict[int, object] = {}
        self.stop_signal: int | None = None
        self._watchers: list[Callable[[], None]] = []
        self._wakeup: tuple[socket.socket, socket.socket, int] | None = None

    # -- installation
    def install(self) -> "NoticeHandler":
        """Install the handlers (idempotent) and return self."""
        if self._previous:
            return self
        for sig in self.stop_signals:
            self._previous[sig] = signal.signal(sig, self._on_stop)
        for sig in self.checkpoint_signals:
            self._previous[sig] = signal.signal(sig, self._on_checkpoint)
        self._take_over_early_notice()
        if self._watchers:
            self._start_wakeup()
        _INSTALLED.add(self)
        _open_running_pipe()
        _register_fork_handler()
        return self

    def add_stop_watcher(self, callback: Callable[[], None]) -> None:
        """Call ``callback()`` on a thread of its own as soon as a stop signal arrives, even while the
        main thread is inside a long C call (a validation pass, a first trace, a blocking fetch),
        where Python runs the signal handler only when that call returns.

        Uses :func:`signal.set_wakeup_fd` (the interpreter's C-level handler writes the signal
        number to a socket at once) read by a daemon thread; the previous wakeup fd is restored on
        :meth:`uninstall`. The stop flag is set before ``callback`` runs. Must be called on the main
        thread once the handler is installed or before :meth:`install`.
        """
        if callback not in self._watchers:
            self._watchers.append(callback)
        if self._previous:
            self._start_wakeup()

    def remove_stop_watcher(self, callback: Callable[[], None]) -> None:
        """Forget a callback of :meth:`add_stop_watcher` (no error when it is not there)."""
        if callback in self._watchers:
            self._watchers.remove(callback)

    def _start_wakeup(self) -> None:
        if self._wakeup is not None:
            return
        reader, writer = socket.socketpair()
        writer.setblocking(False)
        previous = signal.set_wakeup_fd(writer.fileno(), warn_on_full_buffer=False)
        self._wakeup = (reader, writer, previous)
        threading.Thread(target=self._read_wakeup, args=(reader,), name="notice-watcher", daemon=True).start()

    def _read_wakeup(self, reader: socket.socket) -> None:
        while True:
            try:
                data = reader.recv(64)
            except OSError:
                return
            if not data:
                reader.close()
                return  # uninstall closed the writer
            if any(sig in self.stop_signals for sig in data):
                if self.stop_signal is None:
                    self.stop_signal = next(sig for sig in data if sig in self.stop_signals)
                self._stop.set()
                for callback in list(self._watchers):
                    try:
                        callback()
                    except Exception:  # a watcher must not kill the thread that serves the others
                        logging.getLogger("spot_training.training.notice").exception("stop watcher failed")

    def _take_over_early_notice(self) -> None:
        # A signal caught by spot_training.training.early_notice before this handler existed (the script imported
        # it on its first line) counts as if it had arrived here.
        early = sys.modules.get("spot_training.training.early_notice")
        if early is None:
            return
        if early.stop_requested.is_set() and early.stop_signal in self.stop_signals:
            self.stop_signal = early.stop_signal
            self._stop.set()
        if early.checkpoint_requested.is_set() and signal.SIGUSR1 in self.checkpoint_signals:
            early.checkpoint_requested.clear()
            self._checkpoint.set()

    def uninstall(self) -> None:
        """Restore the handlers that were there before :meth:`install`."""
        if self._wakeup is not None:
            reader, writer, previous = self._wakeup
            self._wakeup = None
            signal.set_wakeup_fd(previous)
            writer.close()  # the reader thread sees end of file and ends
        for sig, previous in self._previous.items():
            signal.signal(sig, previous)  # type: ignore[arg-type]
        self._previous.clear()
        _INSTALLED.discard(self)
        if not _INSTALLED:
            _close_running_pipe()

    def __enter__(self) -> "NoticeHandler":
        return self.install()

    def __exit__(self, *exc) -> None:
        self.uninstall()

    def _on_stop(self, signum, _frame) -> None:
        self.stop_signal = signum
        self._stop.set()

    def _on_checkpoint(self, _signum, _frame) -> None:
        self._checkpoint.set()

    # -- what the loop polls
    @property
    def stop_requested(self) -> bool:
        """True once a stop signal arrived (stays True)."""
        return self._stop.is_set()

    def request_stop(self) -> None:
        """Ask for a stop from code (same effect as SIGTERM)."""
        self._stop.set()

    def request_checkpoint(self) -> None:
        """Ask for an extra checkpoint from code (same effect as SIGUSR1)."""
        self._checkpoint.set()

    def consume_checkpoint_request(self) -> bool:
        """True once per request (a checkpoint signal since the last call, or the request file
        exists; the file is deleted). One stat() per call when a request file is configured."""
        requested = self._checkpoint.is_set()
        self._checkpoint.clear()
        if self.request_file is not None:
            try:
                self.request_file.unlink()
                requested = True
            except FileNotFoundError:
                pass
        return requested


_INSTALLED: set[NoticeHandler] = set()
_FORK_HANDLER = False
#: ``(read end, write end)`` of a pipe the trainer holds open while a handler is installed, or None. A
#: child forked meanwhile keeps only the read end (:data:`_CHILD_RUNNING_FD`) and reads end of file once
#: the trainer has uninstalled its last handler (its stop checkpoint is committed) or is gone.
_RUNNING: tuple[int, int] | None = None
_CHILD_RUNNING_FD: int | None = None


def _open_running_pipe() -> None:
    global _RUNNING
    if _RUNNING is None:
        read, write = os.pipe()  # close-on-exec: only forked children share it
        os.set_blocking(read, False)
        _RUNNING = (read, write)


def _close_running_pipe() -> None:
    global _RUNNING
    running, _RUNNING = _RUNNING, None
    if running is not None:
        for fd in running:
            os.close(fd)


def _stop_in_forked_child(signum, _frame) -> None:
    """A forked child's handler of the trainer's stop signals: ignored while the trainer runs, the
    signal's default action (the end of the process) once the trainer is done or gone.

    ``multiprocessing.Pool.terminate`` (what MXNet's ``gluon.data.DataLoader`` runs when it is freed,
    also while the trainer exits after its stop checkpoint) stops its workers with SIGTERM and then
    joins them: ignored for good, the join blocked the trainer's exit until the agent's SIGKILL at the
    end of the notice budget (seen in bench/notice/gluon.py). The agent's SIGTERM to the rest of the
    group after the trainer exited ends such children the same way."""
    try:
        if _CHILD_RUNNING_FD is None or os.read(_CHILD_RUNNING_FD, 1):
            return
    except BlockingIOError:
        return  # the trainer still runs: the notice is its to act on
    except OSError:
        pass  # the descriptor is gone: treat the trainer as gone
    signal.signal(signum, signal.SIG_DFL)
    os.kill(os.getpid(), signum)


def _in_forked_child() -> None:
    # A process forked by the trainer (a Keras PyDataset worker, a PyTorch DataLoader worker, a
    # multiprocessing pool) while notices are handled: a notice is the trainer's to act on, not
    # the worker's. The agent may signal the whole process group, so the worker ignores the stop
    # signals while the trainer runs (it ends when the trainer does: its pipe to the trainer closes,
    # or a stop signal arrives after the trainer is done, see _stop_in_forked_child) and must not
    # write into the trainer's wakeup socket, which it inherited.
    global _RUNNING, _CHILD_RUNNING_FD
    handlers = list(_INSTALLED)
    _INSTALLED.clear()
    running, _RUNNING = _RUNNING, None
    if not handlers:
        return
    try:
        signal.set_wakeup_fd(-1)
    except ValueError:  # forked from a thread other than the main one: no wakeup fd to clear
        pass
    if running is not None:
        os.close(running[1])  # only the trainer holds the write end: end of file when it is done
        _CHILD_RUNNING_FD = running[0]
    for handler in handlers:
        handler._previous.clear()
        handler._wakeup = None
        for sig in handler.stop_signals:
            signal.signal(sig, _stop_in_forked_child if running is not None else signal.SIG_IGN)


def _register_fork_handler() -> None:
    global _FORK_HANDLER
    if not _FORK_HANDLER and hasattr(os, "register_at_fork"):
        os.register_at_fork(after_in_child=_in_forked_child)
        _FORK_HANDLER = True


class SaveSchedule:
    """Save cadence by steps and/or seconds.

    Neither cadence: only on demand (notices). Step-based saves fall on the same steps in every run,
    which keeps resumed runs comparable.

    Args:
        every_steps: save when the number of completed steps is a multiple of it (>= 1, or None: off;
            default 50).
        every_seconds: save when at least this many seconds passed since the last save (> 0, or None: off;
            the default).
        clock: monotonic seconds (default ``time.monotonic``).

    Raises:
        ValueError: ``every_steps`` not an integer >= 1 or ``every_seconds`` not a number > 0 (None passes).
    """

    def __init__(self, every_steps: int | None = contract.default("checkpoint_every_steps"),
                 every_seconds: float | None = None, *, clock: Callable[[], float] = time.monotonic) -> None:
        if every_steps is not None and (isinstance(every_steps, bool) or not isinstance(every_steps, int)
                                        or every_steps < 1):
            raise ValueError(f"every_steps must be an integer >= 1 or None. Received: every_steps={every_steps!r}")
        if every_seconds is not None and (isinstance(every_seconds, bool)
                                          or not isinstance(every_seconds, (int, float)) or every_seconds <= 0):
            raise ValueError(f"every_seconds must be a number > 0 or None. Received: every_seconds={every_seconds!r}")
        self.every_steps = every_steps
        self.every_seconds = every_seconds
        self.clock = clock
        self._last_save = clock()

    def due(self, step: int, now: float | None = None) -> bool:
        """True when a save is due after ``step`` completed steps (``now`` in clock seconds).

        Args:
            step: completed steps so far.
            now: the current time in clock seconds (default: read the clock).

        Returns:
            True on a multiple of ``every_steps`` (step > 0) or when ``every_seconds`` passed since the last save.
        """
        if self.every_steps is not None and step > 0 and step % self.every_steps == 0:
            return True
        if self.every_seconds is not None:
            now = self.clock() if now is None else now
            return now - self._last_save >= self.every_seconds
        return False

    def saved(self, now: float | None = None) -> None:
        """Record that a save happened (restarts the seconds timer)."""
        self._last_save = self.clock() if now is None else now

    def __repr__(self) -> str:
        return f"SaveSchedule(every_steps={self.every_steps!r}, every_seconds={self.every_seconds!r})"
